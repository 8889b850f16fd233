"""Domains: one per NIC (rail), grouped per GPU into DomainGroups."""

from .group import Chaos, DomainGroup

__all__ = ["Chaos", "DomainGroup"]
