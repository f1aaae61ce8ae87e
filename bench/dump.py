"""Dump throughput and size: dump tokens/s vs a bare target forward on the same batches of SmolLM2.

    python bench/dump.py [--samples 64] [--max-length 256] [--batch-tokens 4096] [--threads 2] [--record]
    python bench/dump.py --targets-ab [--repeats 2] ...   # the lean dump with dump.targets all vs replies

Prepares `--samples` real ShareGPT conversations with `eagle-train prep` (SmolLM2 chat template),
plans the dump's length-sorted batches, times the bare target forward (`model(input_ids,
attention_mask)`, logits included) on exactly those batches, then runs the dump stage once per
storage mode and reports, per mode: dump tokens/s (model loaded, everything else timed: corpus
read, forward, feature encoding, shard writes with sha256), the ratio to the bare forward (goal
>= 0.9), bytes per token on disk next to the 8*H bytes of a bf16 last+3-layer dump (goal: lean
<= 4*H), and the relative RMS reconstruction error of aux/last against fp32 features.
`--targets-ab` runs only the lean mode (topk, float8), `--repeats` times each with dump.targets=all and
=replies in turn, and prints the tokens/s ratio replies / all measured in the one run.
`--record` appends the table to bench/RESULTS.md under `## Dump`.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from record import record  # noqa: E402  (bench/record.py)
SHAREGPT = ROOT.parent / "shared" / "data" / "sharegpt" / "sharegpt_v3_salvaged.jsonl.gz"
MODES = [("full", "bfloat16", "all"), ("topk", "bfloat16", "all"), ("topk", "float8", "all"),
         ("topk", "float8", "replies"), ("full", "float8", "all")]


def bare_forward(model, ds, batches) -> tuple[float, int]:
    """Seconds and real tokens of model(input_ids, attention_mask) over the dump's batches."""
    device = next(model.parameters()).device
    tokens, t0 = 0, time.perf_counter()
    with torch.no_grad():
        for batch in batches:
            seqs = ds[batch]["input_ids"]
            width = max(len(s) for s in seqs)
            ids = torch.zeros(len(seqs), width, dtype=torch.long)
            mask = torch.zeros(len(seqs), width, dtype=torch.long)
            for i, s in enumerate(seqs):
                ids[i, :len(s)], mask[i, :len(s)] = torch.tensor(s), 1
            model(input_ids=ids.to(device), attention_mask=None if mask.all() else mask.to(device), use_cache=False)
            tokens += int(mask.sum())
    if device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - t0, tokens


