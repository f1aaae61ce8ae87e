"""Tree attention mask / position ids against hand-computed values; tree verification against
sequential forwards; the target KV cache after acceptance against a plain forward."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

from eagle_train.decoding import (SpecConfig, Tree, draft_tree, graft, head_update, lookup_draft, rerank, static_paths,
                                  target_forward, tree_mask, verify)
from eagle_train.kv_cache import commit_cache
from eagle_train.eagle3 import Eagle3Config, Eagle3Head

#        0 (root)
#       / \
#      1   2
#     / \   \
#    3   4   5
#    |
#    6
PARENTS = [-1, 0, 0, 1, 1, 2, 3]
DEPTHS = [0, 1, 1, 2, 2, 2, 3]

pytestmark = pytest.mark.usefixtures("one_thread")



def test_tree_mask_and_positions_hand_built():
    mask, pos = tree_mask(PARENTS, DEPTHS, past_len=3)
    assert mask.shape == (1, 1, 7, 10)
    tree_part = [  # row i: which tree nodes node i sees (itself and its ancestors)
        [1, 0, 0, 0, 0, 0, 0],
        [1, 1, 0, 0, 0, 0, 0],
        [1, 0, 1, 0, 0, 0, 0],
        [1, 1, 0, 1, 0, 0, 0],
        [1, 1, 0, 0, 1, 0, 0],
        [1, 0, 1, 0, 0, 1, 0],
        [1, 1, 0, 1, 0, 0, 1],
    ]
    expected = torch.cat([torch.ones(7, 3), torch.tensor(tree_part, dtype=torch.float)], dim=1).bool()
    assert torch.equal(mask[0, 0] == 0, expected)
    assert (mask[0, 0][~expected] == torch.finfo(torch.float32).min).all()
    assert pos.tolist() == [[3, 4, 4, 5, 5, 5, 6]]


def test_lookup_draft_copies_after_the_latest_longest_match():
    cfg = SpecConfig(lookup_tokens=3, lookup_ngram=3, lookup_min_ngram=2)
    #        0  1  2  3  4  5  6  7  8  9 10 11 12
    ctx = [5, 6, 7, 1, 5, 6, 8, 2, 9, 6, 7, 5, 6]
    assert lookup_draft(ctx, cfg) == [8, 2, 9]  # "5 6" last seen at 4 (no earlier "x 5 6" of 3 tokens matches "7 5 6")
    assert lookup_draft(ctx + [7], cfg) == [1, 5, 6]  # the 3-gram "5 6 7" (at 0) beats the later 2-gram "6 7" (at 9)
    assert lookup_draft(ctx + [3], cfg) == []  # "6 3" never occurred, and 1-grams are below lookup_min_ngram
    one = SpecConfig(lookup_tokens=2, lookup_ngram=3, lookup_min_ngram=1)
    assert lookup_draft([4, 1, 2, 4, 9, 4], one) == [9, 4]  # the latest "4", not the first
    assert lookup_draft([4, 1, 2, 4, 9, 4], cfg) == []
    assert lookup_draft([4], one) == []  # nothing earlier to copy from
    # a copy that runs into the end of the context repeats its period: "1 2" loops, "3 1 2" loops
    assert lookup_draft([1, 2, 1, 2], SpecConfig(lookup_tokens=5, lookup_ngram=2)) == [1, 2, 1, 2, 1]
    assert lookup_draft([9, 3, 1, 2, 3, 1, 2], SpecConfig(lookup_tokens=5, lookup_ngram=2)) == [3, 1, 2, 3, 1]


def test_graft_follows_matching_nodes_and_appends_the_rest():
    tree = Tree([7], [-1], [0], [None])
    for tok, par in [(1, 0), (2, 0), (3, 1), (4, 1)]:  # root 7 -> {1 -> {3, 4}, 2}
        tree.tokens.append(tok), tree.parents.append(par), tree.depths.append(tree.depths[par] + 1)
        tree.qs.append(None)
    assert graft(tree, [1, 4]) == []  # already drafted: no node to add, the pass costs nothing more
    added = graft(tree, [1, 3, 8, 9])  # shares root -> 1 -> 3, then leaves the head's tree
    assert added == [5, 6] and tree.tokens[5:] == [8, 9]
    assert tree.parents[5:] == [3, 5] and tree.depths[5:] == [3, 4] and tree.qs[5:] == [None, None]
    assert graft(tree, [2, 2]) == [7] and tree.parents[7] == 2  # a second 2 below the head's 2
    added = graft(tree, [6])  # a new sibling of the head's depth-1 nodes
    assert tree.parents[added[0]] == 0 and all(p < i for i, p in enumerate(tree.parents) if i)


def test_static_paths_and_rerank_keep_ancestors():
    assert static_paths(SpecConfig(tree="chain", depth=3)) == [[0], [0, 0], [0, 0, 0]]
    assert static_paths(SpecConfig(tree="static", static_tree=[[0, 0], [1], [0]])) == [[0], [1], [0, 0]]
    # candidates: two depth-1 nodes (work-tree nodes 1, 2) and their children
    cands = [dict(score=-0.1, parent=0, token=10, depth=1, node=1),
             dict(score=-2.0, parent=0, token=11, depth=1, node=2),
             dict(score=-0.3, parent=1, token=12, depth=2, node=None),
             dict(score=-2.5, parent=2, token=13, depth=2, node=None),
             dict(score=-1.0, parent=1, token=14, depth=2, node=None)]
    t = rerank(cands, root=7, n_keep=3)
    assert t.tokens == [7, 10, 12, 14] and t.parents == [-1, 0, 1, 1] and t.depths == [0, 1, 2, 2]
    t = rerank(cands, root=7, n_keep=5)
    assert sorted(t.tokens) == [7, 10, 11, 12, 13, 14]
    assert all(t.parents[i] < i for i in range(1, len(t.tokens)))


def _prefix_cache(model, prefix):
    cache = DynamicCache()
    target_forward(model, prefix, cache, None)
    return cache


def test_tree_logits_equal_sequential_and_cache_after_accept(tiny_llama):
    model = tiny_llama
    prefix = torch.tensor([[1, 17, 33, 5, 99]])
    tokens = [40, 41, 42, 43, 44, 45, 46]
    tree = Tree(tokens, PARENTS, DEPTHS, [None] * 7)
    cache = _prefix_cache(model, prefix)
    logits, feats = verify(model, cache, tree, prefix.shape[1], [1, 3, 5])
    # every node's logits are those of a plain forward over its path
    for i in range(7):
        path = torch.tensor([[tokens[j] for j in tree.ancestors(i)]])
        ref = model(torch.cat([prefix, path], 1)).logits[0, -1]
        torch.testing.assert_close(logits[i], ref, atol=1e-4, rtol=1e-4)
    # accept root -> 1 -> 3 -> 6 (tree indices 0, 1, 3, 6: not contiguous)
    keep = [0, 1, 3, 6]
    commit_cache(cache, prefix.shape[1], torch.tensor(keep))
    accepted = torch.cat([prefix, torch.tensor([[tokens[j] for j in keep]])], 1)
    ref_cache = _prefix_cache(model, accepted)
    assert cache.get_seq_length() == accepted.shape[1]
    for layer, ref in zip(cache.layers, ref_cache.layers):
        torch.testing.assert_close(layer.keys, ref.keys, atol=1e-5, rtol=1e-4)
        torch.testing.assert_close(layer.values, ref.values, atol=1e-5, rtol=1e-4)
    # and the next forward over the committed cache continues exactly like a fresh one
    nxt = torch.tensor([[77]])
    got = model(nxt, cache=cache, use_cache=True).logits[0, -1]
    torch.testing.assert_close(got, model(torch.cat([accepted, nxt], 1)).logits[0, -1], atol=1e-4, rtol=1e-4)
    # the same pass through oneDNN's prepacked linears (eval.packed_verify): the same logits to fp32 rounding, used
    # only inside the pass
    from eagle_train.decoding import packed_linears

    packs = packed_linears(model)
    assert len(packs) == sum(isinstance(m, torch.nn.Linear) for m in model.modules()) > 0
    assert packed_linears(model, "off") == {}
    ref_logits, _ = verify(model, cache, tree, accepted.shape[1] + 1, [1, 3, 5])
    commit_cache(cache, accepted.shape[1] + 1, torch.zeros(0, dtype=torch.long))
    got_logits, _ = verify(model, cache, tree, accepted.shape[1] + 1, [1, 3, 5], packs)
    torch.testing.assert_close(got_logits, ref_logits, atol=1e-4, rtol=1e-4)
    commit_cache(cache, accepted.shape[1] + 1, torch.zeros(0, dtype=torch.long))
    assert not any("forward" in vars(m) for m in packs)  # generate and the prefill see the plain layers
    # keeping no tree entry rolls the cache back to the prefix (what bench/verify_cost.py does between passes)
    verify(model, cache, tree, accepted.shape[1] + 1, None)
    commit_cache(cache, prefix.shape[1], torch.zeros(0, dtype=torch.long))
    assert cache.get_seq_length() == prefix.shape[1]
    for layer, ref in zip(cache.layers, _prefix_cache(model, prefix).layers):
        torch.testing.assert_close(layer.keys, ref.keys, atol=1e-5, rtol=1e-4)


def test_tree_pass_on_a_cpu_skips_repeat_kv_with_the_same_logits(tiny_llama, monkeypatch):
    """A tree pass (a masked, grouped-query forward) runs SDPA's enable_gqa on a CPU instead of transformers'
    repeat_kv copies of the cached keys and values: the same logits and features bit for bit, the switch off again
    after the pass."""
    import os

    from transformers.integrations import sdpa_attention

    copies = []
    real = sdpa_attention.repeat_kv
    monkeypatch.setattr(sdpa_attention, "repeat_kv", lambda x, n: copies.append(n) or real(x, n))
    prefix = torch.tensor([[1, 17, 33, 5, 99]])
    tree = Tree([40, 41, 42, 43, 44, 45, 46], PARENTS, DEPTHS, [None] * 7)
    got = {}
    for how in ("repeat_kv", "enable_gqa"):
        if how == "repeat_kv":  # transformers' own switch, which verify leaves alone when set
            monkeypatch.setenv("TRANSFORMERS_SDPA_FORCE_GQA", "0")
        else:
            monkeypatch.delenv("TRANSFORMERS_SDPA_FORCE_GQA")
        copies.clear()
        got[how] = verify(tiny_llama, _prefix_cache(tiny_llama, prefix), tree, prefix.shape[1], [1, 3, 5])
        assert len(copies) == (2 * tiny_llama.config.num_hidden_layers if how == "repeat_kv" else 0)
    assert "TRANSFORMERS_SDPA_FORCE_GQA" not in os.environ
    assert torch.equal(got["repeat_kv"][0], got["enable_gqa"][0])
    assert torch.equal(got["repeat_kv"][1], got["enable_gqa"][1])


def test_packed_linears_follow_a_weight_changed_in_place():
    """A head trained further after it was packed (its weights updated in place) must not draft from stale packs."""
    from eagle_train.decoding import linears_from, packed_linears

    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 8, bias=False))
    x = torch.randn(3, 16)
    packs = packed_linears(net)
    assert packed_linears(net) is packs  # made once
    with torch.no_grad():
        net[2].weight.mul_(-2.0)  # an optimizer step does the same: an in-place update
    fresh = packed_linears(net)
    assert fresh is not packs
    with torch.no_grad(), linears_from(fresh):
        got = net(x)
    torch.testing.assert_close(got, net(x).detach(), atol=1e-5, rtol=1e-5)
    assert packed_linears(net.to(torch.bfloat16)) == {}  # auto: float32 only


def test_baselines_run_through_the_packs_they_are_given(tiny_llama, monkeypatch):
    """The eval's baselines (generate, batched generate, prompt lookup) go through the same packed linears as the
    head when asked, so a speedup does not credit the head with the packs' gain; the tokens stay generate's."""
    from eagle_train import decoding
    from eagle_train.baselines import prompt_lookup_generate, vanilla_generate
    from eagle_train.eval.deploy import generate_batch

    calls = [0]
    real = decoding._packed_linear

    def counted(m, w, x):
        calls[0] += 1
        return real(m, w, x)

    monkeypatch.setattr(decoding, "_packed_linear", counted)
    prompts = [torch.tensor([1, 17, 33, 5, 99, 17, 33]), torch.tensor([4, 8, 15, 16])]
    got = {}
    for mode in ("off", "on"):
        calls[0] = 0
        got[mode] = (vanilla_generate(tiny_llama, prompts[0][None], 8, packed_verify=mode),
                     generate_batch(tiny_llama, prompts, 8, None, packed_verify=mode),
                     prompt_lookup_generate(tiny_llama, prompts[0][None], 8, 3, packed_verify=mode)[0])
        assert (calls[0] > 0) == (mode == "on"), (mode, calls[0])
    assert got["on"] == got["off"]


def test_head_tree_draft_equals_sequential_head(tiny_llama):
    """A depth-2 draft computed inside the tree (masked batch) equals the head run causally over
    that one path, so tree drafting changes no draft probability."""
    torch.manual_seed(0)
    head = Eagle3Head(Eagle3Config.from_target(tiny_llama.config, 512, [1, 3, 5])).eval()
    prefix = torch.tensor([[1, 17, 33, 5, 99]])
    cache = DynamicCache()
    logits, feats = target_forward(tiny_llama, prefix, cache, [1, 3, 5])
    root = 8
    C = prefix.shape[1]
    last_out, last_logp, hkv = head_update(head, None, 0, prefix[0, 1:].tolist() + [root], feats)
    cfg = SpecConfig(tree="static", static_tree=[[0], [1], [1, 0], [1, 1], [0, 0]])
    tree = draft_tree(head, hkv, C, root, last_out, last_logp, cfg)
    assert hkv[0].shape[2] == C  # drafting never grows the committed head cache
    # sequential: feed depth-1 rank-1 token, its child at rank 0 must match the tree's [1, 0] node
    d1 = int(last_logp.topk(2).indices[1])
    node_10 = [i for i in range(len(tree.tokens)) if tree.depths[i] == 2 and tree.tokens[tree.parents[i]] == d1]
    out, lg, _ = head(torch.tensor([[d1]]), last_out.view(1, 1, -1), torch.tensor([[C]]), kv_cache=hkv)
    assert tree.tokens[node_10[0]] == int(lg[0, -1].argmax())
    assert tree.tokens[node_10[1]] == int(lg[0, -1].topk(2).indices[1])
