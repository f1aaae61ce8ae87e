"""Batched tree speculative decoding: B prompts at once, each row with its own draft tree and its
own accepted length per step (ragged acceptance). The per-row rules are decoding.py's (draft,
rerank, accept_greedy / accept_sample, _finish); this module only batches the passes.

Layout of both caches (the target's DynamicCache and the head's (k, v), each (B, heads, P, d)):
left-aligned, row b's L_b committed entries in slots [0, L_b) (position s in slot s), slots
[L_b, P) padding that no query sees. A step appends the same number of slots to every row: the
drafted entries of one depth level (each row's frontier has the same size for one cfg), the
verified tree (padded to the largest tree with dummy nodes that nothing attends to), the
accepted pairs of the head update (padded to the longest path). Compaction then moves each
row's kept entries into slots [L_b, L_b + kept_b) and drops finished rows, so a row that ends
(EOS or budget) leaves the batch and costs nothing more, and no row sees another row's padding.

Per step: one head pass per depth level over all rows' frontiers, one target pass over all
rows' trees, one head pass over all rows' accepted paths.
"""

from __future__ import annotations

from typing import List, Optional, Sequence, Union

import torch
from transformers import DynamicCache

from eagle_train.acceptance import AcceptRule, accept_greedy, accept_sample, rejection_rule, sample, target_probs
from eagle_train.decoding import (SpecConfig, Tree, _clock, _finish, check_supported, graft, head_aux_layers,
                                  head_dtype, linears_from, lookup_draft, masked_gqa, packed_linears,
                                  rerank, speculative_generate, static_paths, to_target_ids)
from eagle_train.kv_cache import compact, compact_cache, compact_index


def _additive(allowed: torch.Tensor, dtype) -> torch.Tensor:
    """Bool (B, n, K) -> additive (B, 1, n, K) mask; finfo.min rather than -inf keeps a padding
    query that sees little finite (and its cache entry finite, so 0 * value stays 0)."""
    return torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill_(
        ~allowed, torch.finfo(dtype).min)[:, None]


def _committed(lens: torch.Tensor, slots: int) -> torch.Tensor:
    """(B, slots) bool: which cache slots hold a row's committed entries."""
    return torch.arange(slots, device=lens.device)[None] < lens[:, None]


def target_pass(model, ids, cache, aux_layers, position_ids, attention_mask, logits_to_keep=0):
    """Target logits (B, n, V) fp32 and head features (B, n, F) of every input token; logits only at
    the positions `logits_to_keep` (B, k) when given (transformers' convention, 0: all)."""
    out = model(input_ids=ids, position_ids=position_ids, attention_mask=attention_mask, cache=cache,
                use_cache=True, output_hidden_states=True, logits_to_keep=logits_to_keep)
    hs = out.hidden_states
    feats = torch.cat([hs[i] for i in aux_layers], dim=-1) if aux_layers else hs[-1]
    return out.logits.float(), feats


def heads_append(head, hkv, lens: torch.Tensor, new_ids: List[List[int]], feats: List[torch.Tensor]):
    """Pairs (new_ids[b][j], feats[b][j]) at positions L_b + j, appended to every row (padded to
    the longest row): each sees its row's committed entries and the earlier new pairs. Returns
    (last_out (B, H), last_logp (B, Vd)) of each row's last real pair, and the cache."""
    dev = lens.device
    B, n = len(new_ids), max(len(x) for x in new_ids)
    ids = torch.zeros(B, n, dtype=torch.long, device=dev)
    hid = torch.zeros(B, n, feats[0].shape[-1], dtype=head_dtype(head), device=dev)
    for b, (toks, f) in enumerate(zip(new_ids, feats)):
        ids[b, :len(toks)] = torch.tensor(toks, device=dev)
        hid[b, :len(toks)] = f.to(hid.dtype)
    k0 = 0 if hkv is None else hkv[0].shape[2]
    causal = torch.ones(n, n, dtype=torch.bool, device=dev).tril()
    mask = torch.cat([_committed(lens, k0)[:, None].expand(B, n, k0), causal.expand(B, n, n)], dim=2)
    pos = lens[:, None] + torch.arange(n, device=dev)
    out, logits, hkv = head(ids, hid, pos, kv_cache=hkv, attn_mask=mask[:, None])
    last = torch.tensor([len(x) - 1 for x in new_ids], device=dev)
    rows = torch.arange(B, device=dev)
    return out[rows, last], torch.log_softmax(logits[rows, last].float(), dim=-1), hkv


# ---------------------------------------------------------------------------------------------
# drafting: decoding.draft_tree for B rows, one head pass per depth level


