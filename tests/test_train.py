"""Training: TTT attention == the engines' cache + mask view, learning on tiny and SmolLM2 targets,
offline (dump) and online modes, exact resume, NaN stop, CLI."""

import copy
import gzip
import json
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from eagle_train import train
from eagle_train.batches import pad_collate
from eagle_train.eagle3 import Eagle3Config, Eagle3Head
from eagle_train.engine import shared_draft_vocab
from eagle_train.errors import TrainingDiverged
from eagle_train.heads import load_head
from eagle_train.recipe import RecipeError
from eagle_train.recipe_load import load_recipe
from eagle_train.ttt import DraftLoss, shift, ttt_unroll
from conftest import SHAREGPT, make_tiny_llama
from helpers import write_corpus


def synthetic(vocab=128, n=64, length=48, seed=0):
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        ids = torch.randint(3, vocab, (length,), generator=g)
        mask = (torch.arange(length) >= length // 3).long()
        out.append((ids, mask))
    return out


def tiny_args(tmp, steps=30, extra=()):
    return [f"output_dir={tmp}", "target.model=in-memory", "data.source=in-memory", "train.mode=online",
            "train.engine=none", f"train.max_steps={steps}", "train.warmup_steps=3", "train.learning_rate=3e-3",
            "train.micro_batch_size=4", "train.ttt_steps=3", f"train.eval_every={steps}", "train.eval_batches=2",
            "train.log_every=5", "head.draft_vocab_size=64", *extra]


def test_ttt_unroll_equals_engine_kv_cache_with_tree_mask():
    """Step s in training sees exactly what the head sees when drafting s tokens ahead with a KV
    cache: step-0 keys causally + its own earlier-step keys at the same position."""
    torch.manual_seed(0)
    cfg = Eagle3Config(hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
                       head_dim=8, vocab_size=50, draft_vocab_size=50, aux_layers=[1, 2, 3])
    head = Eagle3Head(cfg).eval()
    B, L, steps = 2, 9, 3
    ids, aux = torch.randint(0, 50, (B, L)), torch.randn(B, L, 96)
    got = [o for o in ttt_unroll(head, ids, aux, steps)]
    n = L - 1
    pos = torch.arange(n).expand(B, n)
    out, logits, kv = head(ids[:, 1:], aux[:, :-1], pos)
    torch.testing.assert_close(got[0][1], logits)
    causal = torch.ones(n, n, dtype=torch.bool).tril()
    for s in range(1, steps):
        mask = torch.cat([causal] + [torch.eye(n, dtype=torch.bool)] * s, dim=1)[None, None]
        out, logits, kv = head(shift(ids, 1 + s)[:, :n], out, pos + s, kv_cache=kv, attn_mask=mask)
        torch.testing.assert_close(got[s][1], logits, atol=1e-5, rtol=1e-4)
        torch.testing.assert_close(got[s][0], out, atol=1e-5, rtol=1e-4)


def test_ttt_attention_recomputed_in_backward(monkeypatch):
    """train.recompute_attention: TTT steps >= 1 recompute their attention in backward, with the same
    gradients as keeping it, and autograd no longer keeps the (B, heads, n, n) scores of every step."""
    torch.manual_seed(0)
    cfg = Eagle3Config(hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
                       head_dim=8, vocab_size=50, draft_vocab_size=50, aux_layers=[1, 2, 3])
    head = Eagle3Head(cfg)
    ids, aux = torch.randint(0, 50, (2, 65)), torch.randn(2, 65, 96)

    def grads_and_saved(recompute):
        head.zero_grad()
        saved = {}

        def pack(t):
            saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            return t
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss = sum(logits.logsumexp(-1).mean() for _, logits in ttt_unroll(head, ids, aux, 4, recompute))
        loss.backward()
        return [p.grad.clone() for p in head.parameters() if p.grad is not None], sum(saved.values())

    import eagle_train.ttt as ttt
    got, saved = grads_and_saved(True)
    monkeypatch.setattr(ttt, "MERGED", False)  # the dense ttt_attention, kept for backward
    ref, saved_ref = grads_and_saved(False)
    monkeypatch.undo()
    merged, saved_merged = grads_and_saved(False)
    for g, r, m in zip(got, ref, merged):
        torch.testing.assert_close(g, r)
        torch.testing.assert_close(m, r)
    n_by_n = 2 * 4 * 64 * 64 * 4  # one step's fp32 (B, heads, n, n)
    assert saved_ref - saved > 3 * n_by_n, (saved_ref, saved)
    assert saved_ref - saved_merged > 3 * n_by_n, (saved_ref, saved_merged)  # the merged form keeps none either


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
@pytest.mark.parametrize("steps", [1, 3])
def test_merged_ttt_attention_equals_the_dense_softmax(dtype, steps):
    """MergedTTTAttention (flash causal part + diagonal keys merged through its log-sum-exp, hand-written
    backward) gives ttt_attention's output and the gradient of every input (grouped-query heads, s = 1 and 3):
    to rounding in float64, within bf16 rounding in bf16."""
    from eagle_train.ttt import merged_ttt_attention, ttt_attention

    torch.manual_seed(0)
    B, h, kv, n, d = 2, 6, 2, 33, 16

    ins = [torch.randn(B, h if i == 0 else kv, n, d, dtype=dtype, requires_grad=True) for i in range(3 + 2 * steps)]
    q, k0, v0, ks, vs = ins[0], ins[1], ins[2], ins[3:3 + steps], ins[3 + steps:]
    g = torch.randn(B, h, n, d, dtype=dtype)
    ref = ttt_attention(q, k0, v0, ks, vs)
    got = merged_ttt_attention(q, k0, v0, ks, vs)
    tol = dict(atol=1e-12, rtol=1e-10) if dtype == torch.float64 else dict(atol=0.05, rtol=0.02)
    torch.testing.assert_close(got, ref, **tol)
    for a, b in zip(torch.autograd.grad(got, ins, g), torch.autograd.grad(ref, ins, g)):
        torch.testing.assert_close(a, b, **tol)



@pytest.mark.parametrize("merged", [True, False])
def test_ttt_deep_rows_equal_the_full_unroll(monkeypatch, merged):
    """ttt_unroll(deep_rows=...): TTT steps >= 1 at some (sample, position) pairs only, packed into one row (a
    sample with none among them too), give the full unroll's outputs there, and a loss on them the same
    gradients: a position's deeper steps read nothing of another position's but step 0's keys. Through the merged
    flash attention and the dense softmax."""
    import copy

    import eagle_train.ttt as ttt
    monkeypatch.setattr(ttt, "MERGED", merged)
    torch.manual_seed(0)
    cfg = Eagle3Config(hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
                       head_dim=8, vocab_size=50, draft_vocab_size=50, aux_layers=[1, 2, 3])
    head = Eagle3Head(cfg)
    B, L, steps = 3, 40, 3
    ids, aux = torch.randint(0, 50, (B, L)), torch.randn(B, L, 96)
    bi, ti = torch.tensor([0, 0, 0, 0, 0, 2, 2, 2]), torch.tensor([0, 3, 17, 30, 38, 2, 5, 21])  # sample 1: none
    w = torch.randn(steps, 50)

    def run(deep_rows):
        h = copy.deepcopy(head)
        outs = [y for _, y in ttt_unroll(h, ids, aux, steps, deep_rows=deep_rows)]
        got = outs[:1] + [y if deep_rows is not None else y[bi, ti][None] for y in outs[1:]]
        (sum((y * w[s]).sum() for s, y in enumerate(got))).backward()
        return [y.detach() for y in got], {n: q.grad for n, q in h.named_parameters() if q.grad is not None}

    (got, grads), (ref, ref_grads) = run((bi, ti)), run(None)
    assert got[1].shape == (1, len(bi), 50) and ref[0].shape == (B, L - 1, 50)
    for a, b in zip(got, ref):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)
    assert grads.keys() == ref_grads.keys()
    for n in grads:
        torch.testing.assert_close(grads[n], ref_grads[n], atol=1e-4, rtol=1e-4)


def head_and_user_turn_batch(B, L, V=60):
    """A small EAGLE-3 head and a sparse-target batch of B rows whose first positions are user turns (no loss)."""
    torch.manual_seed(0)
    head = Eagle3Head(Eagle3Config(hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
                                   head_dim=8, vocab_size=V, draft_vocab_size=V, aux_layers=[1, 2, 3]))
    logp = torch.log_softmax(torch.randn(B, L, V) * 3, -1).sort(-1, descending=True)
    ids, probs = logp.indices[..., :8], logp.values[..., :8].exp()
    valid = (torch.rand(B, L) > 0.2) & (torch.arange(L) >= torch.tensor([[8], [30], [20]]))  # user turns first
    return head, {"input_ids": torch.randint(0, V, (B, L)), "valid": valid,
                  "p": (ids, probs / probs.sum(-1, keepdim=True)), "aux": torch.randn(B, L, 96), "top1": ids[..., 0]}


