"""The decoder on a busy CPU: greedy `generate` vs the head, quiet and beside other work, 1 vs all threads.

    python bench/busy_cpu.py [--head heads/smollm2-135m-instruct-eagle3] [--dtype bfloat16] [--record]

For each load (none, then `--others` processes each running a one-thread matmul loop, the kind of job
a shared box runs beside an eval) and each thread count, decodes the first turns of a few MT-bench
prompts with `generate` and with the head, interleaved, and prints tokens/s and what each keeps of its
quiet speed. A tree step is hundreds of small ops, each ending in a barrier for every thread: when a
thread waits for a core that another process holds, the whole op waits. eval's `eval.threads=0` (auto)
picks the cores other work leaves idle; this table is why.
"""

from __future__ import annotations

import argparse
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from record import record  # noqa: E402  (bench/record.py)

from eagle_train.baselines import timed, vanilla_generate  # noqa: E402
from eagle_train.decoding import SpecConfig, speculative_generate  # noqa: E402
from eagle_train.eval.run import load_prompts, render, resolve_benchmark  # noqa: E402

HOG = "import torch\ntorch.set_num_threads(1)\na = torch.randn(768, 768)\nwhile True:\n    a @ a\n"


def decode_rates(model, head, items, scfg, eos):
    """(generate tok/s, head tok/s, tau, every output equal) over `items`, the two interleaved per prompt."""
    n_v = t_v = n_s = t_s = 0.0
    acc, same = [], True
    for ids in items:
        ref, t = timed(vanilla_generate, model, ids, scfg.max_new_tokens, eos_token_id=eos)
        (out, st), ts = timed(speculative_generate, model, head, ids, scfg, eos_token_id=eos)
        n_v, t_v, n_s, t_s = n_v + len(ref), t_v + t, n_s + len(out), t_s + ts
        acc += st["accept_lengths"]
        same &= out == ref
    return n_v / t_v, n_s / t_s, sum(a + 1 for a in acc) / max(1, len(acc)), same


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--head", default="heads/smollm2-135m-instruct-eagle3")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--prompts", type=int, default=3)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--others", type=int, default=1, help="competing one-thread processes in the busy rows")
    ap.add_argument("--record", action="store_true")
    args = ap.parse_args()
    from omegaconf import OmegaConf

    from eagle_train.heads import load_head
    from eagle_train.recipe import TargetConfig
    from eagle_train.target import load_target

    model, tok = load_target(OmegaConf.structured(TargetConfig(model="smollm2-135m-instruct", device="cpu",
                                                               dtype=args.dtype)))
    head = load_head(args.head, target=model).to(model.dtype).eval()
    items = [render(tok, [{"role": "user", "content": p["turns"][0]}])
             for p in load_prompts(resolve_benchmark("mt_bench"), args.prompts)]
    scfg = SpecConfig(tree="dynamic", topk=4, depth=4, num_draft_tokens=8, max_new_tokens=args.max_new_tokens)
    all_threads = os.cpu_count() or 1
    decode_rates(model, head, items[:1], SpecConfig(**{**scfg.__dict__, "max_new_tokens": 4}), tok.eos_token_id)
    load0 = os.getloadavg()[0]
    rows, quiet = [], {}
    for busy in (False, True):
        hogs = [subprocess.Popen([sys.executable, "-c", HOG]) for _ in range(args.others if busy else 0)]
        try:
            time.sleep(2 if busy else 0)
            for threads in sorted({1, all_threads}):
                torch.set_num_threads(threads)
                v, s, tau, same = decode_rates(model, head, items, scfg, tok.eos_token_id)
                if not busy:
                    quiet[threads] = (v, s)
                qv, qs = quiet[threads]
                rows.append((f"{args.others} other" if busy else "quiet", threads, v, s, s / v, v / qv, s / qs, tau, same))
                print(f"{rows[-1][0]:8s} threads {threads}: generate {v:5.1f} tok/s ({v / qv:.2f} of quiet), head "
                      f"{s:5.1f} tok/s ({s / qs:.2f} of quiet), speedup {s / v:.2f}, tau {tau:.2f}, equal {same}",
                      flush=True)
        finally:
            for h in hogs:
                h.kill()
    table = [f"`python bench/busy_cpu.py --dtype {args.dtype} --others {args.others}` ({time.strftime('%Y-%m-%d')}): "
             f"{args.head}, SmolLM2-135M-Instruct {args.dtype}, first turns of {len(items)} MT-bench prompts x "
             f"{args.max_new_tokens} tokens, dynamic tree topk 4 / depth 4 / 8 nodes; {platform.machine()}, "
             f"{all_threads} CPUs, torch {torch.__version__}, load average {load0:.1f} before the quiet rows. "
             "Busy rows: that many other processes each run a one-thread matmul loop.", "",
             "| load | threads | generate tok/s | head tok/s | speedup | generate vs quiet | head vs quiet | tau | "
             "outputs equal |", "|---|---|---|---|---|---|---|---|---|"]
    table += [f"| {r[0]} | {r[1]} | {r[2]:.1f} | {r[3]:.1f} | {r[4]:.2f}x | {r[5]:.2f} | {r[6]:.2f} | {r[7]:.2f} | "
              f"{r[8]} |" for r in rows]
    print("\n".join(table))
    if args.record:
        record("Decoding on a busy CPU", "\n".join(table))


if __name__ == "__main__":
    main()
