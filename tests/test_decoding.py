"""Greedy speculative decoding is lossless (token for token equal to `generate`, EOS and
max_new_tokens included) for the dynamic tree, the chain and a static tree; an oracle drafter
gets tau = depth + 1."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch
from omegaconf import OmegaConf

from conftest import MT_BENCH, make_tiny_llama
from eagle_train.baselines import vanilla_generate
from eagle_train.decoding import SpecConfig, speculative_generate
from eagle_train.heads import build_head
from eagle_train.recipe import HeadConfig

MODES = {
    "dynamic": dict(tree="dynamic", topk=2, depth=3, num_draft_tokens=4),
    "chain": dict(tree="chain", depth=3),
    "static": dict(tree="static", static_tree=[[0], [1], [0, 0], [1, 0], [0, 0, 0]]),
}
MAX_NEW = 16  # short answers keep the 10-prompt x 3-mode losslessness check affordable on a CPU

pytestmark = pytest.mark.usefixtures("one_thread")



class OracleHead(torch.nn.Module):
    """A drafter with the head interface that knows the target's greedy continuation `seq`
    (prompt + answer): at position t it proposes seq[t + 2]. With `noise` > 0 it sometimes ranks
    a wrong token first, so siblings and partial acceptance get exercised."""

    def __init__(self, seq, vocab_size, noise=0.0, seed=0):
        super().__init__()
        self.seq, self.vocab_size, self.noise = seq, vocab_size, noise
        self.config = SimpleNamespace(aux_layers=None)  # reads the post-norm last hidden state
        self.gen = torch.Generator().manual_seed(seed)

    def forward(self, input_ids, hidden, position_ids, kv_cache=None, attn_mask=None):
        n = input_ids.shape[1]
        logits = torch.zeros(1, n, self.vocab_size)
        for j, t in enumerate(position_ids[0].tolist()):
            if t + 2 < len(self.seq):
                right = self.seq[t + 2]
                wrong = torch.rand((), generator=self.gen) < self.noise
                logits[0, j, right] = 4.0 if wrong else 10.0
                if wrong:
                    logits[0, j, (right + 7) % self.vocab_size] = 8.0
        kv = torch.zeros(1, 1, n, 1)
        if kv_cache is not None:
            kv = torch.cat([kv_cache[0], kv], dim=2)
        return torch.zeros(1, n, hidden.shape[-1]), logits, (kv, kv)


def chat_ids(tok, text):
    ids = tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                  return_tensors="pt", return_dict=True)
    return ids["input_ids"]


@pytest.fixture(scope="module")
def prompts_and_refs(smollm2):
    model, tok = smollm2
    qs = [json.loads(line) for line in MT_BENCH.read_text().splitlines()[:10]]
    out = []
    for q in qs:
        ids = chat_ids(tok, q["turns"][0])
        out.append((ids, vanilla_generate(model, ids, MAX_NEW, eos_token_id=tok.eos_token_id)))
    return out


@pytest.fixture(scope="module")
def random_head(smollm2):
    model, _ = smollm2
    torch.manual_seed(0)
    head = build_head(OmegaConf.structured(HeadConfig(type="eagle3", draft_vocab_size=8192)), model.config)
    head.load_target_embeddings(model)
    return head.eval()


@pytest.mark.slow
@pytest.mark.parametrize("mode", list(MODES))
def test_greedy_equals_generate_random_head(smollm2, prompts_and_refs, random_head, mode):
    model, tok = smollm2
    cfg = SpecConfig(max_new_tokens=MAX_NEW, **MODES[mode])
    for ids, ref in prompts_and_refs:
        out, stats = speculative_generate(model, random_head, ids, cfg, eos_token_id=tok.eos_token_id)
        assert out == ref
        assert stats["passes"] == len(stats["accept_lengths"]) >= 1


def test_greedy_equals_generate_eagle1_noisy_oracle(smollm2, prompts_and_refs):
    """Partial acceptance deep in the tree (non-contiguous cache gathers) stays lossless."""
    model, tok = smollm2
    for k, (ids, ref) in enumerate(prompts_and_refs[:2]):
        seq = ids[0].tolist() + ref
        for mode in MODES.values():
            head = OracleHead(seq, model.config.vocab_size, noise=0.3, seed=k)
            out, stats = speculative_generate(model, head, ids, SpecConfig(max_new_tokens=MAX_NEW, **mode),
                                              eos_token_id=tok.eos_token_id)
            assert out == ref
            assert 0 < sum(stats["accept_lengths"]) < 3 * stats["passes"]


@pytest.mark.parametrize("mode", ["dynamic", "chain"])
def test_copy_branch_stays_lossless_and_drafts_what_the_head_cannot(smollm2, random_head, mode):
    """eval.lookup_tokens: a reply that repeats its prompt is drafted by the copy branch (a random head drafts almost
    nothing), token for token the same output as `generate`, more tokens a pass than the head alone."""
    model, tok = smollm2
    ids = chat_ids(tok, "Copy the following text word for word: The committee met on Tuesday to discuss the new "
                        "budget proposal for the city library.")
    ref = vanilla_generate(model, ids, 32, eos_token_id=tok.eos_token_id)
    runs = {}
    for n in (0, 6):
        cfg = SpecConfig(max_new_tokens=32, lookup_tokens=n, **MODES[mode])
        out, stats = speculative_generate(model, random_head, ids, cfg, eos_token_id=tok.eos_token_id)
        assert out == ref
        runs[n] = stats
    assert runs[0]["lookup_accepted"] == 0
    assert runs[6]["lookup_accepted"] >= 10  # the copied sentence (12 of its 16 tokens in 6-token branches)
    assert runs[6]["passes"] < runs[0]["passes"]
    assert max(runs[6]["accept_lengths"]) > 3  # deeper than the head's depth 3: the branch is its own length


@pytest.mark.parametrize("mode", ["dynamic", "chain"])
def test_oracle_tau_is_depth_plus_one(smollm2, prompts_and_refs, mode):
    model, tok = smollm2
    ids, ref = prompts_and_refs[0]
    cfg = SpecConfig(max_new_tokens=MAX_NEW, **MODES[mode])
    out, stats = speculative_generate(model, OracleHead(ids[0].tolist() + ref, model.config.vocab_size),
                                      ids, cfg, eos_token_id=tok.eos_token_id)
    assert out == ref
    # every pass accepts the whole depth; the last one keeps only what the budget leaves (15 = 3 * 4 + 3)
    *full, last = stats["accept_lengths"]
    assert full == [cfg.depth] * len(full) and last + 1 == (MAX_NEW - 1) % (cfg.depth + 1)
    assert sum(a + 1 for a in stats["accept_lengths"]) == len(out) - 1


def test_eos_and_budget_stop_like_generate():
    """EOS inside an accepted path ends generation there, EOS included, like `generate`."""
    model = make_tiny_llama(vocab_size=64, layers=2, hidden=32, seed=3)
    ids = torch.tensor([[1, 5, 9, 12]])
    free = vanilla_generate(model, ids, 12, eos_token_id=None)
    eos = free[6]  # a token the greedy continuation reaches
    ref = vanilla_generate(model, ids, 12, eos_token_id=eos)
    assert ref[-1] == eos and len(ref) <= 7
    for mode in MODES.values():
        for max_new in (1, 3, 12):
            head = OracleHead(ids[0].tolist() + free, 64)
            out, _ = speculative_generate(model, head, ids, SpecConfig(max_new_tokens=max_new, **mode), eos_token_id=eos)
            assert out == vanilla_generate(model, ids, max_new, eos_token_id=eos)


@pytest.mark.slow  # trains a head (4 steps) and decodes 10 prompts x 3 modes: ~1 min on an idle 2-core CPU
def test_greedy_equals_generate_trained_head(smollm2, prompts_and_refs, tmp_path):
    """A head trained for a few steps (tests/helpers.py quick_train, draft vocabulary + d2t) on the
    target's own answers: every mode still reproduces `generate` token for token."""
    from helpers import quick_train

    model, tok = smollm2
    samples = []
    for ids, ref in prompts_and_refs:
        seq = ids[0].tolist() + ref
        samples.append((seq, [0] * ids.shape[1] + [1] * len(ref)))
    head = quick_train(model, samples, tmp_path / "run", steps=4).eval()
    assert int(head.d2t.abs().sum()) > 0  # a real draft vocabulary, so d2t mapping is exercised
    for mode in MODES.values():
        cfg = SpecConfig(max_new_tokens=MAX_NEW, **mode)
        for ids, ref in prompts_and_refs:
            out, _ = speculative_generate(model, head, ids, cfg, eos_token_id=tok.eos_token_id)
            assert out == ref


