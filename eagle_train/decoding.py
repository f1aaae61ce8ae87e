"""Tree speculative decoding with an EAGLE draft head (EAGLE-1/2/3), greedy and sampled. The
baselines it is measured against (plain `generate`, prompt lookup, `timed`) are in eagle_train.baselines.

One step, as small functions over explicit state:
    draft_tree     the head grows a token tree below the root (the last emitted token)
    tree_mask      each tree node sees the committed cache, its ancestors and itself
    verify         one target forward over the whole tree (4D mask + tree position ids)
    accept_greedy / accept_sample   walk the tree from the root (eagle_train.acceptance, with the
                   target's sampling distribution and the rejection rule)
    commit_cache   keep only the accepted path in the target's KV cache (no re-prefill; eagle_train.kv_cache)
    head_update    re-run the head on the accepted path with the target's true features
    graft          (lookup_tokens > 0) prompt lookup's draft joins the tree as one more branch below the root

Conventions (SGLang names in brackets):
    depth             draft steps = depth of the deepest drafted token  [--speculative-num-steps]
    topk              children per expanded node                        [--speculative-eagle-topk]
    num_draft_tokens  drafted nodes verified per step, root EXCLUDED    [--speculative-num-draft-tokens
                      counts the root: SGLang's value = ours + 1]
    chain             topk 1, `depth` tokens (vLLM --num-speculative-tokens = depth)
    tau               tokens emitted per target pass = mean of (accepted drafted tokens + 1 bonus
                      token), counting only tokens kept after the EOS / budget cut; the prefill
                      pass (which emits the first token and drafts nothing) is not counted

Invariant between steps: the target cache and the head cache both hold the C committed tokens
(positions 0..C-1). The root (position C) is emitted but not yet in the target cache; the head
has already read it as the input id of its pair at position C-1 (pair (token_{t+1}, feature_t)
at position t predicts token_{t+2}), whose output `last_out` / `last_logp` start the next tree.

A drafter is any object with the head interface: `forward(input_ids, hidden, position_ids,
kv_cache, attn_mask) -> (out, logits, (k, v))`, a `config` whose `aux_layers` (EAGLE-3) or its
absence (EAGLE-1: post-norm last hidden state) says which target feature it reads, and an
optional `d2t` buffer mapping draft ids to target ids (draft_id + d2t[draft_id]).
"""

from __future__ import annotations

import contextlib
import os
import time
import weakref
from dataclasses import dataclass, field
from functools import partial
from typing import List, Optional

import torch
from transformers import DynamicCache

from eagle_train.acceptance import AcceptRule, accept_greedy, accept_sample, rejection_rule, sample, target_probs
from eagle_train.features import aux_features
from eagle_train.kv_cache import commit_cache


# the copy branch's settings, named alike in SpecConfig and the recipe's eval section
LOOKUP_KEYS = ("lookup_tokens", "lookup_ngram", "lookup_min_ngram")


@dataclass
class SpecConfig:
    tree: str = "dynamic"  # dynamic (EAGLE-2), chain, static
    topk: int = 4
    depth: int = 4
    num_draft_tokens: int = 8  # root excluded
    static_tree: Optional[List[List[int]]] = None  # paths of child ranks, e.g. [[0], [1], [0, 0]]
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0  # 0: off
    max_new_tokens: int = 256
    # verify and draft through oneDNN's prepacked fp32 linears (`packed_linears`): auto = float32 on a CPU
    packed_verify: str = "auto"
    # copy branch: up to this many tokens that followed the latest earlier occurrence of the context's last
    # n-gram (n from lookup_ngram down to lookup_min_ngram) join the head's tree below the root (0: off)
    lookup_tokens: int = 0
    lookup_ngram: int = 3
    lookup_min_ngram: int = 2

    @classmethod
    def from_eval(cls, ecfg, temperature: float = 0.0, **over) -> "SpecConfig":
        """From the recipe's `eval` section (plus overrides such as a sweep's topk/depth)."""
        kw = dict(tree=ecfg.tree, topk=ecfg.topk, depth=ecfg.depth, num_draft_tokens=ecfg.num_draft_tokens,
                  static_tree=[list(p) for p in ecfg.static_tree] if ecfg.static_tree else None,
                  temperature=float(temperature), top_p=ecfg.top_p, top_k=ecfg.top_k,
                  max_new_tokens=ecfg.max_new_tokens, packed_verify=getattr(ecfg, "packed_verify", "auto"))
        kw.update({k: getattr(ecfg, k) for k in LOOKUP_KEYS if hasattr(ecfg, k)})  # else SpecConfig's defaults
        kw.update(over)
        return cls(**kw)


