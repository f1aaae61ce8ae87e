"""Filing a bench result in bench/RESULTS.md: newest first under its `## section` heading (the
section is added at the end when missing); earlier results stay as they were; atomic write."""

from __future__ import annotations

from pathlib import Path

from eagle_train.files import atomic_write_text

RESULTS = Path(__file__).resolve().parent / "RESULTS.md"


def record(section: str, text: str, results: Path = RESULTS) -> None:
    doc = results.read_text() if results.exists() else "# eagle-train benchmarks\n"
    head = f"## {section}\n\n"
    entry = text.strip("\n") + "\n\n"
    doc = doc.replace(head, head + entry, 1) if head in doc else doc.rstrip("\n") + "\n\n" + head + entry
    atomic_write_text(results, doc.rstrip("\n") + "\n")


def publish(section: str, lines, to_results: bool) -> None:
    """Print a bench table; with `to_results` (a script's --record) also file it under `## section`."""
    text = "\n".join(lines)
    print(text)
    if to_results:
        record(section, text)
