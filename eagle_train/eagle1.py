"""EAGLE-1/2 draft head (Li et al., 2024), in the layout vLLM's `EagleLlamaForCausalLM` loads.

    fc:        cat(embed(token_{t+1}), feature_t) [2H] -> [H]
    layers.0:  a Llama decoder layer without its input_layernorm (EAGLE skips it on layer 0)
    output:    the predicted next feature (the target's post-norm last hidden state), decoded
               by the target's own lm_head; no final norm and no lm_head of its own.

EAGLE-2 uses the same head; only the draft tree differs (dynamic, see decoding).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Optional

import torch
from torch import nn

from eagle_train.layers import MLP, Attention, KVCache, RMSNorm, Rotary, frozen, target_shapes


@dataclass
class Eagle1Config:
    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: Optional[dict] = None
    max_position_embeddings: int = 8192
    num_target_layers: Optional[int] = None
    fc_bias: bool = False
    hidden_act: str = "silu"

    @classmethod
    def from_target(cls, tconf, fc_bias: bool = False, intermediate_size: Optional[int] = None):
        """Shapes from the target's HF config."""
        return cls(**target_shapes(tconf, intermediate_size), fc_bias=fc_bias)

    def to_dict(self) -> dict:
        return asdict(self)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: Eagle1Config):
        super().__init__()
        self.self_attn = Attention(cfg, cfg.hidden_size)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x, cos, sin, kv_cache=None, attn_mask=None):
        attn_out, kv = self.self_attn(x, cos, sin, kv_cache, attn_mask)  # no input_layernorm
        h = x + attn_out
        return h + self.mlp(self.post_attention_layernorm(h)), kv


class Eagle1Head(nn.Module):
    head_type = "eagle1"  # recipes: head.type; manifests and saved heads: head_type

    def __init__(self, cfg: Eagle1Config):
        super().__init__()
        self.config, H = cfg, cfg.hidden_size
        self.fc = nn.Linear(2 * H, H, bias=cfg.fc_bias)
        self.layers = nn.ModuleList([DecoderLayer(cfg)])
        # the target's own embeddings and lm_head, copied in at load time and never trained
        self.embed_tokens = frozen(nn.Embedding(cfg.vocab_size, H))
        self.lm_head = frozen(nn.Linear(H, cfg.vocab_size, bias=False))
        self.rotary = Rotary(cfg)

    def load_target_embeddings(self, target) -> None:
        self.embed_tokens.weight.data.copy_(target.get_input_embeddings().weight.data.float())
        self.lm_head.weight.data.copy_(target.get_output_embeddings().weight.data.float())

    def forward(self, input_ids, hidden, position_ids, kv_cache: Optional[KVCache] = None, attn_mask=None):
        """input_ids (B, n) are the tokens *after* each feature (token t+1 beside feature t);
        hidden (B, n, H) target post-norm last hidden states or the head's own predictions.
        Returns (predicted next features (B, n, H), target-vocabulary logits, kv cache)."""
        embeds = self.embed_tokens(input_ids).to(hidden.dtype)
        x = self.fc(torch.cat([embeds, hidden], dim=-1))
        cos, sin = self.rotary(x, position_ids)
        out, kv = self.layers[0](x, cos, sin, kv_cache, attn_mask)
        return out, self.lm_head(out), kv