@dataclass
class Tree:
    """Node 0 is the root. tokens are target ids; parents[i] < i; qs[i] is the distribution
    (target vocabulary) node i was drawn from (None: deterministic top-k, i.e. one-hot)."""
    tokens: List[int]
    parents: List[int]
    depths: List[int]
    qs: List[Optional[torch.Tensor]] = field(default_factory=list)

    def children(self) -> List[List[int]]:
        kids = [[] for _ in self.tokens]
        for i, p in enumerate(self.parents[1:], start=1):
            kids[p].append(i)
        return kids

    def ancestors(self, i: int) -> List[int]:
        out = []
        while i >= 0:
            out.append(i)
            i = self.parents[i]
        return out[::-1]



# ---------------------------------------------------------------------------------------------
# drafting


def head_dtype(head) -> torch.dtype:
    p = next(iter(head.parameters()), None) if hasattr(head, "parameters") else None
    return p.dtype if p is not None else torch.float32


def head_aux_layers(head) -> Optional[List[int]]:
    """EAGLE-3 heads read cat(hidden_states[i] for i in aux_layers); EAGLE-1 the last hidden state."""
    aux = getattr(head.config, "aux_layers", None)
    return list(aux) if aux else None


def to_target_ids(head, draft_ids: torch.Tensor) -> torch.Tensor:
    d2t = getattr(head, "d2t", None)
    return draft_ids if d2t is None else draft_ids + d2t[draft_ids]


def static_paths(cfg: SpecConfig) -> List[List[int]]:
    """Tree shape of the chain and static modes as paths of child ranks (parents before children)."""
    if cfg.tree == "chain":
        return [[0] * d for d in range(1, cfg.depth + 1)]
    paths = sorted({tuple(p) for p in cfg.static_tree}, key=lambda p: (len(p), p))
    have = set(paths)
    for p in paths:
        if len(p) > 1 and p[:-1] not in have:
            raise ValueError(f"eval.static_tree: path {list(p)} has no parent path {list(p[:-1])} in the tree")
    return [list(p) for p in paths]


def max_tree_nodes(cfg: SpecConfig) -> int:
    """The most drafted nodes (root excluded) a step can verify: a chain or static tree has its own
    size; the EAGLE-2 dynamic tree draws topk children at depth 1 and topk * topk at each later
    depth, and `num_draft_tokens` keeps at most that many (SGLang reranks the same candidate set).
    The sweep grid and the model card's serving flags both use this one function."""
    if cfg.tree == "chain":
        return cfg.depth
    if cfg.tree == "static":
        return len(static_paths(cfg))
    return min(cfg.num_draft_tokens, cfg.topk + (cfg.depth - 1) * cfg.topk * cfg.topk)


