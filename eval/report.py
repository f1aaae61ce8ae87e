"""Eval and sweep reports: report.json / report.md and PNG plots (matplotlib Agg, labelled axes);
sweep.json / sweep.md. Every write is atomic (eagle_train/files.py)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import List

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.ticker import MaxNLocator  # noqa: E402

from eagle_train.files import atomic_path, atomic_write_text  # noqa: E402
from eagle_train.model_card import sglang_tree_flags  # noqa: E402

PLOTS = ("accept_hist.png", "tau_by_category.png", "accept_by_depth.png")
COPY_PLOT = "copy_branch.png"  # written when eval.lookup_tokens > 0


def _atomic_fig(fig, path: Path) -> None:
    with atomic_path(path) as tmp:
        fig.savefig(tmp, format="png", dpi=110, bbox_inches="tight")
    plt.close(fig)


def _label(r: dict) -> str:
    return f"{r['benchmark']} T={r['temperature']:g}"


def _fmt(x, nd=2):
    return "-" if x is None else f"{x:.{nd}f}"


def _ci(ci) -> str:
    return f" [{ci[0]:.2f}, {ci[1]:.2f}]" if ci else ""


def _pl_label(name: str) -> str:
    return f"prompt lookup ({name.rsplit('_', 1)[1]} tokens)"


def report_markdown(rep: dict) -> str:
    s = rep["settings"]
    load = rep.get("load_average") or {}
    lines = [f"# Acceptance report: {rep['head']}", "",
             f"- target: `{rep['target']}`, head type: {rep.get('head_type', 'unknown')}",
             f"- machine: {rep['machine']}", f"- date: {rep['date']}",
             f"- target dtype: {rep.get('target_dtype', 'float32')}, decoding threads: {rep.get('threads', '-')}",
             f"- load average (1, 5, 15 min) at start {load.get('start')}, at end {load.get('end')}: timings on a "
             "busy machine are slower for every method alike (they interleave per prompt)",
             *([f"- **warning: {rep['busy']}**"] if rep.get("busy") else []),
             f"- tree: {s['tree']} (topk {s['topk']}, depth {s['depth']}, num_draft_tokens {s['num_draft_tokens']}"
             f" root excluded), max_new_tokens {s['max_new_tokens']}, top_p {s.get('top_p')}, "
             f"top_k {s.get('top_k', 0)}",
             *([f"- copy branch (the row \"head + copy branch\"): up to {s['lookup_tokens']} prompt-lookup tokens "
                f"(n-grams of {s['lookup_min_ngram']}-{s['lookup_ngram']}) join each tree in eagle-train's decoder; "
                "vLLM and SGLang draft with the head alone (the row \"EAGLE head\")"]
               if s.get("lookup_tokens") else []),
             *([] if rep.get("complete", True) else ["- **incomplete**: the run stopped or is still going; the "
                                                      "benchmarks below are finished"]),
             "",
             "tau = tokens per target pass (accepted drafted tokens + the bonus token; tokens cut at EOS or the "
             "budget not counted; the head's prefill pass drafts nothing and is left out, prompt lookup's prefill "
             "already verifies a draft and is counted). speedup = the method's tokens/s over the baseline's "
             "(`generate`, plain argmax at "
             "T=0), measured on the same prompts in the same run, every method through the same linear layers "
             "(`eval.packed_verify`). [a, b] = 95% bootstrap interval over prompts.", "",
             "| benchmark | T | prompts | method | tau | speedup | tok/s | greedy mismatches |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rep["results"]:
        head = f"| {r['benchmark']} | {r['temperature']:g} | {r['n_prompts']} |"
        lines.append(f"{head} baseline | 1.00 | 1.00x | {r['tokens_per_s_vanilla']:.1f} | - |")
        for name, b in (r.get("baselines") or {}).items():
            lines.append(f"{head} {_pl_label(name)} | {b['tau']:.2f}{_ci(b.get('tau_ci'))} | {b['speedup']:.2f}x"
                         f"{_ci(b.get('speedup_ci'))} | {b['tokens_per_s']:.1f} | {b.get('greedy_mismatches', '-')} |")
        lines.append(f"{head} **EAGLE head** | **{r['tau']:.2f}**{_ci(r.get('tau_ci'))} | **{r['speedup']:.2f}x**"
                     f"{_ci(r.get('speedup_ci'))} | {r['tokens_per_s_spec']:.1f} | {r.get('greedy_mismatches', '-')} |")
        if r.get("copy_branch"):
            c = r["copy_branch"]
            lines.append(f"{head} EAGLE head + copy branch | {c['tau']:.2f}{_ci(c.get('tau_ci'))} | {c['speedup']:.2f}x"
                         f"{_ci(c.get('speedup_ci'))} | {c['tokens_per_s']:.1f} | {c.get('greedy_mismatches', '-')} |")
    lines += ["", "## Does the head beat prompt lookup?", ""]
    lines += [f"- {_label(r)}: {r['verdict']}" for r in rep["results"] if r.get("verdict")]
    for r in rep["results"]:
        lines += ["", f"## {_label(r)}", "", "| category | prompts | tau | speedup |", "|---|---|---|---|"]
        lines += [f"| {c} | {v.get('n_prompts', '-')} | {v['tau']:.3f} | {v['speedup']:.3f} |"
                  for c, v in sorted(r["per_category"].items())]
        lines += ["", "acceptance rate by depth (given the parent was accepted): "
                  + ", ".join(f"{d}: {_fmt(a)}" for d, a in enumerate(r["accept_by_depth"], start=1)),
                  "", "accepted drafted tokens per pass (histogram, index = count): "
                  + ", ".join(f"{i}: {n}" for i, n in enumerate(r["accept_hist"]))]
        if r.get("copy_branch"):
            lines += ["", "with the copy branch, accepted drafted tokens only it proposed: "
                      f"{100 * r['copy_branch']['lookup_share']:.0f}%"]
        if r.get("tau_by_turn"):
            lines += ["", "tau by turn: " + ", ".join(f"turn {t}: {v:.2f}" for t, v in r["tau_by_turn"].items())]
        if r.get("tau_by_position"):
            lines += ["", "tau by reply position (where a target pass starts; later tokens are easier to draft, so "
                      "tau grows with eval.max_new_tokens): "
                      + ", ".join(f"{b}: {v:.2f}" for b, v in r["tau_by_position"].items())]
        if r.get("time_split"):
            ts = r["time_split"]
            lines += ["", f"head's time: draft {100 * ts['draft']:.0f}%, verify {100 * ts['verify']:.0f}%, "
                      f"other {100 * ts['other']:.0f}% (draft: the head drafting and re-reading the accepted path; "
                      "verify: the target's tree pass, acceptance and cache commit)"]
        if "greedy_mismatches" in r:
            lines += ["", mismatch_line(r, rep.get("target_dtype", "float32"))]
    lines += ["", "Per-prompt records (tokens, seconds, passes, accepted lengths per method) are in report.json.",
              "", "Plots: " + ", ".join(f"![{p}]({p})" for p in PLOTS
                                         + ((COPY_PLOT,) if any(r.get("copy_branch") for r in rep["results"]) else ())),
              ""]
    return "\n".join(lines)


def mismatch_line(r: dict, dtype: str) -> str:
    n = r["greedy_mismatches"]
    if dtype == "float32":
        return f"greedy outputs differing from the baseline: {n} (must be 0 in float32)"
    where = r.get("first_divergence") or []
    return (f"greedy outputs differing from the baseline in {dtype}: {n}"
            + (f", first differing token at positions {where}" if where else "")
            + f" (a {dtype} tree pass and a {dtype} one-token pass can round a near-tie differently; each output "
            "is the target's greedy text up to that position; float32 has none)")


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
    _save_plot(fig, ax, "accepted drafted tokens per target pass", "fraction of target passes",
               "Accepted length histogram", out / "accept_hist.png")

    fig, ax = plt.subplots(figsize=(7, 4))
    cats = sorted({c for r in results for c in r["per_category"]})
    _grouped_bars(ax, results, lambda r: [r["per_category"].get(c, {}).get("tau", 0.0) for c in cats])
    ax.set_xticks(range(len(cats)), cats, rotation=30, ha="right")
    _save_plot(fig, ax, "category", "tau (tokens per target pass)", "tau per category", out / "tau_by_category.png")

    fig, ax = plt.subplots(figsize=(6, 4))
    for r in results:
        ys = [float("nan") if a is None else a for a in r["accept_by_depth"]]
        ax.plot(range(1, len(ys) + 1), ys, marker="o", label=_label(r))
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_ylim(0, 1.05)
    _save_plot(fig, ax, "draft depth", "acceptance rate (given the parent was accepted)", "Acceptance by depth",
               out / "accept_by_depth.png")

    if any(r.get("copy_branch") for r in results):  # eval.lookup_tokens: what the copy branch adds, per benchmark
        fig, ax = plt.subplots(figsize=(7, 4))
        xs = range(len(results))
        ax.bar([x - 0.2 for x in xs], [r["tau"] for r in results], width=0.4, label="EAGLE head (as the engines)")
        ax.bar([x + 0.2 for x in xs], [(r.get("copy_branch") or {}).get("tau", 0.0) for r in results], width=0.4,
               label="head + copy branch")
        ax.set_xticks(list(xs), [_label(r) for r in results], rotation=30, ha="right")
        _save_plot(fig, ax, "benchmark", "tau (tokens per target pass)", "The copy branch", out / COPY_PLOT)


def _save_plot(fig, ax, xlabel: str, ylabel: str, title: str, path: Path) -> None:
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.legend()
    _atomic_fig(fig, path)


def write_report(rep: dict, out_dir) -> Path:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    plot_report(rep, out)
    atomic_write_text(out / "report.md", report_markdown(rep))
    atomic_write_text(out / "report.json", json.dumps(rep, indent=2))  # last: its presence means done
    return out


def set_spread(r: dict, sets: List[str]) -> str:
    """One row's tau on each prompt set, and how far the lowest set falls below the first listed (the
    reference set, MT-bench in the recipes): a head tuned to one set shows it here."""
    taus = r["tau_by_set"]
    text = ", ".join(f"{s} {_tau(taus[s])}" for s in sets)
    rest = [s for s in sets[1:] if taus[s] is not None]
    if taus[sets[0]] is None or not rest:
        return text
    low = min(rest, key=lambda s: taus[s])
    return text + f"; lowest {low}, {100 * (taus[low] / taus[sets[0]] - 1):+.0f}% of {sets[0]}"


def _tau(t) -> str:
    return "-" if t is None else f"{t:.3f}"


def write_sweep(sweep: dict, out_dir) -> Path:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    b = sweep["best"]
    # per-set columns only where the sweep pooled several sets (older sweep.json files have none)
    sets = list(b.get("tau_by_set", {})) if len(b.get("tau_by_set", {})) > 1 else []
    lines = [f"# Tree sweep: {sweep.get('head', '')}", "",
             f"- target: `{sweep.get('target', '')}`, machine: {sweep.get('machine', '')}, "
             f"temperature {sweep.get('temperature', 0):g}, prompts {sweep.get('n_prompts', '')} "
             f"(first turns of {', '.join(sweep.get('benchmarks', []))})",
             f"- vanilla tokens/s: {sweep.get('tokens_per_s_vanilla', 0):.1f}", "",
             f"**Best on this machine:** topk {b['topk']}, depth {b['depth']}, num_draft_tokens "
             f"{b['num_draft_tokens']} (tau {b['tau']:.3f}, speedup {b['speedup']:.3f}; SGLang "
             f"{sglang_tree_flags(b)})", "",
             *([f"**Most tokens per target pass:** topk {m['topk']}, depth {m['depth']}, num_draft_tokens "
                f"{m['num_draft_tokens']} (tau {m['tau']:.3f}, speedup {m['speedup']:.3f} here; SGLang "
                f"{sglang_tree_flags(m)}): the tree to start from where a target pass over that many tokens costs "
                "about one token (a GPU)", ""]
               if (m := sweep.get("most_tau")) and m is not b else []),
             f"- load average (1, 5, 15 min): {sweep.get('load_average')}; settings and the baseline interleave "
             "per prompt",
             f"- target dtype: {sweep.get('target_dtype', 'float32')}, decoding threads: {sweep.get('threads', '-')}"
             + ("" if sweep.get("target_dtype", "float32") == "float32" else
                " (greedy mismatches: near-ties rounded differently by a tree pass; counted, not disqualifying)"),
             *([f"- **warning: {sweep['busy']}**"] if sweep.get("busy") else []),
             *([f"- tau by prompt set, best: {set_spread(b, sets)}"] if sets else []),
             *([f"- tau by prompt set, most tokens per pass: {set_spread(m, sets)}"]
               if sets and (m := sweep.get("most_tau")) and m is not b else []), "",
             "| tree | topk | depth | num_draft_tokens | tau | speedup | tok/s | greedy mismatches |"
             + "".join(f" tau {s} |" for s in sets),
             "|---|---|---|---|---|---|---|---|" + "---|" * len(sets)]
    lines += [f"| {r.get('tree', '-')} | {r['topk']} | {r['depth']} | {r['num_draft_tokens']} | {r['tau']:.3f} | "
              f"{r['speedup']:.3f} | {r['tokens_per_s']:.1f} | {r.get('greedy_mismatches', '-')} |"
              + "".join(f" {_tau(r['tau_by_set'][s])} |" for s in sets)
              for r in sweep["results"]]
    atomic_write_text(out / "sweep.md", "\n".join(lines) + "\n")
    atomic_write_text(out / "sweep.json", json.dumps(sweep, indent=2))
    return out
