"""Fixtures for the integration tests: the engine tests' shared daemons.

``clusters``, ``cluster`` (once per domain) and ``tcp_cluster`` are defined in
:mod:`tests.integration.engine_cluster`; importing them here makes them
fixtures of every module in this folder.
"""

from tests.integration.engine_cluster import cluster, clusters, tcp_cluster

__all__ = ["cluster", "clusters", "tcp_cluster"]
