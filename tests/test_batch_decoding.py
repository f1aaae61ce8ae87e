"""Batched tree speculative decoding: every row's greedy output is that row's plain greedy output
(B = 3 prompts of different lengths, some rows ending at EOS early) with a tiny Llama and with
SmolLM2 and its trained head; a row decodes the same in the batch as alone, sampled too (its own
generator), so a row that finishes early changes nothing for the others; per-row sampling
reproduces the target's distribution (chi-square, test_sampling's helpers)."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest
import torch

import test_sampling
from conftest import make_tiny_llama
from eagle_train.batch_decoding import batched_speculative_generate
from eagle_train.kv_cache import compact_index
from eagle_train.acceptance import rejection_rule
from eagle_train.baselines import vanilla_generate
from eagle_train.decoding import SpecConfig, speculative_generate
from eagle_train.eagle3 import Eagle3Config, Eagle3Head
from test_decoding import MODES

pytestmark = pytest.mark.usefixtures("one_thread")

PROMPTS = [[1, 5, 9, 12], [1, 7, 3, 22, 40, 41, 8, 19, 33], [1, 30]]


class BatchOracle(torch.nn.Module):
    """A drafter with the head interface for B rows that knows the target's greedy continuation of
    each prompt (`seqs`: prompt + answer): the pair at position t whose input token is seq[t + 1]
    proposes seq[t + 2]. With `noise` > 0 it sometimes ranks a wrong token first, so siblings and
    partial acceptance get exercised."""

    def __init__(self, seqs, vocab_size, noise=0.0, seed=0):
        super().__init__()
        self.next = {}
        for seq in seqs:
            for t in range(len(seq) - 2):
                self.next.setdefault((t, seq[t + 1]), seq[t + 2])
        self.vocab_size, self.noise = vocab_size, noise
        self.config = SimpleNamespace(aux_layers=None)  # reads the post-norm last hidden state
        self.gen = torch.Generator().manual_seed(seed)

    def forward(self, input_ids, hidden, position_ids, kv_cache=None, attn_mask=None):
        B, n = input_ids.shape
        logits = torch.zeros(B, n, self.vocab_size)
        for b in range(B):
            for j, (t, tok) in enumerate(zip(position_ids[b].tolist(), input_ids[b].tolist())):
                right = self.next.get((t, tok))
                if right is not None:
                    wrong = torch.rand((), generator=self.gen) < self.noise
                    logits[b, j, right] = 4.0 if wrong else 10.0
                    if wrong:
                        logits[b, j, (right + 7) % self.vocab_size] = 8.0
        kv = torch.zeros(B, 1, n, 1)
        if kv_cache is not None:
            kv = torch.cat([kv_cache[0], kv], dim=2)
        return torch.zeros(B, n, hidden.shape[-1]), logits, (kv, kv)


def oracle_for(model, prompts, max_new, noise=0.0):
    seqs = [p.tolist() + vanilla_generate(model, p[None], max_new) for p in prompts]
    return BatchOracle(seqs, model.config.vocab_size, noise=noise)


@pytest.fixture(scope="module")
def tiny():
    return make_tiny_llama(vocab_size=64, layers=2, hidden=32, seed=3), [torch.tensor(p) for p in PROMPTS]


def test_compact_index_keeps_each_rows_entries():
    idx = compact_index(torch.tensor([3, 1]), [[7, 9], [5]])
    assert idx.tolist() == [[0, 1, 2, 7, 9], [0, 5, 0, 0, 0]]


@pytest.mark.parametrize("mode", list(MODES))
def test_greedy_rows_equal_generate_tiny(tiny, mode):
    """Rows of 4, 9 and 2 prompt tokens; EOS is a token row 0 reaches early, so it leaves the batch
    while the others go on; partial acceptance (a noisy oracle) makes the accepted lengths ragged."""
    model, prompts = tiny
    free = vanilla_generate(model, prompts[0][None], 14)
    eos = free[4]
    refs = [vanilla_generate(model, p[None], 14, eos_token_id=eos) for p in prompts]
    assert len(refs[0]) <= 5 and max(len(r) for r in refs) == 14  # one row ends early, one runs to the budget
    head = oracle_for(model, prompts, 14, noise=0.3)
    out, stats = batched_speculative_generate(model, head, prompts, SpecConfig(max_new_tokens=14, **MODES[mode]),
                                              eos_token_id=eos)
    assert out == refs
    assert stats["active"][0] == 3 and stats["active"][-1] < 3  # finished rows left the batch
    rows = stats["rows"]
    assert all(sum(a + 1 for a in r["accept_lengths"]) == len(o) - 1 for r, o in zip(rows, out))
    lengths = {a for r in rows for a in r["accept_lengths"]}
    assert max(lengths) >= 2 and min(lengths) == 0  # ragged: deep and zero acceptance both occur
    # budget cuts: every row stops at max_new_tokens like generate
    for max_new in (1, 3):
        short, _ = batched_speculative_generate(model, head, prompts, SpecConfig(max_new_tokens=max_new, **MODES[mode]),
                                                eos_token_id=eos)
        assert short == [vanilla_generate(model, p[None], max_new, eos_token_id=eos) for p in prompts]


def test_random_head_rows_equal_generate_tiny(tiny):
    """A real (random) EAGLE-3 head drafts from the target's features through the batched head cache."""
    model, prompts = tiny
    torch.manual_seed(1)
    head = Eagle3Head(Eagle3Config.from_target(model.config, 64)).eval()
    head.load_target_embeddings(model)
    refs = [vanilla_generate(model, p[None], 12) for p in prompts]
    for mode in MODES.values():
        assert batched_speculative_generate(model, head, prompts, SpecConfig(max_new_tokens=12, **mode))[0] == refs
    # the copy branch (eval.lookup_tokens) grafted per row: rows' trees of different sizes, still lossless
    out, stats = batched_speculative_generate(model, head, prompts, SpecConfig(
        max_new_tokens=12, lookup_tokens=4, lookup_min_ngram=1, **MODES["dynamic"]))
    assert out == refs
    assert len({n for r in stats["rows"] for n in r["tree_sizes"]}) > 1