def test_deep_steps_run_only_where_they_train(monkeypatch):
    """DraftLoss runs TTT steps >= 1 only at the positions where one of them trains (the user turns and the rest
    drop out): loss, accuracy counts and gradients equal running them everywhere. train.ttt_rows=0.5 runs them at
    about half of those while training, evaluation (eval()) at all of them."""
    import copy

    B, L = 3, 64
    n = L - 1
    head, b = head_and_user_turn_batch(B, L)
    seen = []

    def run(everywhere=False, share=1.0, training=True):
        h = copy.deepcopy(head)
        loss_fn = DraftLoss(h, ttt_steps=3, ttt_decay=0.8, feature_weight=0, token_weight=0, noise=0, ttt_rows=share)
        loss_fn.train(training)
        if everywhere:
            monkeypatch.setattr(loss_fn, "deep_rows", lambda *a: (torch.arange(B).repeat_interleave(n),
                                                                 torch.arange(n).repeat(B)))
        spy = loss_fn.deep_rows
        loss_fn.deep_rows = lambda *a: seen.append(spy(*a)) or seen[-1]
        loss, stats = loss_fn(b)
        loss.backward()
        return loss.detach(), stats, {n: q.grad for n, q in h.named_parameters() if q.grad is not None}

    (loss, stats, grads), (ref, ref_stats, ref_grads) = run(), run(everywhere=True)
    rows = seen[0]
    assert len(rows[0]) < 0.8 * B * n and len(seen[1][0]) == B * n
    torch.testing.assert_close(loss, ref)
    assert stats.keys() == ref_stats.keys() == {"acc_0", "acc_1", "acc_2", "chain_1", "chain_2"}
    for k in stats:
        assert torch.equal(stats[k], ref_stats[k]), k
    for name in grads:
        torch.testing.assert_close(grads[name], ref_grads[name], atol=1e-6, rtol=1e-5)
    run(share=0.5)
    half = len(seen[-1][0]) / len(rows[0])
    assert 0.35 < half < 0.65, half
    run(share=0.5, training=False)
    assert all(torch.equal(a, r) for a, r in zip(seen[-1], rows))


