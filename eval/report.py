"""Eval and sweep reports: report.json / report.md and PNG plots (matplotlib Agg, labelled axes);
sweep.json / sweep.md. Every write is atomic (temp name + os.replace)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.ticker import MaxNLocator  # noqa: E402

PLOTS = ("accept_hist.png", "tau_by_category.png", "accept_by_depth.png")


def _atomic_text(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    tmp.write_text(text)
    os.replace(tmp, path)


def _atomic_fig(fig, path: Path) -> None:
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    fig.savefig(tmp, format="png", dpi=110, bbox_inches="tight")
    plt.close(fig)
    os.replace(tmp, path)


def _label(r: dict) -> str:
    return f"{r['benchmark']} T={r['temperature']:g}"


def _fmt(x, nd=2):
    return "-" if x is None else f"{x:.{nd}f}"


def report_markdown(rep: dict) -> str:
    s = rep["settings"]
    lines = [f"# Acceptance report: {rep['head']}", "",
             f"- target: `{rep['target']}`", f"- machine: {rep['machine']}", f"- date: {rep['date']}",
             f"- tree: {s['tree']} (topk {s['topk']}, depth {s['depth']}, num_draft_tokens {s['num_draft_tokens']}"
             f" root excluded), max_new_tokens {s['max_new_tokens']}", "",
             "tau = mean tokens per target pass (accepted drafted tokens + the bonus token); speedup = "
             "speculative tokens/s over vanilla tokens/s measured on the same prompts in the same run.", "",
             "| benchmark | T | prompts | tau | speedup | tok/s spec | tok/s vanilla | accept rate by depth |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rep["results"]:
        by_depth = " ".join(_fmt(a) for a in r["accept_by_depth"])
        lines.append(f"| {r['benchmark']} | {r['temperature']:g} | {r['n_prompts']} | {r['tau']:.3f} | "
                     f"{r['speedup']:.3f} | {r['tokens_per_s_spec']:.1f} | {r['tokens_per_s_vanilla']:.1f} | {by_depth} |")
    for r in rep["results"]:
        lines += ["", f"## {_label(r)}: per category", "", "| category | tau | speedup |", "|---|---|---|"]
        lines += [f"| {c} | {v['tau']:.3f} | {v['speedup']:.3f} |" for c, v in sorted(r["per_category"].items())]
        lines += ["", "accepted drafted tokens per pass (histogram, index = count): "
                  + ", ".join(f"{i}: {n}" for i, n in enumerate(r["accept_hist"]))]
        if "greedy_mismatches" in r:
            lines += ["", f"greedy outputs differing from vanilla: {r['greedy_mismatches']} (must be 0)"]
    lines += ["", "Plots: " + ", ".join(f"![{p}]({p})" for p in PLOTS), ""]
    return "\n".join(lines)


def _grouped_bars(ax, results, values) -> None:
    """One bar series per result (temperature), side by side at x = 0, 1, ...; values(r) -> heights."""
    width = 0.8 / max(1, len(results))
    for k, r in enumerate(results):
        ys = values(r)
        ax.bar([i + k * width for i in range(len(ys))], ys, width=width, label=_label(r))


def plot_report(rep: dict, out: Path) -> None:
    results = rep["results"]
    fig, ax = plt.subplots(figsize=(6, 4))
    _grouped_bars(ax, results, lambda r: [n / max(1, sum(r["accept_hist"])) for n in r["accept_hist"]])
    ax.set_xlabel("accepted drafted tokens per target pass")
    ax.set_ylabel("fraction of target passes")
    ax.set_title("Accepted length histogram")
    ax.legend()
    _atomic_fig(fig, out / "accept_hist.png")

    fig, ax = plt.subplots(figsize=(7, 4))
    cats = sorted({c for r in results for c in r["per_category"]})
    _grouped_bars(ax, results, lambda r: [r["per_category"].get(c, {}).get("tau", 0.0) for c in cats])
    ax.set_xticks(range(len(cats)), cats, rotation=30, ha="right")
    ax.set_xlabel("category")
    ax.set_ylabel("tau (tokens per target pass)")
    ax.set_title("tau per category")
    ax.legend()
    _atomic_fig(fig, out / "tau_by_category.png")

    fig, ax = plt.subplots(figsize=(6, 4))
    for r in results:
        ys = [float("nan") if a is None else a for a in r["accept_by_depth"]]
        ax.plot(range(1, len(ys) + 1), ys, marker="o", label=_label(r))
    ax.set_xlabel("draft depth")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_ylabel("acceptance rate (given the parent was accepted)")
    ax.set_ylim(0, 1.05)
    ax.set_title("Acceptance by depth")
    ax.legend()
    _atomic_fig(fig, out / "accept_by_depth.png")


def write_report(rep: dict, out_dir) -> Path:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    plot_report(rep, out)
    _atomic_text(out / "report.md", report_markdown(rep))
    _atomic_text(out / "report.json", json.dumps(rep, indent=2))  # last: its presence means done
    return out


def write_sweep(sweep: dict, out_dir) -> Path:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    b = sweep["best"]
    lines = [f"# Tree sweep: {sweep.get('head', '')}", "",
             f"- target: `{sweep.get('target', '')}`, machine: {sweep.get('machine', '')}, "
             f"temperature {sweep.get('temperature', 0):g}, prompts {sweep.get('n_prompts', '')}",
             f"- vanilla tokens/s: {sweep.get('tokens_per_s_vanilla', 0):.1f}", "",
             f"**Best on this machine:** topk {b['topk']}, depth {b['depth']}, num_draft_tokens "
             f"{b['num_draft_tokens']} (tau {b['tau']:.3f}, speedup {b['speedup']:.3f}; SGLang "
             f"--speculative-num-steps {b['depth']} --speculative-eagle-topk {b['topk']} "
             f"--speculative-num-draft-tokens {b['num_draft_tokens'] + 1})", "",
             "| topk | depth | num_draft_tokens | tau | speedup | tok/s |", "|---|---|---|---|---|---|"]
    lines += [f"| {r['topk']} | {r['depth']} | {r['num_draft_tokens']} | {r['tau']:.3f} | {r['speedup']:.3f} | "
              f"{r['tokens_per_s']:.1f} |" for r in sweep["results"]]
    _atomic_text(out / "sweep.md", "\n".join(lines) + "\n")
    _atomic_text(out / "sweep.json", json.dumps(sweep, indent=2))
    return out