def _sampling_setup():
    """test_sampling's target (vocabulary of 4, peaked) and random EAGLE-3 head."""
    target = make_tiny_llama(vocab_size=test_sampling.V, layers=2, hidden=32, seed=0)
    target.lm_head.weight.data *= 8
    torch.manual_seed(1)
    head = Eagle3Head(dataclasses.replace(Eagle3Config.from_target(target.config, test_sampling.V),
                                          aux_layers=[0, 1, 2])).eval()
    head.load_target_embeddings(target)
    return target, head


def test_sampled_row_in_batch_equals_row_alone():
    """Row b draws only from generator b: the same seeds give every row the tokens it gets decoded
    alone, while rows stop at different steps (EOS early, budget) and leave the batch."""
    target, head = _sampling_setup()
    prompts = [torch.tensor(p) % test_sampling.V for p in PROMPTS]
    cfg = SpecConfig(tree="dynamic", topk=2, depth=2, num_draft_tokens=3, temperature=1.0, max_new_tokens=10)
    ended_early = 0
    for seed in range(4):
        gens = [torch.Generator().manual_seed(100 * seed + b) for b in range(3)]
        out, _ = batched_speculative_generate(target, head, prompts, cfg, eos_token_id=3, generator=gens)
        for b, p in enumerate(prompts):
            alone, _ = speculative_generate(target, head, p[None], cfg, eos_token_id=3,
                                            generator=torch.Generator().manual_seed(100 * seed + b))
            assert out[b] == alone, (seed, b)
        ended_early += min(len(o) for o in out) < max(len(o) for o in out)
    assert ended_early >= 2  # the comparison covered batches whose rows finished at different steps


def test_sampling_matches_target_per_row(monkeypatch):
    """Three rows (two prompts, one of them twice) sampled together N times: each row's joint of its
    first 3 tokens matches the target's exact joint for its prompt; a wrong acceptance rule fails."""
    target, head = _sampling_setup()
    other = torch.tensor([[1, 2, 2, 0, 3, 1, 0]])
    prompts = [test_sampling.PROMPT[0], other[0], test_sampling.PROMPT[0]]
    kw = test_sampling.SAMPLERS["top_p"]
    joints = [test_sampling.exact_joint(target, **kw)]
    monkeypatch.setattr(test_sampling, "PROMPT", other)  # exact_joint reads the module's prompt
    joints.append(test_sampling.exact_joint(target, **kw))
    joints.append(joints[0])
    cfg = SpecConfig(tree="dynamic", topk=2, depth=2, num_draft_tokens=3, max_new_tokens=3, **kw)
    V = test_sampling.V

    def counts(rule, n):
        gens = [torch.Generator().manual_seed(b) for b in range(3)]
        c = torch.zeros(3, V ** 3)
        for _ in range(n):
            out, _ = batched_speculative_generate(target, head, prompts, cfg, generator=gens, accept_rule=rule)
            for b, (x, y, z) in enumerate(out):
                c[b, (x * V + y) * V + z] += 1
        return c

    good = counts(rejection_rule, test_sampling.N)
    for b in range(3):
        assert test_sampling.chi2_pvalue(good[b], joints[b]) > 0.01, b
    bad = counts(test_sampling.wrong_rule, test_sampling.N)
    assert max(test_sampling.chi2_pvalue(bad[b], joints[b]) for b in range(3)) < 1e-3


def test_smollm2_rows_equal_generate(smollm2):
    """The embedded target and its trained head: three chat prompts of different lengths, the first
    answered in one short sentence (EOS early), decoded together equal each prompt's own `generate`."""
    from eagle_train.heads import load_head

    model, tok = smollm2
    head = load_head("heads/smollm2-135m-instruct-eagle3", target=model).eval()
    texts = ["What is the capital of France?",
             "Write a haiku about autumn leaves falling in a quiet forest by the river.",
             "List three tips for staying focused while studying."]
    prompts = [tok.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True,
                                       return_tensors="pt", return_dict=True)["input_ids"][0] for t in texts]
    assert len({len(p) for p in prompts}) == 3
    refs = [vanilla_generate(model, p[None], 16, eos_token_id=tok.eos_token_id) for p in prompts]
    assert refs[0][-1] == tok.eos_token_id and len(refs[0]) < 16  # a row that finishes early
    cfg = SpecConfig(max_new_tokens=16, **MODES["dynamic"])
    out, stats = batched_speculative_generate(model, head, prompts, cfg, eos_token_id=tok.eos_token_id)
    assert out == refs
    assert stats["active"][-1] < 3
    tau = sum(a + 1 for r in stats["rows"] for a in r["accept_lengths"]) / sum(r["passes"] for r in stats["rows"])
    assert tau > 1  # the trained head's drafts get accepted in the batch too
