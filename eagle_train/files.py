"""Atomic file writes: a reader (or a resumed run) sees the old file or the new one, never half of one."""

from __future__ import annotations

import os
from pathlib import Path


def atomic_write_text(path, text: str) -> Path:
    """Write `text` to a temp name beside `path`, then rename it over `path`."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    try:
        tmp.write_text(text)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return path
