"""Held-out accuracy of several heads on one dump's held-out split: an A/B without training anything.

    python bench/heldout.py recipes/smollm2-135m-eagle3.yaml outputs/full/more/final outputs/ab/final \\
        --labels shipped candidate -- output_dir=outputs/full train.ttt_steps=5

Each head is evaluated the way training evaluates it at step 0 (`train.main(..., stop_after=0)`): the
recipe's held-out split (`dump.output`/eval, or `train.eval_dump`), `train.eval_batches` batches of
`train.micro_batch_size`, acc_k of TTT steps k < `train.ttt_steps`, loss at the target's own distribution,
chain_k (steps 0..k all hit) and the τ a chain as deep as the unroll would get drafting at every position.
Prints a Markdown table; --record files it under `## Held-out accuracy` in bench/RESULTS.md.
"""

from __future__ import annotations

import argparse
import shlex
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from record import publish  # noqa: E402  (bench/record.py)

from eagle_train import train  # noqa: E402
from eagle_train.recipe_load import load_recipe  # noqa: E402


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("recipe")
    ap.add_argument("heads", nargs="+", help="head folders (a trained `final`, a snapshot or an exported head)")
    ap.add_argument("--labels", nargs="*", default=None)
    ap.add_argument("--record", action="store_true")
    argv = list(sys.argv[1:] if argv is None else argv)
    cut = argv.index("--") if "--" in argv else len(argv)
    args, overrides = ap.parse_args(argv[:cut]), argv[cut + 1:]  # recipe overrides after --
    labels = args.labels or args.heads
    if len(labels) != len(args.heads):
        ap.error(f"{len(labels)} labels for {len(args.heads)} heads")

    rows, steps = [], 0
    with tempfile.TemporaryDirectory() as tmp:
        for i, (label, head) in enumerate(zip(labels, args.heads)):
            cfg = load_recipe(args.recipe, [*overrides, f"head.init={head}", "train.engine=none",
                                            "train.resume=false", "train.tracker=none", f"train.output={tmp}/{i}"])
            t0 = time.perf_counter()
            metrics = train.main(cfg, stop_after=0)["metrics"]
            if "eval0/acc_0" not in metrics:
                raise SystemExit(f"{args.recipe}: no held-out split at {cfg.dump.output}/eval (set train.eval_dump)")
            steps = cfg.train.ttt_steps
            rows.append((label, metrics, time.perf_counter() - t0))
            print(f"[heldout] {label}: acc_0 {metrics['eval0/acc_0']:.4f} ({rows[-1][2]:.0f} s)", flush=True)
        where = cfg.train.eval_dump or cfg.dump.output

    lines = [f"`python bench/heldout.py {shlex.join(argv)}`: held-out split of `{where}`, "
             f"{cfg.train.eval_batches} batches of {cfg.train.micro_batch_size}, {time.strftime('%Y-%m-%d')}", "",
             "| head | loss | " + " | ".join(f"acc_{k}" for k in range(steps))
             + f" | chain_1..{steps - 1} (steps 0..s all hit) | τ of a chain of {steps} |",
             "|---|---|" + "---|" * (steps + 2)]
    for label, m, _ in rows:
        chain = " / ".join(f"{m.get(f'eval0/chain_{k}', float('nan')):.4f}" for k in range(1, steps))
        lines.append(f"| {label} | {m['eval0/loss']:.3f} | "
                     + " | ".join(f"{m.get(f'eval0/acc_{k}', float('nan')):.4f}" for k in range(steps))
                     + f" | {chain} | {m.get('eval0/chain_tau', float('nan')):.3f} |")
    publish("Held-out accuracy", lines, args.record)


if __name__ == "__main__":
    main()
