"""The training-time-test (TTT) math and the draft loss: a library for eagle_train/train.py.

Alignment (engine convention): at position t the head reads (token_{t+1}, feature_t) and predicts
token_{t+2}, i.e. the target distribution at t+1. Only positions whose predicted token is
loss-masked (assistant) and present count.

Training-time test (EAGLE-3): step s>0 feeds step s-1's own output (pre-norm, H wide) as the
feature at the same position, the input tokens shifted s further, at position id t+s. Its
attention sees the step-0 keys causally plus, at the same position only, the keys of steps
1..s - what the head sees when it drafts s tokens ahead at inference. We never build the
(B, heads, L, L*steps) score matrix: each step scores causally against the step-0 keys (L x L)
and against its own diagonal (one dot product per earlier step, L x s), and takes one softmax over
the concatenation (`ttt_attention`, the reference): memory per step O(L^2 + L*s), linear in steps. On a
CPU, MergedTTTAttention computes the same without the L x L scores: the causal part through the flash
kernel that step 0's SDPA uses, the diagonal keys merged into its softmax through the log-sum-exp.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from eagle_train.draft_vocab import draft_ids_of


def shift(x, k, fill=0):
    """x[:, t + k] at index t (fill past the end); keeps the length."""
    if k == 0:
        return x
    pad = x.new_full((x.shape[0], k, *x.shape[2:]), fill)
    return torch.cat([x[:, k:], pad], dim=1)


def ttt_attention(q, k0, v0, ks, vs, mask=None):
    """q (B, h, n, d); k0/v0 (B, kv, n, d) step-0 keys (causal); ks/vs: keys of steps 1..s at the
    same position (each (B, kv, n, d)). One softmax over [n causal scores | s diagonal scores].
    `mask` (B, 1, m, n) bool, for q at m of the n positions (ttt_unroll's `deep_rows`): the step-0 keys each
    query sees, in place of the causal n x n."""
    rep, scale, n = q.shape[1] // k0.shape[1], q.shape[-1] ** -0.5, k0.shape[2]
    k0, v0 = k0.repeat_interleave(rep, 1), v0.repeat_interleave(rep, 1)
    scores = (q @ k0.transpose(-1, -2)) * scale  # (B, h, n or m, n)
    hide = torch.ones(n, n, dtype=torch.bool, device=q.device).triu(1) if mask is None else ~mask
    scores = scores.masked_fill(hide, float("-inf"))
    diag = torch.stack([(q * k.repeat_interleave(rep, 1)).sum(-1) for k in ks], dim=-1) * scale  # (B, h, n, s)
    acc = torch.promote_types(q.dtype, torch.float32)  # fp32 softmax for bf16, float64 kept float64
    probs = torch.softmax(torch.cat([scores, diag], dim=-1).to(acc), dim=-1).to(q.dtype)
    out = probs[..., :n] @ v0
    for i, v in enumerate(vs):
        out = out + probs[..., n + i, None] * v.repeat_interleave(rep, 1)
    return out


# TTT steps >= 1 take MergedTTTAttention where the CPU flash kernel exists (tests set False to compare with the
# dense reference above)
MERGED = hasattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu")


class MergedTTTAttention(torch.autograd.Function):
    """ttt_attention without the (B, h, n, n) scores: the causal part is the CPU flash kernel (as step 0's SDPA),
    which also gives each row's log-sum-exp, and the s diagonal keys join its softmax through that log-sum-exp:
    out = a_c * o_c + sum_i a_i * v_i with a_c = exp(lse_c - L), a_i = exp(d_i - L), L = logsumexp(lse_c, d_1..d_s).
    Backward: the flash kernel's backward with upstream a_c * grad and the merged `out` (its rowsum(grad * out)
    term is then the merged softmax's), plus the diagonal keys' own terms. Inputs (B, h, n, d), keys and values
    already repeated to q's heads. At phase A's shapes a third of the dense form's time, and a training step 1.19x
    faster (bench/RESULTS.md "## TTT attention through the flash kernel")."""

    @staticmethod
    def forward(ctx, q, k0, v0, mask, *kv):
        s = len(kv) // 2
        ks, vs = kv[:s], kv[s:]
        scale, acc = q.shape[-1] ** -0.5, torch.promote_types(q.dtype, torch.float32)  # fp32 sums for bf16
        oc, lse_k = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k0, v0, 0.0, mask is None,
                                                                               attn_mask=mask)
        lse = lse_k.to(acc)
        d = torch.stack([(q * k).sum(-1) for k in ks], -1).to(acc) * scale  # (B, h, n, s)
        L = torch.logsumexp(torch.cat([lse[..., None], d], -1), -1)
        ac, ai = (lse - L).exp(), (d - L[..., None]).exp()
        out = ac[..., None] * oc.to(acc)
        for i, v in enumerate(vs):
            out = out + ai[..., i, None] * v.to(acc)
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k0, v0, out, lse_k, ac, ai, mask, *kv)
        return out

    @staticmethod
    def backward(ctx, g):
        q, k0, v0, out, lse_k, ac, ai, mask, *kv = ctx.saved_tensors
        s = len(kv) // 2
        ks, vs = kv[:s], kv[s:]
        scale, acc = q.shape[-1] ** -0.5, ac.dtype
        gf = g.to(acc)
        gq, gk0, gv0 = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            (ac[..., None] * gf).to(q.dtype), q, k0, v0, out, lse_k, 0.0, mask is None, attn_mask=mask)
        gq = gq.to(acc)
        D = (gf * out.to(acc)).sum(-1)  # rowsum(grad * out) of the merged softmax
        gks, gvs = [], []
        for i, (k, v) in enumerate(zip(ks, vs)):
            dS = ai[..., i] * ((gf * v.to(acc)).sum(-1) - D) * scale  # (B, h, n)
            gq = gq + dS[..., None] * k.to(acc)
            gks.append((dS[..., None] * q.to(acc)).to(k.dtype))
            gvs.append((ai[..., i, None] * gf).to(v.dtype))
        return (gq.to(q.dtype), gk0, gv0, None, *gks, *gvs)


def merged_ttt_attention(q, k0, v0, ks, vs, mask=None):
    """ttt_attention's arguments and result, through MergedTTTAttention."""
    rep = q.shape[1] // k0.shape[1]
    dt = q.dtype
    kv = [x.to(dt).repeat_interleave(rep, 1) for x in (k0, v0, *ks, *vs)]
    if mask is not None:  # the flash kernel takes an additive mask of q's dtype
        mask = torch.zeros(mask.shape, dtype=dt, device=q.device).masked_fill(~mask, float("-inf"))
    return MergedTTTAttention.apply(q, kv[0], kv[1], mask, *kv[2:])


def soft_ce(logits, p, valid):
    """Sum over valid positions of -sum_v p log softmax(logits), and the count. `p` is dense
    (B, n, Vd), or sparse as (ids, probs) each (B, n, k) (the lean dump's top-k): then
    -sum_k p_k logits[ids_k] + logsumexp(logits) * sum_k p_k, without a dense (B, n, Vd) target."""
    logits = logits.float()
    if isinstance(p, tuple):
        ids, probs = p
        ce = torch.logsumexp(logits, dim=-1) * probs.sum(-1) - (logits.gather(-1, ids) * probs).sum(-1)
    else:
        ce = -(p * torch.log_softmax(logits, dim=-1)).sum(-1)
    return (ce * valid).sum(), valid.sum()


def shift_target(p, k):
    return tuple(shift(x, k) for x in p) if isinstance(p, tuple) else shift(p, k)


def cut(p, n):
    return tuple(x[:, :n] for x in p) if isinstance(p, tuple) else p[:, :n]


LOSS_CHUNK = 512  # rows per chunk: their fp32 logits (16 MB at Vd 8192) stay in the L3 cache (128-2048: within 10%)


class LinearSoftCE(torch.autograd.Function):
    """sum_i w_i * soft CE(h_i @ W^T, p_i) over the rows of h (m, H), chunk by chunk: the (m, Vd) logits never
    exist whole, and their gradient is formed in the same pass that computes the loss (softmax * w P - w p), so
    the lm_head and the cross-entropy read each logit once instead of the three passes of logits -> logsumexp ->
    backward (their fp32 (m, 8192) tensors, not the matmuls, took ~30% of a CPU step). `p`: sparse (ids, probs)
    each (m, k), or dense (m, Vd). Matmuls in `dtype` (autocast's), softmax and loss in fp32. Returns the loss,
    when `argmax` each row's top-1 draft id (for the accuracy), and when `label` (m,) draft ids are given each
    label's rank among its row's logits (0: the head's top-1; for `ttt_mask_topk`)."""

    @staticmethod
    def forward(ctx, h, W, p_ids, p_probs, w, dtype, argmax, label=None):
        grads = ctx.needs_input_grad[0] or ctx.needs_input_grad[1]
        with torch.autocast(h.device.type, enabled=False):
            hc, Wc = h.to(dtype), W.to(dtype)
            loss = torch.zeros((), device=h.device)
            gh = torch.empty_like(hc) if ctx.needs_input_grad[0] else None
            gW = torch.zeros(W.shape, device=W.device) if ctx.needs_input_grad[1] else None
            top = torch.empty(h.shape[0], dtype=torch.long, device=h.device)
            rank = torch.empty(h.shape[0] if label is not None else 0, dtype=torch.long, device=h.device)
            for a in range(0, h.shape[0], LOSS_CHUNK):
                r = slice(a, a + LOSS_CHUNK)
                z = (hc[r] @ Wc.T).float()  # (rows, Vd) logits of this chunk
                pr, wr = p_probs[r].float(), w[r].float()
                P = pr.sum(-1)
                zt = (z.gather(-1, p_ids[r]) * pr).sum(-1) if p_ids is not None else (z * pr).sum(-1)
                if argmax:
                    top[r] = z.argmax(-1)
                if label is not None:
                    rank[r] = (z > z.gather(-1, label[r, None])).sum(-1)
                lse = torch.logsumexp(z, -1)
                loss += (wr * (lse * P - zt)).sum()
                if not grads:
                    continue
                g = z.sub_(lse[:, None]).exp_().mul_((wr * P)[:, None])  # d loss / d z, in place of z
                if p_ids is not None:
                    g.scatter_add_(-1, p_ids[r], -(wr[:, None] * pr))
                else:
                    g.sub_(wr[:, None] * pr)
                g = g.to(dtype)
                if gh is not None:
                    gh[r] = g @ Wc
                if gW is not None:
                    gW += (g.T @ hc[r]).float()
        ctx.save_for_backward(gh, gW)
        ctx.h_dtype, ctx.W_dtype = h.dtype, W.dtype
        ctx.mark_non_differentiable(top, rank)
        return loss, top, rank

    @staticmethod
    def backward(ctx, g_loss, g_top, g_rank):
        gh, gW = ctx.saved_tensors
        return (None if gh is None else (gh * g_loss).to(ctx.h_dtype),
                None if gW is None else (gW * g_loss).to(ctx.W_dtype), None, None, None, None, None, None)


def linear_soft_ce(normed, lm_head, p, valid, weight, argmax=False, label=None):
    """(sum over the valid positions of weight * soft CE of lm_head(normed) against p, their weight sum, each
    one's top-1 draft id or None, the rank of each one's `label` (B, n) draft id or None). normed (B, n, H); p
    sparse (ids, probs) or dense, each (B, n, ...); valid, weight (B, n). Invalid rows (user turns, padding,
    targets outside the draft vocabulary) are dropped before the lm_head: a third of the rows, counting for
    nothing."""
    rows = valid.flatten().nonzero().squeeze(1)
    h, w = normed.flatten(0, 1)[rows], weight.flatten()[rows].float()
    ids, probs = (p[0].flatten(0, 1)[rows], p[1].flatten(0, 1)[rows]) if isinstance(p, tuple) else \
        (None, p.flatten(0, 1)[rows])
    dev = h.device.type
    dtype = torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else lm_head.weight.dtype
    W = lm_head.weight
    if not torch.is_grad_enabled():  # needs_input_grad ignores no_grad: detached, forward forms no gradients
        h, W = h.detach(), W.detach()
    lab = label.flatten()[rows] if label is not None else None
    loss, top, rank = LinearSoftCE.apply(h, W, ids, probs, w, dtype, argmax, lab)
    return loss, w.sum(), top if argmax else None, rank if label is not None else None


def ttt_step_attention(q, k, v, keys: dict, recompute: bool = False, segments=None):
    """One TTT step's attention in one layer. `keys` (empty before step 0, then kept by the caller): step 0 is causal
    over its own keys and stores them; step s >= 1 adds its keys to the diagonal ones and reads the step-0 keys
    causally plus the diagonal keys of steps 1..s (`recompute`: in backward, not kept; see ttt_unroll).
    `segments`: steps >= 1 run at some positions only, packed into one row (1, h, M, d); each (b, rows, mask) says
    which of them belong to sample b and which of its step-0 keys each one sees ((1, 1, m_b, n) bool)."""
    if not keys:
        keys.update(k0=k, v0=v, ks=[], vs=[])
        rep = q.shape[1] // k.shape[1]
        return F.scaled_dot_product_attention(q, k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1),
                                              is_causal=True)
    keys["ks"].append(k), keys["vs"].append(v)
    if segments is None:
        return _ttt_attention(q, keys["k0"], keys["v0"], keys["ks"], keys["vs"], recompute, None)
    # one sample's rows at a time: each attends to its own sample's step-0 keys
    outs = [_ttt_attention(q[:, :, r], keys["k0"][b:b + 1], keys["v0"][b:b + 1], [x[:, :, r] for x in keys["ks"]],
                           [x[:, :, r] for x in keys["vs"]], recompute, mask) for b, r, mask in segments]
    return torch.cat(outs, dim=2) if outs else torch.zeros_like(q)


def _ttt_attention(q, k0, v0, ks, vs, recompute, mask):
    # copies of ks/vs: backward replays these arguments, and the lists grow at the next step
    if recompute and torch.is_grad_enabled():
        return checkpoint(ttt_attention, q, k0, v0, list(ks), list(vs), mask, use_reentrant=False)
    if MERGED and q.device.type == "cpu":
        return merged_ttt_attention(q, k0, v0, ks, vs, mask)
    return ttt_attention(q, k0, v0, ks, vs, mask)


def ttt_unroll(head, ids, aux, steps, recompute: bool = False, project: bool = True, deep_rows=None, rows0=None):
    """Yield (out (B, n, H), logits (B, n, Vd)) of TTT steps 0..steps-1 for n = L-1 positions:
    step s at position t reads (token_{t+1+s}, step s-1's out at t) and predicts token_{t+2+s}.
    `recompute`: steps >= 1 recompute their attention in backward rather than keep its n x n scores.
    `project=False` yields head.norm(out) in place of the logits (the fused loss applies the lm_head).
    `deep_rows` (b, t), two (M,) index tensors ordered by b: steps >= 1 run at those M (sample, position) pairs
    only, packed into one row, and yield (1, M, ...). A position's deeper steps read nothing of another
    position's but step 0's keys, so they are the same as in the full unroll.
    `rows0` (B, n) bool: step 0's o_proj and MLP run at those positions only, and its out is 0 at the others
    (the positions no loss and no deeper step reads: the rest of a position's step 0 is only its keys)."""
    mid = head.midlayer
    attn = mid.self_attn
    hidden = head.fc(aux[:, :-1].to(head.fc.weight.dtype))  # feature_t, t = 0..n-1
    B, n = hidden.shape[:2]
    pos = torch.arange(n, device=ids.device).expand(B, n)
    keys, segments = {}, None
    for s in range(steps):
        tok = shift(ids, 1 + s)[:, :n]
        if s >= 1 and deep_rows is not None:
            bi, ti = deep_rows
            tok = tok[bi, ti][None]
            if s == 1:
                hidden, pos = hidden[bi, ti][None], ti[None]
                ends = torch.bincount(bi, minlength=B).cumsum(0).tolist()
                segments = [(b, slice(a, e), (torch.arange(n, device=ids.device) <= ti[a:e, None])[None, None])
                            for b, (a, e) in enumerate(zip([0] + ends[:-1], ends)) if e > a]
        cos, sin = head.rotary(hidden, pos + s)
        q, k, v = attn.qkv(mid.attn_input(head.embed_tokens(tok).to(hidden.dtype), hidden), cos, sin)
        o = ttt_step_attention(q, k, v, keys, recompute, segments).transpose(1, 2).reshape(*hidden.shape[:2], -1)
        if s == 0 and rows0 is not None:
            at = rows0.nonzero(as_tuple=True)
            out = hidden.new_zeros(hidden.shape).index_put(at, mid.finish(hidden[at], attn.o_proj(o[at])))
        else:
            out = mid.finish(hidden, attn.o_proj(o))
        yield out, head.lm_head(head.norm(out)) if project else head.norm(out)
        hidden = out


class DraftLoss(nn.Module):
    """Wraps the head so DDP/DeepSpeed see one forward: batch -> (loss, stats).

    EAGLE-3: sum over TTT steps s < ttt_steps of ttt_decay**s * soft CE against the target
    distribution. EAGLE-1/2: (feature_weight * smooth-L1 on the next feature + token_weight * CE)
    with uniform input noise of half-width `noise` while training. `feature_scale`: per-dim RMS of
    the aux features; fc trains on aux / feature_scale and the scale is folded back on save.
    `ttt_mask_topk` k > 0: step s >= 1 trains only at the positions where every earlier step ranked the
    target's top-1 within its own top k (train.ttt_mask_topk). While training, `step0_rows` < 1 trains step 0 at a
    random share of its positions (train.step0_rows) and `dropout` drops the target's features (train.dropout)."""

    def __init__(self, head, *, ttt_steps, ttt_decay, feature_weight, token_weight, noise, feature_scale=None,
                 recompute_attention=False, fused=True, ttt_mask_topk=0, ttt_rows=1.0, step0_rows=1.0,
                 dropout=0.0):
        super().__init__()
        # TTT steps >= 1 run only at the positions where one of them trains, and while training at a random
        # `ttt_rows` share of those (train.ttt_rows)
        self.ttt_rows = ttt_rows
        # step 0's loss, while training, at a random `step0_rows` share of its positions (train.step0_rows)
        self.step0_rows = step0_rows
        self.dropout = dropout  # EAGLE-3: dropout on the target's features while training (train.dropout)
        # fused: the lm_head and the loss chunk by chunk on the valid rows (LinearSoftCE); off under ZeRO-3, whose
        # partitioned lm_head weight is gathered only inside the module's own forward
        self.fused = fused
        self.head, self.head_type = head, head.head_type
        self.ttt_steps, self.ttt_decay, self.recompute_attention = ttt_steps, ttt_decay, recompute_attention
        self.ttt_mask_topk = ttt_mask_topk
        self.feature_weight, self.token_weight, self.noise = feature_weight, token_weight, noise
        self.register_buffer("feature_scale", feature_scale, persistent=False)

    def forward(self, b, with_stats=True):
        """(loss, stats); stats (top-1 hits per TTT step) only when asked: logging steps and evals."""
        return self.eagle3(b, with_stats) if self.head_type == "eagle3" else self.eagle1(b)

    def eagle3(self, b, with_stats=True):
        """stats: acc_s, step s's top-1 hits over its valid positions; chain_s (s >= 1), the positions where steps
        0..s all hit: a chain drafted from there accepts depth s."""
        head, steps, k = self.head, self.ttt_steps, self.ttt_mask_topk
        ids, valid_tok, p = b["input_ids"], b["valid"], b["p"]
        aux = b["aux"] / self.feature_scale if self.feature_scale is not None else b["aux"]
        if self.training and self.dropout > 0:
            aux = F.dropout(aux, self.dropout)
        loss, stats = 0.0, {}
        alive = chain = None  # (B, n): every earlier step had the target's top-1 in its top-k / as its top-1
        n = ids.shape[1] - 1
        deep = self.deep_rows(valid_tok, n, steps) if steps > 1 else None
        # step 0's MLP where its loss or a deeper step reads it: a user turn's positions give only their keys (29%
        # of phase A's rows; a 1-step step 1.07x faster, bench/RESULTS.md "## The head's MLP at half width")
        rows0 = shift(valid_tok, 2)[:, :n].bool()
        keep0 = None  # train.step0_rows: the positions where step 0's loss trains
        if self.training and self.step0_rows < 1:
            keep0 = rows0 & (torch.rand(rows0.shape, device=rows0.device) < self.step0_rows)
            rows0 = keep0.clone()
        if deep is not None:
            rows0[deep] = True

        def sub(x):  # (B, n, ...) -> (1, M, ...) at the deep steps' (sample, position) pairs
            return x[deep][None]

        for s, (out, y) in enumerate(ttt_unroll(head, ids, aux, steps, self.recompute_attention, not self.fused,
                                                deep, rows0)):
            # the predicted token t+2+s is real, trained on, and its target top-1 is in the draft vocabulary
            valid = shift(valid_tok, 2 + s)[:, :n]
            weight = shift(b["weight"], 2 + s)[:, :n] if "weight" in b else valid.float()  # train.copy_weight
            if s == 0 and keep0 is not None:
                valid, weight = valid & keep0, weight * keep0
            target, top1 = cut(shift_target(p, 1 + s), n), shift(b["top1"], 1 + s)[:, :n]
            if s >= 1:
                valid, weight, top1 = sub(valid), sub(weight), sub(top1)
                target = tuple(sub(x) for x in target) if isinstance(target, tuple) else sub(target)
                if s == 1:
                    alive = None if alive is None else sub(alive)
                    chain = None if chain is None else sub(chain)
            if alive is not None:  # ttt_mask_topk: depth s is drafted only where its ancestors were
                weight = weight * alive
            # the lm_head sees every valid row when the accuracy is counted (comparable with the mask off), else
            # only the rows that train
            rows = valid if with_stats or alive is None else valid & alive
            label = None
            if k > 0 and s + 1 < steps:  # the target's top-1 as a draft id (valid rows: it is one)
                label = target[0][..., 0] if isinstance(target, tuple) else target.argmax(-1)
            if self.fused:  # y = head.norm(out)
                ce, wsum, top, rank = linear_soft_ce(y, head.lm_head, target, rows, weight, with_stats, label)
            else:  # y = logits
                ce, wsum = soft_ce(y, target, weight)
                top = y.argmax(-1)[rows] if with_stats else None
                rank = (y > y.gather(-1, label[..., None])).sum(-1)[rows] if label is not None else None
            loss = loss + self.ttt_decay ** s * ce / wsum.clamp(min=1)
            if label is not None:
                ok = torch.zeros_like(rows)
                ok[rows] = rank < k
                alive = ok if alive is None else alive & ok
            if with_stats:
                with torch.no_grad():
                    hit = draft_ids_of(head.d2t)[top] == top1[rows]
                    count = rows.sum().float()
                    stats[f"acc_{s}"] = torch.stack([hit.float().sum(), count])
                    if chain is not None:
                        stats[f"chain_{s}"] = torch.stack([(hit & chain[rows]).float().sum(), count])
                    hits = torch.zeros_like(rows)
                    hits[rows] = hit
                    chain = hits if chain is None else chain & hits
        return loss, stats

    def deep_rows(self, valid_tok, n, steps):
        """(b, t) (M,) each: the (sample, position) pairs where some TTT step >= 1 trains, a random `ttt_rows` share
        of them while training; ordered by sample, then position."""
        need = torch.zeros(valid_tok.shape[0], n, dtype=torch.bool, device=valid_tok.device)
        for s in range(1, steps):
            need |= shift(valid_tok, 2 + s)[:, :n].bool()
        if self.training and self.ttt_rows < 1:
            need &= torch.rand(need.shape, device=need.device) < self.ttt_rows
        return need.nonzero(as_tuple=True)

    def eagle1(self, b):
        head = self.head
        ids, valid_tok, last = b["input_ids"], b["valid"], b["last"].to(head.fc.weight.dtype)
        feat, nxt = last[:, :-1], last[:, 1:]
        if self.training and self.noise > 0:
            feat = feat + (torch.rand_like(feat) * 2 - 1) * self.noise
        n = feat.shape[1]
        pos = torch.arange(n, device=ids.device).expand(ids.shape[0], n)
        out, logits, _ = head(ids[:, 1:], feat, pos)
        valid = shift(valid_tok, 2)[:, :n].to(feat.dtype)
        with torch.no_grad():
            p = torch.softmax(head.lm_head(nxt).float(), dim=-1)
        ce, cnt = soft_ce(logits, p, valid)
        l1 = (F.smooth_l1_loss(out.float(), nxt.float(), reduction="none").mean(-1) * valid).sum()
        loss = (self.feature_weight * l1 + self.token_weight * ce) / cnt.clamp(min=1)
        hit = (logits.argmax(-1) == p.argmax(-1)).to(valid.dtype)
        return loss, {"acc_0": torch.stack([(hit * valid).sum().detach(), cnt.detach()])}

