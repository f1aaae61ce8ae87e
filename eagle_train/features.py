"""What a draft head learns from: features of the frozen target, for the dump and online training.

Per token t of a sample (all tensors (B, L, ...)):
    aux      EAGLE-3: cat(hidden_states[i] for i in aux_layers) -> (B, L, 3H), pre-norm residuals
    last     hidden_states[-1], the post-norm last hidden state (B, L, H): the EAGLE-1/2 feature
             and, through the target's lm_head, the full target distribution
    topk_logp, topk_ids  lean mode: the target's top-k next-token log-probs at t (B, L, k)

Layer convention (HF `hidden_states` indices, used by `head.aux_layers` and dump manifests):
index 0 is the embedding output, index i (1..N) the output of decoder layer i-1, and index N, the
last one, has the final norm applied. The EAGLE-3 default for an N-layer target is
`default_aux_layers(N) = [2, N//2, N-3]` (low, mid, high); for SmolLM2-135M (N=30) that is
[2, 15, 27]. Serving engines (vLLM/SGLang) count decoder-layer outputs, i.e. these indices minus 1.

Storage (`dump.dtype`): bfloat16 / float16 / float32 store hidden features as such. `float8`
stores them as float8 e4m3 with one float32 absmax scale per token and per layer (`aux_scale`
(L, 3), `last_scale` (L, 1)): SmolLM2's pre-norm residual reaches |x| ~ 4400 in a few dims, far
beyond e4m3's 448, so a per-token scale is needed. Relative rounding error is <= 2^-4 per element
(3 mantissa bits). `quantize_fp8` / `dequantize_fp8` below are the one definition of that format.
"""

from __future__ import annotations

from typing import Dict, List, Optional, Tuple

import torch

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0  # largest finite e4m3fn value


def decoder_of(model):
    """The bare decoder stack of a *ForCausalLM (no lm_head)."""
    return model.get_decoder() if hasattr(model, "get_decoder") else model.model


def aux_features(hidden_states, aux_layers: List[int]) -> torch.Tensor:
    """EAGLE-3's input feature: the `aux_layers` entries of the target's `hidden_states`, side by side
    (..., 3H) in that order."""
    return torch.cat([hidden_states[i] for i in aux_layers], dim=-1)


@torch.no_grad()
def target_features(model, input_ids: torch.Tensor, attention_mask: Optional[torch.Tensor],
                    aux_layers: Optional[List[int]], storage: str = "full", topk: int = 64,
                    chunk_tokens: int = 2048, target_rows: Optional[torch.Tensor] = None) -> Dict[str, torch.Tensor]:
    """Run the frozen target once and return the features named above.

    aux_layers None means no `aux` (EAGLE-1/2). storage is "full" (return `last`) or "topk"
    (return `topk_logp`/`topk_ids` instead of `last`). The top-k is taken `chunk_tokens` rows at a
    time so the (tokens, vocab) logits never exist for the whole batch at once, and only where
    `target_rows` (B, L) bool is set when given (zeros elsewhere: see `topk_logprobs`)."""
    # ask only for the layers we keep (transformers >= 5 accepts a list; older ones return all)
    out = decoder_of(model)(input_ids=input_ids, attention_mask=attention_mask,
                            output_hidden_states=list(aux_layers) if aux_layers else False, use_cache=False)
    hs = out.hidden_states
    feats = {}
    if aux_layers is not None:
        feats["aux"] = aux_features(hs, aux_layers)
    last = out.last_hidden_state  # == hs[-1], post-norm
    if storage == "full":
        feats["last"] = last
    else:
        feats["topk_logp"], feats["topk_ids"] = topk_logprobs(model.get_output_embeddings(), last, topk, chunk_tokens,
                                                              target_rows)
    return feats


def topk_logprobs(lm_head, last: torch.Tensor, k: int, chunk_tokens: int = 2048,
                  rows: Optional[torch.Tensor] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """Top-k next-token log-probs (float32) and ids (int32) from post-norm hidden states (..., H).
    `rows` (...) bool: only those positions get them, the others log-prob 0 and id 0. The lm_head,
    log-softmax and top-k over SmolLM2's 49,152 tokens are ~24% of a dumped token's time on a CPU
    (bench/RESULTS.md "## The dump's top-k only where training reads it"), and a user turn's never train."""
    flat = last.reshape(-1, last.shape[-1])
    pick = None if rows is None else rows.reshape(-1).nonzero().squeeze(1)
    src = flat if pick is None else flat[pick]
    logp, ids = [], []
    for s in range(0, src.shape[0], chunk_tokens):
        v, i = torch.log_softmax(lm_head(src[s:s + chunk_tokens]).float(), dim=-1).topk(k, dim=-1)
        logp.append(v)
        ids.append(i.to(torch.int32))
    logp = torch.cat(logp) if logp else torch.zeros(0, k, device=flat.device)
    ids = torch.cat(ids) if ids else torch.zeros(0, k, dtype=torch.int32, device=flat.device)
    if pick is not None:
        full_logp = torch.zeros(flat.shape[0], k, device=flat.device)
        full_ids = torch.zeros(flat.shape[0], k, dtype=torch.int32, device=flat.device)
        full_logp[pick], full_ids[pick] = logp, ids
        logp, ids = full_logp, full_ids
    shape = (*last.shape[:-1], k)
    return logp.reshape(shape), ids.reshape(shape)


def quantize_fp8(x: torch.Tensor, groups: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """(T, G*H) float -> (T, G*H) float8 e4m3 and (T, G) float32 scales, one absmax scale per token per group."""
    t = x.float().reshape(x.shape[0], groups, -1)
    scale = t.abs().amax(dim=-1, keepdim=True).clamp_min(1e-30) / FP8_MAX
    # clamp: float rounding can push |x|/scale a hair above 448, which is NaN on some devices
    q = (t / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return q.reshape(x.shape), scale.squeeze(-1)


def dequantize_fp8(q: torch.Tensor, scale: torch.Tensor, dtype=torch.float32) -> torch.Tensor:
    """Inverse of `quantize_fp8`: (T, G*H) float8 and (T, G) scales -> (T, G*H) `dtype`."""
    t = q.float().reshape(q.shape[0], scale.shape[-1], -1) * scale.float().unsqueeze(-1)
    return t.reshape(q.shape).to(dtype)
