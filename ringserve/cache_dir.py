"""Where ringserve keeps what it makes once and reuses: machine measurements (allreduce
bands, CP rates) and GGUF files converted to Hugging Face checkpoints.

The one definition of that folder: $RINGSERVE_CACHE, else ~/.cache/ringserve. Read at each
call (not at import), so a test session or a subprocess that sets the variable is obeyed.
"""

from __future__ import annotations

import os

CACHE_ENV = "RINGSERVE_CACHE"


def cache_root() -> str:
    return os.environ.get(CACHE_ENV) or os.path.join(os.path.expanduser("~"), ".cache", "ringserve")
