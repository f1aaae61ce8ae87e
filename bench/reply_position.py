"""Where in a reply a head predicts the target: top-1 accuracy by reply position, on the target's own greedy text.

    python bench/reply_position.py recipes/smollm2-135m-eagle3.yaml heads/smollm2-135m-instruct-eagle3 \\
        --sets mt_bench alpaca qa --prompts 5 --new-tokens 384 -- eval.benchmark_dir=../shared/data/eagle_eval

The target answers each prompt's first turn greedily (`eval.target_dtype`); each head then reads that text once,
teacher-forced with the target's features (as training does), and its top-1 for every reply token is compared with
the target's top-1: the depth-0 acceptance a chain of 1 would get there (tests/test_decoding.py checks that the
decoder accepts exactly these). Positions are bucketed like the eval report's tau by reply position. "copyable":
the 3 tokens before it occurred earlier in prompt + reply and were followed by this token then, i.e. prompt lookup
would propose it (repeats and loops), split into copies from the prompt (and those of them the draft vocabulary
holds) and repeats of the reply; "outside draft vocab": the target's token is not in the (first) head's draft
vocabulary, so no head can draft it; "in vocab, target p ...": tokens the draft vocabulary holds, by the target's own
probability of its greedy token there (is a set hard for the head where the target is sure, or where the target
itself hesitates?). --record files the table under `## Accuracy by reply position`.
--depth D > 1 (EAGLE-3 heads) adds a second table: a chain of D drafted from every reply position, the head's later
steps reading their own output as training's TTT does; per depth d the share accepted given depth d - 1 was (the eval
report's accept-by-depth for a chain, free of a tree's shape and of bf16 divergence) and the chain's tau.
"""

from __future__ import annotations

import argparse
import shlex
import sys
import time
from pathlib import Path

import torch
from transformers import DynamicCache

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from record import publish  # noqa: E402  (bench/record.py)

from eagle_train.baselines import vanilla_generate  # noqa: E402
from eagle_train.batches import copy_sources  # noqa: E402
from eagle_train.decoding import (head_aux_layers, target_forward, teacher_forced_drafts,  # noqa: E402
                                  to_target_ids)