def _head_step(head, hkv, C, outs, slots, nodes, tree):
    """Feed drafted `nodes` to the head in one pass. Node i's input is (its token, the head output
    of its parent) at position C + depth - 1; it sees the committed cache, its ancestors' draft
    entries and itself. Returns (outs (m, H), logp (m, Vd), new cache); records each node's slot."""
    k0 = hkv[0].shape[2]  # C + draft entries so far
    m = len(nodes)
    dev = hkv[0].device
    mask = torch.zeros(1, 1, m, k0 + m, dtype=torch.bool, device=dev)
    mask[..., :C] = True
    for r, i in enumerate(nodes):
        for a in tree.ancestors(i)[1:-1]:  # drafted ancestors (the root has no draft entry)
            mask[0, 0, r, slots[a]] = True
        mask[0, 0, r, k0 + r] = True
    ids = torch.tensor([[tree.tokens[i] for i in nodes]], device=dev)
    hidden = torch.stack([outs[tree.parents[i]] for i in nodes])[None]
    pos = torch.tensor([[C + tree.depths[i] - 1 for i in nodes]], device=dev)
    out, logits, hkv = head(ids, hidden, pos, kv_cache=hkv, attn_mask=mask)
    for r, i in enumerate(nodes):
        slots[i] = k0 + r
        outs[i] = out[0, r]
    return torch.log_softmax(logits[0].float(), dim=-1), hkv


@torch.no_grad()
def draft_tree(head, hkv, C: int, root: int, last_out: torch.Tensor, last_logp: torch.Tensor,
               cfg: SpecConfig) -> Tree:
    """Grow the draft tree below `root`. last_out (H,) / last_logp (Vd,) come from the head's pair
    at position C-1. The head's draft entries are appended to a copy of its cache and dropped."""
    tree = Tree([root], [-1], [0], [None])
    outs, slots, scores = {0: last_out}, {}, [0.0]
    logps = {0: last_logp}
    if cfg.tree in ("chain", "static"):
        paths = static_paths(cfg)
        index = {(): 0}
        for d in range(1, max(len(p) for p in paths) + 1):
            level = [p for p in paths if len(p) == d]
            parents = sorted({index[tuple(p[:-1])] for p in level})
            need = [i for i in parents if i not in logps]
            if need:
                lp, hkv = _head_step(head, hkv, C, outs, slots, need, tree)
                logps.update({i: lp[r] for r, i in enumerate(need)})
            for p in level:
                par = index[tuple(p[:-1])]
                lp = logps[par]
                did = lp.topk(p[-1] + 1).indices[-1]
                tree.tokens.append(int(to_target_ids(head, did)))
                tree.parents.append(par)
                tree.depths.append(d)
                tree.qs.append(None)
                index[tuple(p)] = len(tree.tokens) - 1
        return tree
    # EAGLE-2 dynamic tree: each depth expands the topk children of every frontier node, scored by
    # cumulative draft log-prob; the topk best of those children form the next frontier (fed to the
    # head), and every generated child is a candidate for the final rerank.
    cands = []  # dicts: score, parent (work-tree node), token, depth, node (work-tree index or None)
    frontier = [0]
    for d in range(1, cfg.depth + 1):
        if d > 1:
            lp, hkv = _head_step(head, hkv, C, outs, slots, frontier, tree)
            logps = {i: lp[r] for r, i in enumerate(frontier)}
        level = []
        for i in frontier:
            top = logps[i].topk(min(cfg.topk, logps[i].numel()))
            tok = to_target_ids(head, top.indices).tolist()
            level += [dict(score=scores[i] + v, parent=i, token=t, depth=d, node=None)
                      for v, t in zip(top.values.tolist(), tok)]
        level.sort(key=lambda c: -c["score"])
        frontier = []
        for c in level[: cfg.topk if d < cfg.depth else 0]:
            tree.tokens.append(c["token"]), tree.parents.append(c["parent"])
            tree.depths.append(d), tree.qs.append(None), scores.append(c["score"])
            c["node"] = len(tree.tokens) - 1
            frontier.append(c["node"])
        cands += level
    return rerank(cands, root, cfg.num_draft_tokens)


