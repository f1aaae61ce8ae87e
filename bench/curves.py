"""Learning curves: held-out acc_0 and tau against training tokens and CPU-minutes.

    python bench/curves.py outputs/run-a/train outputs/run-b/train --labels sharegpt regen --record

Each argument is a training output folder of a run made with `train.snapshots=true`: its
`curve.jsonl` (one row per evaluation: step, tokens, cpu_s, wall_s, eval/acc_k, eval/loss) and
`snapshots/step-N` heads. tau of every snapshot is measured greedy (output checked equal to plain
`generate`) on the first turns of a few prompts of each benchmark (several sets, not MT-bench
alone), with the recipe's-style dynamic tree; results are cached in `<run>/tau_curve.json`, so a
rerun measures only new snapshots. Writes `bench/curves.png` and, with --record, a table under
`## Learning curves` in bench/RESULTS.md.

    python bench/curves.py outputs/full/main outputs/full/ttt5 outputs/full/more --phases --steps ...

--phases: the runs are consecutive training phases of one head (each started from the previous one's
final head): tokens, CPU- and wall-minutes add up across them, so the plot reads as one curve of what
the whole recipe's CPU bought.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from record import record  # noqa: E402  (bench/record.py)

from eagle_train.baselines import vanilla_generate  # noqa: E402
from eagle_train.decoding import SpecConfig, speculative_generate  # noqa: E402
from eagle_train.files import atomic_path, atomic_write_text  # noqa: E402
from eagle_train.heads import load_head  # noqa: E402
from eagle_train.eval.run import load_prompts, render  # noqa: E402

default_out = ROOT / "bench" / "curves.png"


def shown(path):  # as the README and RESULTS name it: relative to the repository when inside it
    path = Path(path).resolve()
    return path.relative_to(ROOT) if path.is_relative_to(ROOT) else path


EVAL_SETS = ROOT.parent / "shared" / "data" / "eagle_eval"


def tau_of(model, tok, head, prompts, scfg, refs):
    """Mean tokens per target pass over `prompts` (first turns), greedy; checks equality with `refs`."""
    kept, passes = 0, 0
    for p in prompts:
        ids = render(tok, [{"role": "user", "content": p["turns"][0]}])
        new, stats = speculative_generate(model, head, ids, scfg, eos_token_id=tok.eos_token_id)
        ref = refs.get(p["key"])
        if ref is None:
            ref = refs[p["key"]] = vanilla_generate(model, ids, scfg.max_new_tokens, eos_token_id=tok.eos_token_id)
        if list(new) != list(ref):
            raise AssertionError(f"speculative output differs from generate on {p['key']}")
        kept += sum(a + 1 for a in stats["accept_lengths"])
        passes += len(stats["accept_lengths"])
    return kept / max(1, passes)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("runs", nargs="+", type=Path)
    ap.add_argument("--labels", nargs="*")
    ap.add_argument("--benchmarks", nargs="*", default=["mt_bench", "alpaca", "gsm8k", "qa", "sum", "humaneval"])
    ap.add_argument("--prompts", type=int, default=3, help="prompts per benchmark")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--topk", type=int, default=4)
    ap.add_argument("--depth", type=int, default=5)
    ap.add_argument("--num-draft-tokens", type=int, default=16)
    ap.add_argument("--steps", nargs="*", help="measure tau only at these steps (default: every snapshot); "
                    "one comma list per run (e.g. 50,150 200) gives each run its own")
    ap.add_argument("--out", type=Path, default=default_out)
    ap.add_argument("--record", action="store_true")
    ap.add_argument("--phases", action="store_true", help="runs are consecutive phases of one head: x adds up")
    a = ap.parse_args()
    labels = a.labels or [r.parent.name for r in a.runs]
    torch.set_num_threads(1)

    from omegaconf import OmegaConf

    from eagle_train.recipe import TargetConfig
    from eagle_train.target import load_target

    model, tok = load_target(OmegaConf.structured(TargetConfig(model="smollm2-135m-instruct", device="cpu")))
    prompts = []
    for b in a.benchmarks:
        for p in load_prompts(EVAL_SETS / b / "question.jsonl", a.prompts):
            prompts.append({**p, "key": f"{b}/{p['id']}"})
    scfg = SpecConfig(tree="dynamic", topk=a.topk, depth=a.depth, num_draft_tokens=a.num_draft_tokens,
                      max_new_tokens=a.max_new_tokens)
    setting = f"topk {a.topk}, depth {a.depth}, {a.num_draft_tokens} draft tokens"
    refs = {}
    curves = []
    per_run = a.steps and len(a.steps) == len(a.runs) and any("," in x for x in a.steps)
    steps = ([{int(v) for v in x.split(",")} for x in a.steps] if per_run
             else [None if a.steps is None else {int(v) for x in a.steps for v in x.split(",")}] * len(a.runs))
    for run, label, wanted_steps in zip(a.runs, labels, steps):
        rows = [json.loads(x) for x in (run / "curve.jsonl").read_text().splitlines() if x.strip()]
        cache_file = run / "tau_curve.json"
        cache = json.loads(cache_file.read_text()) if cache_file.is_file() else {}
        key = f"{setting}; {a.max_new_tokens} tokens; {','.join(a.benchmarks)} x {a.prompts}"
        taus = cache.setdefault(key, {})
        for row in rows:
            snap = run / "snapshots" / f"step-{row['step']}"
            wanted = wanted_steps is None or row["step"] in wanted_steps
            if str(row["step"]) not in taus and snap.is_dir() and wanted:
                t0 = time.perf_counter()
                taus[str(row["step"])] = tau_of(model, tok, load_head(snap, target=model), prompts, scfg, refs)
                print(f"[curves] {label} step {row['step']}: tau {taus[str(row['step'])]:.3f} "
                      f"({time.perf_counter() - t0:.0f}s)", flush=True)
                atomic_write_text(cache_file, json.dumps(cache, indent=2))
            row["tau"] = taus.get(str(row["step"]))
        if a.phases and curves:  # this phase starts where the previous one ended
            last = curves[-1][1][-1]
            for row in rows:
                for k in ("tokens", "cpu_s", "wall_s"):
                    row[k] += last[k]
        curves.append((label, rows))

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(2, 2, figsize=(11, 7))
    for label, rows in curves:
        for j, (xk, xl, scale) in enumerate((("tokens", "training tokens (M)", 1e-6),
                                             ("cpu_s", "training CPU-minutes", 1 / 60))):
            ax[0, j].plot([r[xk] * scale for r in rows], [r.get("eval/acc_0") for r in rows], "o-", label=label)
            pts = [(r[xk] * scale, r["tau"]) for r in rows if r.get("tau") is not None]
            ax[1, j].plot([p[0] for p in pts], [p[1] for p in pts], "o-", label=label)
            ax[1, j].set_xlabel(xl)
    ax[0, 0].set_ylabel("held-out acc_0")
    ax[1, 0].set_ylabel(f"tau ({len(a.benchmarks)} sets x {a.prompts})")
    for x in ax.flat:
        x.grid(alpha=0.3)
        x.legend()
    fig.suptitle(f"SmolLM2-135M EAGLE-3 head: learning curves (tau: greedy, dynamic tree {setting})")
    fig.tight_layout()
    with atomic_path(a.out) as tmp:
        fig.savefig(tmp, format="png", dpi=100)

    lines = [f"`python bench/curves.py {' '.join(map(str, a.runs))} --labels {' '.join(labels)}"
             f"{' --phases' if a.phases else ''}{' --steps ' + ' '.join(map(str, a.steps)) if a.steps else ''}"
             f"{'' if a.prompts == 3 else f' --prompts {a.prompts}'}"
             f"{'' if a.max_new_tokens == 64 else f' --max-new-tokens {a.max_new_tokens}'}"
             f"{'' if a.out == default_out else f' --out {shown(a.out)}'}` "
             f"({time.strftime('%Y-%m-%d')}): tau greedy on the first turns of {a.prompts} prompts of each of "
             f"{', '.join(a.benchmarks)} ({a.max_new_tokens} new tokens, dynamic tree {setting}; every output equal to "
             f"`generate`); CPU-minutes = training process CPU time (2 threads), torch {torch.__version__}, "
             f"{platform.machine()}, load average {os.getloadavg()[0]:.1f}. Plot: `{shown(a.out)}`.", "",
             "| run | step | tokens (M) | CPU-min | wall-min | held-out acc_0 | acc_1 | tau |", "|---|---|---|---|---|---|---|---|"]
    for label, rows in curves:
        for r in rows:
            tau = f"{r['tau']:.3f}" if r.get("tau") is not None else "-"
            acc1 = r.get("eval/acc_1")
            lines.append(f"| {label} | {r['step']} | {r['tokens'] / 1e6:.2f} | {r['cpu_s'] / 60:.1f} | "
                         f"{r['wall_s'] / 60:.1f} | {r.get('eval/acc_0', float('nan')):.3f} | "
                         f"{'-' if acc1 is None else f'{acc1:.3f}'} | {tau} |")
    print("\n".join(lines))
    if a.record:
        record("Learning curves", "\n".join(lines))


if __name__ == "__main__":
    main()