from eagle_train.eval.run import load_prompts, render, resolve_benchmark  # noqa: E402
from eagle_train.eval.summary import POSITION_LABELS, position_label  # noqa: E402
from eagle_train.heads import load_head  # noqa: E402
from eagle_train.recipe_load import load_recipe  # noqa: E402
from eagle_train.target import load_target  # noqa: E402
from eagle_train.ttt import ttt_unroll  # noqa: E402
from omegaconf import OmegaConf  # noqa: E402


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("recipe")
    ap.add_argument("heads", nargs="+")
    ap.add_argument("--labels", nargs="*", default=None)
    ap.add_argument("--sets", nargs="+", default=["mt_bench", "alpaca", "qa"])
    ap.add_argument("--prompts", type=int, default=5)
    ap.add_argument("--new-tokens", type=int, default=384)
    ap.add_argument("--depth", type=int, default=1, help="chain depth of the second table (1: no such table)")
    ap.add_argument("--record", action="store_true")
    argv = list(sys.argv[1:] if argv is None else argv)
    cut = argv.index("--") if "--" in argv else len(argv)
    args, overrides = ap.parse_args(argv[:cut]), argv[cut + 1:]
    labels = args.labels or args.heads
    if len(labels) != len(args.heads):
        ap.error(f"{len(labels)} labels for {len(args.heads)} heads")
    cfg = load_recipe(args.recipe, overrides)
    model, tok = load_target(OmegaConf.merge(cfg.target, {"dtype": cfg.eval.target_dtype or cfg.target.dtype}))
    model.eval()
    heads = [load_head(h, target=model).to(model.dtype).eval() for h in args.heads]
    aux = head_aux_layers(heads[0])
    # EAGLE-3 heads mark their draft vocabulary in t2d; an EAGLE-1 head drafts the whole vocabulary
    t2d = getattr(heads[0], "t2d", None)
    in_vocab = t2d.cpu() if t2d is not None else torch.ones(model.config.vocab_size, dtype=torch.bool)
    for path, head in zip(args.heads, heads):
        if head_aux_layers(head) != aux:
            raise SystemExit(f"{path} reads target layers {head_aux_layers(head)}, {args.heads[0]} reads {aux}: "
                             "compare them in separate runs")
    if args.depth > 1 and any(h.head_type != "eagle3" for h in heads):
        ap.error("--depth > 1 needs EAGLE-3 heads (their later draft steps read the head's own output)")
    # (set, bucket or "copyable"/"other") -> [positions, hits per head]
    rows = {}
    # set -> per head, per depth: [positions that reached the depth, of them accepted]
    chains = {}
    t0 = time.perf_counter()
    for name in args.sets:
        for p in load_prompts(resolve_benchmark(name, cfg.eval.benchmark_dir), args.prompts):
            ids = render(tok, [{"role": "user", "content": p["turns"][0]}])
            gen = vanilla_generate(model, ids, args.new_tokens, eos_token_id=tok.eos_token_id)
            full = torch.cat([ids, torch.tensor([gen])], dim=1)
            P, L = ids.shape[1], full.shape[1]
            with torch.no_grad():
                logits, feats = target_forward(model, full, DynamicCache(), aux)
                top = logits.argmax(-1)  # top[t]: the target's greedy token t + 1
                sure = logits.float().softmax(-1).amax(-1)  # sure[t]: the target's probability of top[t]
                hits = [teacher_forced_drafts(head, full, feats)[P - 1:L - 2] == top[P:L - 1] for head in heads]
            # reply tokens 1..len(gen)-1 (token 0 is the prefill's own, never drafted)
            # the text's own next token as the guess: prompt lookup would propose reply token j + 1
            source = copy_sources(full, full.roll(-1, 1))[0, P + 1:].tolist()
            for j in range(len(gen) - 1):
                copied = ("copy from prompt" if source[j] < P else "copy from reply") if source[j] >= 0 else None
                keys = [(name, position_label(j + 1)), (name, "copyable" if copied else "other")]
                vocab = bool(in_vocab[gen[j + 1]])
                keys += [(name, copied)] * bool(copied) + [(name, "outside draft vocab")] * (not vocab)
                # is a copy from the prompt missed for want of the token in the draft vocabulary?
                keys += [(name, "copy from prompt, in draft vocab")] * (copied == "copy from prompt" and vocab)
                keys += [(name, confidence_label(float(sure[P + j])))] * vocab
                for key in keys:
                    row = rows.setdefault(key, [0] + [0] * len(heads))
                    row[0] += 1
                    for k, hit in enumerate(hits):
                        row[1 + k] += int(hit[j])
            if args.depth > 1:
                per_head = chains.setdefault(name, [[[0, 0] for _ in range(args.depth)] for _ in heads])
                for k, head in enumerate(heads):
                    chain_counts(head, full, feats, top, P, args.depth, per_head[k])
            print(f"[reply_position] {name} {p['id']}: {len(gen)} tokens ({time.perf_counter() - t0:.0f} s)",
                  flush=True)
    order = POSITION_LABELS + ["copyable", "copy from prompt", "copy from prompt, in draft vocab", "copy from reply",
                               "other", "outside draft vocab"] + CONFIDENCE_LABELS
    lines = [f"`python bench/reply_position.py {shlex.join(argv)}`: {args.prompts} first turns per set, "
             f"{args.new_tokens} new tokens, target {cfg.eval.target_dtype or cfg.target.dtype}, "
             f"{time.strftime('%Y-%m-%d')}", "",
             "| set | reply positions | tokens | " + " | ".join(f"acc_0 {x}" for x in labels) + " |",
             "|---|---|---|" + "---|" * len(labels)]
    for name in args.sets:
        for what in order:
            if (name, what) in rows:
                n, *h = rows[(name, what)]
                lines.append(f"| {name} | {what} | {n} | " + " | ".join(f"{x / n:.3f}" for x in h) + " |")
    if chains:
        lines += ["", f"Chain of {args.depth} from every reply position (teacher-forced TTT): accepted at depth d "
                      "given depth d - 1 was; tau = 1 + the expected accepted length", "",
                  "| set | head | " + " | ".join(f"depth {d + 1}" for d in range(args.depth)) + " | chain tau |",
                  "|---|---|" + "---|" * (args.depth + 1)]
        for name, per_head in chains.items():
            for label, counts in zip(labels, per_head):
                rates = [hit / max(1, reached) for reached, hit in counts]
                tau = 1 + sum(hit for _, hit in counts) / max(1, counts[0][0])
                lines.append(f"| {name} | {label} | " + " | ".join(f"{r:.3f}" for r in rates) + f" | {tau:.3f} |")
    publish("Accuracy by reply position", lines, args.record)


CONFIDENCE_LABELS = ["in vocab, target p >= 0.9", "in vocab, target p 0.5-0.9", "in vocab, target p < 0.5"]


def confidence_label(p):
    return CONFIDENCE_LABELS[0 if p >= 0.9 else 1 if p >= 0.5 else 2]


@torch.no_grad()
def chain_counts(head, full, feats, top, P, depth, counts):
    """Add to counts[d] = [reached, accepted] a chain of `depth` drafted from each reply position t (P - 1 <= t,
    every drafted token inside the text): step s guesses token t + 2 + s, the target's greedy top[t + 1 + s]."""
    L = full.shape[1]
    end = L - 1 - depth  # the deepest guess, token end + depth, is the text's last
    if end <= P - 1:
        return
    alive = torch.ones(end - (P - 1), dtype=torch.bool)
    for s, (_, logits) in enumerate(ttt_unroll(head, full, feats[None], depth)):  # it casts to the head dtype
        guess = to_target_ids(head, logits[0, P - 1:end].argmax(-1))
        hit = guess == top[P + s:end + 1 + s]
        counts[s][0] += int(alive.sum())
        alive = alive & hit
        counts[s][1] += int(alive.sum())


if __name__ == "__main__":
    main()
