"""Summaries of an acceptance evaluation: tau and speedup per method from per-prompt sums, 95%
bootstrap intervals over prompts, the head's acceptance by depth / by turn / by reply position / time
split, per-category rows and the plain verdict against prompt lookup."""

from __future__ import annotations

from collections import defaultdict
from typing import List

import numpy as np

BOOTSTRAP = 1000
# where in the reply a target pass starts: a small head accepts far less in a reply's opening tokens
# than later on (bench/RESULTS.md "## Where in a reply the head is accepted"), so tau depends on the length
POSITION_BUCKETS = (0, 32, 96, 192, 384)
POSITION_LABELS = ([f"{lo}-{hi - 1}" for lo, hi in zip(POSITION_BUCKETS, POSITION_BUCKETS[1:])]
                   + [f"{POSITION_BUCKETS[-1]}+"])


def position_label(pos: int) -> str:
    """The bucket ("0-31", ..., "384+") of reply position `pos`."""
    return POSITION_LABELS[sum(b <= pos for b in POSITION_BUCKETS) - 1]


def _emitted_passes(res: dict, name: str):
    """(tokens credited to drafting passes, target passes) of one method's result. The head's
    prefill emits one token and drafts nothing: excluded. Prompt lookup's prefill already
    verifies a draft: every pass counts."""
    if name in ("head", "head_copy"):
        return sum(a + 1 for a in res["accept_lengths"]), res["passes"]
    return res["n"], res.get("passes", res["n"])


def _per_prompt(records, name):
    """Per prompt (turns summed): emitted, passes, tokens and seconds of `name` and the baseline."""
    by_id = defaultdict(lambda: np.zeros(6))
    for r in records:
        m, b = r["methods"][name], r["methods"]["baseline"]
        e, ps = _emitted_passes(m, name)
        by_id[r["id"]] += [e, ps, m["n"], m["seconds"], b["n"], b["seconds"]]
    return np.stack(list(by_id.values()))


def _ratios(x: np.ndarray):
    """tau and speedup from column sums (rows: prompts; a leading axis: bootstrap resamples)."""
    s = x.sum(axis=-2)
    tau = s[..., 0] / np.maximum(s[..., 1], 1)
    speed = (s[..., 2] / np.maximum(s[..., 3], 1e-9)) / np.maximum(s[..., 4] / np.maximum(s[..., 5], 1e-9), 1e-9)
    return tau, speed


def bootstrap_ci(x: np.ndarray, seed: int = 0, n: int = BOOTSTRAP):
    """95% percentile intervals of tau and speedup, resampling prompts with replacement."""
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, len(x), size=(n, len(x)))
    tau, speed = _ratios(x[idx])
    q = lambda v: [float(np.percentile(v, 2.5)), float(np.percentile(v, 97.5))]  # noqa: E731
    return q(tau), q(speed)


def summarize_method(records: List[dict], name: str, seed: int = 0) -> dict:
    x = _per_prompt(records, name)
    tau, speed = _ratios(x)
    tau_ci, speed_ci = bootstrap_ci(x, seed)
    out = {"tau": float(tau), "tau_ci": tau_ci, "speedup": float(speed), "speedup_ci": speed_ci,
           "tokens_per_s": float(x[:, 2].sum() / max(1e-9, x[:, 3].sum()))}
    same = [r["methods"][name].get("same") for r in records]
    if same and same[0] is not None:
        out["greedy_mismatches"] = sum(not s for s in same)
        # where a reduced-precision tree pass first rounds a near-tie differently from the one-token pass
        out["first_divergence"] = sorted(r["methods"][name]["first_diff"] for r in records
                                         if r["methods"][name].get("first_diff") is not None)
    return out


def tau_of(accept_lengths: List[int]) -> float:
    """Mean tokens per target pass: the accepted drafts plus the target's own token."""
    return sum(a + 1 for a in accept_lengths) / max(1, len(accept_lengths))


def tau_by_position(records: List[dict]) -> dict:
    """The head's tau over the passes starting in each reply-position bucket ("0-31", ..., "384+").
    The prefill emits reply token 0, so the first drafting pass starts at position 1."""
    sums = defaultdict(lambda: [0, 0])
    for r in records:
        pos = 1
        for a in r["methods"]["head"]["accept_lengths"]:
            bucket = sums[position_label(pos)]
            bucket[0] += a + 1
            bucket[1] += 1
            pos += a + 1
    return {b: sums[b][0] / sums[b][1] for b in POSITION_LABELS if b in sums}