def argmax_loop(model, ids, n):
    """The definition of greedy: full forward, argmax, append; no cache, no logits processor."""
    out = []
    with torch.no_grad():
        for _ in range(n):
            out.append(int(model(ids).logits[0, -1].argmax()))
            ids = torch.cat([ids, torch.tensor([[out[-1]]])], dim=1)
    return out


def test_baseline_is_plain_argmax_despite_generation_config():
    """A target whose generation_config.json sets repetition_penalty / no_repeat_ngram_size:
    `generate` with the model's config applies them even when greedy; the baseline must not."""
    model = make_tiny_llama(vocab_size=64, layers=2, hidden=32, seed=3)
    ids = torch.tensor([[1, 5, 9, 12]])
    plain = argmax_loop(model, ids, 12)
    model.generation_config.repetition_penalty = 5.0
    model.generation_config.no_repeat_ngram_size = 2
    own = model.generate(ids, do_sample=False, max_new_tokens=12, pad_token_id=0)[0, 4:].tolist()
    assert own != plain  # the processors do change this target's greedy output
    assert vanilla_generate(model, ids, 12) == plain
    out, _ = speculative_generate(model, OracleHead(ids[0].tolist() + plain, 64, noise=0.3), ids,
                                  SpecConfig(max_new_tokens=12, **MODES["dynamic"]))
    assert out == plain