def rerank(cands: List[dict], root: int, n_keep: int) -> Tree:
    """Keep the n_keep best candidates by cumulative log-prob, ancestors included. A child's score
    never exceeds its parent's, so ordering by (-score, depth) lists ancestors first and every
    prefix is closed under ancestors; the parent check only guards against surprises."""
    order = sorted(range(len(cands)), key=lambda j: (-cands[j]["score"], cands[j]["depth"], j))
    keep, kept_nodes = [], {0}
    for j in order:
        if len(keep) == n_keep:
            break
        if cands[j]["parent"] in kept_nodes:
            keep.append(j)
            if cands[j]["node"] is not None:
                kept_nodes.add(cands[j]["node"])
    keep.sort(key=lambda j: (cands[j]["depth"], -cands[j]["score"], j))  # parents before children
    out, index = Tree([root], [-1], [0], [None]), {0: 0}
    for j in keep:
        c = cands[j]
        out.tokens.append(c["token"]), out.parents.append(index[c["parent"]])
        out.depths.append(c["depth"]), out.qs.append(None)
        if c["node"] is not None:
            index[c["node"]] = len(out.tokens) - 1
    return out


def lookup_draft(context: List[int], cfg: SpecConfig) -> List[int]:
    """Prompt lookup's draft: the lookup_tokens tokens that followed the latest earlier occurrence of the context's
    last n tokens, for the longest n from lookup_ngram down to lookup_min_ngram that occurs; [] if none. A copy that
    reaches the context's end goes on from its own start, as text repeating with that period would: a loop shorter
    than lookup_tokens (SmolLM2-135M writes them) still gets a full draft."""
    L = len(context)
    for n in range(min(cfg.lookup_ngram, L - 1), max(1, cfg.lookup_min_ngram) - 1, -1):
        tail = context[L - n:]
        for i in range(L - n - 1, -1, -1):  # latest first: the nearest copy source is the likeliest
            if context[i] == tail[0] and context[i:i + n] == tail:
                draft = context[i + n:i + n + cfg.lookup_tokens]
                period = L - n - i
                while len(draft) < cfg.lookup_tokens:
                    draft.append(draft[len(draft) - period])
                return draft
    return []


def graft(tree: Tree, chain: List[int]) -> List[int]:
    """Put `chain` below the root: follow the nodes it matches, append the rest as new nodes (deterministic, qs None:
    greedy and the rejection rule stay exact for any set of distinct deterministic siblings). Why: the head cannot
    draft a token outside its draft vocabulary or copy a name from the prompt well (bench/RESULTS.md "## Why
    summarization trails"); prompt lookup can. Returns the indices of the added nodes."""
    kids = tree.children()
    node, added = 0, []
    for t in chain:
        nxt = None if added else next((c for c in kids[node] if tree.tokens[c] == t), None)
        if nxt is None:
            tree.tokens.append(t), tree.parents.append(node), tree.depths.append(tree.depths[node] + 1)
            tree.qs.append(None)
            nxt = len(tree.tokens) - 1
            added.append(nxt)
        node = nxt
    return added


# ---------------------------------------------------------------------------------------------
# verification and acceptance


def tree_mask(parents: List[int], depths: List[int], past_len: int, dtype=torch.float32, device="cpu"):
    """Additive attention mask (1, 1, n, past_len + n) and position ids (1, n) of a tree whose
    nodes sit at position past_len + depth: each node sees the whole cache, its ancestors, itself."""
    n = len(parents)
    allowed = torch.zeros(n, past_len + n, dtype=torch.bool)
    allowed[:, :past_len] = True
    for i in range(n):
        j = i
        while j >= 0:
            allowed[i, past_len + j] = True
            j = parents[j]
    mask = torch.zeros(n, past_len + n, dtype=dtype).masked_fill_(~allowed, torch.finfo(dtype).min)
    pos = torch.tensor(depths, dtype=torch.long) + past_len
    return mask[None, None].to(device), pos[None].to(device)


