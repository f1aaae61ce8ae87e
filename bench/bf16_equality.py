"""How exact is greedy decoding in bf16? The head in bf16 against bf16 `generate`, and bf16 `generate` against fp32.

    python bench/bf16_equality.py [--head heads/smollm2-135m-instruct-eagle3] [--prompts 2] [--record]

A bf16 tree pass and a bf16 one-token pass sum in different orders, so where the target's top two
logits nearly tie they may pick different tokens; from there the two outputs go separate ways. The
same happens between bf16 and fp32 `generate`. This counts, over the first turns of `--prompts`
prompts of each of six eval sets, the outputs that differ and the position of the first differing
token for: head (bf16) vs generate (bf16), generate (bf16) vs generate (fp32), and head (fp32) vs
generate (fp32), which must be 0.
"""

from __future__ import annotations

import argparse
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
from eagle_train.eval.run import first_difference, load_prompts, render, resolve_benchmark  # noqa: E402

SETS = ["mt_bench", "humaneval", "gsm8k", "alpaca", "sum", "qa"]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--head", default="heads/smollm2-135m-instruct-eagle3")
    ap.add_argument("--prompts", type=int, default=2, help="prompts per eval set")
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--record", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(1)
    from omegaconf import OmegaConf

    from eagle_train.heads import load_head
    from eagle_train.recipe import TargetConfig
    from eagle_train.target import load_target

    models, heads = {}, {}
    for dtype in ("float32", "bfloat16"):
        models[dtype], tok = load_target(OmegaConf.structured(TargetConfig(model="smollm2-135m-instruct", device="cpu",
                                                                           dtype=dtype)))
        heads[dtype] = load_head(args.head, target=models[dtype]).to(models[dtype].dtype).eval()
    bench_dir = ROOT.parent / "shared" / "data" / "eagle_eval"
    items = [render(tok, [{"role": "user", "content": p["turns"][0]}])
             for s in SETS for p in load_prompts(resolve_benchmark(s, bench_dir), args.prompts)]
    scfg = SpecConfig(tree="dynamic", topk=4, depth=4, num_draft_tokens=8, max_new_tokens=args.max_new_tokens)
    eos = tok.eos_token_id
    pairs = {"head bf16 vs generate bf16": [], "generate bf16 vs generate fp32": [], "head fp32 vs generate fp32": []}
    for ids in items:
        gen = {d: vanilla_generate(models[d], ids, args.max_new_tokens, eos_token_id=eos) for d in models}
        spec = {d: speculative_generate(models[d], heads[d], ids, scfg, eos)[0] for d in models}
        pairs["head bf16 vs generate bf16"].append(first_difference(spec["bfloat16"], gen["bfloat16"]))
        pairs["generate bf16 vs generate fp32"].append(first_difference(gen["bfloat16"], gen["float32"]))
        pairs["head fp32 vs generate fp32"].append(first_difference(spec["float32"], gen["float32"]))
    rows = []
    for name, diffs in pairs.items():
        where = sorted(d for d in diffs if d is not None)
        rows.append(f"| {name} | {len(where)} of {len(diffs)} | {where if where else '-'} |")
        print(rows[-1], flush=True)
    text = "\n".join([
        f"`python bench/bf16_equality.py --prompts {args.prompts}` ({time.strftime('%Y-%m-%d')}): {args.head}, "
        f"SmolLM2-135M-Instruct, first turns of {args.prompts} prompts x {len(SETS)} eval sets, {args.max_new_tokens} "
        f"new tokens, dynamic tree topk 4 / depth 4 / 8 nodes, 1 thread, torch {torch.__version__}, "
        f"{platform.machine()}.", "",
        "| outputs compared | differing | first differing token (positions) |", "|---|---|---|", *rows])
    print(text)
    if args.record:
        record("bf16 greedy equality", text)
    assert all(d is None for d in pairs["head fp32 vs generate fp32"]), "fp32 must be exact"


if __name__ == "__main__":
    main()