def _heads_step(head, hkv, lens, outs, slots, nodes, trees):
    """Feed each row's drafted `nodes[b]` (the same count per row) to the head in one pass. Node
    i sits at position L_b + depth - 1 and sees its row's committed cache, its drafted ancestors
    and itself. Returns log-probs (B, m, Vd) and the cache; records each node's slot and output."""
    k0 = hkv[0].shape[2]
    dev = lens.device
    B, m = len(nodes), len(nodes[0])
    mask = torch.zeros(B, m, k0 + m, dtype=torch.bool, device=dev)
    mask[:, :, :k0] = _committed(lens, k0)[:, None]
    mask[:, torch.arange(m), k0 + torch.arange(m)] = True
    bi, qi, ki = [], [], []
    for b in range(B):
        for r, i in enumerate(nodes[b]):
            for a in trees[b].ancestors(i)[1:-1]:  # drafted ancestors (the root has no draft entry)
                bi.append(b), qi.append(r), ki.append(slots[b][a])
    if bi:
        mask[bi, qi, ki] = True
    ids = torch.tensor([[trees[b].tokens[i] for i in nodes[b]] for b in range(B)], device=dev)
    hidden = torch.stack([torch.stack([outs[b][trees[b].parents[i]] for i in nodes[b]]) for b in range(B)])
    pos = lens[:, None] + torch.tensor([[trees[b].depths[i] - 1 for i in nodes[b]] for b in range(B)], device=dev)
    out, logits, hkv = head(ids, hidden, pos, kv_cache=hkv, attn_mask=mask[:, None])
    for b in range(B):
        for r, i in enumerate(nodes[b]):
            slots[b][i] = k0 + r
            outs[b][i] = out[b, r]
    return torch.log_softmax(logits.float(), dim=-1), hkv


@torch.no_grad()
def draft_trees(head, hkv, lens: torch.Tensor, roots: List[int], last_out: torch.Tensor, last_logp: torch.Tensor,
                cfg: SpecConfig) -> List[Tree]:
    """One tree per row, grown below roots[b] by the rules of decoding.draft_tree. last_out (B, H)
    and last_logp (B, Vd) come from each row's pair at position L_b - 1. The draft entries are
    appended to the head cache (the caller drops them)."""
    B = len(roots)
    trees = [Tree([r], [-1], [0], [None]) for r in roots]
    outs = [{0: last_out[b]} for b in range(B)]
    slots = [{} for _ in range(B)]
    if cfg.tree in ("chain", "static"):
        # one shape for every row: node indices and the parents to expand agree across rows
        paths = static_paths(cfg)
        index, logps = {(): 0}, {0: last_logp}  # node -> (B, Vd)
        for d in range(1, max(len(p) for p in paths) + 1):
            level = [p for p in paths if len(p) == d]
            need = [i for i in sorted({index[tuple(p[:-1])] for p in level}) if i not in logps]
            if need:
                lp, hkv = _heads_step(head, hkv, lens, outs, slots, [need] * B, trees)
                logps.update({i: lp[:, r] for r, i in enumerate(need)})
            for p in level:
                par = index[tuple(p[:-1])]
                toks = to_target_ids(head, logps[par].topk(p[-1] + 1).indices[:, -1]).tolist()
                for b in range(B):
                    trees[b].tokens.append(toks[b]), trees[b].parents.append(par)
                    trees[b].depths.append(d), trees[b].qs.append(None)
                index[tuple(p)] = len(trees[0].tokens) - 1
        return trees
    # EAGLE-2 dynamic tree, per row as in draft_tree; every row's frontier has min(topk, |level|) nodes
    scores = [[0.0] for _ in range(B)]
    cands = [[] for _ in range(B)]
    frontier = [[0] for _ in range(B)]
    lp = last_logp[:, None]  # (B, frontier, Vd)
    for d in range(1, cfg.depth + 1):
        if d > 1:
            lp, hkv = _heads_step(head, hkv, lens, outs, slots, frontier, trees)
        top = lp.topk(min(cfg.topk, lp.shape[-1]))
        vals, toks = top.values.tolist(), to_target_ids(head, top.indices).tolist()
        for b in range(B):
            level = [dict(score=scores[b][i] + v, parent=i, token=t, depth=d, node=None)
                     for r, i in enumerate(frontier[b]) for v, t in zip(vals[b][r], toks[b][r])]
            level.sort(key=lambda c: -c["score"])
            frontier[b] = []
            for c in level[: cfg.topk if d < cfg.depth else 0]:
                tree = trees[b]
                tree.tokens.append(c["token"]), tree.parents.append(c["parent"])
                tree.depths.append(d), tree.qs.append(None), scores[b].append(c["score"])
                c["node"] = len(tree.tokens) - 1
                frontier[b].append(c["node"])
            cands[b] += level
    return [rerank(cands[b], roots[b], cfg.num_draft_tokens) for b in range(B)]