def target_forward(model, input_ids, cache, aux_layers, position_ids=None, attention_mask=None, logits_to_keep=0):
    """Target logits (n, V) fp32 (the last `logits_to_keep` only, when > 0: a prefill needs one row, as in
    `generate`) and the head's features (n, F) for each input token."""
    out = model(input_ids=input_ids, position_ids=position_ids, attention_mask=attention_mask,
                cache=cache, use_cache=True, output_hidden_states=True, logits_to_keep=logits_to_keep)
    hs = out.hidden_states
    feats = aux_features(hs, aux_layers) if aux_layers else hs[-1]
    return out.logits[0].float(), feats[0]


def verify(model, cache, tree: Tree, past_len: int, aux_layers, packs=None):
    """The target's pass over the tree; `packs` (packed_linears) computes its linear layers through them."""
    dev = model.device
    mask, pos = tree_mask(tree.parents, tree.depths, past_len, model.dtype, dev)
    ids = torch.tensor([tree.tokens], device=dev)
    with linears_from(packs or {}), masked_gqa(dev):
        return target_forward(model, ids, cache, aux_layers, pos, mask)


@contextlib.contextmanager
def masked_gqa(device):
    """Inside, on a CPU: grouped-query attention under a mask (a tree pass) runs as SDPA's `enable_gqa` instead of
    transformers' default there, `repeat_kv`, which copies every layer's cached keys and values n_heads/n_kv_heads
    times a pass (CPU flash attention takes the mask with enable_gqa, the same output bit for bit). One-token steps
    (`generate`) never copy. Elsewhere (CUDA) enable_gqa under a mask falls back to the math kernel, so left as is.
    Why: a 9-token SmolLM2 pass 74.7 -> 70.2 ms on an AVX2 CPU (bench/RESULTS.md "## Tree verification without
    repeat_kv")."""
    key = "TRANSFORMERS_SDPA_FORCE_GQA"
    if torch.device(device).type != "cpu" or os.environ.get(key) is not None:
        yield
        return
    os.environ[key] = "1"
    try:
        yield
    finally:
        del os.environ[key]


def packed_linears(model, mode: str = "auto") -> dict:
    """{nn.Linear of `model` (the target or the head): its weight prepacked for oneDNN's fp32 GEMM}, made once per
    model (`_PACKED`, remade if a weight changed in place); {} where it does not apply (mode off; auto: not float32
    on a CPU). Why: in fp32 MKL leaves its GEMV path at two rows, so a tree pass of 4-8 tokens cost 2.1-2.4x a
    one-token pass on an AVX2 CPU; through prepacked weights ~1.0x, and the head's drafting (1-8 rows a step) 41%
    less time (bench/RESULTS.md "## A CPU without native bf16", "## Packed verification end to end"). Costs a
    second copy of the linear weights; logits within ~1e-4 of MKL's (a tree pass already rounds unlike a one-token
    pass)."""
    p = next(iter(model.parameters()), None) if hasattr(model, "parameters") else None
    on = p is not None and (mode == "on" or (mode == "auto" and p.device.type == "cpu" and p.dtype == torch.float32))
    if not on or not torch.backends.mkldnn.is_available() or not hasattr(torch.ops.mkldnn, "_reorder_linear_weight"):
        return {}
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    version = [m.weight._version for m in linears]
    packs, made_at = _PACKED.get(model, (None, None))
    if packs is None or made_at != version:
        packs = {m: torch.ops.mkldnn._reorder_linear_weight(m.weight.detach(), None) for m in linears}
        _PACKED[model] = (packs, version)
    return packs


# model -> its packed linears, beside the model rather than on it: a copy.deepcopy of the model (a bf16 twin) cannot
# copy oneDNN's opaque tensors
_PACKED = weakref.WeakKeyDictionary()


def _packed_linear(m, w, x):
    y = torch.ops.mkldnn._linear_pointwise(x.reshape(-1, x.shape[-1]), w, m.bias, "none", [], "")
    return y.view(*x.shape[:-1], y.shape[-1])


