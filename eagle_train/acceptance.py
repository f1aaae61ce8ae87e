"""The acceptance rules of tree speculative decoding: the target's sampling distribution, the
rejection rule that keeps sampled output distributed exactly as the target's, and the walks
down a verified tree (greedy and sampled) that pick the accepted path and the bonus token."""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Optional

import torch

if TYPE_CHECKING:  # the walks only call Tree's methods; a runtime import would be a cycle
    from eagle_train.decoding import Tree


def target_probs(logits: torch.Tensor, temperature: float, top_p: float = 1.0, top_k: int = 0) -> torch.Tensor:
    """softmax(logits / T), restricted to the top_k tokens, then to the top-p nucleus of what is
    left, renormalised: the order of transformers' temperature -> top-k -> top-p warpers, so the
    speculative sampler draws from the same p as `generate(do_sample=True)`."""
    logits = logits.float() / temperature
    if 0 < top_k < logits.shape[-1]:
        kth = logits.topk(top_k).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    p = torch.softmax(logits, dim=-1)
    if top_p < 1.0:
        sp, idx = p.sort(descending=True)
        drop = sp.cumsum(-1) - sp >= top_p  # keep the smallest prefix whose mass reaches top_p
        sp[drop] = 0
        p = torch.zeros_like(p).scatter_(-1, idx, sp)
        p = p / p.sum()
    return p


def sample(p: torch.Tensor, generator: torch.Generator) -> int:
    return int(torch.multinomial(p, 1, generator=generator))


def rejection_rule(p: torch.Tensor, q: Optional[torch.Tensor], x: int, generator: torch.Generator):
    """Multi-candidate speculative sampling (SpecInfer; EAGLE's evaluate_posterior), one candidate.

    x was drawn from q. Accept with probability min(1, p(x) / q(x)). On reject the next target
    is the residual p' = norm(max(0, p - q)), which the next sibling is tested against (its own q
    given by the drafter; for candidates sampled without replacement that q is the previous one
    with x removed and renormalised). If every sibling is rejected the token is sampled from the
    final residual, so the emitted token is distributed exactly as p.
    Our trees pick children deterministically (top-k), so q is one-hot on x (EAGLE's `qx = 1`):
    accept with probability p(x); on reject p' = p with x removed, renormalised. Using the
    draft softmax as q for top-k children would be biased.
    Returns (accepted, p for the next sibling)."""
    px = float(p[x])
    qx = 1.0 if q is None else float(q[x])
    u = float(torch.rand((), generator=generator, device=generator.device))
    if u * qx < px:
        return True, p
    if q is None:
        r = p.clone()
        r[x] = 0
    else:
        r = (p - q).clamp_min(0)
    s = r.sum()
    return False, (r / s if s > 0 else p)


AcceptRule = Callable[[torch.Tensor, Optional[torch.Tensor], int, torch.Generator], tuple]


def accept_greedy(logits: torch.Tensor, tree: Tree):
    """Follow the child equal to the target's argmax; returns (accepted path incl. root, bonus)."""
    kids = tree.children()
    best = logits.argmax(-1).tolist()
    path = [0]
    while True:
        nxt = [c for c in kids[path[-1]] if tree.tokens[c] == best[path[-1]]]
        if not nxt:
            return path, best[path[-1]]
        path.append(nxt[0])


def accept_sample(logits: torch.Tensor, tree: Tree, temperature: float, top_p: float,
                  generator: torch.Generator, rule: AcceptRule = rejection_rule, top_k: int = 0):
    """At each node test its children in order with `rule` against the target's p (temperature,
    top-k and top-p applied); the first accepted child becomes the node; if all are rejected the
    bonus token is drawn from the residual."""
    kids = tree.children()
    path = [0]
    while True:
        p = target_probs(logits[path[-1]], temperature, top_p, top_k)
        for c in kids[path[-1]]:
            ok, p = rule(p, tree.qs[c], tree.tokens[c], generator)
            if ok:
                path.append(c)
                break
        else:
            return path, sample(p, generator)
