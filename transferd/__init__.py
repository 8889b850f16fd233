"""transferd: a per-node daemon that moves bytes between machines for LLM systems.

Kept light on purpose: importing ``transferd`` (as ``client`` does, for
``transferd.protocol``) must not pull in the engine, uvloop or prometheus.
"""

__version__ = "0.1.0"
