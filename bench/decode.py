"""Decoding speed on SmolLM2: vanilla greedy `generate` vs tree speculative decoding.

    python bench/decode.py                          # table on stdout
    python bench/decode.py --head <folder> --record # a trained head; append to bench/RESULTS.md (## Decoding)

Drafters: `random` (an untrained EAGLE-3 head: tau ~ 1, so this row is the pure overhead of
drafting + tree verification), `oracle` (proposes the target's own greedy continuation: tau =
depth + 1, the ceiling this machine allows for each tree), `oracle70` (the oracle ranks a wrong
token first 30% of the time), and `--head` (a trained head folder). Greedy, first turns of the
MT-bench prompts, 1 thread; every speculative output is checked equal to vanilla. transformers'
prompt lookup (`prompt_lookup_num_tokens` 3 and 10) runs beside them: the free drafter a head
must beat (tau = tokens per counted target pass).
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

from record import record  # noqa: E402  (bench/record.py)

from eagle_train.baselines import prompt_lookup_generate, timed, vanilla_generate  # noqa: E402
from eagle_train.decoding import SpecConfig, speculative_generate  # noqa: E402
from eagle_train.eval.run import load_prompts, render, resolve_benchmark  # noqa: E402

SETTINGS = [
    ("chain", dict(tree="chain", depth=2)),
    ("chain", dict(tree="chain", depth=4)),
    ("dynamic", dict(tree="dynamic", topk=2, depth=3, num_draft_tokens=4)),
    ("dynamic", dict(tree="dynamic", topk=4, depth=4, num_draft_tokens=8)),
    ("static", dict(tree="static", static_tree=[[0], [1], [0, 0], [0, 0, 0]])),
]


class Oracle(torch.nn.Module):
    """Head interface; at position t proposes seq[t + 2] (wrong first with probability `noise`)."""

    def __init__(self, seq, vocab_size, noise=0.0):
        super().__init__()
        self.seq, self.vocab_size, self.noise = seq, vocab_size, noise
        self.config = SimpleNamespace(aux_layers=None)
        self.gen = torch.Generator().manual_seed(0)

    def forward(self, input_ids, hidden, position_ids, kv_cache=None, attn_mask=None):
        n = input_ids.shape[1]
        logits = torch.zeros(1, n, self.vocab_size)
        for j, t in enumerate(position_ids[0].tolist()):
            if t + 2 < len(self.seq):
                wrong = torch.rand((), generator=self.gen) < self.noise
                logits[0, j, self.seq[t + 2]] = 4.0 if wrong else 10.0
                if wrong:
                    logits[0, j, (self.seq[t + 2] + 7) % self.vocab_size] = 8.0
        kv = torch.zeros(1, 1, n, 1)
        kv = kv if kv_cache is None else torch.cat([kv_cache[0], kv], dim=2)
        return torch.zeros(1, n, hidden.shape[-1]), logits, (kv, kv)


def describe(s):
    if s["tree"] == "static":
        return f"static {s['static_tree']}"
    if s["tree"] == "chain":
        return f"chain depth {s['depth']}"
    return f"dynamic topk {s['topk']} depth {s['depth']} nd {s['num_draft_tokens']}"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--head", default=None, help="trained head folder (heads.load_head)")
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=48)
    ap.add_argument("--record", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(1)
    from omegaconf import OmegaConf

    from eagle_train.heads import build_head, load_head
    from eagle_train.recipe import HeadConfig, TargetConfig
    from eagle_train.target import load_target

    model, tok = load_target(OmegaConf.structured(TargetConfig(model="smollm2-135m-instruct", device="cpu")))
    torch.manual_seed(0)
    random_head = build_head(OmegaConf.structured(HeadConfig(draft_vocab_size=8192)), model.config).eval()
    random_head.load_target_embeddings(model)
    trained = load_head(args.head, target=model).eval() if args.head else None
    prompts = load_prompts(resolve_benchmark("mt_bench"), args.prompts)
    eos = tok.eos_token_id
    vanilla_generate(model, render(tok, [{"role": "user", "content": "hi"}]), 2)  # warm-up
    prompt_lookup_generate(model, render(tok, [{"role": "user", "content": "hi"}]), 2, 3)
    load = [round(x, 2) for x in os.getloadavg()]
    items = []
    n_v = t_v = 0.0
    for p in prompts:
        ids = render(tok, [{"role": "user", "content": p["turns"][0]}])
        ref, t = timed(vanilla_generate, model, ids, args.max_new_tokens, eos_token_id=eos)
        items.append((ids, ref))
        n_v, t_v = n_v + len(ref), t_v + t
    tps_v = n_v / t_v
    drafters = {"random": lambda ids, ref: random_head,
                "oracle": lambda ids, ref: Oracle(ids[0].tolist() + ref, model.config.vocab_size),
                "oracle70": lambda ids, ref: Oracle(ids[0].tolist() + ref, model.config.vocab_size, 0.3)}
    if trained is not None:
        drafters["trained"] = lambda ids, ref: trained
    rows = []
    for n_pl in (3, 10):
        n = t_s = passes = 0
        for ids, ref in items:
            (out, ps), t = timed(prompt_lookup_generate, model, ids, args.max_new_tokens, n_pl, eos_token_id=eos)
            assert out == ref, f"prompt lookup {n_pl}: greedy output differs from generate"
            n, t_s, passes = n + len(out), t_s + t, passes + ps
        rows.append(("prompt lookup", f"{n_pl} tokens", n / passes, n / t_s, n / t_s / tps_v))
        print(f"prompt lookup {n_pl:2d} tokens  tau {n / passes:.2f}  {n / t_s:6.1f} tok/s  "
              f"speedup {n / t_s / tps_v:.2f}", flush=True)
    for name, make in drafters.items():
        for _, s in SETTINGS:
            n = t_s = 0.0
            acc = []
            for ids, ref in items:
                (out, st), t = timed(speculative_generate, model, make(ids, ref), ids,
                                     SpecConfig(max_new_tokens=args.max_new_tokens, **s), eos_token_id=eos)
                assert out == ref, f"{name} {describe(s)}: speculative greedy output differs from generate"
                n, t_s = n + len(out), t_s + t
                acc += st["accept_lengths"]
            tau = sum(a + 1 for a in acc) / len(acc)
            rows.append((name, describe(s), tau, n / t_s, n / t_s / tps_v))
            print(f"{name:9s} {describe(s):42s} tau {tau:.2f}  {n / t_s:6.1f} tok/s  speedup {n / t_s / tps_v:.2f}",
                  flush=True)
    table = [f"Vanilla greedy `generate`: {tps_v:.1f} tokens/s.", "",
             "| drafter | tree | tau | tokens/s | speedup vs vanilla |", "|---|---|---|---|---|"]
    table += [f"| {r[0]} | {r[1]} | {r[2]:.2f} | {r[3]:.1f} | {r[4]:.2f} |" for r in rows]
    print("\n".join(table))
    if args.record:
        head_note = f"; trained head {args.head}" if args.head else "; no trained SmolLM2 head was available"
        text = "\n".join([
            f"`python bench/decode.py --prompts {args.prompts} --max-new-tokens {args.max_new_tokens}"
            f"{' --head ' + args.head if args.head else ''}` ({time.strftime('%Y-%m-%d')}): SmolLM2-135M-Instruct fp32, "
            f"greedy, first turns of {len(items)} MT-bench prompts, {platform.processor() or 'CPU'} with 1 thread "
            f"on 2 shared cores, load average {load} at start{head_note}. Every speculative output equals "
            "`generate`. random = untrained EAGLE-3 head (the overhead of drafting + verification), oracle = "
            "drafts the target's own greedy tokens (the ceiling of each tree on this machine), oracle70 = the "
            "oracle ranks a wrong token first 30% of the time; prompt lookup = transformers' n-gram drafter "
            "(tau = tokens per target pass, its prefill included).", "", *table, ""])
        record("Decoding", text)


if __name__ == "__main__":
    main()
