"""Speculative sampling must reproduce the target's distribution exactly (chi-square on the joint
of the first 3 sampled tokens of a tiny small-vocabulary target) with top-p and with top-k, and
both a grossly and a subtly wrong acceptance rule must fail the same test."""

from __future__ import annotations

import dataclasses
import itertools

import pytest
import torch
from scipy.stats import chisquare

from conftest import make_tiny_llama
from eagle_train.acceptance import rejection_rule, target_probs
from eagle_train.decoding import SpecConfig, speculative_generate
from eagle_train.eagle3 import Eagle3Config, Eagle3Head

V, N = 4, 400  # 64 joint cells; the gross wrong rule below fails with p ~ 1e-9 at this N
N_SUBTLE = 3200  # the subtle one shifts a few cells by a few percent: it needs more samples
PROMPT = torch.tensor([[1, 3, 0, 2]])
TEMPERATURE, TOP_P = 1.0, 0.95
SAMPLERS = {"top_p": dict(temperature=1.0, top_p=0.95, top_k=0), "top_k": dict(temperature=0.8, top_p=1.0, top_k=2)}


@pytest.fixture(scope="module")
def setup():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny ops: extra threads only contend
    target = make_tiny_llama(vocab_size=V, layers=2, hidden=32, seed=0)
    target.lm_head.weight.data *= 8  # a peaked but not degenerate next-token distribution
    torch.manual_seed(1)
    # embeddings, layer 1, post-norm output: no engine reads [0, 1, 2], but the rule under test holds for any head
    head = Eagle3Head(dataclasses.replace(Eagle3Config.from_target(target.config, V), aux_layers=[0, 1, 2])).eval()
    head.load_target_embeddings(target)
    yield target, head
    torch.set_num_threads(threads)


def exact_joint(target, temperature=TEMPERATURE, top_p=TOP_P, top_k=0):
    """p(t1, t2, t3) for all V^3 continuations, with the same temperature / top-k / top-p as the sampler."""
    probs = {}
    with torch.no_grad():
        for prefix in itertools.chain([()], itertools.product(range(V), repeat=1), itertools.product(range(V), repeat=2)):
            ids = torch.cat([PROMPT, torch.tensor([prefix], dtype=torch.long).view(1, -1)], dim=1)
            probs[prefix] = target_probs(target(ids).logits[0, -1], temperature, top_p, top_k)
    joint = torch.zeros(V, V, V)
    for a, b, c in itertools.product(range(V), repeat=3):
        joint[a, b, c] = probs[()][a] * probs[(a,)][b] * probs[(a, b)][c]
    return joint.flatten()


def sampled_counts(target, head, rule, seed=0, n=N, temperature=TEMPERATURE, top_p=TOP_P, top_k=0, stats=None,
                   **spec):
    cfg = SpecConfig(tree="dynamic", topk=2, depth=2, num_draft_tokens=3, temperature=temperature,
                     top_p=top_p, top_k=top_k, max_new_tokens=3, **spec)
    gen = torch.Generator().manual_seed(seed)
    counts = torch.zeros(V ** 3)
    for _ in range(n):
        toks, st = speculative_generate(target, head, PROMPT, cfg, generator=gen, accept_rule=rule)
        a, b, c = toks
        counts[(a * V + b) * V + c] += 1
        if stats is not None:
            stats.append(st)
    return counts


def chi2_pvalue(counts, joint):
    """Pool cells whose expected count is < 5 into one bin, then chi-square."""
    expected = joint * counts.sum()
    small = expected < 5
    obs = torch.cat([counts[~small], counts[small].sum().view(1)])
    exp = torch.cat([expected[~small], expected[small].sum().view(1)])
    keep = exp > 0
    obs, exp = obs[keep].double(), exp[keep].double()
    assert obs.sum() == exp.sum().round(), "sampled tokens outside the top-k / top-p support"
    return chisquare(obs.numpy(), exp.numpy() * obs.sum().item() / exp.sum().item()).pvalue


def wrong_rule(p, q, x, generator):
    """Classic bug: on reject keep sampling from p instead of the residual (x not removed)."""
    ok, _ = rejection_rule(p, q, x, generator)
    return ok, p


