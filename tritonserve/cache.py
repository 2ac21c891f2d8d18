"""Where the project caches what it builds once: ~/.cache/tritonserve, or $TRITONSERVE_CACHE
(the converted default model, the CPU C++ ops)."""
from __future__ import annotations

import os
from pathlib import Path


def cache_root() -> Path:
    return Path(os.environ.get("TRITONSERVE_CACHE") or Path.home() / ".cache" / "tritonserve")
