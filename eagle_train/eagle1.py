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

from eagle_train.eagle3 import MLP, Attention, KVCache, RMSNorm, Rotary


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
        from eagle_train.eagle3 import Eagle3Config

        c = Eagle3Config.from_target(tconf, tconf.vocab_size, intermediate_size=intermediate_size)
        return cls(hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
                   num_attention_heads=c.num_attention_heads, num_key_value_heads=c.num_key_value_heads,
                   head_dim=c.head_dim, vocab_size=c.vocab_size, rms_norm_eps=c.rms_norm_eps,
                   rope_theta=c.rope_theta, rope_scaling=c.rope_scaling,
                   max_position_embeddings=c.max_position_embeddings,
                   num_target_layers=c.num_target_layers, fc_bias=fc_bias, hidden_act=c.hidden_act)

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
    def __init__(self, cfg: Eagle1Config):
        super().__init__()
        self.config = cfg
        H = cfg.hidden_size
        self.embed_tokens = nn.Embedding(cfg.vocab_size, H)  # frozen copy of the target's
        self.embed_tokens.weight.requires_grad_(False)
        self.lm_head = nn.Linear(H, cfg.vocab_size, bias=False)  # frozen copy of the target's
        self.lm_head.weight.requires_grad_(False)
        self.fc = nn.Linear(2 * H, H, bias=cfg.fc_bias)
        self.layers = nn.ModuleList([DecoderLayer(cfg)])
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