@pytest.mark.parametrize("steps,fused", [(1, True), (3, True), (3, False)])
def test_step0_mlp_runs_only_where_a_loss_or_deeper_step_reads_it(monkeypatch, steps, fused):
    """DraftLoss runs step 0's o_proj and MLP only at the positions its loss or a deeper TTT step reads (a user
    turn's positions give only their keys): loss, accuracy counts and every gradient equal running it at every
    position, with the fused loss and the plain logits, 1 and 3 TTT steps, while training and in evaluation."""
    import copy

    import eagle_train.ttt as ttt
    B, L = 3, 64
    n = L - 1
    head, b = head_and_user_turn_batch(B, L)
    unroll = ttt.ttt_unroll

    def run(everywhere, training):
        if everywhere:  # rows0 dropped: step 0 at every position
            monkeypatch.setattr(ttt, "ttt_unroll", lambda *a: unroll(*a[:7]))
        h = copy.deepcopy(head)
        mlp_rows = []
        h.midlayer.mlp.register_forward_hook(lambda m, x, y: mlp_rows.append(x[0].shape[:-1].numel()))
        loss_fn = DraftLoss(h, ttt_steps=steps, ttt_decay=0.8, feature_weight=0, token_weight=0, noise=0,
                            fused=fused, ttt_rows=0.5)
        loss_fn.train(training)
        torch.manual_seed(1)  # the same half of the deep rows in both runs
        loss, stats = loss_fn(b)
        if training:
            loss.backward()
        monkeypatch.setattr(ttt, "ttt_unroll", unroll)
        return loss.detach(), stats, {k: q.grad for k, q in h.named_parameters() if q.grad is not None}, mlp_rows

    for training in (True, False):
        (loss, stats, grads, rows), (ref, ref_stats, ref_grads, ref_rows) = run(False, training), run(True, training)
        assert ref_rows[0] == B * n and rows[0] < 0.8 * B * n, (rows, ref_rows)  # the user turns dropped out
        assert rows[1:] == ref_rows[1:]  # deeper steps untouched
        torch.testing.assert_close(loss, ref)
        assert stats.keys() == ref_stats.keys() and len(stats) == 2 * steps - 1
        for k in stats:
            assert torch.equal(stats[k], ref_stats[k]), k
        assert grads.keys() == ref_grads.keys() and (len(grads) > 0) == training
        for name in grads:
            torch.testing.assert_close(grads[name], ref_grads[name], atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("fused", [True, False])
def test_step0_rows_trains_step_0_at_a_random_share(fused):
    """train.step0_rows=0.5: while training, step 0's loss at a random half of its positions, its MLP only there.
    1 TTT step: loss and every gradient equal a full run on the batch whose valid tokens (and copy weights) are cut
    to that half by hand (the same draw), fused loss or plain logits. 3 steps: the deeper steps' counts are
    untouched. Evaluation (eval()) uses every position."""
    import copy

    B, L = 3, 64
    n = L - 1
    head, b = head_and_user_turn_batch(B, L)
    b["weight"] = b["valid"].float() * (1 + torch.rand(B, L))  # train.copy_weight's

    def run(batch, share, steps, training=True, seed=1):
        h = copy.deepcopy(head)
        mlp_rows = []
        h.midlayer.mlp.register_forward_hook(lambda m, x, y: mlp_rows.append(x[0].shape[:-1].numel()))
        loss_fn = DraftLoss(h, ttt_steps=steps, ttt_decay=0.8, feature_weight=0, token_weight=0, noise=0,
                            step0_rows=share, fused=fused)
        loss_fn.train(training)
        torch.manual_seed(seed)
        loss, stats = loss_fn(batch)
        if training:
            loss.backward()
        return loss.detach(), stats, {k: q.grad for k, q in h.named_parameters() if q.grad is not None}, mlp_rows

    torch.manual_seed(1)
    keep = torch.rand(B, n) < 0.5  # the draw DraftLoss makes after the same seed (1 step: no deep rows drawn)
    cut = dict(b, valid=b["valid"].clone(), weight=b["weight"].clone())
    cut["valid"][:, 2:] &= keep[:, :L - 2]  # step 0 at position t trains on token t + 2
    cut["weight"][:, 2:] *= keep[:, :L - 2]
    loss, stats, grads, rows = run(b, 0.5, 1)
    ref, ref_stats, ref_grads, ref_rows = run(cut, 1.0, 1)
    full = run(b, 1.0, 1)
    torch.testing.assert_close(loss, ref)
    assert torch.equal(stats["acc_0"], ref_stats["acc_0"])
    assert 0.35 < stats["acc_0"][1] / full[1]["acc_0"][1] < 0.65
    assert rows == ref_rows and rows[0] < 0.65 * full[3][0]
    assert grads.keys() == ref_grads.keys() and grads
    for name in grads:
        torch.testing.assert_close(grads[name], ref_grads[name], atol=1e-6, rtol=1e-5)
    _, stats3, _, _ = run(b, 0.5, 3)
    _, full3, _, _ = run(b, 1.0, 3)
    assert stats3["acc_0"][1] < 0.65 * full3["acc_0"][1]
    for k in ("acc_1", "acc_2"):
        assert torch.equal(stats3[k], full3[k]), k
    evaluated, ref_eval = run(b, 0.5, 3, training=False), run(b, 1.0, 3, training=False)
    torch.testing.assert_close(evaluated[0], ref_eval[0])
    assert all(torch.equal(evaluated[1][k], ref_eval[1][k]) for k in ref_eval[1])


def test_dropout_drops_features_while_training_only():
    """train.dropout: while training the head reads F.dropout of the target's features (the same loss and gradients
    as a run without it on features dropped by hand with the same draw); evaluation reads them whole."""
    import copy

    head, b = head_and_user_turn_batch(3, 64)

    def run(batch, p, training=True):
        h = copy.deepcopy(head)
        loss_fn = DraftLoss(h, ttt_steps=3, ttt_decay=0.8, feature_weight=0, token_weight=0, noise=0, dropout=p)
        loss_fn.train(training)
        torch.manual_seed(1)
        loss, stats = loss_fn(batch)
        if training:
            loss.backward()
        return loss.detach(), stats, {k: q.grad for k, q in h.named_parameters() if q.grad is not None}

    torch.manual_seed(1)
    dropped = dict(b, aux=torch.nn.functional.dropout(b["aux"], 0.3))
    assert 0.2 < (dropped["aux"] == 0).float().mean() < 0.4
    (loss, stats, grads), (ref, ref_stats, ref_grads) = run(b, 0.3), run(dropped, 0.0)
    torch.testing.assert_close(loss, ref)
    assert all(torch.equal(stats[k], ref_stats[k]) for k in ref_stats)
    for name in ref_grads:
        torch.testing.assert_close(grads[name], ref_grads[name], atol=1e-6, rtol=1e-5)
    assert not torch.allclose(loss, run(b, 0.0)[0])
    evaluated, whole = run(b, 0.3, training=False), run(b, 0.0, training=False)
    assert torch.equal(evaluated[0], whole[0]) and all(torch.equal(evaluated[1][k], whole[1][k]) for k in whole[1])


@pytest.mark.parametrize("target,mask", [("sparse", 0), ("dense", 0), ("sparse", 3), ("dense", 1)])
def test_fused_loss_equals_logits_then_soft_ce(monkeypatch, target, mask):
    """DraftLoss(fused=True) (the lm_head and the soft CE chunk by chunk on the valid rows only, gradients formed
    in forward) gives the loss, accuracy counts and every gradient of the plain path (full logits, soft_ce), over
    several chunks, with copy weights, a frozen lm_head and no grad (the held-out evaluation); with the TTT loss
    mask too (the fused path ranks the label inside its chunks)."""
    import copy

    import eagle_train.ttt as ttt
    monkeypatch.setattr(ttt, "LOSS_CHUNK", 7)  # several chunks and a ragged last one
    torch.manual_seed(0)
    V, B, L = 60, 3, 30
    head = Eagle3Head(Eagle3Config(hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
                                   head_dim=8, vocab_size=V, draft_vocab_size=V, aux_layers=[1, 2, 3]))
    logp = torch.log_softmax(torch.randn(B, L, V) * 3, -1).sort(-1, descending=True)
    ids, probs = logp.indices[..., :8], logp.values[..., :8].exp()
    p = (ids, probs / probs.sum(-1, keepdim=True))
    if target == "dense":
        p = torch.zeros(B, L, V).scatter_(-1, *p)
    valid = torch.rand(B, L) > 0.3
    b = {"input_ids": torch.randint(0, V, (B, L)), "valid": valid, "p": p, "aux": torch.randn(B, L, 96),
         "top1": ids[..., 0], "weight": valid.float() * (1 + 2 * (torch.rand(B, L) > 0.5))}

    def run(fused, freeze=False, grad=True):
        h = copy.deepcopy(head)
        h.lm_head.weight.requires_grad_(not freeze)
        with torch.set_grad_enabled(grad):
            loss, stats = DraftLoss(h, ttt_steps=3, ttt_decay=0.8, feature_weight=0, token_weight=0, noise=0,
                                    fused=fused, ttt_mask_topk=mask)(b)
        if grad:
            loss.backward()
        return loss.detach(), stats, {n: q.grad for n, q in h.named_parameters() if q.grad is not None}

    for freeze, grad in [(False, True), (True, True), (False, False)]:
        (loss, stats, grads), (ref, ref_stats, ref_grads) = run(True, freeze, grad), run(False, freeze, grad)
        torch.testing.assert_close(loss, ref)
        assert stats.keys() == ref_stats.keys() == {"acc_0", "acc_1", "acc_2", "chain_1", "chain_2"}
        for k in stats:
            assert torch.equal(stats[k], ref_stats[k])
        assert grads.keys() == ref_grads.keys() and ("lm_head.weight" in grads) == (grad and not freeze)
        for n in grads:
            torch.testing.assert_close(grads[n], ref_grads[n], atol=1e-6, rtol=1e-5)
    assert stats["acc_0"][1] < B * L  # invalid rows were left out of the counts
def test_ttt_mask_trains_each_depth_below_accepted_ancestors_only():
    """ttt_mask_topk=k: step 1 trains only where step 0 ranked the target's top-1 within its top k, step 2 only
    where steps 0 and 1 both did (and had a valid target: no draft gets past a token it cannot propose); the
    loss equals soft CE over those rows built from the unrolled logits, and chain_s counts the positions where
    steps 0..s all hit."""
    from eagle_train.ttt import cut, shift_target, soft_ce

    torch.manual_seed(1)
    V, B, L, steps = 8, 6, 32, 3  # a small vocabulary: a random head's top-1 hits often enough to chain
    head = Eagle3Head(Eagle3Config(hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
                                   head_dim=8, vocab_size=V, draft_vocab_size=V, aux_layers=[1, 2, 3]))
    logp = torch.log_softmax(torch.randn(B, L, V) * 3, -1).sort(-1, descending=True)
    ids, probs = logp.indices[..., :6], logp.values[..., :6].exp()
    p = (ids, probs / probs.sum(-1, keepdim=True))
    valid = torch.rand(B, L) > 0.2
    b = {"input_ids": torch.randint(0, V, (B, L)), "valid": valid, "p": p, "aux": torch.randn(B, L, 96),
         "top1": ids[..., 0]}

    def loss_of(k):
        with torch.no_grad():
            return DraftLoss(head, ttt_steps=steps, ttt_decay=0.8, feature_weight=0, token_weight=0, noise=0,
                             ttt_mask_topk=k)(b)

    with torch.no_grad():
        logits = [y for _, y in ttt_unroll(head, b["input_ids"], b["aux"], steps)]
    n = L - 1
    for k in (1, 4, V):
        ref, alive, chain = 0.0, torch.ones(B, n, dtype=torch.bool), torch.ones(B, n, dtype=torch.bool)
        for s, y in enumerate(logits):
            v = shift(valid, 2 + s)[:, :n]
            target, label = cut(shift_target(p, 1 + s), n), shift(b["top1"], 1 + s)[:, :n]
            ce, cnt = soft_ce(y, target, (v & alive).float())
            ref += 0.8 ** s * ce / cnt
            rank = (y > y.gather(-1, label[..., None])).sum(-1)
            alive &= v & (rank < k)
            chain &= v & (y.argmax(-1) == label)
            if s:
                assert int(loss_of(k)[1][f"chain_{s}"][0]) == int(chain.sum())
        assert 0 < cnt < v.sum() and chain.any()  # the mask left rows out, and some survived
        torch.testing.assert_close(loss_of(k)[0], ref)
    assert not torch.allclose(loss_of(1)[0], loss_of(0)[0])


@pytest.mark.parametrize("head_type", ["eagle3", "eagle1"])
def test_tiny_target_30_steps_learn(tmp_path, head_type):
    target = make_tiny_llama(vocab_size=128)
    write_corpus(synthetic(), tmp_path / "data")
    cfg = load_recipe(None, tiny_args(tmp_path, extra=[f"head.type={head_type}"]))
    res = train.main(cfg, target=target)
    m = res["metrics"]
    assert m["eval/loss"] < m["eval0/loss"] - 0.05, m
    assert m["eval/acc_0"] > m["eval0/acc_0"] + 0.03, m
    head = load_head(res["final"], target=target)
    state = json.loads((res["final"] / "train_state.json").read_text())
    assert state["step"] == 30 and "eval/acc_0" in state["metrics"]
    if head_type == "eagle3":
        assert set(m) >= {"eval/acc_0", "eval/acc_1", "eval/acc_2", "eval/chain_1", "eval/chain_2"}
        # a chain of 3 accepts depth s at the positions where depths 0..s all hit: no more than each one alone
        assert m["eval/chain_2"] <= m["eval/chain_1"] <= m["eval/acc_1"] + 1e-9
        assert m["eval/chain_tau"] == pytest.approx(1 + m["eval/acc_0"] + m["eval/chain_1"] + m["eval/chain_2"])
        # the saved head (feature scale folded into fc) reproduces the training-time accuracy
        from eagle_train.features import target_features

        b = pad_collate([{"input_ids": ids, "loss_mask": lm} for ids, lm in synthetic()[:8]])
        f = target_features(target, b["input_ids"], b["attention_mask"], head.config.aux_layers, "full")
        _, logits = next(ttt_unroll(head, b["input_ids"], f["aux"], 1))
        top1 = (f["last"] @ target.lm_head.weight.T).argmax(-1)
        hit = head.draft_to_target(logits.argmax(-1))[:, :-1] == top1[:, 1:-1]
        # trained on: assistant tokens whose target top-1 is in the draft vocabulary
        valid = b["loss_mask"][:, 2:].bool() & head.t2d[top1[:, 1:-1]]
        assert abs(hit[valid].float().mean().item() - m["eval/acc_0"]) < 0.02


@pytest.mark.parametrize("storage", ["full", "topk"])
def test_tiny_target_offline_from_dump(tmp_path, storage):
    """Offline mode reads the dump: `full` -> softmax(target lm_head(last)) over the draft vocabulary,
    `topk` -> renormalized top-k probabilities; both learn."""
    from eagle_train.data_prep import dump

    target = make_tiny_llama(vocab_size=128)
    write_corpus(synthetic(), tmp_path / "data")
    extra = ["train.mode=offline", f"dump.storage={storage}", "dump.topk=16", "dump.dtype=float32"]
    cfg = load_recipe(None, tiny_args(tmp_path, extra=extra))
    dump.main(cfg, model=target)
    m = train.main(cfg, target=target)["metrics"]
    assert m["eval/loss"] < m["eval0/loss"] - 0.05, m
    assert m["eval/acc_0"] > m["eval0/acc_0"] + 0.03, m


def test_reply_targets_train_as_every_target(tmp_path):
    """dump.targets=replies keeps the top-k only where a reply token follows; training reads nothing else, so its
    head equals the one trained on a dump with targets everywhere, and train.loss_positions=all refuses it."""
    from eagle_train.data_prep import dump
    from eagle_train.dump_reader import FeatureDataset
    from eagle_train.errors import DumpError

    target = make_tiny_llama(vocab_size=128)
    write_corpus(synthetic(), tmp_path / "data")
    runs = {}
    for targets in ("replies", "all"):
        extra = ["train.mode=offline", "dump.storage=topk", "dump.topk=16", "dump.dtype=float32",
                 f"dump.targets={targets}", f"dump.output={tmp_path / targets}", f"train.output={tmp_path / 't' / targets}"]
        cfg = load_recipe(None, tiny_args(tmp_path, steps=6, extra=extra))
        dump.main(cfg, model=target)
        runs[targets] = train.main(cfg, target=target)
    first = FeatureDataset(tmp_path / "replies")[0]
    skipped = ~first["loss_mask"][1:].bool()
    assert skipped.any() and (first["topk_ids"][:-1][skipped] == 0).all() and (first["topk_logp"][:-1][skipped] == 0).all()
    assert (first["topk_ids"][:-1][~skipped, 0] == FeatureDataset(tmp_path / "all")[0]["topk_ids"][:-1][~skipped, 0]).all()
    a, b = (load_file(str(runs[t]["final"] / "model.safetensors")) for t in ("replies", "all"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert runs["replies"]["metrics"]["eval/loss"] == runs["all"]["metrics"]["eval/loss"]

    every = ["train.mode=offline", "dump.storage=topk", "dump.topk=16", "dump.dtype=float32", "train.loss_positions=all"]
    with pytest.raises(DumpError, match=r"dump.targets=replies.*train.loss_positions=all"):
        train.main(load_recipe(None, tiny_args(tmp_path, steps=2, extra=every + [
            f"dump.output={tmp_path / 'replies'}", f"train.output={tmp_path / 't' / 'x'}"])), target=target)
    train.main(load_recipe(None, tiny_args(tmp_path, steps=2, extra=every + [
        f"dump.output={tmp_path / 'all'}", f"train.output={tmp_path / 't' / 'y'}"])), target=target)


def test_draft_vocab_counts_the_target_top1(tmp_path):
    """head.draft_vocab_counts=target_top1: the draft vocabulary is the target's most frequent top-1 tokens where a
    reply token follows (from the dump), not the corpus' reply tokens; online mode refuses it."""
    from eagle_train.data_prep import dump
    from eagle_train.draft_vocab import build_draft_vocab
    from eagle_train.dump_reader import FeatureDataset

    target = make_tiny_llama(vocab_size=128)
    write_corpus(synthetic(), tmp_path / "data")
    extra = ["train.mode=offline", "dump.storage=topk", "dump.topk=16", "dump.dtype=float32", "head.draft_vocab_size=32"]
    vocab = {}
    for counts in ("replies", "target_top1"):
        cfg = load_recipe(None, tiny_args(tmp_path, steps=2, extra=extra + [
            f"head.draft_vocab_counts={counts}", f"train.output={tmp_path / counts}"]))
        if counts == "replies":
            dump.main(cfg, model=target)
        vocab[counts] = load_head(train.main(cfg, target=target)["final"], target=target).t2d
    ds = FeatureDataset(tmp_path / "dump")
    top1 = torch.zeros(128, dtype=torch.long)
    replies = torch.zeros(128, dtype=torch.long)
    with torch.no_grad():
        for i in range(len(ds)):
            ids, mask = ds[i]["input_ids"], ds[i]["loss_mask"].bool()
            pred = target(input_ids=ids[None]).logits[0].argmax(-1)  # the target's top-1 for token t+1
            top1 += torch.bincount(pred[:-1][mask[1:]], minlength=128)
            replies += torch.bincount(ids[mask], minlength=128)
    assert torch.equal(vocab["target_top1"], build_draft_vocab(top1, 32)[1])
    assert torch.equal(vocab["replies"], build_draft_vocab(replies, 32)[1])
    assert not torch.equal(vocab["target_top1"], vocab["replies"])
    online = load_recipe(None, tiny_args(tmp_path, steps=2, extra=[
        "head.draft_vocab_counts=target_top1", f"train.output={tmp_path / 'online'}"]))
    with pytest.raises(RecipeError, match="head.draft_vocab_counts=target_top1 counts the target's top-1"):
        train.main(online, target=target)


def test_extra_dumps_train_with_the_first(tmp_path):
    """train.extra_dumps: a second corpus (other length) is read with dump.output as one training set,
    draft vocabulary counted over both, recorded in the head; a dump for another target is refused."""
    from eagle_train.batches import open_data
    from eagle_train.data_prep import dump
    from eagle_train.errors import DumpError

    target = make_tiny_llama(vocab_size=128)
    dumped = ["train.mode=offline", "dump.storage=topk", "dump.topk=16", "dump.dtype=float32"]
    write_corpus(synthetic(n=32), tmp_path / "a" / "data")
    dump.main(load_recipe(None, tiny_args(tmp_path / "a", extra=dumped)), model=target)
    # the second corpus: other tokens (ids >= 100 only: they must reach the draft vocabulary), longer samples
    second = [(ids % 28 + 100, mask) for ids, mask in synthetic(n=24, length=64, seed=1)]
    write_corpus(second, tmp_path / "b" / "data", eval_samples=[])  # as prep with data.eval_fraction=0
    cfg_b = load_recipe(None, tiny_args(tmp_path / "b", extra=dumped + ["data.max_length=64"]))
    dump.main(cfg_b, model=target)
    assert open_data(cfg_b, "eval") is None  # an empty held-out split: no held-out metrics, not zeros

    cfg = load_recipe(None, tiny_args(tmp_path / "a", extra=dumped + [
        f"train.extra_dumps=[{tmp_path / 'b' / 'dump'}]", f"train.output={tmp_path / 'ab'}", "head.draft_vocab_size=128"]))
    ds, _ = open_data(cfg, "train")
    assert len(ds) == 32 + 24 and ds.lengths[-1] == 64
    torch.testing.assert_close(ds[32 + 5]["input_ids"], second[5][0].long())
    res = train.main(cfg, target=target)
    assert res["metrics"]["eval/acc_0"] > res["metrics"]["eval0/acc_0"] + 0.03
    state = json.loads((res["final"] / "train_state.json").read_text())
    assert state["data"]["extra_dumps"][0]["num_tokens"] == 24 * 64
    first = json.loads((tmp_path / "a" / "dump" / "manifest.json").read_text())
    assert Path(state["data"]["dump"]["folder"]).resolve() == (tmp_path / "a" / "dump").resolve()
    assert state["data"]["dump"]["num_tokens"] == first["num_tokens"] > 0
    head = load_head(res["final"], target=target)
    assert head.t2d[100:].any()  # the second corpus' tokens were counted

    write_corpus(second, tmp_path / "c" / "data")  # dumped from another target: refused, naming that dump
    other = make_tiny_llama(vocab_size=128, seed=7)
    dump.main(load_recipe(None, tiny_args(tmp_path / "c", extra=dumped + ["data.max_length=64"])), model=other)
    bad = load_recipe(None, tiny_args(tmp_path / "a", extra=dumped + [
        f"train.extra_dumps=[{tmp_path / 'c' / 'dump'}]", f"train.output={tmp_path / 'ac'}"]))
    with pytest.raises(DumpError, match=f"{tmp_path / 'c' / 'dump'}/manifest.json: the dump has target_digest"):
        train.main(bad, target=target)

    # train.eval_dump: the second corpus trained alone keeps the first corpus' held-out split
    def alone(eval_dump, out):
        return load_recipe(None, tiny_args(tmp_path / "b", steps=4, extra=dumped + [
            "data.max_length=64", f"train.eval_dump={eval_dump}", f"train.output={tmp_path / out}"]))
    held, _ = open_data(alone(tmp_path / "a" / "dump", "b-a"), "eval")
    assert held.folder == tmp_path / "a" / "dump" / "eval" and len(held) == len(open_data(cfg, "eval")[0]) > 0
    m = train.main(alone(tmp_path / "a" / "dump", "b-a"), target=target)["metrics"]
    assert "eval0/acc_0" in m and "eval/acc_0" in m
    with pytest.raises(FileNotFoundError, match="`train.eval_dump` = .*no held-out samples"):
        open_data(alone(tmp_path / "b" / "dump", "b-b"), "eval")
    with pytest.raises(DumpError, match=f"{tmp_path / 'c' / 'dump' / 'eval'}/manifest.json: the dump has target_digest"):
        train.main(alone(tmp_path / "c" / "dump", "b-c"), target=target)


def smollm2_samples(tok, n=40, length=96):
    rows = []
    with gzip.open(SHAREGPT, "rt") as f:
        for line in f:
            conv = json.loads(line)["conversations"]
            if len(conv) < 2 or conv[0]["from"] != "human" or conv[1]["from"] != "gpt":
                continue
            user = [{"role": "user", "content": conv[0]["value"][:200]}]
            prompt = tok.apply_chat_template(user, add_generation_prompt=True, tokenize=True, return_dict=False)
            full = tok.apply_chat_template(user + [{"role": "assistant", "content": conv[1]["value"]}],
                                           tokenize=True, return_dict=False)
            if len(prompt) >= length - 16:
                continue
            ids = list(full)[:length]
            rows.append((ids, [0] * len(prompt) + [1] * (len(ids) - len(prompt))))
            if len(rows) == n:
                return rows
    return rows


def test_smollm2_features_30_steps_learn(tmp_path, smollm2):
    """Offline from a real SmolLM2 top-k dump (the recipe default; online mode and full storage run
    the same loss and are covered on the tiny target, SmolLM2 forwards being slow on this CPU)."""
    from eagle_train.data_prep import dump

    model, tok = smollm2
    samples = smollm2_samples(tok, n=28, length=64)
    write_corpus(samples[:20], tmp_path / "data", eval_samples=samples[20:])
    extra = ["target.model=smollm2-135m-instruct", "head.draft_vocab_size=2048", "train.learning_rate=2e-3",
             "train.ttt_steps=2", "train.eval_batches=2", "train.mode=offline", "dump.storage=topk",
             "dump.topk=32", "dump.batch_tokens=2048", "dump.dtype=float32"]
    cfg = load_recipe(None, tiny_args(tmp_path, extra=extra))
    t0 = time.perf_counter()
    dump.main(cfg, model=model)
    print(f"dump {time.perf_counter() - t0:.1f}s")
    m = train.main(cfg, target=model)["metrics"]
    assert m["eval/loss"] < m["eval0/loss"] - 0.2, m
    assert m["eval/acc_0"] > m["eval0/acc_0"] + 0.05, m


@pytest.mark.parametrize("head_type,more", [("eagle3", []), ("eagle1", []), ("eagle3", ["train.ttt_rows=0.5", "train.step0_rows=0.5"])],
                         ids=["eagle3", "eagle1", "eagle3-ttt_rows"])
def test_resume_after_kill_equals_uninterrupted(tmp_path, head_type, more):
    """A resumed run ends bit-identical to an uninterrupted one (train.ttt_rows and train.step0_rows < 1 too: their
    draws come from the RNG state the checkpoint restores)."""
    target = make_tiny_llama(vocab_size=128)
    data = tmp_path / "data"
    write_corpus(synthetic(n=24), data)
    common = [f"head.type={head_type}", f"data.output={data}", "train.save_every=3", "train.grad_accum=2", *more]
    full = train.main(load_recipe(None, tiny_args(tmp_path / "a", steps=7, extra=common)), target=target)
    # the "killed" run: stops after the step-3 checkpoint (and a few micro-steps more is not saved)
    killed = load_recipe(None, tiny_args(tmp_path / "b", steps=7, extra=common))
    part = train.main(killed, target=target, stop_after=4)
    assert part["final"] is None and part["step"] == 4
    state = json.loads((tmp_path / "b/train/checkpoint/train_state.json").read_text())
    assert state["step"] == 3  # step 4 was never saved: the resume redoes it
    resumed = train.main(load_recipe(None, tiny_args(tmp_path / "b", steps=7, extra=common + ["train.resume=true"])),
                         target=target)
    a, b = load_file(full["final"] / "model.safetensors"), load_file(resumed["final"] / "model.safetensors")
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k
    with pytest.raises(FileNotFoundError, match="no checkpoint"):
        train.main(load_recipe(None, tiny_args(tmp_path / "c", steps=2, extra=common + ["train.resume=true"])),
                   target=target)


def test_nan_loss_stops_and_keeps_last_checkpoint(tmp_path, monkeypatch):
    target = make_tiny_llama(vocab_size=128)
    write_corpus(synthetic(n=16), tmp_path / "data")
    calls = {"n": 0}
    real = DraftLoss.forward

    def poisoned(self, b, with_stats=True):
        loss, stats = real(self, b, with_stats)
        calls["n"] += self.training
        return (loss * float("nan") if calls["n"] > 3 and self.training else loss), stats

    monkeypatch.setattr(DraftLoss, "forward", poisoned)
    cfg = load_recipe(None, tiny_args(tmp_path, steps=10, extra=["train.save_every=2"]))
    with pytest.raises(TrainingDiverged, match="non-finite training loss at step 3.*checkpoint"):
        train.main(cfg, target=target)
    ckpt = tmp_path / "train/checkpoint"
    assert json.loads((ckpt / "train_state.json").read_text())["step"] == 2
    assert not (tmp_path / "train/final").exists()


def test_cli_trains_from_a_target_folder(tmp_path, capsys):
    from eagle_train import cli

    target_dir = tmp_path / "target"
    make_tiny_llama(vocab_size=128, layers=4).save_pretrained(target_dir)
    write_corpus(synthetic(n=16), tmp_path / "data")
    recipe = tmp_path / "r.yaml"
    recipe.write_text(f"output_dir: {tmp_path}\ntarget:\n  model: {target_dir}\ndata:\n  source: x\n")
    args = ["train", str(recipe), "train.mode=online", "train.engine=none", "train.max_steps=4",
            "train.warmup_steps=1", "head.draft_vocab_size=64", "train.ttt_steps=2", "train.tracker=tensorboard"]
    assert cli.main(args) == 0
    head = load_head(tmp_path / "train/final")
    assert head.config.draft_vocab_size == 64 and head.d2t.numel() == 64
    assert list((tmp_path / "train").rglob("events.out.tfevents*"))  # tensorboard tracker wrote
    assert cli.main(["train", str(recipe), "train.max_steps=4"]) == 2  # offline without a dump
    assert "eagle-train dump" in capsys.readouterr().err


def test_draft_vocab_barrier_is_entered_whether_or_not_the_file_exists(tmp_path):
    """Every rank must reach the same collectives: a rank arriving after rank 0 wrote the vocabulary
    still enters main_process_first (its barrier), and reads rank 0's file instead of recounting."""
    import contextlib

    class Acc:
        entered = 0

        @contextlib.contextmanager
        def main_process_first(self):
            Acc.entered += 1
            yield

    counted = []

    def count():
        counted.append(1)
        return torch.arange(100, 0, -1).float()

    path = tmp_path / "draft_vocab.safetensors"
    d2t, t2d = shared_draft_vocab(Acc(), path, count, 10)  # rank 0: counts and writes
    d2t_late, t2d_late = shared_draft_vocab(Acc(), path, count, 10)  # a late rank: file exists
    assert Acc.entered == 2 and len(counted) == 1
    assert torch.equal(d2t, d2t_late) and torch.equal(t2d, t2d_late) and int(t2d.sum()) == 10


def test_init_from_a_head_folder_fine_tunes_it(tmp_path):
    """head.init=<head folder>: training starts from that head's weights and draft vocabulary (the
    step-0 held-out accuracy is the trained head's, not a fresh one's); a head of other shapes is refused."""
    target = make_tiny_llama(vocab_size=128)
    for run in ("a", "b", "c"):
        write_corpus(synthetic(), tmp_path / run / "data")
    first = train.main(load_recipe(None, tiny_args(tmp_path / "a")), target=target)
    res = train.main(load_recipe(None, tiny_args(tmp_path / "b", steps=2, extra=[f"head.init={first['final']}"])),
                     target=target)
    trained, again = first["metrics"], res["metrics"]
    assert abs(again["eval0/acc_0"] - trained["eval/acc_0"]) < 0.02 and again["eval0/acc_0"] > trained["eval0/acc_0"] + 0.03
    a, b = load_head(first["final"]), load_head(res["final"])
    assert torch.equal(a.d2t, b.d2t)
    with pytest.raises(Exception, match="head.init"):
        train.main(load_recipe(None, tiny_args(tmp_path / "c", extra=[f"head.init={first['final']}",
                                                                      "head.intermediate_size=32"])), target=target)
    # a wider MLP: the start head's units plus new ones that add nothing yet; the held-out metrics at step 0
    # are the start head's to float precision, and the new units train
    wide_width = 2 * a.config.intermediate_size
    wide = train.main(load_recipe(None, tiny_args(tmp_path / "c", steps=3, extra=[
        f"head.init={first['final']}", f"head.intermediate_size={wide_width}"])), target=target)
    m = wide["metrics"]
    assert abs(m["eval0/loss"] - trained["eval/loss"]) < 1e-4 and m["eval0/acc_0"] == trained["eval/acc_0"], m
    w = load_head(wide["final"])
    down = w.state_dict()["midlayer.mlp.down_proj.weight"]
    assert w.config.intermediate_size == wide_width and down[:, a.config.intermediate_size:].abs().sum() > 0

    # a larger draft vocabulary: the start's tokens keep their lm_head rows, the corpus' next most frequent join
    # (their rows mapped from the target's lm_head), and the grown head trains and saves
    from eagle_train.draft_vocab import draft_ids_of
    from eagle_train.head_init import copy_start
    write_corpus(synthetic(), tmp_path / "d" / "data")
    grown = train.main(load_recipe(None, tiny_args(tmp_path / "d", steps=2, extra=[
        f"head.init={first['final']}", "head.draft_vocab_size=96"])), target=target)
    g = load_head(grown["final"])
    ids, old = draft_ids_of(g.d2t), draft_ids_of(a.d2t)
    assert len(ids) == 96 and g.t2d[old].all()
    head = Eagle3Head(Eagle3Config(**{**a.config.__dict__, "draft_vocab_size": 96}))
    head.set_draft_vocab(g.d2t, g.t2d)
    with torch.no_grad():
        copy_start(head, a, target.lm_head.weight)
    rows = torch.searchsorted(ids, old)
    added = torch.ones(96, dtype=torch.bool)
    added[rows] = False
    assert torch.equal(head.lm_head.weight[rows], a.lm_head.weight.float())
    assert head.lm_head.weight[added].isfinite().all() and head.lm_head.weight[added].abs().sum() > 0

    # a re-ranked vocabulary (head.draft_vocab_swap) on text made of tokens the start head lacks: exactly 8 of its
    # slots change hands, the 56 tokens both share keep their rows, and swapping needs a head to start from
    outsiders = (~a.t2d).nonzero().squeeze(1)
    g = torch.Generator().manual_seed(1)
    other = [(outsiders[torch.randint(0, len(outsiders), (48,), generator=g)], (torch.arange(48) >= 16).long())
             for _ in range(64)]
    write_corpus(other, tmp_path / "e" / "data")
    swapped = load_head(train.main(load_recipe(None, tiny_args(tmp_path / "e", steps=2, extra=[
        f"head.init={first['final']}", "head.draft_vocab_swap=8"])), target=target)["final"])
    ids = draft_ids_of(swapped.d2t)
    assert len(ids) == 64 and int((swapped.t2d & a.t2d).sum()) == 56 and not swapped.t2d[outsiders].all()
    head = Eagle3Head(Eagle3Config(**a.config.__dict__))
    head.set_draft_vocab(swapped.d2t, swapped.t2d)
    with torch.no_grad():
        copy_start(head, a, target.lm_head.weight)
    shared = a.t2d[ids]
    assert torch.equal(head.lm_head.weight[shared], a.lm_head.weight.float()[swapped.t2d[draft_ids_of(a.d2t)]])
    assert head.lm_head.weight[~shared].isfinite().all() and head.lm_head.weight[~shared].abs().sum() > 0
    with pytest.raises(RecipeError, match="head.draft_vocab_swap` = 8 re-ranks .* set `head.init` to a head folder"):
        load_recipe(None, tiny_args(tmp_path / "f", extra=["head.draft_vocab_swap=8"]))


def test_target_temperature_sharpens_dense_and_sparse_targets_alike():
    from eagle_train.batches import add_targets
    g = torch.Generator().manual_seed(0)
    V, H, B, L, k = 32, 8, 2, 6, 32
    lm_head_w, last = torch.randn(V, H, generator=g), torch.randn(B, L, H, generator=g)
    draft_ids = torch.arange(0, V, 2)  # every other token is a draft token
    t2d_index = torch.full((V,), -1, dtype=torch.long)
    t2d_index[draft_ids] = torch.arange(draft_ids.numel())
    base = {"attention_mask": torch.ones(B, L, dtype=torch.long), "loss_mask": torch.ones(B, L, dtype=torch.long)}
    logp = torch.log_softmax(last @ lm_head_w.T, -1).sort(-1, descending=True)

    def both(T):
        dense = add_targets({**base, "last": last}, "eagle3", lm_head_w, draft_ids, t2d_index, temperature=T)
        sparse = add_targets({**base, "topk_ids": logp.indices[..., :k], "topk_logp": logp.values[..., :k]},
                             "eagle3", lm_head_w, draft_ids, t2d_index, temperature=T)
        ids, probs = sparse["p"]  # the full vocabulary is in the top-k here: the two must agree
        as_dense = torch.zeros(B, L, draft_ids.numel()).scatter_add_(-1, ids, probs)
        torch.testing.assert_close(as_dense, dense["p"], atol=1e-5, rtol=1e-4)
        assert torch.equal(dense["top1"], sparse["top1"]) and torch.equal(dense["valid"], sparse["valid"])
        return dense

    p1, p_half = both(1.0)["p"], both(0.5)
    torch.testing.assert_close(p_half["p"], p1 ** 2 / (p1 ** 2).sum(-1, keepdim=True), atol=1e-6, rtol=1e-5)
    assert (p_half["p"].max(-1).values > p1.max(-1).values).all()  # sharper, same argmax
    assert torch.equal(p_half["p"].argmax(-1), p1.argmax(-1))
    with pytest.raises(Exception, match="train.target_temperature"):
        load_recipe(None, ["train.target_temperature=0"])


def test_copy_weight_marks_what_prompt_lookup_would_get_right():
    from eagle_train.batches import add_targets, copy_sources, copyable
    # "a b c d" repeats: after the second "a b c" lookup proposes "d"; top1[t-1] is the target's guess for t
    ids = torch.tensor([[1, 2, 3, 4, 9, 1, 2, 3, 4, 7]])
    top1 = torch.roll(ids, -1, 1)
    top1[0, 7] = 5  # the target does not continue the repeat at t = 8: not copyable
    want = torch.zeros_like(ids, dtype=torch.bool)
    assert torch.equal(copyable(ids, top1), want)  # ... so nothing is copyable
    top1[0, 7] = 4
    want[0, 8] = True
    assert torch.equal(copyable(ids, top1), want)
    assert copy_sources(ids, top1)[0, 8] == 3 and (copy_sources(ids, top1) >= 0).sum() == 1  # the first "d"
    V, H = 12, 8
    g = torch.Generator().manual_seed(0)
    lm_head_w = torch.randn(V, H, generator=g)
    draft_ids = torch.arange(V)
    t2d = torch.arange(V)
    logp = torch.log_softmax(torch.randn(1, 10, V, generator=g), -1)
    logp[0, torch.arange(10), top1[0]] = 5.0  # the target's top-1 is top1
    logp = torch.log_softmax(logp, -1).sort(-1, descending=True)
    base = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "loss_mask": torch.ones_like(ids),
            "topk_ids": logp.indices, "topk_logp": logp.values}
    b = add_targets(dict(base), "eagle3", lm_head_w, draft_ids, t2d, copy_weight=3.0)
    assert torch.equal(b["weight"], b["valid"].float() * torch.where(want, 3.0, 1.0))
    assert "weight" not in add_targets(dict(base), "eagle3", lm_head_w, draft_ids, t2d)
    # the loss weighs position 8 three times: (sum of the CEs + 2 * CE_8) / (count + 2)
    head = Eagle3Head(Eagle3Config(hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
                                   head_dim=8, vocab_size=V, draft_vocab_size=V, aux_layers=[1, 2, 3]))
    b["aux"] = torch.randn(1, 10, 96, generator=g)
    loss = DraftLoss(head, ttt_steps=1, ttt_decay=1.0, feature_weight=0, token_weight=0, noise=0)
    loss_w, stats = loss(b)
    loss_1, stats_1 = loss(dict(b, weight=b["valid"].float()))
    ce_8, _ = loss(dict(b, weight=want.float()))
    cnt = stats_1["acc_0"][1]
    torch.testing.assert_close(loss_w, (loss_1 * cnt + 2 * ce_8) / (cnt + 2))
    assert not torch.isclose(loss_w, loss_1)
    assert torch.equal(stats["acc_0"], stats_1["acc_0"])  # accuracy counts stay unweighted


def test_freeze_lm_head_keeps_the_target_rows_and_trains_the_rest(tmp_path):
    """head.freeze_lm_head=true: lm_head stays the target's rows of the draft vocabulary through training, the rest
    learns; the final head saves those rows; resuming with the other setting is refused (the optimizer's tensors
    differ)."""
    from eagle_train.draft_vocab import draft_ids_of
    target = make_tiny_llama(vocab_size=128)
    write_corpus(synthetic(), tmp_path / "a" / "data")
    res = train.main(load_recipe(None, tiny_args(tmp_path / "a", steps=12, extra=["head.freeze_lm_head=true",
                                                                                 "train.save_every=6"])), target=target)
    h = load_head(res["final"])
    rows = target.lm_head.weight.float()[draft_ids_of(h.d2t)]
    assert torch.equal(h.lm_head.weight.float(), rows)
    assert res["metrics"]["eval/acc_0"] > res["metrics"]["eval0/acc_0"] + 0.03, res["metrics"]
    with pytest.raises(Exception, match="freeze_lm_head"):
        train.main(load_recipe(None, tiny_args(tmp_path / "a", steps=14)), target=target)


def test_shallow_steps_unroll_fewer_ttt_steps_first(tmp_path):
    """train.shallow_steps: those first optimizer steps train exactly as a `shallow_ttt` unroll would, the rest with
    `ttt_steps`; held-out evaluations always unroll `ttt_steps`; a run killed after the switch resumes to the same
    weights; shallow_ttt > ttt_steps is refused by name."""
    from eagle_train.recipe import RecipeError

    target = make_tiny_llama(vocab_size=128)
    data = tmp_path / "data"
    write_corpus(synthetic(n=24), data)
    common = [f"data.output={data}", "train.save_every=3"]

    def run(name, extra, steps=6, **kw):
        return train.main(load_recipe(None, tiny_args(tmp_path / name, steps=steps, extra=common + extra)),
                          target=target, **kw)

    def weights(res):
        return load_file(res["final"] / "model.safetensors")

    one = run("one", ["train.ttt_steps=1"])
    early = run("early", ["train.shallow_steps=6", "train.shallow_ttt=1"])  # every step shallow, evaluated at 3
    deep = run("deep", [])
    mixed = run("mixed", ["train.shallow_steps=3", "train.shallow_ttt=1"])
    for k, v in weights(one).items():
        assert torch.equal(v, weights(early)[k]), k
    assert "eval/acc_1" not in one["metrics"] and {"eval/acc_1", "eval/acc_2"} <= set(early["metrics"])
    assert "eval/chain_2" in mixed["metrics"]
    w = weights(mixed)
    assert any(not torch.equal(w[k], weights(one)[k]) for k in w)
    assert any(not torch.equal(w[k], weights(deep)[k]) for k in w)
    state = json.loads((mixed["final"] / "train_state.json").read_text())
    assert state["train"]["shallow_steps"] == 3 and state["train"]["shallow_ttt"] == 1
    # killed at step 4: the resume starts from the step-3 checkpoint, the first step past the switch
    shallow = ["train.shallow_steps=3", "train.shallow_ttt=1"]
    assert run("killed", shallow, stop_after=4)["final"] is None
    resumed = run("killed", shallow + ["train.resume=true"])
    for k, v in w.items():
        assert torch.equal(v, weights(resumed)[k]), k
    with pytest.raises(RecipeError, match=r"train\.shallow_ttt` = 4 > `train\.ttt_steps` = 3"):
        load_recipe(None, tiny_args(tmp_path / "bad", extra=["train.shallow_steps=2", "train.shallow_ttt=4"]))


def test_weight_decay_pulls_the_matrices_only():
    """engine.adamw: train.weight_decay shrinks every matrix by lr * decay a step (zero gradients: Adam's own update
    is 0) and leaves norm gains and biases alone; without decay a single parameter group, as old checkpoints hold."""
    from types import SimpleNamespace

    from eagle_train.engine import adamw

    lin, norm = torch.nn.Linear(4, 3), torch.nn.RMSNorm(3)
    params = [*lin.parameters(), *norm.parameters()]
    before = [p.detach().clone() for p in params]
    opt = adamw(params, SimpleNamespace(learning_rate=0.1, weight_decay=0.5, adam_betas=[0.9, 0.95]))
    for p in params:
        p.grad = torch.zeros_like(p)
    opt.step()
    assert torch.allclose(lin.weight, before[0] * 0.95)
    for p, b in zip(params[1:], before[1:]):  # the bias and the norm gain
        assert torch.equal(p.detach(), b)
    assert len(adamw(params, SimpleNamespace(learning_rate=0.1, weight_decay=0.0, adam_betas=[0.9, 0.95]))
               .param_groups) == 1


def test_muon_orthogonalizes_the_hidden_matrices_and_steps_the_rest_as_adamw():
    """train.optimizer=muon (engine.optimizer): a hidden matrix moves by an orthogonalized update (every singular value
    of the step ~ lr * 0.2 sqrt(max(rows, cols)), whatever the gradient's spectrum), the lm_head and the norm gain
    step exactly as torch's AdamW, the state resumes bit-equal from its state_dict, and DeepSpeed is refused."""
    from types import SimpleNamespace

    from eagle_train.engine import Muon, optimizer, orthogonalize

    torch.manual_seed(0)
    g = torch.randn(24, 40) @ torch.diag(torch.logspace(-1, 1, 40))  # column scales over 2 decades
    s = torch.linalg.svdvals(orthogonalize(g))
    assert s.min() > 0.6 and s.max() < 1.3, s
    u, _, vh = torch.linalg.svd(g, full_matrices=False)
    assert torch.nn.functional.cosine_similarity(orthogonalize(g).flatten(), (u @ vh).flatten(), dim=0) > 0.9

    class Tiny(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc, self.norm, self.lm_head = torch.nn.Linear(16, 8, bias=False), torch.nn.RMSNorm(8), \
                torch.nn.Linear(8, 32, bias=False)

        def forward(self, x):
            return self.lm_head(self.norm(self.fc(x)))

    tc = SimpleNamespace(optimizer="muon", learning_rate=1e-2, weight_decay=0.0, adam_betas=[0.9, 0.95],
                         muon_ns_steps=5, muon_block=0, muon_scale=0.2)
    model, twin = Tiny(), Tiny()
    twin.load_state_dict(model.state_dict())
    opt = optimizer(model, tc)
    assert isinstance(opt, Muon) and [gr["muon"] for gr in opt.param_groups] == [True, False, False]
    ref = torch.optim.AdamW([twin.lm_head.weight, twin.norm.weight], lr=1e-2, betas=(0.9, 0.95), weight_decay=0.0)
    x = torch.randn(64, 16)
    for _ in range(3):
        before = model.fc.weight.detach().clone()
        twin.fc.weight.data.copy_(before)  # Muon's fc in both, so the AdamW parameters see the same gradients
        for m, o in ((model, opt), (twin, ref)):
            o.zero_grad()
            m(x).square().mean().backward()
            o.step()
        step = torch.linalg.svdvals(model.fc.weight.detach() - before) / (1e-2 * 0.2 * 16 ** 0.5)
        assert step.min() > 0.6 and step.max() < 1.3, step
        assert torch.allclose(model.lm_head.weight, twin.lm_head.weight, atol=1e-6)
        assert torch.allclose(model.norm.weight, twin.norm.weight, atol=1e-6)
    resumed = Tiny()
    resumed.load_state_dict(model.state_dict())
    opt2 = optimizer(resumed, tc)
    opt2.load_state_dict(copy.deepcopy(opt.state_dict()))  # as from a checkpoint file: no shared tensors
    for m, o in ((model, opt), (resumed, opt2)):
        o.zero_grad()
        m(x).square().mean().backward()
        o.step()
    for a, b in zip(model.parameters(), resumed.parameters()):
        assert torch.equal(a, b)
    with pytest.raises(RecipeError, match="train.optimizer=muon"):
        optimizer(model, tc, deepspeed=True)


def test_muon_blocks_orthogonalize_each_run_of_rows_alone():
    """train.muon_block: each run of `block` rows is orthogonalized on its own (equal to that block alone, every
    singular value ~1, the blocks not orthogonal to each other), a matrix the block does not divide goes whole;
    train.muon_ns_steps and train.muon_scale reach the optimizer (the step is lr * muon_scale * sqrt(max(shape)) times
    the blocked update), and fewer iterations leave the small singular values lower."""
    from types import SimpleNamespace

    from eagle_train.engine import MUON_MOMENTUM, optimizer, orthogonalize

    torch.manual_seed(0)
    g = torch.randn(24, 40) @ torch.diag(torch.logspace(-1, 1, 40))
    u = orthogonalize(g, block=8)
    for i in range(0, 24, 8):
        assert torch.allclose(u[i:i + 8], orthogonalize(g[i:i + 8]), atol=1e-5)
        s = torch.linalg.svdvals(u[i:i + 8])
        assert s.min() > 0.6 and s.max() < 1.3, s
    assert torch.linalg.svdvals(u).max() > 1.3  # stacked, the blocks share directions: not one orthogonal matrix
    tall = torch.randn(48, 12)  # blocks of 8 x 12 rows, each orthogonalized on its short side
    assert torch.allclose(orthogonalize(tall, block=8)[8:16], orthogonalize(tall[8:16]), atol=1e-5)
    assert torch.equal(orthogonalize(g[:20], block=8), orthogonalize(g[:20]))  # 8 does not divide 20
    assert torch.linalg.svdvals(orthogonalize(g, steps=3)).min() < torch.linalg.svdvals(orthogonalize(g)).min()

    model = torch.nn.Sequential(torch.nn.Linear(16, 8, bias=False), torch.nn.Linear(8, 4, bias=False))
    tc = SimpleNamespace(optimizer="muon", learning_rate=1e-2, weight_decay=0.0, adam_betas=[0.9, 0.95],
                         muon_ns_steps=3, muon_block=4, muon_scale=0.3)
    opt = optimizer(model, tc)
    assert (opt.ns_steps, opt.block, opt.scale) == (3, 4, 0.3)
    before = model[0].weight.detach().clone()
    model(torch.randn(32, 16)).square().mean().backward()
    opt.step()
    # first step: the Nesterov update is the gradient times 1 - m^2, built as the optimizer builds it (in fp32 the
    # scale would drop out, but a bf16 CPU orthogonalizes in bf16, where the scaled gradient rounds differently)
    grad = model[0].weight.grad
    nesterov = grad.lerp(torch.zeros_like(grad).lerp_(grad, 1 - MUON_MOMENTUM), MUON_MOMENTUM)
    assert torch.allclose(nesterov, grad * (1 - MUON_MOMENTUM ** 2))
    expect = before - 1e-2 * 0.3 * 16 ** 0.5 * orthogonalize(nesterov, 3, 4)  # muon_scale 0.3
    assert torch.allclose(model[0].weight.detach(), expect, atol=1e-6)
    with pytest.raises(RecipeError, match="train.muon_block. = 4 .* train.optimizer=adamw"):
        optimizer(model, SimpleNamespace(**{**vars(tc), "optimizer": "adamw"}))  # a Muon option doing nothing
    with pytest.raises(RecipeError, match="train.muon_scale. = 0.3 are Muon's"):
        optimizer(model, SimpleNamespace(**{**vars(tc), "optimizer": "adamw", "muon_block": 0, "muon_ns_steps": 5}))


def test_fit_budget_shrinks_both_phases_by_one_factor():
    """engine.fit_budget: steps that fit are left alone; otherwise the shallow and deep steps left shrink by the
    same factor (never below one deep step), a run shallow to the end moves only its end, and only the deep phase's
    own fit grows its steps into time left over, up to the recipe's deep steps."""
    from types import SimpleNamespace

    from eagle_train.engine import fit_budget

    def plan(shallow=2400, end=2900):
        return SimpleNamespace(shallow_steps=shallow, max_steps=end)

    p = plan()  # 2,378 x 1 s + 500 x 3 s + 2,878 x 0.1 s = 4,165.8 s
    assert fit_budget(p, 22, 5000, 1.0, 3.0, 0.1) == 1.0 and (p.shallow_steps, p.max_steps) == (2400, 2900)
    f = fit_budget(p, 22, 2083, 1.0, 3.0, 0.1)
    assert f == pytest.approx(0.5, abs=1e-3) and (p.shallow_steps, p.max_steps) == (22 + 1189, 22 + 1189 + 250)
    p = plan()  # in the deep phase only its steps are left
    assert fit_budget(p, 2450, 901, 1.0, 3.0, 0.0) == pytest.approx(2 / 3, abs=1e-3)
    assert (p.shallow_steps, p.max_steps) == (2400, 2450 + 300)
    p = plan()  # no time left: the deep phase still gets its one step, from where the run is
    assert fit_budget(p, 22, -10, 1.0, 3.0, 0.0) == 0.0 and (p.shallow_steps, p.max_steps) == (22, 23)
    p = plan(shallow=3000)  # shallow to the end
    fit_budget(p, 100, 1400, 1.0, 3.0, 0.0)
    assert (p.shallow_steps, p.max_steps) == (3000, 100 + 1400)
    # the deep phase's own step time leaves time over: more deep steps (95% of the spare time), up to the recipe's
    p = plan(shallow=830, end=1215)  # lowered by the shallow phase; 852: the deep phase's fit
    f = fit_budget(p, 852, 1400, 1.0, 2.0, 0.0, deep_cap=1800)  # 363 steps x 2 s = 726 s of 1,400
    assert (p.shallow_steps, p.max_steps) == (830, 1215 + 320) and f == pytest.approx((363 + 320) / 363)
    p = plan(shallow=830, end=1215)
    assert fit_budget(p, 852, 10**6, 1.0, 2.0, 0.0, deep_cap=500) > 1 and p.max_steps == 830 + 500  # the cap
    p = plan(shallow=830, end=1215)  # no cap given (the shallow phase's fit): never grows
    assert fit_budget(p, 100, 10**6, 1.0, 2.0, 0.0) == 1.0 and (p.shallow_steps, p.max_steps) == (830, 1215)
    p = plan(shallow=830, end=1215)  # the plan is the recipe's already: nothing to add
    assert fit_budget(p, 852, 10**6, 1.0, 2.0, 0.0, deep_cap=385) == 1.0 and p.max_steps == 1215


def test_budget_minutes_lowers_the_steps_and_a_resume_keeps_the_plan(tmp_path, capsys):
    """train.budget_minutes: a budget the recipe's steps overrun lowers both phases after the probe steps, the final
    head records the counts it was trained with beside the recipe's; a run killed after the fit resumes to the same
    plan (the new run's own budget does not refit it) and the same weights; an ample budget changes nothing."""
    from eagle_train.engine import BUDGET_PROBE
    from eagle_train.recipe import RecipeError

    target = make_tiny_llama(vocab_size=128)
    data = tmp_path / "data"
    write_corpus(synthetic(n=24), data)
    fit_at = BUDGET_PROBE + 2  # the step the shallow phase is fitted at
    common = [f"data.output={data}", f"train.save_every={fit_at}", "train.shallow_steps=28", "train.shallow_ttt=1"]

    def run(name, extra, **kw):
        return train.main(load_recipe(None, tiny_args(tmp_path / name, steps=32, extra=common + extra)),
                          target=target, **kw)

    def state(res):
        return json.loads((res["final"] / "train_state.json").read_text())["train"]

    tight = run("tight", ["train.budget_minutes=1e-4"])  # 6 ms: every step is over it
    assert tight["step"] == fit_at + 1
    # the shallow phase's log projects the deep step from its own
    said = [line for line in capsys.readouterr().out.splitlines() if "[train] budget at step" in line]
    assert len(said) == 1 and "shallow steps" in said[0] and "(projected)" in said[0], said
    got = state(tight)
    assert (got["shallow_steps"], got["max_steps"]) == (fit_at, fit_at + 1)
    assert (got["recipe_shallow_steps"], got["recipe_max_steps"], got["budget_minutes"]) == (28, 32, 1e-4)
    ample = run("ample", ["train.budget_minutes=1e6"])
    assert ample["step"] == 32 and (state(ample)["shallow_steps"], state(ample)["max_steps"]) == (28, 32)
    assert run("killed", ["train.budget_minutes=1e-4"], stop_after=fit_at)["final"] is None
    resumed = run("killed", ["train.budget_minutes=1e6", "train.resume=true"])
    assert resumed["step"] == fit_at + 1 and state(resumed)["max_steps"] == fit_at + 1
    w = load_file(tight["final"] / "model.safetensors")
    for k, v in load_file(resumed["final"] / "model.safetensors").items():
        assert torch.equal(v, w[k]), k
    with pytest.raises(RecipeError, match=r"train\.budget_minutes"):
        load_recipe(None, tiny_args(tmp_path / "bad", extra=["train.budget_minutes=0"]))


def test_budget_refit_gives_back_the_steps_a_slow_probe_took(tmp_path, capsys, monkeypatch):
    """train.budget_minutes fits a phase twice: a first probe that reads slow lowers the shallow counts, and the refit
    over more steps starts again from the recipe's counts, so the run trains the recipe's steps where they fit."""
    from eagle_train import engine

    monkeypatch.setattr(train, "BUDGET_PROBE", 4)  # fits at step 6 and 12 instead of 22 and 202
    monkeypatch.setattr(train, "BUDGET_REFIT", 10)
    reads = iter([1.0, 0.5])  # the probe's median step time, then the refit's (seconds; the real steps are faster)
    monkeypatch.setattr(train, "median", lambda times: next(reads))
    data = tmp_path / "data"
    write_corpus(synthetic(n=24), data)
    # 22 s: 22 shallow + 4 deep (ttt 3, projected 3 s) steps left need 34 s at the probe's 1.0 s, 14 s at the refit's
    res = train.main(load_recipe(None, tiny_args(tmp_path / "refit", steps=32, extra=[
        f"data.output={data}", "train.shallow_steps=28", "train.shallow_ttt=1", "train.save_every=100",
        f"train.budget_minutes={22 / 60}"])), target=make_tiny_llama(vocab_size=128))
    said = [line for line in capsys.readouterr().out.splitlines() if "[train] budget at step" in line]
    assert len(said) == 2 and engine.BUDGET_PROBE == 20, said  # the deep phase's 4 steps are too few to fit
    assert said[0].startswith("[train] budget at step 6: shallow steps 1.00 s") and "steps lowered" in said[0], said
    assert said[1].startswith("[train] budget at step 12: refit over 10 steps, shallow steps 0.50 s"), said
    assert "the recipe's steps fit" in said[1] and "-> 28" in said[1] and said[1].endswith("-> 32"), said
    got = json.loads((res["final"] / "train_state.json").read_text())["train"]
    assert res["step"] == 32 and (got["shallow_steps"], got["max_steps"]) == (28, 32)


def test_deep_learning_rate_restarts_schedule_and_moments(tmp_path):
    """train.deep_learning_rate: from shallow_steps on, a warmup and decay of its own to that peak (the shallow steps
    keep the single schedule), and fresh AdamW moments: at an equal learning rate the moments alone tell the runs
    apart; a run killed across the restart resumes to the same weights; a restart outside the run is refused."""
    from types import SimpleNamespace

    from eagle_train.engine import lr_lambda
    from eagle_train.recipe import RecipeError

    tc = SimpleNamespace(warmup_steps=2, max_steps=10, scheduler="cosine", learning_rate=1e-3,
                         deep_learning_rate=5e-4, shallow_steps=6)
    single, restart = lr_lambda(SimpleNamespace(**{**vars(tc), "deep_learning_rate": 0.0})), lr_lambda(tc)
    assert [restart(s) for s in range(6)] == [single(s) for s in range(6)]
    assert restart(6) == pytest.approx(0.5 / 3) and restart(7) == pytest.approx(0.5 * 2 / 3)
    assert restart(8) == pytest.approx(0.5) and restart(9) == pytest.approx(0.25)  # cosine from step 8 to 10

    target = make_tiny_llama(vocab_size=128)
    data = tmp_path / "data"
    write_corpus(synthetic(n=24), data)
    flat = [f"data.output={data}", "train.save_every=3", "train.shallow_steps=3", "train.shallow_ttt=1",
            "train.scheduler=constant", "train.warmup_steps=0"]

    def run(name, extra, **kw):
        return train.main(load_recipe(None, tiny_args(tmp_path / name, steps=6, extra=flat + extra)),
                          target=target, **kw)

    def weights(res):
        return load_file(res["final"] / "model.safetensors")

    kept = weights(run("kept", []))
    fresh = run("fresh", ["train.deep_learning_rate=3e-3"])  # the same rate as train.learning_rate: moments only
    w = weights(fresh)
    assert any(not torch.equal(w[k], kept[k]) for k in w)
    assert json.loads((fresh["final"] / "train_state.json").read_text())["train"]["deep_learning_rate"] == 3e-3
    # killed at step 4: the resume loads the step-3 checkpoint (saved before the restart) and restarts there too
    assert run("killed", ["train.deep_learning_rate=3e-3"], stop_after=4)["final"] is None
    resumed = weights(run("killed", ["train.deep_learning_rate=3e-3", "train.resume=true"]))
    for k, v in w.items():
        assert torch.equal(v, resumed[k]), k
    with pytest.raises(RecipeError, match=r"train\.deep_learning_rate` = 0.001 restarts .* `train\.shallow_steps` = 0"):
        load_recipe(None, tiny_args(tmp_path / "bad", extra=["train.deep_learning_rate=1e-3"]))


@pytest.mark.parametrize("native", [False, True])
def test_cpu_training_precision_follows_native_bf16(monkeypatch, capsys, native):
    """train.mixed_precision=auto: bf16 autocast only on a CPU that computes bf16 natively (fp32 elsewhere: a phase-A
    step 39 s against 1.36 s, bench/RESULTS.md "## A CPU without native bf16"); an explicit bf16 there is kept and
    warned about; GPUs and DeepSpeed's CPU ranks as before."""
    from types import SimpleNamespace

    from eagle_train import engine

    monkeypatch.setattr(engine, "cpu_has_fast_bf16", lambda: native)
    tc = SimpleNamespace(mixed_precision="auto", engine="ddp")
    assert engine.mixed_precision(tc, cuda=False, multi=False) == ("bf16" if native else "no")
    assert engine.mixed_precision(tc, cuda=True, multi=False) == "bf16"
    assert engine.mixed_precision(SimpleNamespace(mixed_precision="auto", engine="deepspeed"), False, True) == "no"
    capsys.readouterr()
    assert engine.mixed_precision(SimpleNamespace(mixed_precision="bf16", engine="ddp"), False, False) == "bf16"
    assert ("without native bf16" in capsys.readouterr().out) is not native