# ---------------------------------------------------------------------------------------------
# verification and cache compaction


def batch_tree_mask(trees: List[Tree], lens: torch.Tensor, past: int, dtype):
    """Additive mask (B, 1, N, past + N) and position ids (B, N) of B trees padded to N nodes: node
    i of row b sits at position L_b + depth, sees its row's committed slots, its ancestors and
    itself. A dummy node (beyond a row's tree) sees its row's cache and itself; nothing sees it."""
    dev = lens.device
    B, N = len(trees), max(len(t.tokens) for t in trees)
    parents = torch.full((B, N), -1, dtype=torch.long)
    depths = torch.zeros(B, N, dtype=torch.long)
    for b, t in enumerate(trees):
        parents[b, :len(t.parents)] = torch.tensor(t.parents)
        depths[b, :len(t.depths)] = torch.tensor(t.depths)
    anc = torch.zeros(B, N, N, dtype=torch.bool)  # anc[b, i, j]: j is i or an ancestor of i
    rows = torch.arange(B)
    for i in range(N):  # parents come before children
        p = parents[:, i]
        anc[:, i] = anc[rows, p.clamp(min=0)] & (p >= 0)[:, None]
        anc[:, i, i] = True
    anc = anc.to(dev)
    allowed = torch.cat([_committed(lens, past)[:, None].expand(B, N, past), anc], dim=2)
    return _additive(allowed, dtype), lens[:, None] + depths.to(dev)


def verify_trees(model, cache, trees: List[Tree], lens: torch.Tensor, aux_layers, packs=None):
    """One target pass over every row's tree: logits (B, N, V) fp32, features (B, N, F); `packs` as in `verify`."""
    dev = model.device
    past = cache.get_seq_length()
    mask, pos = batch_tree_mask(trees, lens, past, model.dtype)
    ids = torch.zeros(len(trees), pos.shape[1], dtype=torch.long, device=dev)
    for b, t in enumerate(trees):
        ids[b, :len(t.tokens)] = torch.tensor(t.tokens, device=dev)
    with linears_from(packs or {}), masked_gqa(dev):
        return target_pass(model, ids, cache, aux_layers, pos, mask)


# ---------------------------------------------------------------------------------------------
# the generation loop


def _generators(generator, B: int, device) -> List[torch.Generator]:
    """One generator per row: a list as given, one generator shared by every row, or seeds 0..B-1."""
    if generator is None:
        return [torch.Generator(device=device).manual_seed(b) for b in range(B)]
    if isinstance(generator, torch.Generator):
        return [generator] * B
    if len(generator) != B:
        raise ValueError(f"{len(generator)} generators for {B} prompts: pass one per prompt or a single one")
    return list(generator)


