"""The baselines speculative decoding is measured against: plain `generate` (greedy or sampled,
every other logits processor off) and transformers' prompt lookup decoding; and `timed`, the
accelerator-synchronised wall clock every comparison uses."""

from __future__ import annotations

import time
from typing import List, Optional

import torch
from transformers import GenerationConfig

from eagle_train.decoding import _finish, linears_from, packed_linears


def plain_generation_config(max_new_tokens: int, eos_token_id: Optional[int], temperature: float = 0.0,
                            top_p: float = 1.0, top_k: int = 0, **extra) -> GenerationConfig:
    """An explicit config for `generate` with every logits processor off except the sampler's own
    temperature / top-k / top-p: a model's generation_config.json may carry repetition_penalty,
    no_repeat_ngram_size, bad words, ..., which `generate` applies even when greedy, while the
    speculative path is plain argmax (or plain sampling from `target_probs`). A fresh
    GenerationConfig has them all off; passing it replaces the model's."""
    sampled = temperature > 0
    return GenerationConfig(
        do_sample=sampled, max_new_tokens=max_new_tokens, min_new_tokens=0,
        temperature=float(temperature) if sampled else None, top_p=top_p if sampled else None,
        top_k=top_k if sampled else None, repetition_penalty=1.0, no_repeat_ngram_size=0,
        eos_token_id=eos_token_id, pad_token_id=eos_token_id if eos_token_id is not None else 0, **extra)


@torch.no_grad()
def vanilla_generate(model, input_ids: torch.Tensor, max_new_tokens: int, temperature: float = 0.0,
                     top_p: float = 1.0, eos_token_id: Optional[int] = None, top_k: int = 0,
                     seed: Optional[int] = None, packed_verify: str = "off") -> List[int]:
    """The baseline, one loop at every temperature: `generate` with `plain_generation_config`
    (argmax at T=0, else sampling with the same temperature / top-k / top-p). `generate` samples
    from the global RNG, seeded here with `seed`. `packed_verify` as the head's: the packs speed up a
    one-token pass too (9% in fp32 on an AVX2 CPU), so a speedup measured against plain layers would
    credit the head with the packs' gain."""
    ids = input_ids.to(model.device)
    if seed is not None:
        torch.manual_seed(seed)
    gcfg = plain_generation_config(max_new_tokens, eos_token_id, temperature, top_p, top_k)
    with linears_from(packed_linears(model, packed_verify)):
        out = model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=gcfg)
    return _finish(out[0, ids.shape[1]:].tolist(), max_new_tokens, eos_token_id)[0]


@torch.no_grad()
def prompt_lookup_generate(model, input_ids: torch.Tensor, max_new_tokens: int, num_tokens: int,
                           temperature: float = 0.0, top_p: float = 1.0, eos_token_id: Optional[int] = None,
                           top_k: int = 0, seed: Optional[int] = None, packed_verify: str = "off"):
    """transformers' prompt lookup decoding (n-gram drafts copied from the context, verified by the
    target), counting target forward passes. Returns (tokens, passes). Its first pass is the
    prefill and already verifies a draft, so every pass counts: tau = tokens / passes. Each of its
    passes verifies a draft, so `packed_verify` (as the head's, `packed_linears`) covers all of them."""
    ids = input_ids.to(model.device)
    if seed is not None:
        torch.manual_seed(seed)
    calls = [0]
    hook = model.register_forward_pre_hook(lambda mod, args: calls.__setitem__(0, calls[0] + 1))
    try:
        gcfg = plain_generation_config(max_new_tokens, eos_token_id, temperature, top_p, top_k,
                                       prompt_lookup_num_tokens=num_tokens)
        with linears_from(packed_linears(model, packed_verify)):
            out = model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=gcfg)
    finally:
        hook.remove()
    return _finish(out[0, ids.shape[1]:].tolist(), max_new_tokens, eos_token_id)[0], calls[0]


def timed(fn, *args, **kw):
    """(result, seconds), synchronising the accelerator so GPU timings are honest."""
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    sync()
    t0 = time.perf_counter()
    out = fn(*args, **kw)
    sync()
    return out, time.perf_counter() - t0
