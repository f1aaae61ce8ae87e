"""eagle-train. Importing the package checks the installed libraries against the version ranges
in pyproject.toml (the ones the tests ran on); EAGLE_TRAIN_SKIP_VERSION_CHECK=1 skips the check.
A library import gets a DependencyError to catch; a command (`eagle-train <stage>`, `python
eagle_train/train.py`) that leaves it uncaught prints it as one line and exits non-zero."""

from __future__ import annotations

import os
import sys
from pathlib import Path


def declared_requirements() -> list:
    """The `dependencies` of pyproject.toml (a source checkout) or of the installed metadata."""
    pyproject = Path(__file__).resolve().parents[1] / "pyproject.toml"
    try:
        import tomllib

        return list(tomllib.loads(pyproject.read_text())["project"]["dependencies"])
    except (ImportError, OSError, KeyError):  # python 3.10 or an installed wheel
        from importlib.metadata import PackageNotFoundError, requires

        try:
            return [r for r in requires("eagle-train") or [] if "extra ==" not in r]
        except PackageNotFoundError:
            return []


def version_problems(requirements, installed) -> list:
    """`name version` outside its declared range, for each requirement; `installed(name)` gives the
    version or None when the package is absent (then the import itself will say so)."""
    from packaging.requirements import Requirement

    out = []
    for line in requirements:
        req = Requirement(line)
        have = installed(req.name)
        if have is not None and req.specifier and not req.specifier.contains(have, prereleases=True):
            out.append(f"{req.name} {have} (declared {req.specifier})")
    return out


def _installed(name):
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(name)
    except PackageNotFoundError:
        return None


def check_versions() -> None:
    from eagle_train.errors import DependencyError

    if os.environ.get("EAGLE_TRAIN_SKIP_VERSION_CHECK", "") not in ("", "0"):
        return
    bad = version_problems(declared_requirements(), _installed)
    if bad:
        _one_line_when_uncaught(DependencyError)
        raise DependencyError("eagle-train was tested with other library versions than these installed ones: "
                              + "; ".join(bad) + ". Install the declared ranges (pip install -e .), or set "
                              "EAGLE_TRAIN_SKIP_VERSION_CHECK=1 to run untested")


def _one_line_when_uncaught(kind) -> None:
    """The check runs at import, before any stage's error handler: when nothing catches the error
    (a command, not a library user), print it as the CLI prints errors instead of a traceback."""
    previous = sys.excepthook

    def hook(etype, err, tb):
        debug = "--debug" in sys.argv or os.environ.get("EAGLE_TRAIN_DEBUG", "") not in ("", "0")
        if not isinstance(err, kind) or debug:
            return previous(etype, err, tb)
        print(f"\neagle-train: error: {err} (--debug shows the traceback)", file=sys.stderr)

    sys.excepthook = hook


check_versions()
