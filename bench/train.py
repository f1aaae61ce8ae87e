"""Training throughput and memory of the EAGLE-3 TTT unroll on SmolLM2 features.

    python bench/train.py                 # table on stdout
    python bench/train.py --record        # also append it to bench/RESULTS.md (## Training)

For ttt_steps 1, 3, 7 at two sequence lengths, in fp32 and under bf16 autocast (fp32 master weights
and loss, what `train.mixed_precision=auto` picks on a CPU with native bf16; the bf16/fp32 speed
ratio of each setting is printed): tokens/s of a full training step (forward, soft
cross-entropy over the draft vocabulary, backward, AdamW) on real SmolLM2-135M aux features of
ShareGPT text whose first `--user-fraction` of each row is masked out of the loss like a user turn
(0.24: the 2-hour recipe's corpus trains on 76% of its tokens), with the fused lm_head + loss (`--fused on`,
what training uses) or the plain logits -> soft CE (`off`; `both` prints the fused / plain ratio), TTT steps >= 1
through the merged flash attention (`--attention merged`, what training uses on a CPU) or the dense softmax
(`dense`; `both` prints the merged / dense ratio), with `--optimizers` (adamw, or
muon[:Newton-Schulz steps[:rows per block]]: the step time of each over the first's) and `--mlp` (the head's MLP
width), the
activation memory autograd keeps for backward (bytes of saved tensors, deduplicated by storage), and the
process peak RSS. Each setting runs in its own process so peaks
do not mix. Activation memory must grow linearly in steps: the check compares the 1->3 and 3->7
increments per step.
"""

from __future__ import annotations

import argparse
import gzip
import json
import platform
import resource
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from record import record  # noqa: E402  (bench/record.py)


def features(L, B):
    from omegaconf import OmegaConf

    from eagle_train.features import target_features
    from eagle_train.recipe import TargetConfig
    from eagle_train.target import load_target

    model, tok = load_target(OmegaConf.structured(TargetConfig(model="smollm2-135m-instruct", device="cpu")))
    ids = []
    with gzip.open(ROOT.parent / "shared/data/sharegpt/sharegpt_v3_salvaged.jsonl.gz", "rt") as f:
        for line in f:
            text = " ".join(t["value"] for t in json.loads(line)["conversations"])
            ids += tok(text)["input_ids"]
            if len(ids) >= L * B:
                break
    ids = torch.tensor(ids[:L * B]).view(B, L)
    f = target_features(model, ids, torch.ones_like(ids), [2, 15, 27], "topk", 64)
    return model, ids, f


