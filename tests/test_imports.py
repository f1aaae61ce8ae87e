"""Every module of the packages imports on its own, first, in a fresh interpreter: an import cycle
(a module that needs a half-initialised one) fails here whatever order the other tests import in."""

import importlib
import os
import pkgutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

from conftest import ROOT

PACKAGES = ["eagle_train", "eagle_train.data_prep", "eagle_train.eval"]


def modules():
    names = []
    for package in PACKAGES:
        pkg = importlib.import_module(package)
        names.append(package)
        names += [m.name for m in pkgutil.walk_packages(pkg.__path__, package + ".")]
    return sorted(names)


def import_alone(name):
    proc = subprocess.run([sys.executable, "-c", f"import {name}"], cwd=ROOT, capture_output=True, text=True,
                          env={**os.environ, "OMP_NUM_THREADS": "1"}, timeout=300)
    return name, proc.returncode, proc.stderr.strip().splitlines()[-1:] if proc.returncode else []


def test_each_module_imports_alone_in_a_fresh_interpreter():
    names = modules()
    assert {"eagle_train.train", "eagle_train.export", "eagle_train.heads", "eagle_train.layout",
            "eagle_train.data_prep.dump", "eagle_train.eval.run"} <= set(names)
    with ThreadPoolExecutor(max_workers=max(2, os.cpu_count() or 2)) as pool:  # one interpreter per module
        failed = [r for r in pool.map(import_alone, names) if r[1] != 0]
    assert not failed, failed