def summarize(records: List[dict], depth: int, seed: int = 0) -> dict:
    """The head's row (tau, speedup with CIs, accept rate per depth given the parent was accepted,
    histogram, tau by turn, draft/verify split) and one row per baseline drafter."""
    acc = [a for r in records for a in r["methods"]["head"]["accept_lengths"]]
    hist = [sum(1 for a in acc if a == d) for d in range(depth + 1)]
    by_depth = []
    for d in range(1, depth + 1):
        reached = sum(1 for a in acc if a >= d - 1)
        by_depth.append(sum(1 for a in acc if a >= d) / reached if reached else None)
    head = summarize_method(records, "head", seed)
    base = _per_prompt(records, "head")
    t_draft = sum(r["methods"]["head"]["t_draft"] for r in records)
    t_verify = sum(r["methods"]["head"]["t_verify"] for r in records)
    t_all = sum(r["methods"]["head"]["seconds"] for r in records)
    turns = defaultdict(list)
    for r in records:
        turns[r["turn"] + 1] += r["methods"]["head"]["accept_lengths"]
    out = {**{k: v for k, v in head.items() if k != "tokens_per_s"},
           "tokens_per_s_spec": head["tokens_per_s"],
           "tokens_per_s_vanilla": float(base[:, 4].sum() / max(1e-9, base[:, 5].sum())),
           "accept_by_depth": by_depth, "accept_hist": hist,
           "tau_by_turn": {str(t): tau_of(v) for t, v in sorted(turns.items())},
           "tau_by_position": tau_by_position(records),
           "time_split": {"draft": t_draft / max(1e-9, t_all), "verify": t_verify / max(1e-9, t_all),
                          "other": max(0.0, 1 - (t_draft + t_verify) / max(1e-9, t_all))}}
    if "head_copy" in records[0]["methods"]:  # eval.lookup_tokens: the head with the copy branch
        cp = summarize_method(records, "head_copy", seed)
        drafted = sum(a for r in records for a in r["methods"]["head_copy"]["accept_lengths"])
        # the share of its accepted drafts that only the copy branch proposed
        cp["lookup_share"] = sum(r["methods"]["head_copy"]["lookup_accepted"] for r in records) / max(1, drafted)
        out["copy_branch"] = cp
    out["baselines"] = {m: summarize_method(records, m, seed) for m in records[0]["methods"]
                        if m.startswith("prompt_lookup_")}
    return out


def _category_row(records: List[dict]) -> dict:
    s = summarize_method(records, "head")
    return {"tau": s["tau"], "speedup": s["speedup"], "n_prompts": len({r["id"] for r in records})}


def verdict(res: dict) -> str:
    """One plain sentence: does the head beat the best prompt lookup on this benchmark?"""
    pls = res.get("baselines") or {}
    if not pls:
        return "no prompt-lookup baseline was run"
    name, best = max(pls.items(), key=lambda kv: kv[1]["speedup"])
    n = name.rsplit("_", 1)[1]
    if res["speedup"] > best["speedup"] and res["tau"] > best["tau"]:
        sure = " (the speedup intervals do not overlap)" if res["speedup_ci"][0] > best["speedup_ci"][1] else \
            " (but the speedup intervals overlap: more prompts would tell)"
        return f"the head BEATS prompt lookup ({n} tokens) on tau and speedup{sure}"
    figures = (f"({n} tokens: tau {best['tau']:.2f}, speedup {best['speedup']:.2f}x vs the head's {res['tau']:.2f}, "
               f"{res['speedup']:.2f}x)")
    (lo, hi), (pl_lo, pl_hi) = res["speedup_ci"], best["speedup_ci"]
    if lo <= pl_hi and pl_lo <= hi:  # e.g. 1.38x vs 1.39x: a tie, not a loss
        return (f"the head does not clearly beat prompt lookup {figures}: the speedup intervals overlap, "
                "more prompts would tell")
    return f"the head does NOT beat prompt lookup {figures}: serving it gains nothing over the free n-gram drafter"


def lossless_rows(results: List[dict], target_dtype: str) -> List[dict]:
    """The sweep rows a setting may be chosen from. In float32 a greedy mismatch is a decoder bug and
    disqualifies; in bf16/fp16 near-ties round differently between a tree pass and a one-token pass,
    so mismatches are counted and reported, not disqualifying."""
    exact = target_dtype == "float32"
    return [r for r in results if not (exact and r.get("greedy_mismatches"))]