def test_tau_counts_only_kept_tokens():
    """A pass whose accepted path runs past EOS or the budget counts only the tokens kept, so
    sum(accepted + 1) over passes is exactly the tokens emitted after the prefill's first one."""
    model = make_tiny_llama(vocab_size=64, layers=2, hidden=32, seed=3)
    ids = torch.tensor([[1, 5, 9, 12]])
    free = argmax_loop(model, ids, 12)
    eos = free[6]
    for mode in MODES.values():
        for max_new, stop in [(3, None), (6, None), (12, None), (12, eos)]:
            head = OracleHead(ids[0].tolist() + free, 64)
            out, stats = speculative_generate(model, head, ids, SpecConfig(max_new_tokens=max_new, **mode),
                                              eos_token_id=stop)
            assert out == vanilla_generate(model, ids, max_new, eos_token_id=stop)
            assert sum(a + 1 for a in stats["accept_lengths"]) == len(out) - 1, (mode, max_new, stop)
            assert stats["t_draft"] > 0 and stats["t_verify"] > 0


def test_refuses_batches_flash_kernels_and_sliding_windows():
    model = make_tiny_llama(vocab_size=64, layers=2, hidden=32, seed=3)
    head = OracleHead(list(range(40)), 64)
    cfg = SpecConfig(tree="chain", depth=3, max_new_tokens=6)
    with pytest.raises(ValueError, match="batched_speculative_generate"):
        speculative_generate(model, head, torch.tensor([[1, 5, 9], [1, 5, 9]]), cfg)
    flash = SimpleNamespace(config=SimpleNamespace(_attn_implementation="flash_attention_2"), device="cpu")
    with pytest.raises(ValueError, match="flash_attention_2.*sdpa"):
        speculative_generate(flash, head, torch.tensor([[1, 5, 9]]), cfg)

    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    sliding = Qwen2ForCausalLM(Qwen2Config(
        hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=2,
        vocab_size=64, use_sliding_window=True, sliding_window=16, max_window_layers=0,
        attn_implementation="sdpa")).eval()
    ids = torch.tensor([[1, 5, 9, 12]])
    ref = vanilla_generate(sliding, ids, 6)
    out, _ = speculative_generate(sliding, OracleHead(ids[0].tolist() + ref, 64), ids, cfg)  # fits the window
    assert out == ref
    with pytest.raises(ValueError, match="sliding-window attention \\(window 16\\)"):
        speculative_generate(sliding, head, ids, SpecConfig(tree="chain", depth=3, max_new_tokens=30))


def test_node_cap_is_the_dynamic_trees_candidate_count():
    from eagle_train.decoding import max_tree_nodes

    assert max_tree_nodes(SpecConfig(tree="dynamic", topk=4, depth=5, num_draft_tokens=100)) == 4 + 4 * 16
    assert max_tree_nodes(SpecConfig(tree="dynamic", topk=4, depth=5, num_draft_tokens=16)) == 16
    assert max_tree_nodes(SpecConfig(tree="chain", depth=5, num_draft_tokens=16)) == 5
    assert max_tree_nodes(SpecConfig(tree="static", static_tree=[[0], [1], [0, 0]])) == 3


