"""eagle-train. Importing the package checks the installed libraries against the version ranges
in pyproject.toml (the ones the tests ran on); EAGLE_TRAIN_SKIP_VERSION_CHECK=1 skips the check."""

from __future__ import annotations

import os
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
        raise DependencyError("eagle-train was tested with other library versions than these installed ones: "
                              + "; ".join(bad) + ". Install the declared ranges (pip install -e .), or set "
                              "EAGLE_TRAIN_SKIP_VERSION_CHECK=1 to run untested")


check_versions()
