"""What verifying a tree costs the target on this machine: one pass over n tokens vs a one-token pass.

    python bench/verify_cost.py [--model smollm2-135m-instruct] [--context 200] [--threads 1 2]
                                [--dtypes float32 bfloat16] [--packed] [--repeat-kv] [--reps 11] [--record]

After a `--context`-token prefill, times (median of --reps) a cached pass over n = 1, 2, 4, 8, 12, 16
tokens, the shape of a verification pass over a tree of n - 1 drafted nodes. The ratio
pass(n) / pass(1) is the price of a tree of that size: speculative decoding gains only where
tau / (ratio + draft cost) > 1, so this table is what `eagle-train sweep` trades against tau.
Also splits out the target's lm_head (a vocab x hidden matmul) at the same n, the part whose
cost grows most with n on a CPU. `--packed` adds float32 through oneDNN's prepacked linears (the decoder's
`eval.packed_verify`, on by default for a float32 target on a CPU). `--repeat-kv` adds each of those rows
as the pass ran before `decoding.masked_gqa`: transformers' `repeat_kv` copies of the cached keys and values under the
tree mask instead of SDPA's `enable_gqa` (same logits; the decoder's default on a CPU is enable_gqa), the two paths
taking turns pass by pass so that a busy machine's drift hits both alike. Each dtype is the whole target in that precision (eval.target_dtype):
on a CPU with native bf16 a bf16 pass over a small tree costs about what a one-token pass costs. `--record` adds the table to bench/RESULTS.md under
`## Verification cost`.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time
from pathlib import Path
from unittest import mock

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from record import record  # noqa: E402  (bench/record.py)

SIZES = (1, 2, 4, 8, 12, 16)


def median_ms(*fns, reps=11):
    """Median ms of each fn, the fns taking turns rep by rep: on a busy machine drift hits them alike."""
    times = [[] for _ in fns]
    for _ in range(reps):
        for fn, ts in zip(fns, times):
            t0 = time.perf_counter()
            fn()
            ts.append(time.perf_counter() - t0)
    medians = [sorted(ts)[reps // 2] * 1e3 for ts in times]
    return medians if len(fns) > 1 else medians[0]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--context", type=int, default=200)
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    ap.add_argument("--packed", action="store_true", help="also float32 through oneDNN's prepacked linears "
                    "(eval.packed_verify)")
    ap.add_argument("--repeat-kv", action="store_true", help="also each pass through transformers' repeat_kv "
                    "(TRANSFORMERS_SDPA_FORCE_GQA=0), the tree pass before decoding.masked_gqa")
    ap.add_argument("--reps", type=int, default=11, help="passes per median (more on a busy machine)")
    ap.add_argument("--record", action="store_true")
    args = ap.parse_args()
    from omegaconf import OmegaConf

    from eagle_train.recipe import TargetConfig
    from eagle_train.target import load_target

    rows = []
    for dtype in args.dtypes:
        model, _ = load_target(OmegaConf.structured(TargetConfig(model=args.model, device="cpu", dtype=dtype)),
                               with_tokenizer=False)
        variants = [(dtype, False)] + ([("float32 packed", True)] if args.packed and dtype == "float32" else [])
        for label, packed in variants:
            rows += measure(model, label, packed, args)
    table = [f"`python bench/verify_cost.py` ({time.strftime('%Y-%m-%d')}): {args.model}, "
             f"{args.context}-token cached prefix, median of {args.reps}; torch {torch.__version__}, {platform.machine()}, "
             f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}.", "",
             "| dtype | threads | tokens in pass (n) | pass ms | vs n=1 | lm_head ms |", "|---|---|---|---|---|---|"]
    table += [f"| {d} | {t} | {n} | {ms:.1f} | {r:.2f}x | {lm:.1f} |" for d, t, n, ms, r, lm in rows]
    print("\n".join(table))
    if args.record:
        record("Verification cost", "\n".join(table))
    return 0


def measure(model, dtype, packed, args):
    from transformers import DynamicCache

    from eagle_train.decoding import Tree, packed_linears, verify
    from eagle_train.kv_cache import commit_cache

    vocab = model.config.vocab_size
    g = torch.Generator().manual_seed(0)
    prefix = torch.randint(0, vocab, (1, args.context), generator=g)
    head_w = model.get_output_embeddings().weight
    keep_none = torch.zeros(0, dtype=torch.long)
    packs = packed_linears(model, "on" if packed else "off")
    rows = []
    with torch.no_grad():
        for threads in args.threads:
            torch.set_num_threads(threads)
            cache = DynamicCache()
            model(input_ids=prefix, cache=cache, use_cache=True)

            def one_pass(n, copies=False):
                # the decoder's own verification pass over a chain of n tokens (tree mask, tree positions,
                # hidden states, fp32 logits)
                tree = Tree(torch.randint(0, vocab, (n,), generator=g).tolist(), list(range(-1, n - 1)), list(range(n)))
                # transformers' own path under a mask: decoding.masked_gqa leaves a set TRANSFORMERS_SDPA_FORCE_GQA
                # alone, and "0" is transformers' default (repeat_kv); patch.dict restores the caller's environment
                with mock.patch.dict(os.environ, {"TRANSFORMERS_SDPA_FORCE_GQA": "0"} if copies else {}):
                    verify(model, cache, tree, args.context, None, packs)
                commit_cache(cache, args.context, keep_none)  # back to the prefix: same cache length each pass

            for n in SIZES:
                one_pass(n)  # warm-up for this shape
                if args.repeat_kv:
                    one_pass(n, True)
            if args.repeat_kv:  # both paths pass by pass, then one row set each
                both = {n: median_ms(lambda: one_pass(n), lambda: one_pass(n, True), reps=args.reps) for n in SIZES}
                passes, copied = {n: b[0] for n, b in both.items()}, {n: b[1] for n, b in both.items()}
            else:
                passes = {n: median_ms(lambda: one_pass(n), reps=args.reps) for n in SIZES}
            heads = {}
            for n in SIZES:
                h = torch.randn(n, head_w.shape[1], dtype=head_w.dtype)
                heads[n] = median_ms(lambda: torch.nn.functional.linear(h, head_w))
            for n in SIZES:
                rows.append((dtype, threads, n, passes[n], passes[n] / passes[1], heads[n]))
                print(f"{dtype} threads {threads}  n={n:2d}: pass {passes[n]:6.1f} ms  ({passes[n] / passes[1]:.2f}x)  "
                      f"lm_head {heads[n]:5.1f} ms", flush=True)
            if args.repeat_kv:
                for n in SIZES:
                    rows.append((dtype + " repeat_kv", threads, n, copied[n], copied[n] / copied[1], heads[n]))
                    print(f"{dtype} repeat_kv threads {threads}  n={n:2d}: pass {copied[n]:6.1f} ms  "
                          f"({copied[n] / passes[n]:.3f}x the enable_gqa pass)", flush=True)
    return rows


if __name__ == "__main__":
    sys.exit(main())
