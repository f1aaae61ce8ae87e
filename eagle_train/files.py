"""Atomic file writes: a reader (or a resumed run) sees the old file or the new one, never half of one.

Every stage writes through these: a file goes to a temp name beside its path and is renamed over it
(`atomic_path`, `atomic_write_text`, `atomic_save`); a folder is built under a temp name and swapped
in whole (`atomic_dir`, `replace_dir`).
"""

from __future__ import annotations

import json
import os
import shutil
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from eagle_train.recipe import RecipeError


def _temp_name(path: Path, what: str = "tmp") -> Path:
    return path.with_name(f".{path.name}.{what}{os.getpid()}")


@contextmanager
def atomic_path(path) -> Iterator[Path]:
    """Yield a temp path beside `path` to write to; it is renamed over `path` when the block ends,
    and removed when the block raises."""
    path = Path(path)
    tmp = _temp_name(path)
    try:
        yield tmp
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def atomic_write_text(path, text: str) -> Path:
    """Write `text` to a temp name beside `path`, then rename it over `path`."""
    with atomic_path(path) as tmp:
        tmp.write_text(text)
    return Path(path)


def atomic_save(path, data, indent: int | None = 2, metadata: dict | None = None) -> Path:
    """Write `data` atomically: bytes as they are, a dict of tensors as safetensors (`path` ends in
    .safetensors; `metadata` goes in its header), anything else as JSON (`indent`)."""
    with atomic_path(path) as tmp:
        if isinstance(data, (bytes, bytearray)):
            tmp.write_bytes(data)
        elif Path(path).suffix == ".safetensors":
            from safetensors.torch import save_file

            save_file({k: v.contiguous() for k, v in data.items()}, str(tmp), metadata=metadata)
        else:
            tmp.write_text(json.dumps(data, indent=indent))
    return Path(path)


def replace_dir(tmp, out, old=None) -> Path:
    """Swap the finished folder `tmp` in as `out`. The previous `out` is first renamed to `old` (a kill
    between the two renames leaves it whole there), then removed."""
    tmp, out = Path(tmp), Path(out)
    old = Path(old) if old is not None else _temp_name(out, "old")
    if out.exists():
        os.replace(out, old)
    os.replace(tmp, out)
    shutil.rmtree(old, ignore_errors=True)
    return out


@contextmanager
def atomic_dir(out, keep_existing: bool = False) -> Iterator[Path]:
    """Yield an empty temp folder beside `out` to fill; swapped in as `out` when the block ends,
    removed when it raises. `keep_existing`: when `out` appeared meanwhile (another process made the
    same folder), keep that one and drop ours, so a reader of it is never pulled from under."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = _temp_name(out)
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if keep_existing and out.exists():
        shutil.rmtree(tmp, ignore_errors=True)
    else:
        replace_dir(tmp, out)


def refuse_orphan_pieces(out: Path, record: Path, pieces: str, key: str) -> None:
    """A resumable stage folder is known by its `record` file; pieces (`out.glob(pieces)`) without it
    were written by something else: refuse to add to them (`key` names the recipe setting)."""
    if not record.is_file() and any(out.glob(pieces)):
        raise RecipeError(f"{out} ({key}) holds {pieces} pieces but no {record.name}: not a folder this recipe "
                          f"can resume. Use another {key} or delete the folder")
