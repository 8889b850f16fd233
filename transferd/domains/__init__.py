"""Domains: one per NIC (rail), behind one interface (:mod:`.base`), found by name
(:mod:`.registry`), grouped per device into DomainGroups (:mod:`.group`).

Nothing is imported here: the registry imports a Domain when it is first named,
and this package never imports :mod:`transferd.engine` (shared types live in
:mod:`transferd.parts`).
"""
