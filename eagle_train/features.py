"""What a draft head learns from: features of the frozen target, for the dump and online training.

Per token t of a sample (all tensors (B, L, ...)):
    aux      EAGLE-3: cat(hidden_states[i] for i in aux_layers) -> (B, L, 3H), pre-norm residuals
    last     hidden_states[-1], the post-norm last hidden state (B, L, H): the EAGLE-1/2 feature
             and, through the target's lm_head, the full target distribution
    topk_logp, topk_ids  lean mode: the target's top-k next-token log-probs at t (B, L, k)

HF `hidden_states` convention: index 0 is the embedding output, index i the output of decoder
layer i-1, and the last index has the final norm applied.
"""

from __future__ import annotations

from typing import Dict, List, Optional

import torch


def decoder_of(model):
    """The bare decoder stack of a *ForCausalLM (no lm_head)."""
    return model.get_decoder() if hasattr(model, "get_decoder") else model.model


@torch.no_grad()
def target_features(model, input_ids: torch.Tensor, attention_mask: Optional[torch.Tensor],
                    aux_layers: Optional[List[int]], storage: str = "full", topk: int = 64) -> Dict[str, torch.Tensor]:
    """Run the frozen target once and return the features named above.

    aux_layers None means no `aux` (EAGLE-1/2). storage is "full" (return `last`) or "topk"
    (return `topk_logp`/`topk_ids` instead of `last`)."""
    out = decoder_of(model)(input_ids=input_ids, attention_mask=attention_mask,
                            output_hidden_states=True, use_cache=False)
    hs = out.hidden_states
    feats = {}
    if aux_layers is not None:
        feats["aux"] = torch.cat([hs[i] for i in aux_layers], dim=-1)
    last = out.last_hidden_state  # == hs[-1], post-norm
    if storage == "full":
        feats["last"] = last
    else:
        logits = model.get_output_embeddings()(last).float()
        logp, ids = torch.log_softmax(logits, dim=-1).topk(topk, dim=-1)
        feats["topk_logp"], feats["topk_ids"] = logp, ids.to(torch.int32)
    return feats
