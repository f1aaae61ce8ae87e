"""When to deploy: greedy `generate` against the head at each batch size, on this hardware.

    eagle-train deploy recipes/smollm2-135m-eagle3.yaml eval.batch_sizes=[1,2,4,8,16] eval.max_prompts=16
    python -m eagle_train.eval.deploy recipes/smollm2-135m-eagle3.yaml key=value ...

EAGLE pays off while the target is memory-bound: at batch 1 a pass over a tree costs about what a
one-token pass costs. As the batch grows the passes become compute-bound, verifying B trees costs
more than B tokens, and the gain shrinks and then turns into a loss. This measures where.

For each batch size in `eval.batch_sizes` the same prompts (first turns of `eval.benchmarks`,
`eval.deploy_prompts` of them, cycled to fill the largest batch) go through batched greedy
`generate` (left-padded, plain argmax) and the batched head decoder
(eagle_train.batch_decoding), batch by batch, alternating which goes first. Throughput is output
tokens per second over the batch; a request's latency is the wall time of the batch it rode in.
Writes deploy.json / deploy.md / deploy_speedup.png under eval.output; `eagle-train export` puts
the table and the sentence "use EAGLE up to batch N on this hardware" in the model card.
Device-agnostic: on a GPU machine the same command measures the GPU.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import List, Sequence

import torch
from tqdm import tqdm

from eagle_train.batch_decoding import batched_speculative_generate
from eagle_train.baselines import plain_generation_config, timed
from eagle_train.decoding import SpecConfig, _finish, linears_from, packed_linears
from eagle_train.files import atomic_write_text
from eagle_train.recipe import RecipeError
from eagle_train.eval.report import _atomic_fig, plt
from eagle_train.eval.run import (busy_warning, check_eval_section, dtype_name, load_at_start, load_average,
                                  load_prompts, machine, render, resolve_benchmark, setup)

WARM_TOKENS = 4  # each method's first call at a batch size pays one-off costs: not timed


@torch.no_grad()
def generate_batch(model, prompts: Sequence[torch.Tensor], max_new_tokens: int, eos_token_id,
                   packed_verify: str = "off") -> List[List[int]]:
    """Batched greedy `generate` as a server would run it: prompts left-padded to one length with an
    attention mask, plain argmax (plain_generation_config), each row cut at its EOS; through the same
    packed linears as the head where `packed_verify` packs them (fp32 on an AVX2 CPU: -33% time at batch
    2-4, the same tokens), so the head is not credited with the packs' gain."""
    dev = model.device
    width = max(len(p) for p in prompts)
    pad = eos_token_id if eos_token_id is not None else 0
    ids = torch.full((len(prompts), width), pad, dtype=torch.long, device=dev)
    mask = torch.zeros_like(ids)
    for b, p in enumerate(prompts):
        ids[b, width - len(p):] = p.to(dev)
        mask[b, width - len(p):] = 1
    gcfg = plain_generation_config(max_new_tokens, eos_token_id)
    with linears_from(packed_linears(model, packed_verify)):
        out = model.generate(ids, attention_mask=mask, generation_config=gcfg)
    return [_finish(row, max_new_tokens, eos_token_id)[0] for row in out[:, width:].tolist()]


def head_batch(model, head, prompts, scfg: SpecConfig, eos_token_id):
    return batched_speculative_generate(model, head, prompts, scfg, eos_token_id=eos_token_id)


