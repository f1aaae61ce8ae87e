"""Tree-setting sweep: tau and speedup of the head over the recipe's topk x depth x
num_draft_tokens grid, each setting against the same baseline, per prompt back to back. The head
drafts alone (no `eval.lookup_tokens` copy branch): the settings are the engines' serving flags.

    eagle-train sweep recipes/smollm2-135m-eagle3.yaml eval.sweep_topk=[1,2] eval.sweep_depth=[2,3]

Writes sweep.json / sweep.md under eval.output.
"""

from __future__ import annotations

from pathlib import Path
from typing import List

import torch
from tqdm import tqdm

from eagle_train.decoding import SpecConfig, max_tree_nodes
from eagle_train.eval.report import write_sweep
from eagle_train.eval.summary import lossless_rows, tau_of
from eagle_train.eval.run import (benchmark_label, busy_warning, check_eval_section, dtype_name, load_at_start,
                                  load_average, load_prompts, machine, render, resolve_benchmark, run_method, setup)


def sweep_settings(ecfg) -> List[dict]:
    """The grid topk x depth x num_draft_tokens, then `sweep_trees`, without duplicates: topk 1 is
    the chain (num_draft_tokens = depth), and a dynamic tree keeps at most `max_tree_nodes`."""
    grid = [(t, d, n) for t in ecfg.sweep_topk for d in ecfg.sweep_depth for n in ecfg.sweep_num_draft_tokens]
    seen, out = set(), []
    for topk, depth, nd in grid + [tuple(t) for t in ecfg.sweep_trees]:
        tree = "chain" if topk == 1 else "dynamic"
        nd = max_tree_nodes(SpecConfig(tree=tree, topk=topk, depth=depth, num_draft_tokens=nd))
        if (topk, depth, nd) not in seen:
            seen.add((topk, depth, nd))
            out.append({"tree": tree, "topk": topk, "depth": depth, "num_draft_tokens": nd})
    return out


def sweep_main(cfg) -> Path:
    """Per prompt: the baseline and every tree setting back to back (rotating order); rank the
    lossless settings by measured speedup."""
    ecfg = cfg.eval
    check_eval_section(ecfg)
    # prompts of every benchmark pooled, so the chosen tree is not tuned to one prompt set
    labels = [benchmark_label(b) for b in ecfg.benchmarks]
    prompts = [(label, p) for label, b in zip(labels, ecfg.benchmarks)
               for p in load_prompts(resolve_benchmark(b, ecfg.benchmark_dir), ecfg.max_prompts)]
    torch.manual_seed(ecfg.seed)
    load = load_at_start()
    model, tok, head, tid = setup(cfg, load)
    temp = float(ecfg.temperatures[0])
    settings = sweep_settings(ecfg)
    scfgs = [SpecConfig.from_eval(ecfg, temp, **s) for s in settings]
    for s in scfgs:  # warm each tree shape too
        run_method("head", model, head, render(tok, [{"role": "user", "content": "hi"}]),
                   SpecConfig(**{**s.__dict__, "max_new_tokens": 4}), tok.eos_token_id, 0)
    eos = tok.eos_token_id
    names = ["baseline"] + [f"s{i}" for i in range(len(settings))]
    # accepted lengths kept per prompt set too: a tree is judged on each set, not only on the pooled mean
    stats = {n: {"n": 0, "t": 0.0, "acc": {label: [] for label in labels}, "mismatches": 0} for n in names}
    for k, (label, p) in enumerate(tqdm(prompts, desc="sweep", unit="prompt", dynamic_ncols=True)):
        ids = render(tok, [{"role": "user", "content": p["turns"][0]}])
        outs = {}
        for name in names[k % len(names):] + names[: k % len(names)]:
            scfg = scfgs[int(name[1:])] if name != "baseline" else scfgs[0]
            res = run_method("baseline" if name == "baseline" else "head", model, head, ids, scfg, eos,
                             ecfg.seed + 1000 * k)
            outs[name] = res["tokens"]
            stats[name]["n"] += len(res["tokens"])
            stats[name]["t"] += res["seconds"]
            stats[name]["acc"][label] += res.get("accept_lengths", [])
        if temp == 0:
            for name in names[1:]:
                stats[name]["mismatches"] += outs[name] != outs["baseline"]
    tps_v = stats["baseline"]["n"] / max(1e-9, stats["baseline"]["t"])
    results = []
    for i, s in enumerate(settings):
        st = stats[f"s{i}"]
        tps = st["n"] / max(1e-9, st["t"])
        acc = [a for per_set in st["acc"].values() for a in per_set]  # each set once, even if two share a label
        results.append({**s, "tau": tau_of(acc), "speedup": tps / tps_v, "tokens_per_s": tps,
                        **({"greedy_mismatches": st["mismatches"]} if temp == 0 else {}),
                        # None: the set's replies ended before a target pass (nothing to average)
                        "tau_by_set": {label: tau_of(st["acc"][label]) if st["acc"][label] else None
                                       for label in labels},
                        "passes_by_set": {label: len(st["acc"][label]) for label in labels}})
        print(f"[sweep] {s}: tau {results[-1]['tau']:.3f}, speedup {results[-1]['speedup']:.3f}")
    lossless = lossless_rows(results, dtype_name(model))
    if not lossless:
        raise RuntimeError("every sweep setting's greedy output differs from the baseline: a decoder bug")
    best = max(lossless, key=lambda r: r["speedup"])
    most_tau = max(lossless, key=lambda r: r["tau"])  # where verifying a tree costs ~one token (a GPU)
    load["end"] = load_average()
    sweep = {"target": tid, "head": str(ecfg.head), "machine": machine(), "load_average": load,
             "target_dtype": dtype_name(model), "threads": torch.get_num_threads(),
             "busy": busy_warning(load, torch.get_num_threads()),
             "temperature": temp, "benchmarks": labels,
             "n_prompts": len(prompts), "tokens_per_s_vanilla": tps_v, "results": results, "best": best,
             "most_tau": most_tau}
    return write_sweep(sweep, ecfg.output)
