"""Runnable examples of transferd's client API (``python3 examples/NAME.py --help``).

Each example is also importable (``examples.kv_cache``, ``examples.weight_update``,
``examples.moe_dispatch``): the workload benchmarks (``python -m benchmarks --only
workloads``) and ``tests/integration/test_workloads.py`` run the very code shown here,
placed on daemons (and, later, in-process engines) of their own.
"""