@contextlib.contextmanager
def linears_from(packs: dict):
    """Inside: each Linear in `packs` computes through its packed weight; outside (generate, the prefill) as before."""
    for m, w in packs.items():
        m.forward = partial(_packed_linear, m, w)
    try:
        yield
    finally:
        for m in packs:
            del m.forward



def head_update(head, hkv, C: int, ids: List[int], feats: torch.Tensor):
    """Pairs (ids[j], feats[j]) at positions C..C+n-1 (causal, committed cache visible).
    Returns (last_out (H,), last_logp (Vd,), cache)."""
    dev = feats.device
    pos = torch.arange(C, C + len(ids), device=dev)[None]
    out, logits, hkv = head(torch.tensor([ids], device=dev), feats[None].to(head_dtype(head)), pos,
                            kv_cache=hkv, attn_mask=None)
    return out[0, -1], torch.log_softmax(logits[0, -1].float(), dim=-1), hkv


def teacher_forced_drafts(head, ids: torch.Tensor, feats: torch.Tensor) -> torch.Tensor:
    """The head's top-1 draft (target ids) at every position of a known text ids (1, L) whose target
    features (L, F) come from one `target_forward`, all pairs read at once as training reads them:
    out[t] guesses token t + 2. A chain of 1 accepts exactly these (tests/test_decoding.py)."""
    n = ids.shape[1] - 1
    _, logits, _ = head(ids[:, 1:], feats[None, :-1].to(head_dtype(head)), torch.arange(n, device=ids.device)[None])
    return to_target_ids(head, logits[0].argmax(-1))


# ---------------------------------------------------------------------------------------------
# generation loops


ATTENTION_OK = ("sdpa", "eager")  # kernels that honour an arbitrary 4D (tree) mask


def sliding_window(config) -> Optional[int]:
    """The target's attention window when some layer slides, else None."""
    window = getattr(config, "sliding_window", None)
    if "sliding_attention" in (getattr(config, "layer_types", None) or []):
        return window
    return window if window and getattr(config, "use_sliding_window", True) else None


def check_supported(model, input_ids: torch.Tensor, cfg: SpecConfig) -> None:
    """Refuse set-ups that would decode silently wrong: a batch (only row 0 would be decoded), a
    flash kernel (ignores the tree mask) and a sliding window the sequence can outgrow (the
    tree mask and `commit_cache` assume every position stays visible)."""
    if input_ids.dim() != 2 or input_ids.shape[0] != 1:
        raise ValueError(f"speculative decoding takes one sequence at a time (input_ids of shape (1, L)), got "
                         f"{tuple(input_ids.shape)}; for a batch use eagle_train.batch_decoding.batched_speculative_generate")
    impl = getattr(model.config, "_attn_implementation", None) or "eager"
    if impl not in ATTENTION_OK:
        raise ValueError(f"target attn_implementation = {impl!r} ignores the tree attention mask; load the target "
                         f"with one of {', '.join(ATTENTION_OK)} (target.attn_implementation=sdpa)")
    window = sliding_window(model.config)
    need = input_ids.shape[-1] + cfg.max_new_tokens + max_tree_nodes(cfg) + cfg.lookup_tokens + 1
    if window is not None and need > window:
        raise ValueError(f"the target uses sliding-window attention (window {window}) and this generation can reach "
                         f"{need} positions; tree verification assumes full attention and is not supported past "
                         f"the window: lower the prompt length or eval.max_new_tokens")


def _finish(new: List[int], budget: int, eos: Optional[int]):
    """Truncate at EOS (kept, like generate) and at the token budget; returns (tokens, done)."""
    if eos is not None and eos in new:
        return new[: new.index(eos) + 1][:budget], True
    return new[:budget], len(new) >= budget