def batches_of(prompts: Sequence[torch.Tensor], size: int) -> List[list]:
    """The prompts in batches of `size`, cycled so every batch is full and every prompt runs at least once."""
    n = -(-max(len(prompts), size) // size) * size
    cycled = [prompts[i % len(prompts)] for i in range(n)]
    return [cycled[i:i + size] for i in range(0, n, size)]


def measure(model, head, prompts: Sequence[torch.Tensor], batch_sizes: Sequence[int], scfg: SpecConfig,
            eos_token_id=None, progress: bool = False) -> List[dict]:
    """One row per batch size: tokens/s and mean / max per-request latency of both methods, their
    ratio (speedup), the head's tau and how many rows' outputs differ from `generate`'s."""
    rows = []
    warm = SpecConfig(**{**scfg.__dict__, "max_new_tokens": WARM_TOKENS})
    for size in batch_sizes:
        batches = batches_of(prompts, size)
        generate_batch(model, batches[0], WARM_TOKENS, eos_token_id, scfg.packed_verify)
        head_batch(model, head, batches[0], warm, eos_token_id)
        acc = {m: {"tokens": 0, "seconds": 0.0, "latencies": []} for m in ("generate", "head")}
        accepted, passes, differ, t_draft, t_verify = 0, 0, 0, 0.0, 0.0
        for k, batch in enumerate(tqdm(batches, desc=f"deploy batch {size}", disable=not progress, leave=False)):
            outs = {}
            for m in (("generate", "head") if k % 2 == 0 else ("head", "generate")):  # interleaved
                if m == "generate":
                    outs[m], t = timed(generate_batch, model, batch, scfg.max_new_tokens, eos_token_id,
                                       scfg.packed_verify)
                else:
                    (outs[m], st), t = timed(head_batch, model, head, batch, scfg, eos_token_id)
                    accepted += sum(a + 1 for r in st["rows"] for a in r["accept_lengths"])
                    passes += sum(r["passes"] for r in st["rows"])
                    t_draft, t_verify = t_draft + st["t_draft"], t_verify + st["t_verify"]
                acc[m]["tokens"] += sum(len(o) for o in outs[m])
                acc[m]["seconds"] += t
                acc[m]["latencies"] += [t] * len(batch)  # every request of a batch returns with the batch
            differ += sum(a != b for a, b in zip(outs["generate"], outs["head"]))
        row = {"batch_size": size, "batches": len(batches), "requests": len(batches) * size}
        for m, a in acc.items():
            row[m] = {"tokens": a["tokens"], "seconds": a["seconds"],
                      "tokens_per_s": a["tokens"] / max(1e-9, a["seconds"]),
                      "latency_mean_s": sum(a["latencies"]) / len(a["latencies"]), "latency_max_s": max(a["latencies"])}
        row["speedup"] = row["head"]["tokens_per_s"] / max(1e-9, row["generate"]["tokens_per_s"])
        row["latency_ratio"] = row["head"]["latency_mean_s"] / max(1e-9, row["generate"]["latency_mean_s"])
        row["tau"] = accepted / max(1, passes)
        row["rows_differing"] = differ
        # draft: the head's passes and tree building; verify: the target's pass, acceptance, cache compaction
        t = max(1e-9, row["head"]["seconds"])
        row["head_time_split"] = {"draft": t_draft / t, "verify": t_verify / t,
                                  "other": max(0.0, 1 - (t_draft + t_verify) / t)}
        rows.append(row)
    return rows


def crossover(rows: List[dict]):
    """The largest batch size N such that the head is faster (speedup > 1) at every measured batch
    size up to N; None when it is not faster even at the smallest."""
    best = None
    for r in sorted(rows, key=lambda r: r["batch_size"]):
        if r["speedup"] <= 1:
            break
        best = r["batch_size"]
    return best


def advice(n) -> str:
    return (f"use EAGLE up to batch {n} on this hardware" if n is not None
            else "use EAGLE up to batch none on this hardware: plain `generate` was faster at every batch size "
                 "measured")


# ---------------------------------------------------------------------------------------------
# report


def deploy_markdown(rep: dict) -> str:
    load = rep.get("load_average") or {}
    lines = [f"# When to deploy: {rep.get('head', '')}", "",
             f"**Verdict: {rep['advice']}.**", "",
             f"- target: `{rep.get('target', '')}` ({rep.get('target_dtype', '')}); device: {rep.get('device', '')}",
             f"- machine: {rep.get('machine', '')}; date: {rep.get('date', '')}",
             f"- load average (1, 5, 15 min) at start {load.get('start')}, at end {load.get('end')}",
             *([f"- **warning: {rep['busy']}**"] if rep.get("busy") else []),
             f"- {rep.get('n_prompts')} prompts cycled to fill each batch, max_new_tokens {rep.get('max_new_tokens')}, "
             f"tree {rep.get('tree', '')}; greedy",
             "", "speedup = the head's output tokens/s over batched `generate`'s (left-padded, plain argmax), same "
             "prompts, batches interleaved. Latency = wall time of the batch a request rode in (mean, max). "
             "rows differing = rows whose head output is not batched `generate`'s (padding may round fp32 "
             "differently; the head decoder itself reproduces batch-1 greedy).", "",
             "| batch | speedup | tok/s generate | tok/s head | latency generate (s) | latency head (s) | tau "
             "| head's time draft / verify | requests | rows differing |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rep["rows"]:
        g, h = r["generate"], r["head"]
        lines.append(f"| {r['batch_size']} | {r['speedup']:.2f}x | {g['tokens_per_s']:.1f} | {h['tokens_per_s']:.1f} "
                     f"| {g['latency_mean_s']:.2f} (max {g['latency_max_s']:.2f}) | {h['latency_mean_s']:.2f} "
                     f"(max {h['latency_max_s']:.2f}) | {r['tau']:.2f} | {100 * r['head_time_split']['draft']:.0f}% / "
                     f"{100 * r['head_time_split']['verify']:.0f}% | {r['requests']} | {r['rows_differing']} |")
    lines += ["", "![speedup against batch size](deploy_speedup.png)", ""]
    return "\n".join(lines)


def plot_deploy(rep: dict, path: Path) -> None:
    rows, n = rep["rows"], rep["crossover"]
    xs, ys = [r["batch_size"] for r in rows], [r["speedup"] for r in rows]
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(xs, ys, marker="o", label="EAGLE head / generate")
    ax.axhline(1.0, color="grey", linestyle="--", label="break-even")
    if n is not None:
        ax.axvline(n, color="tab:green", linestyle=":", label=f"crossover: batch {n}")
    ax.set_xscale("log", base=2)
    ax.set_xticks(xs, [str(x) for x in xs])
    ax.set_xlabel("batch size")
    ax.set_ylabel("speedup (output tokens/s over generate's)")
    ax.set_title(f"Speedup against batch size ({rep.get('device', '')}): EAGLE up to batch "
                 f"{'none' if n is None else n}")
    ax.legend()
    _atomic_fig(fig, path)


def write_deploy(rep: dict, out_dir) -> Path:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    plot_deploy(rep, out / "deploy_speedup.png")
    atomic_write_text(out / "deploy.md", deploy_markdown(rep))
    atomic_write_text(out / "deploy.json", json.dumps(rep, indent=2))
    return out


def device_name(model) -> str:
    dev = model.device
    if dev.type == "cuda":
        return f"GPU {torch.cuda.get_device_name(dev)}"
    return f"{dev.type.upper()}, {torch.get_num_threads()} threads"


def build_report(rows: List[dict], model, scfg: SpecConfig, n_prompts: int, load: dict, **info) -> dict:
    n = crossover(rows)
    return {**info, "device": device_name(model), "target_dtype": dtype_name(model),
            "date": time.strftime("%Y-%m-%d %H:%M:%S"), "load_average": load,
            "busy": busy_warning(load, torch.get_num_threads()), "n_prompts": n_prompts,
            "max_new_tokens": scfg.max_new_tokens, "tree": f"{scfg.tree} (topk {scfg.topk}, depth {scfg.depth}, "
            f"num_draft_tokens {scfg.num_draft_tokens})", "rows": rows, "crossover": n, "advice": advice(n)}


def main(cfg) -> Path:
    ecfg = cfg.eval
    check_eval_section(ecfg)
    if not ecfg.batch_sizes or any(b <= 0 for b in ecfg.batch_sizes):
        raise RecipeError(f"`eval.batch_sizes` = {list(ecfg.batch_sizes)} must list batch sizes > 0")
    n = ecfg.deploy_prompts or ecfg.max_prompts or max(ecfg.batch_sizes)
    texts = [p["turns"][0] for b in ecfg.benchmarks
             for p in load_prompts(resolve_benchmark(b, ecfg.benchmark_dir), n)][:n]
    torch.manual_seed(ecfg.seed)
    load = load_at_start()  # before loading: our own work is not in it yet
    model, tok, head, tid = setup(cfg, load)
    prompts = [render(tok, [{"role": "user", "content": t}])[0] for t in texts]
    scfg = SpecConfig.from_eval(ecfg, 0.0, lookup_tokens=0)  # serving advice: the head alone, as the engines draft
    rows = measure(model, head, prompts, list(ecfg.batch_sizes), scfg, tok.eos_token_id, progress=True)
    load["end"] = load_average()
    rep = build_report(rows, model, scfg, len(prompts), load, target=tid, head=str(ecfg.head), machine=machine())
    out = write_deploy(rep, ecfg.output)
    for r in rows:
        print(f"[deploy] batch {r['batch_size']}: speedup {r['speedup']:.2f}x ({r['head']['tokens_per_s']:.1f} vs "
              f"{r['generate']['tokens_per_s']:.1f} tok/s), tau {r['tau']:.2f}")
    print(f"[deploy] {rep['advice']}")
    return out


if __name__ == "__main__":
    from eagle_train.cli import run_stage

    sys.exit(run_stage("deploy", sys.argv[1:]))
