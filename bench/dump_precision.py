"""What running the target in bf16 for the dump (`dump.target_dtype=bfloat16`) does to the features.

    python bench/dump_precision.py [--record]    # files the result under ## Dump in bench/RESULTS.md

SmolLM2-135M-Instruct in fp32 and in bf16 over the same ShareGPT text (4 x 512 tokens): tokens/s of
the feature forward in each dtype (measured in one run, so the ratio holds on a noisy machine), the
relative error per token of the bf16 aux (EAGLE-3's three layers) and last hidden states against
fp32, and how often the top-1 next token (fp32 lm_head over each) agrees. The lean dump's own fp8
storage error (bench/RESULTS.md ## Dump) is the yardstick: ~2% per token on the aux features.
"""

from __future__ import annotations

import argparse
import copy
import gzip
import json
import os
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from record import record  # noqa: E402  (bench/record.py)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--record", action="store_true")
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--batch", type=int, default=4)
    a = ap.parse_args()
    from omegaconf import OmegaConf

    from eagle_train.features import target_features
    from eagle_train.recipe import TargetConfig
    from eagle_train.target import load_target

    model, tok = load_target(OmegaConf.structured(TargetConfig(model="smollm2-135m-instruct", device="cpu")))
    ids = []
    with gzip.open(ROOT.parent / "shared/data/sharegpt/sharegpt_v3_salvaged.jsonl.gz", "rt") as f:
        for line in f:
            ids += tok(" ".join(t["value"] for t in json.loads(line)["conversations"]))["input_ids"]
            if len(ids) >= a.tokens * a.batch:
                break
    ids = torch.tensor(ids[:a.tokens * a.batch]).view(a.batch, a.tokens)
    mask = torch.ones_like(ids)
    runs = {}
    for name, m in (("fp32", model), ("bf16", copy.deepcopy(model).to(torch.bfloat16))):
        target_features(m, ids[:1, :64], mask[:1, :64], [2, 15, 27], "full")  # warm-up
        t0 = time.perf_counter()
        runs[name] = target_features(m, ids, mask, [2, 15, 27], "full")
        runs[name]["tok_s"] = ids.numel() / (time.perf_counter() - t0)
    ref, got = runs["fp32"], runs["bf16"]
    err = {k: ((got[k].float() - ref[k]).norm(dim=-1) / ref[k].norm(dim=-1)).mean().item() for k in ("aux", "last")}
    w = model.get_output_embeddings().weight
    agree = ((ref["last"] @ w.T).argmax(-1) == (got["last"].float() @ w.T).argmax(-1)).float().mean().item()
    text = (f"`python bench/dump_precision.py` ({time.strftime('%Y-%m-%d')}): SmolLM2-135M-Instruct feature forward "
            f"over {a.batch} x {a.tokens} ShareGPT tokens, {torch.get_num_threads()} threads, torch "
            f"{torch.__version__}, load average {os.getloadavg()[0]:.1f}. fp32 {ref['tok_s']:.0f} tokens/s, bf16 "
            f"{got['tok_s']:.0f} tokens/s ({got['tok_s'] / ref['tok_s']:.2f}x). bf16 vs fp32 relative error per token: "
            f"aux {err['aux']:.4f}, last {err['last']:.4f} (the fp8 lean storage alone: ~0.021 on aux); top-1 next "
            f"token agreement {agree:.4f}. `dump.target_dtype=bfloat16` is what the SmolLM2 recipe dumps with.")
    print(text)
    if a.record:
        record("Dump", text)


if __name__ == "__main__":
    main()