def one(L, steps, B, iters, precision="fp32", recompute=False, fused=True, user_fraction=0.0, attention="merged",
        ttt_rows="1", step0_mlp="loss", opt_name="adamw", mlp=0):
    from eagle_train.batches import add_targets
    from eagle_train.draft_vocab import build_draft_vocab, draft_ids_of
    from eagle_train.engine import optimizer
    from eagle_train.heads import build_head
    from eagle_train.recipe import HeadConfig, TrainConfig
    import eagle_train.ttt as ttt
    from eagle_train.ttt import DraftLoss
    from omegaconf import OmegaConf

    ttt.MERGED = ttt.MERGED and attention == "merged"
    if step0_mlp == "all":  # step 0's o_proj and MLP at every position, user turns included (as before)
        unroll = ttt.ttt_unroll
        ttt.ttt_unroll = lambda *a: unroll(*a[:7])
    torch.set_num_threads(2)
    model, ids, f = features(L, B)
    head = build_head(OmegaConf.structured(HeadConfig(draft_vocab_size=8192, intermediate_size=mlp or None)),
                      model.config)
    head.embed_tokens.weight.data.copy_(model.get_input_embeddings().weight)
    counts = torch.bincount(ids.flatten(), minlength=model.config.vocab_size)
    head.set_draft_vocab(*build_draft_vocab(counts, 8192))
    kind, ns, block = (opt_name.split(":") + ["5", "0"])[:3]  # adamw, or muon[:ns_steps[:block]]
    tc = OmegaConf.structured(TrainConfig(ttt_steps=steps, optimizer=kind, learning_rate=1e-4, muon_ns_steps=int(ns),
                                          muon_block=int(block)))
    scale = f["aux"].pow(2).mean((0, 1)).sqrt()
    loss_fn = DraftLoss(head, ttt_steps=tc.ttt_steps, ttt_decay=tc.ttt_decay, feature_weight=tc.feature_weight,
                        token_weight=tc.token_weight, noise=tc.noise, feature_scale=scale,
                        recompute_attention=recompute, fused=fused, ttt_rows=1.0 if ttt_rows == "all" else float(ttt_rows))
    if ttt_rows == "all":  # TTT steps >= 1 at every position, user turns included (before train.ttt_rows)
        n = L - 1
        loss_fn.deep_rows = lambda *a: (torch.arange(B).repeat_interleave(n), torch.arange(n).repeat(B))
    draft = draft_ids_of(head.d2t)
    t2d_index = torch.full((model.config.vocab_size,), -1, dtype=torch.long)
    t2d_index[draft] = torch.arange(draft.numel())
    loss_mask = torch.ones_like(ids)
    loss_mask[:, :int(L * user_fraction)] = 0
    b = {"input_ids": ids, "loss_mask": loss_mask, "attention_mask": torch.ones_like(ids), **f}
    b = add_targets(b, "eagle3", None, draft, t2d_index)
    opt = optimizer(head, tc)  # the recipe's defaults for everything the setting does not name
    del model

    saved = {}

    def pack(t):
        saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    times = []
    for i in range(iters + 1):  # first iteration warms up
        saved.clear()
        t0 = time.perf_counter()
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), \
                torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16"):
            loss, _ = loss_fn(b, with_stats=False)
        activ = sum(saved.values())
        loss.backward()
        opt.step()
        opt.zero_grad()
        if i:
            times.append(time.perf_counter() - t0)
    sec = sorted(times)[len(times) // 2]
    return {"L": L, "B": B, "ttt_steps": steps, "precision": precision, "fused": "on" if fused else "off",
            "attention": attention, "ttt_rows": ttt_rows, "step0_mlp": step0_mlp, "optimizer": opt_name,
            "mlp": mlp or "target's",
            "tokens_per_s": B * L / sec, "sec_per_step": sec,
            "activation_mib": activ / 2**20, "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--record", action="store_true")
    ap.add_argument("--lengths", type=int, nargs="+", default=[256, 512])
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--iters", type=int, default=3)
    ap.add_argument("--steps", type=int, nargs="+", default=[1, 3, 7])
    ap.add_argument("--precisions", nargs="+", default=["fp32", "bf16"])
    # train.recompute_attention: off, on, or both (each setting run both ways, side by side in the table)
    ap.add_argument("--recompute", choices=["off", "on", "both"], default="off")
    ap.add_argument("--fused", choices=["off", "on", "both"], default="on")
    ap.add_argument("--attention", choices=["merged", "dense", "both"], default="merged")
    ap.add_argument("--user-fraction", type=float, default=0.24)
    # train.ttt_rows values to compare ("all": TTT steps >= 1 at every position, as before the option)
    ap.add_argument("--ttt-rows", nargs="+", default=["1"])
    # step 0's o_proj and MLP at the positions a loss or a deeper step reads (training's) or at all; both: the ratio
    ap.add_argument("--step0-mlp", choices=["loss", "all", "both"], default="loss")
    # train.optimizer settings to compare: adamw, or muon[:muon_ns_steps[:muon_block]] (muon = muon:5:0)
    ap.add_argument("--optimizers", nargs="+", default=["adamw"])
    # head.intermediate_size (0: the target's, 1,536)
    ap.add_argument("--mlp", type=int, default=0)
    ap.add_argument("--one", nargs=9, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.one:
        print(json.dumps(one(int(a.one[0]), int(a.one[1]), a.batch, a.iters, a.one[2], a.one[3] == "on",
                             a.one[4] == "on", a.user_fraction, a.one[5], a.one[6], a.one[7], a.one[8], a.mlp)))
        return
    rows = []
    for L in a.lengths:
        for steps in a.steps:
            for prec in a.precisions:  # alternated per setting, so load changes hit both alike
                for rc in (["off", "on"] if a.recompute == "both" else [a.recompute]):
                    for fu, at, tr, s0, op in [(fu, at, tr, s0, op)
                                               for fu in (["off", "on"] if a.fused == "both" else [a.fused])
                                               for at in (["dense", "merged"] if a.attention == "both" else [a.attention])
                                               for tr in a.ttt_rows
                                               for s0 in (["all", "loss"] if a.step0_mlp == "both" else [a.step0_mlp])
                                               for op in a.optimizers]:
                        out = subprocess.run([sys.executable, __file__, "--one", str(L), str(steps), prec, rc, fu, at,
                                              tr, s0, op, "--batch", str(a.batch), "--iters", str(a.iters),
                                              "--user-fraction", str(a.user_fraction), "--mlp", str(a.mlp)],
                                             capture_output=True, text=True, check=True)
                        rows.append({**json.loads(out.stdout.strip().splitlines()[-1]), "recompute": rc})
                        print(rows[-1], flush=True)
    lines = ["| seq len | batch | ttt_steps | precision | recompute attention | fused loss | TTT attention | "
             "ttt_rows | step-0 MLP rows | MLP units | optimizer | tokens/s | s/step | activations (MiB) | "
             "peak RSS (MiB) |", "|---" * 15 + "|"]
    lines += [f"| {r['L']} | {r['B']} | {r['ttt_steps']} | {r['precision']} | {r['recompute']} | {r['fused']} | "
              f"{r['attention']} | {r['ttt_rows']} | {r['step0_mlp']} | {r['mlp']} | {r['optimizer']} | "
              f"{r['tokens_per_s']:.0f} | {r['sec_per_step']:.2f} | {r['activation_mib']:.0f} | "
              f"{r['peak_rss_mib']:.0f} |" for r in rows]
    checks = []
    for r in rows:  # each optimizer against the first one listed, in the same setting
        first = [q for q in rows if q["optimizer"] == a.optimizers[0] and all(
            q[k] == r[k] for k in ("L", "ttt_steps", "precision", "recompute", "fused", "attention", "ttt_rows",
                                   "step0_mlp"))]
        if r["optimizer"] != a.optimizers[0] and first:
            checks.append(f"L={r['L']}, ttt_steps={r['ttt_steps']}, {r['precision']}: optimizer {r['optimizer']} / "
                          f"{a.optimizers[0]} s/step = {r['sec_per_step'] / first[0]['sec_per_step']:.2f}")
    rows = [r for r in rows if r["optimizer"] == a.optimizers[0]]  # the other comparisons at the first optimizer
    for L in a.lengths:
        for steps in a.steps:
            for prec in a.precisions:  # each train.ttt_rows value against the first one listed
                tr = {r["ttt_rows"]: r["tokens_per_s"] for r in rows if r["L"] == L and r["ttt_steps"] == steps
                      and r["precision"] == prec and r["recompute"] == rows[0]["recompute"]
                      and r["step0_mlp"] == rows[0]["step0_mlp"]
                      and r["fused"] == rows[0]["fused"] and r["attention"] == rows[0]["attention"]}
                checks += [f"L={L}, ttt_steps={steps}, {prec}: ttt_rows {v} / {a.ttt_rows[0]} tokens/s = "
                           f"{tr[v] / tr[a.ttt_rows[0]]:.2f}" for v in a.ttt_rows[1:] if v in tr and a.ttt_rows[0] in tr]
                s0 = {r["step0_mlp"]: r["tokens_per_s"] for r in rows if r["L"] == L and r["ttt_steps"] == steps
                      and r["precision"] == prec and r["ttt_rows"] == rows[0]["ttt_rows"]}
                if {"loss", "all"} <= set(s0):
                    checks.append(f"L={L}, ttt_steps={steps}, {prec}: step-0 MLP at the read rows / at all rows "
                                  f"tokens/s = {s0['loss'] / s0['all']:.2f}")
            same = [r for r in rows if r["L"] == L and r["ttt_steps"] == steps
                    and r["recompute"] == rows[0]["recompute"] and r["ttt_rows"] == rows[0]["ttt_rows"]
                    and r["step0_mlp"] == rows[0]["step0_mlp"]]
            t = {r["precision"]: r["tokens_per_s"] for r in same
                 if r["fused"] == rows[0]["fused"] and r["attention"] == rows[0]["attention"]}
            if {"fp32", "bf16"} <= set(t):
                checks.append(f"L={L}, ttt_steps={steps}: bf16 autocast / fp32 tokens/s = {t['bf16'] / t['fp32']:.2f}")
            for prec in a.precisions:
                f = {r["fused"]: r["tokens_per_s"] for r in same
                     if r["precision"] == prec and r["attention"] == rows[0]["attention"]}
                if {"on", "off"} <= set(f):
                    checks.append(f"L={L}, ttt_steps={steps}, {prec}: fused / plain loss tokens/s = "
                                  f"{f['on'] / f['off']:.2f}")
                at = {r["attention"]: r["tokens_per_s"] for r in same
                      if r["precision"] == prec and r["fused"] == rows[0]["fused"]}
                if {"merged", "dense"} <= set(at):
                    checks.append(f"L={L}, ttt_steps={steps}, {prec}: merged / dense TTT attention tokens/s = "
                                  f"{at['merged'] / at['dense']:.2f}")
    for L in a.lengths:
        m = {r["ttt_steps"]: r["activation_mib"] for r in rows if r["L"] == L and r["precision"] == a.precisions[0]
             and r["recompute"] == rows[0]["recompute"] and r["fused"] == rows[0]["fused"]
             and r["ttt_rows"] == rows[0]["ttt_rows"] and r["step0_mlp"] == rows[0]["step0_mlp"]
             and r["attention"] == rows[0]["attention"]}
        if not {1, 3, 7} <= set(m):
            continue
        per_a, per_b = (m[3] - m[1]) / 2, (m[7] - m[3]) / 4
        checks.append(f"L={L}: activation growth per step {per_a:.0f} MiB (1->3) vs {per_b:.0f} MiB (3->7): "
                      f"ratio {per_b / per_a:.2f} ({'linear' if per_b / per_a < 1.5 else 'SUPERLINEAR'})")
    text = "\n".join(lines + [""] + [f"- {c}" for c in checks])
    print(text)
    if a.record:
        head = (f"`python bench/train.py` on {platform.node() and 'the dev box'} "
                f"({torch.get_num_threads()} threads, torch {torch.__version__}, CPU), EAGLE-3 head for "
                f"SmolLM2-135M-Instruct (draft vocab 8192), real ShareGPT features, {a.user_fraction:.0%} of each row "
                f"out of the loss, "
                f"{time.strftime('%Y-%m-%d')}:\n\n")
        record("Training", head + text)


if __name__ == "__main__":
    main()