@torch.no_grad()
def batched_speculative_generate(model, head, prompts: Sequence[torch.Tensor], cfg: SpecConfig,
                                 eos_token_id: Optional[int] = None,
                                 generator: Union[None, torch.Generator, Sequence[torch.Generator]] = None,
                                 accept_rule: AcceptRule = rejection_rule):
    """Generate up to cfg.max_new_tokens after each prompt (1-D id tensors of any lengths), all
    rows in one batch. Returns (token lists, stats): stats["rows"][b] has row b's accept_lengths,
    passes and tree_sizes as speculative_generate counts them; stats["steps"] the batched target
    passes, stats["active"] the rows in each, t_draft / t_verify as in speculative_generate.
    Sampling draws row b's randomness from generator[b], so a row's output does not depend on
    the other rows. One prompt goes through speculative_generate (the batch-1 path)."""
    prompts = [p.reshape(-1) for p in prompts]
    B = len(prompts)
    dev = model.device
    gens = _generators(generator, B, dev)
    if B == 1:
        toks, st = speculative_generate(model, head, prompts[0][None], cfg, eos_token_id, gens[0], accept_rule)
        row = {k: st[k] for k in ("accept_lengths", "passes", "tree_sizes")}
        return [toks], {"rows": [row], "steps": st["passes"], "active": [1] * st["passes"],
                        "t_draft": st["t_draft"], "t_verify": st["t_verify"]}
    check_supported(model, max(prompts, key=len)[None], cfg)
    greedy = cfg.temperature == 0
    aux = head_aux_layers(head)
    packs = packed_linears(model, cfg.packed_verify)
    stats = {"rows": [{"accept_lengths": [], "passes": 0, "tree_sizes": []} for _ in range(B)], "steps": 0,
             "active": [], "t_draft": 0.0, "t_verify": 0.0}

    # prefill: right-padded prompts, each row causal over its own tokens
    lens = torch.tensor([len(p) for p in prompts], device=dev)
    P = int(lens.max())
    ids = torch.zeros(B, P, dtype=torch.long, device=dev)
    for b, p in enumerate(prompts):
        ids[b, :len(p)] = p.to(dev)
    causal = torch.ones(P, P, dtype=torch.bool, device=dev).tril()
    mask = _additive(causal[None] & _committed(lens, P)[:, None], model.dtype)
    cache = DynamicCache()
    # logits of each row's last prompt token only: B x V, not B x P x V (as `generate` keeps only the last)
    logits, feats = target_pass(model, ids, cache, aux, torch.arange(P, device=dev).expand(B, P), mask,
                                logits_to_keep=(lens - 1)[:, None])
    tokens, roots, alive = [], [], []
    for b in range(B):
        last = logits[b, 0]
        root = (int(last.argmax()) if greedy
                else sample(target_probs(last, cfg.temperature, cfg.top_p, cfg.top_k), gens[b]))
        toks, done = _finish([root], cfg.max_new_tokens, eos_token_id)
        tokens.append(toks)
        roots.append(root)
        alive.append(not done)
    rows = [b for b in range(B) if alive[b]]  # original row of each batch row
    prompt_ids = [p.tolist() for p in prompts] if cfg.lookup_tokens else None  # what the copy branch reads
    if not rows:
        return tokens, stats
    # the head's linears through packs as in speculative_generate: each drafting pass computes B x 1-8 rows
    with linears_from(packed_linears(head, cfg.packed_verify)):
        t0 = _clock()
        last_out, last_logp, hkv = heads_append(
            head, None, torch.zeros_like(lens),
            [prompts[b][1:].tolist() + [roots[b]] for b in range(B)], [feats[b, :len(prompts[b])] for b in range(B)])
        sel = torch.tensor(rows, device=dev)
        if len(rows) < B:
            index = compact_index(lens[sel], [[] for _ in rows])
            compact_cache(cache, sel, lens[sel], [[] for _ in rows])
            hkv = (compact(hkv[0], sel, index), compact(hkv[1], sel, index))
            last_out, last_logp = last_out[sel], last_logp[sel]
        lens, roots = lens[sel], [roots[b] for b in rows]

        while rows:
            trees = draft_trees(head, hkv, lens, roots, last_out, last_logp, cfg)
            if cfg.lookup_tokens:  # the copy branch, per row from its own prompt and tokens (decoding.graft)
                for j, b in enumerate(rows):
                    graft(trees[j], lookup_draft(prompt_ids[b] + tokens[b], cfg))
            t1 = _clock()
            P = cache.get_seq_length()
            logits, feats = verify_trees(model, cache, trees, lens, aux, packs)
            stats["steps"] += 1
            stats["active"].append(len(rows))
            keep, src, news, paths = [], [], [], []
            for j, b in enumerate(rows):
                tree, n = trees[j], len(trees[j].tokens)
                if greedy:
                    path, bonus = accept_greedy(logits[j, :n], tree)
                else:
                    path, bonus = accept_sample(logits[j, :n], tree, cfg.temperature, cfg.top_p, gens[b], accept_rule,
                                                cfg.top_k)
                new = [tree.tokens[i] for i in path[1:]] + [bonus]
                new, done = _finish(new, cfg.max_new_tokens - len(tokens[b]), eos_token_id)
                st = stats["rows"][b]
                st["passes"] += 1
                st["accept_lengths"].append(len(new) - 1)
                st["tree_sizes"].append(n - 1)
                tokens[b] += new
                if not done:  # a finished row leaves the batch: it is not compacted, updated or drafted again
                    keep.append(j), news.append(new), paths.append(path)
                    src.append([P + i for i in path])
            if keep:
                sel = torch.tensor(keep, device=dev)
                compact_cache(cache, sel, lens[sel], src)
                hkv = (hkv[0].index_select(0, sel)[:, :, :P], hkv[1].index_select(0, sel)[:, :, :P])  # drop drafts
            t2 = _clock()
            stats["t_draft"] += t1 - t0
            stats["t_verify"] += t2 - t1
            t0 = t2
            if not keep:
                break
            lens = lens[sel]
            pf = [feats[j, torch.tensor(path, device=dev)] for j, path in zip(keep, paths)]
            last_out, last_logp, hkv = heads_append(head, hkv, lens, news, pf)
            index = compact_index(lens, [[P + i for i in range(len(new))] for new in news])
            everyone = torch.arange(len(keep), device=dev)
            hkv = (compact(hkv[0], everyone, index), compact(hkv[1], everyone, index))
            lens = lens + torch.tensor([len(p) for p in paths], device=dev)
            rows = [rows[j] for j in keep]
            roots = [new[-1] for new in news]
    return tokens, stats