def test_decoder_accepts_what_the_head_predicts_teacher_forced(smollm2, prompts_and_refs):
    """The shipped head, fp32: a chain of 1 accepts at a pass exactly when the head, run once over
    prompt + greedy answer with the target's features (as training reads them), predicts that reply
    token. Catches a decoder that feeds the head shifted features, tokens or positions: it would
    stay lossless but accept less than the head has learned."""
    from eagle_train.decoding import head_aux_layers, target_forward, teacher_forced_drafts
    from eagle_train.heads import load_head
    from transformers import DynamicCache

    model, tok = smollm2
    head = load_head("heads/smollm2-135m-instruct-eagle3", target=model).float().eval()
    aux = head_aux_layers(head)
    hits_total = 0
    for ids, ref in prompts_and_refs:
        full = torch.cat([ids, torch.tensor([ref])], dim=1)
        with torch.no_grad():
            logits, feats = target_forward(model, full, DynamicCache(), aux)
            pred = teacher_forced_drafts(head, full, feats)  # pred[t] guesses token t + 2
        P = ids.shape[1]
        hit = [int(pred[P + i - 2]) == ref[i] for i in range(1, len(ref))]  # reply token i, i >= 1
        assert [int(x) for x in logits.argmax(-1)[P - 1:-1]] == ref  # the features are of the greedy text
        expect, i = [], 1
        while i < len(ref):  # a pass rooted at reply token i - 1 drafts token i; a hit also emits i + 1
            expect.append(int(hit[i - 1]))
            i += 2 if hit[i - 1] else 1
        out, stats = speculative_generate(model, head, ids, SpecConfig(tree="chain", depth=1, max_new_tokens=MAX_NEW),
                                          eos_token_id=tok.eos_token_id)
        assert out == ref
        n = len(stats["accept_lengths"])
        # the budget can cut the last pass's draft; every earlier pass matches exactly
        assert stats["accept_lengths"][:n - 1] == expect[:n - 1]
        hits_total += sum(expect)
    assert hits_total >= 10  # the head does predict the target: the comparison is not all misses


def test_chain_of_4_accepts_what_the_ttt_unroll_predicts(smollm2, prompts_and_refs):
    """The shipped head, fp32, vLLM's chain of 4: every pass accepts exactly the run of drafts that training's
    TTT unroll (ttt.py, over prompt + greedy answer with the target's features) gets right from that pass's
    anchor. Depth s of the chain is TTT step s, so a decoder that feeds depth >= 1 other hidden states or tokens
    than training did fails here even where depth 0 (the test above) is right. Positions off by one or a draft
    not seeing its drafted ancestors leave this head's top-1 unchanged on these passes (tried): the exact check
    of those is test_train.py's test_ttt_unroll_equals_engine_kv_cache_with_tree_mask."""
    from eagle_train.decoding import head_aux_layers, target_forward
    from eagle_train.heads import load_head
    from eagle_train.ttt import ttt_unroll
    from transformers import DynamicCache

    model, tok = smollm2
    head = load_head("heads/smollm2-135m-instruct-eagle3", target=model).float().eval()
    aux, S = head_aux_layers(head), 4
    compared = deep = 0
    for ids, ref in prompts_and_refs:
        full = torch.cat([ids, torch.tensor([ref])], dim=1)
        P, L = ids.shape[1], full.shape[1]
        hits = []  # hits[s][t]: TTT step s at position t (reading token t + 1 + s) guesses token t + 2 + s
        with torch.no_grad():
            _, feats = target_forward(model, full, DynamicCache(), aux)
            for s, (_, logits) in enumerate(ttt_unroll(head, full, feats[None], S)):
                guess, m = head.draft_to_target(logits[0].argmax(-1)), L - 2 - s
                hits.append(torch.cat([guess[:m] == full[0, 2 + s:], torch.zeros(s + 1, dtype=torch.bool)]))
        out, stats = speculative_generate(model, head, ids, SpecConfig(tree="chain", depth=S, max_new_tokens=MAX_NEW),
                                          eos_token_id=tok.eos_token_id)
        assert out == ref
        anchor = P - 1  # the pair (reply token 0, feature P - 1) starts the first chain
        for accepted in stats["accept_lengths"]:
            if anchor + 2 + S > L - 1:  # this pass drafts past the known text (the budget cuts it): stop here
                break
            k = 0
            while k < S and bool(hits[k][anchor]):
                k += 1
            assert accepted == k, f"pass at reply token {anchor - P + 1}: decoder accepted {accepted}, TTT {k}"
            compared += 1
            deep += k >= 2
            anchor += k + 1
    assert compared >= 20 and deep >= 3  # enough passes, and some accept past depth 1