def rel_error(folder, ref_feats, hidden: int) -> dict:
    """Reconstruction error of the read-back hidden features against fp32 ones (first samples):
    `name` = global relative RMS error, `name_row` = mean over tokens and layers of ||x^ - x|| / ||x||
    (the per-token view that the outlier dims do not dominate)."""
    from eagle_train.dump_reader import FeatureDataset

    ds = FeatureDataset(folder)
    err = {}
    for name in ("aux", "last"):
        num = den = 0.0
        rows = []
        for i, sid in enumerate(ds.ids):
            if sid in ref_feats and name in ds[i]:
                x, ref = ds[i][name].reshape(-1, hidden), ref_feats[sid][name].reshape(-1, hidden)
                num += float((x - ref).pow(2).sum())
                den += float(ref.pow(2).sum())
                rows.append((x - ref).norm(dim=-1) / ref.norm(dim=-1))
        if den:
            err[name], err[name + "_row"] = (num / den) ** 0.5, float(torch.cat(rows).mean())
    return err


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--samples", type=int, default=64)
    ap.add_argument("--max-length", type=int, default=256)
    ap.add_argument("--batch-tokens", type=int, default=4096)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--device", default="auto")
    ap.add_argument("--dtype", default="float32", help="target.dtype the dump runs in (make full: auto, bf16 where native)")
    ap.add_argument("--targets-ab", action="store_true", help="only topk/float8, targets all vs replies in turn")
    ap.add_argument("--repeats", type=int, default=1, help="with --targets-ab: runs of each")
    ap.add_argument("--record", action="store_true", help="append the results to bench/RESULTS.md")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    from eagle_train.data_prep import dump, prepare
    from datasets import load_from_disk
    from eagle_train.eagle3 import default_aux_layers
    from eagle_train.features import target_features
    from eagle_train.recipe_load import load_recipe
    from eagle_train.target import load_target

    tmp = Path(tempfile.mkdtemp(prefix="bench-dump-"))
    base = [f"output_dir={tmp}", f"data.source={SHAREGPT}", f"data.max_conversations={args.samples}",
            f"data.max_length={args.max_length}", "data.eval_fraction=0", "target.model=smollm2-135m-instruct",
            f"target.device={args.device}", f"target.dtype={args.dtype}", f"dump.batch_tokens={args.batch_tokens}", "dump.include_eval=false",
            "dump.topk=64"]
    cfg = load_recipe(None, base)
    prepare.main(cfg)
    model, _ = load_target(cfg.target, with_tokenizer=False)
    H = model.config.hidden_size
    ds = load_from_disk(str(tmp / "data" / "train"))
    rows, lengths = dump.select_samples(ds)
    batches = dump.plan_batches(rows, lengths, args.batch_tokens)
    n_tokens = int(lengths.sum())
    print(f"{len(rows)} samples, {n_tokens} tokens, {len(batches)} batches, device {next(model.parameters()).device}")

    bare_forward(model, ds, batches[-1:])  # warm-up
    bare = []
    sec, tok = bare_forward(model, ds, batches)
    bare.append(tok / sec)
    # fp32 reference features of the first 8 samples, one by one
    ref = {}
    for r in rows[:8].tolist():
        ids = torch.tensor([ds[r]["input_ids"]], device=next(model.parameters()).device)
        f = target_features(model, ids, None, default_aux_layers(model.config.num_hidden_layers), "full")
        ref[ds[r]["id"]] = {k: v[0].float().cpu() for k, v in f.items()}

    results = []
    modes = [m for m in MODES if m[:2] == ("topk", "float8")] * args.repeats if args.targets_ab else MODES
    for n, (storage, dtype, targets) in enumerate(modes):
        out = tmp / f"dump-{storage}-{dtype}-{targets}-{n}"
        c = load_recipe(None, base + [f"dump.storage={storage}", f"dump.dtype={dtype}", f"dump.output={out}",
                                      f"dump.targets={targets}"])
        t0 = time.perf_counter()
        stats = dump.main(c, model)["train"]
        wall = time.perf_counter() - t0
        man = json.loads((out / "manifest.json").read_text())
        assert man["num_tokens"] == n_tokens
        results.append({"storage": storage, "dtype": dtype, "targets": targets, "tokens_per_s": man["num_tokens"] / wall,
                        "loop_tokens_per_s": stats["tokens_per_s"], "bytes_per_token": man["bytes"] / man["num_tokens"],
                        "error": rel_error(out, ref, H)})
    sec, tok = bare_forward(model, ds, batches)
    bare.append(tok / sec)
    bare_tps = sum(bare) / len(bare)

    lines = [f"{len(rows)} ShareGPT samples (max_length {args.max_length}), {n_tokens} tokens, {len(batches)} batches "
             f"(batch_tokens {args.batch_tokens}), SmolLM2-135M {next(model.parameters()).dtype} on "
             f"{next(model.parameters()).device} "
             f"({args.threads} threads), H={H}, k=64.",
             f"Bare target forward (logits incl.): {bare_tps:.0f} tokens/s (runs: {', '.join(f'{b:.0f}' for b in bare)}).",
             "",
             "| storage | dtype | targets | dump tokens/s | ratio to bare | bytes/token | / (8*H = %d) | aux error: RMS, per token | last error: RMS, per token |" % (8 * H),
             "|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        e = r["error"]
        err = {n: f"{e[n]:.1e}, {e[n + '_row']:.1e}" if n in e else "-" for n in ("aux", "last")}
        lines.append(f"| {r['storage']} | {r['dtype']} | {r['targets']} | {r['tokens_per_s']:.0f} | {r['tokens_per_s'] / bare_tps:.2f} | "
                     f"{r['bytes_per_token']:.0f} | {r['bytes_per_token'] / (8 * H):.2f} | {err['aux']} | {err['last']} |")
    lean = {t: [r["tokens_per_s"] for r in results if (r["storage"], r["dtype"], r["targets"])
                == ("topk", "float8", t)] for t in ("all", "replies")}
    if lean["all"] and lean["replies"]:
        ratio = sum(lean["replies"]) / len(lean["replies"]) / (sum(lean["all"]) / len(lean["all"]))
        lines += ["", f"Lean dump, dump.targets=replies / all: **{ratio:.2f}x** tokens/s (means of "
                      f"{len(lean['replies'])} and {len(lean['all'])} runs in this one process)"]
    text = "\n".join(lines)
    print(text)
    if args.record:
        record("Dump", f"`python bench/dump.py {' '.join(sys.argv[1:])}` on {platform.node() or 'this machine'}, "
                       f"{time.strftime('%Y-%m-%d')}, torch {torch.__version__}\n\n{text}")


if __name__ == "__main__":
    main()
