"""Layers both head families share (EAGLE-1/2 in eagle1.py, EAGLE-3 in eagle3.py): Llama's RMSNorm,
rotary embedding, grouped-query attention with a KV cache and SwiGLU MLP, and the one reading of a
config's RoPE settings."""

from __future__ import annotations

from typing import Optional, Tuple

import torch
import torch.nn.functional as F
from torch import nn

KVCache = Tuple[torch.Tensor, torch.Tensor]  # (k, v), each (B, n_kv_heads, P, head_dim)


def rope_settings(conf) -> Tuple[float, Optional[dict]]:
    """(rope_theta, rope_scaling) of an HF config object or a config.json dict, whether it carries
    the legacy keys (`rope_theta`, `rope_scaling` with `type` or `rope_type`) or transformers 5
    `rope_parameters`; plain RoPE gives scaling None."""
    def get(key):
        return conf.get(key) if isinstance(conf, dict) else getattr(conf, key, None)

    params = dict(get("rope_parameters") or get("rope_scaling") or {})
    theta = params.pop("rope_theta", None)
    theta = get("rope_theta") if theta is None else theta
    if "type" in params and "rope_type" not in params:
        params["rope_type"] = params.pop("type")
    scaling = params if params.get("rope_type", "default") != "default" else None
    return float(10000.0 if theta is None else theta), scaling


def frozen(module: nn.Module) -> nn.Module:
    """`module` with its weight out of training (a copy of the target's, set at load time)."""
    module.weight.requires_grad_(False)
    return module


def target_shapes(tconf, intermediate_size: Optional[int] = None) -> dict:
    """The draft decoder layer's config fields from the target's HF config (both head families)."""
    theta, scaling = rope_settings(tconf)
    return dict(
        hidden_size=tconf.hidden_size,
        intermediate_size=intermediate_size or tconf.intermediate_size,
        num_attention_heads=tconf.num_attention_heads,
        num_key_value_heads=getattr(tconf, "num_key_value_heads", tconf.num_attention_heads),
        head_dim=getattr(tconf, "head_dim", None) or tconf.hidden_size // tconf.num_attention_heads,
        vocab_size=tconf.vocab_size,
        rms_norm_eps=tconf.rms_norm_eps,
        rope_theta=theta,
        rope_scaling=scaling,
        max_position_embeddings=tconf.max_position_embeddings,
        num_target_layers=tconf.num_hidden_layers,
        hidden_act=getattr(tconf, "hidden_act", "silu"),
    )


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x):
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


class Rotary(nn.Module):
    """Llama RoPE (llama3 scaling included) via transformers' init functions."""

    def __init__(self, cfg):
        super().__init__()
        from transformers import LlamaConfig
        from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

        rope = {"rope_type": "default", **(cfg.rope_scaling or {}), "rope_theta": cfg.rope_theta}
        lc = LlamaConfig(hidden_size=cfg.hidden_size, num_attention_heads=cfg.num_attention_heads,
                         head_dim=cfg.head_dim, max_position_embeddings=cfg.max_position_embeddings,
                         rope_parameters=rope)
        self.inner = LlamaRotaryEmbedding(lc)

    def forward(self, x, position_ids):
        return self.inner(x, position_ids)  # cos, sin: (B, n, head_dim)


def apply_rope(x, cos, sin):
    # x: (B, heads, n, d); cos/sin: (B, n, d)
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


class Attention(nn.Module):
    def __init__(self, cfg, in_features: int):
        super().__init__()
        self.n_heads, self.n_kv, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.q_proj = nn.Linear(in_features, self.n_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(in_features, self.n_kv * self.head_dim, bias=False)
        self.v_proj = nn.Linear(in_features, self.n_kv * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.n_heads * self.head_dim, cfg.hidden_size, bias=False)

    def qkv(self, x, cos, sin):
        """Projected, rotated q (B, heads, n, d) and k, v (B, kv_heads, n, d)."""
        B, n, _ = x.shape
        q = self.q_proj(x).view(B, n, self.n_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(B, n, self.n_kv, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(B, n, self.n_kv, self.head_dim).transpose(1, 2)
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v

    def forward(self, x, cos, sin, kv_cache: Optional[KVCache] = None, attn_mask=None):
        """attn_mask: None (causal over the new tokens, all of the cache visible) or an additive
        float / boolean mask (B or 1, 1, n, P + n). Returns (out, (k, v) with the new tokens)."""
        q, k, v = self.qkv(x, cos, sin)
        if kv_cache is not None:
            k, v = torch.cat([kv_cache[0], k], dim=2), torch.cat([kv_cache[1], v], dim=2)
        n, total = q.shape[2], k.shape[2]
        if attn_mask is None and n > 1:
            attn_mask = torch.ones(n, total, dtype=torch.bool, device=x.device).tril(total - n)
        rep = self.n_heads // self.n_kv
        o = F.scaled_dot_product_attention(q, k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1),
                                           attn_mask=attn_mask)
        o = o.transpose(1, 2).reshape(x.shape[0], n, -1)
        return self.o_proj(o), (k, v)


class MLP(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