def soft_q_rule(p, q, x, generator):
    """Subtle bug: the child was picked deterministically (top-k, so q is one-hot on x) but the
    rule accepts with min(1, p(x) / q(x)) for a soft q(x) = 0.9, as if a confident draft had
    sampled x; the residual is the right one. It accepts ~11% too often: N = 400 samples miss it
    (p ~ 0.5), N_SUBTLE catch it."""
    u = float(torch.rand((), generator=generator))
    if u * 0.9 < float(p[x]):
        return True, p
    r = p.clone()
    r[x] = 0
    return False, r / r.sum()


@pytest.mark.parametrize("sampler", list(SAMPLERS))
def test_speculative_sampling_matches_target(setup, sampler):
    target, head = setup
    kw = SAMPLERS[sampler]
    joint = exact_joint(target, **kw)
    assert chi2_pvalue(sampled_counts(target, head, rejection_rule, **kw), joint) > 0.01
    assert chi2_pvalue(sampled_counts(target, head, wrong_rule, **kw), joint) < 1e-5


def test_copy_branch_keeps_the_target_distribution(setup):
    """eval.lookup_tokens: prompt lookup's tokens join the tree as deterministic siblings; sampled output stays
    distributed as p, and the branch did get accepted (a vocabulary of 4 repeats its 1-grams all the time)."""
    target, head = setup
    joint = exact_joint(target)
    stats = []
    counts = sampled_counts(target, head, rejection_rule, seed=2, stats=stats, lookup_tokens=2, lookup_min_ngram=1)
    assert chi2_pvalue(counts, joint) > 0.01
    assert sum(s["lookup_accepted"] for s in stats) > N // 10


def test_subtly_wrong_rule_fails(setup):
    """Enough samples that a rule accepting a little too often is caught, while the right rule,
    on the same seed and sample count, passes."""
    target, head = setup
    joint = exact_joint(target)
    assert chi2_pvalue(sampled_counts(target, head, rejection_rule, seed=1, n=N_SUBTLE), joint) > 0.01
    assert chi2_pvalue(sampled_counts(target, head, soft_q_rule, seed=1, n=N_SUBTLE), joint) < 1e-4


def test_top_k_top_p_match_transformers_warpers():
    """target_probs applies temperature, then top-k, then top-p on what is left, like generate."""
    from transformers import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

    torch.manual_seed(0)
    logits = torch.randn(50) * 3
    for t, k, top_p in [(0.7, 5, 1.0), (1.0, 10, 0.8), (1.3, 0, 0.9), (0.5, 3, 0.5)]:
        x = TemperatureLogitsWarper(t)(None, logits[None].clone())
        if k:
            x = TopKLogitsWarper(k)(None, x)
        if top_p < 1:
            x = TopPLogitsWarper(top_p)(None, x)
        torch.testing.assert_close(target_probs(logits, t, top_p, k), torch.softmax(x[0], -1))


def test_top_p_keeps_the_nucleus():
    p = target_probs(torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05])), 1.0, top_p=0.8)
    torch.testing.assert_close(p, torch.tensor([0.625, 0.375, 0.0, 0.0]))
    p = target_probs(torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05])), 1.0, top_p=0.81)
    assert (p > 0).tolist() == [True, True, True, False]


def test_rejection_rule_with_a_real_q_draws_from_the_residual():
    """Candidate sampled from q: accepted w.p. min(1, p/q); residual norm(max(0, p - q))."""
    p, q = torch.tensor([0.2, 0.5, 0.3]), torch.tensor([0.6, 0.2, 0.2])
    gen = torch.Generator().manual_seed(0)
    hits = sum(rejection_rule(p, q, 0, gen)[0] for _ in range(4000))
    assert abs(hits / 4000 - 0.2 / 0.6) < 0.03
    ok, residual = False, None
    while not ok and residual is None:
        ok, residual = rejection_rule(p, q, 0, gen)
        residual = None if ok else residual
    torch.testing.assert_close(residual, torch.tensor([0.0, 0.75, 0.25]))
