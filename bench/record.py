"""Filing a bench result in bench/RESULTS.md: newest first under its `## section` heading (the
section is added at the end when missing); earlier results stay as they were; atomic write."""

from __future__ import annotations

import os
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "RESULTS.md"


def record(section: str, text: str, results: Path = RESULTS) -> None:
    doc = results.read_text() if results.exists() else "# eagle-train benchmarks\n"
    head = f"## {section}\n\n"
    entry = text.strip("\n") + "\n\n"
    doc = doc.replace(head, head + entry, 1) if head in doc else doc.rstrip("\n") + "\n\n" + head + entry
    tmp = results.with_name(results.name + f".tmp{os.getpid()}")
    tmp.write_text(doc.rstrip("\n") + "\n")
    os.replace(tmp, results)