@torch.no_grad()
def speculative_generate(model, head, input_ids: torch.Tensor, cfg: SpecConfig,
                         eos_token_id: Optional[int] = None, generator: Optional[torch.Generator] = None,
                         accept_rule: AcceptRule = rejection_rule):
    """Generate up to cfg.max_new_tokens after input_ids (1, L). Returns (new token ids, stats) with
    stats = {accept_lengths: tokens kept from each target pass minus 1 (accepted drafted tokens;
    a pass cut by EOS or the budget counts only what it kept), passes, tree_sizes, t_draft (head:
    drafting and updating on the accepted path), t_verify (target tree pass, acceptance, cache), lookup_accepted
    (accepted tokens drafted only by the copy branch, cfg.lookup_tokens)}."""
    check_supported(model, input_ids, cfg)
    dev = model.device
    greedy = cfg.temperature == 0
    if generator is None:
        generator = torch.Generator(device=dev).manual_seed(0)
    aux = head_aux_layers(head)
    packs = packed_linears(model, cfg.packed_verify)
    cache = DynamicCache()
    ids = input_ids.to(dev)
    logits, feats = target_forward(model, ids, cache, aux, logits_to_keep=1)
    root = (int(logits[-1].argmax()) if greedy
            else sample(target_probs(logits[-1], cfg.temperature, cfg.top_p, cfg.top_k), generator))
    tokens, done = _finish([root], cfg.max_new_tokens, eos_token_id)
    stats = {"accept_lengths": [], "passes": 0, "tree_sizes": [], "t_draft": 0.0, "t_verify": 0.0,
             "lookup_accepted": 0}
    if done:
        return tokens, stats
    context = ids[0].tolist() + tokens  # what prompt lookup copies from (cfg.lookup_tokens)
    C = ids.shape[1]
    t0 = _clock()
    # the head's linears through packs too: a drafting step computes 1-8 rows (41% less drafting time in fp32);
    # both models' packs go in once for the whole loop (swapping 211 SmolLM2 layers in and out costs 0.6 ms a pass)
    with linears_from({**packed_linears(head, cfg.packed_verify), **packs}), masked_gqa(dev):
        last_out, last_logp, hkv = head_update(head, None, 0, ids[0, 1:].tolist() + [root], feats)
        while True:
            tree = draft_tree(head, hkv, C, root, last_out, last_logp, cfg)
            copied = set(graft(tree, lookup_draft(context, cfg))) if cfg.lookup_tokens else set()
            t1 = _clock()
            logits, feats = verify(model, cache, tree, C, aux)  # the packs are in already
            if greedy:
                path, bonus = accept_greedy(logits, tree)
            else:
                path, bonus = accept_sample(logits, tree, cfg.temperature, cfg.top_p, generator, accept_rule,
                                            cfg.top_k)
            new = [tree.tokens[i] for i in path[1:]] + [bonus]
            new, done = _finish(new, cfg.max_new_tokens - len(tokens), eos_token_id)
            # tau counts what the user gets: tokens cut at EOS / the budget were not accepted
            stats["passes"] += 1
            stats["accept_lengths"].append(len(new) - 1)
            stats["tree_sizes"].append(len(tree.tokens) - 1)
            stats["lookup_accepted"] += len(copied.intersection(path[1:len(new)]))
            tokens += new
            context += new
            if done:
                stats["t_draft"] += t1 - t0
                stats["t_verify"] += _clock() - t1
                return tokens, stats
            keep = torch.tensor(path, device=dev)
            commit_cache(cache, C, keep)
            hkv = (hkv[0][:, :, :C], hkv[1][:, :, :C])
            t2 = _clock()
            stats["t_draft"] += t1 - t0
            stats["t_verify"] += t2 - t1
            t0 = t2
            last_out, last_logp, hkv = head_update(head, hkv, C, new, feats[keep])
            C += len(path)
            root = bonus


def _clock() -> float:
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return time.perf_counter()
