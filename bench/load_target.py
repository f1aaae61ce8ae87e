"""Time loading the embedded default target (SmolLM2-135M-Instruct alias) from its safetensors cache.

    python bench/load_target.py [--runs 3] [--no-record]

The first run converts the GGUF once if the cache is missing (reported separately, not timed as a
load). Then each load runs in a fresh process, so it pays what a stage pays: transformers' lazy
imports, tokenizer, weights. Goal: < 5 s. The result is filed in bench/RESULTS.md, newest first under
`## Target loading`.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

from record import record  # bench/record.py

ROOT = Path(__file__).resolve().parents[1]
COMMAND = "python bench/load_target.py"

# one load in a fresh interpreter; torch/transformers imports are timed apart from the load
CHILD = """
import json, time
t0 = time.perf_counter()
import torch
torch.set_num_threads(1)
import transformers
t1, c1 = time.perf_counter(), time.process_time()
from omegaconf import OmegaConf
from eagle_train.recipe import TargetConfig
from eagle_train.target import load_target
model, tok = load_target(OmegaConf.structured(TargetConfig(model="smollm2-135m-instruct", device="cpu")))
t2, c2 = time.perf_counter(), time.process_time()
load_target(OmegaConf.structured(TargetConfig(model="smollm2-135m-instruct", device="cpu")))
t3 = time.perf_counter()
print(json.dumps({"import_s": t1 - t0, "load_s": t2 - t1, "cpu_s": c2 - c1, "again_s": t3 - t2, "params": sum(p.numel() for p in model.parameters())}))
"""


def one_load() -> dict:
    out = subprocess.run([sys.executable, "-c", CHILD], cwd=ROOT, capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--no-record", action="store_true", help="print only, do not append to bench/RESULTS.md")
    args = ap.parse_args()

    from omegaconf import OmegaConf

    from eagle_train.recipe import TargetConfig
    from eagle_train.target import resolve_model_path

    cfg = OmegaConf.structured(TargetConfig(model="smollm2-135m-instruct"))
    t = time.perf_counter()
    folder = resolve_model_path(cfg.model, cfg.cache_dir)  # converts once when the cache is missing
    first = time.perf_counter() - t
    print(f"cache: {folder} (resolve {first:.1f}s{' incl. conversion' if first > 5 else ''})")

    runs = [one_load() for _ in range(args.runs)]
    loads = sorted(r["load_s"] for r in runs)
    median = loads[len(loads) // 2]
    cpu = sorted(r["cpu_s"] for r in runs)[len(runs) // 2]
    again = sorted(r["again_s"] for r in runs)[len(runs) // 2]
    imports = sorted(r["import_s"] for r in runs)[len(runs) // 2]
    load_avg = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    line = (f"- {time.strftime('%Y-%m-%d')} `{COMMAND}`: SmolLM2-135M-Instruct alias load from the safetensors "
            f"cache (fresh process, load_target incl. tokenizer, fp32 CPU): median {median:.2f} s, "
            f"min {loads[0]:.2f} s over {len(loads)} runs (goal < 5 s), {cpu:.2f} s CPU time; a second load in the same process {again:.2f} s; `import torch, transformers` "
            f"{imports:.2f} s on top; {os.cpu_count()} CPUs, load average {load_avg:.1f}, "
            f"Python {platform.python_version()}")
    print(line)
    if not args.no_record:
        record("Target loading", line)
    return 0 if median < 5 else 1


if __name__ == "__main__":
    sys.exit(main())
