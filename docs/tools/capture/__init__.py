"""The parts of ``docs/tools/capture_frames.py``, which regenerates docs/protocol.md's frames.

- :mod:`capture.live`: a daemon (forked by a zygote) and a raw connection that records frames;
- :mod:`capture.registry`: the example registry and the helpers examples are built from;
- :mod:`capture.core`: the examples of the core protocol (HELLO, buffers, tensors, errors);
- :mod:`capture.engine`: the transfer-engine examples (two daemons) and the peer plane;
- :mod:`capture.blocks`: rendering a capture, reading a block back, comparing modulo
  per-run values, and rewriting the blocks in the doc.

Importing this package puts the repository on ``sys.path`` so that ``transferd`` imports.
"""

from __future__ import annotations

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(REPO))

DOC = REPO / "docs" / "protocol.md"
# The script a zygote runs as (``capture_frames.py --zygote PATH``).
ENTRY = REPO / "docs" / "tools" / "capture_frames.py"
