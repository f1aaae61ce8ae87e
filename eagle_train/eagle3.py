"""EAGLE-3 draft head (Li et al., 2025), in the parameter layout vLLM and SGLang load.

    fc:        [3H] low/mid/high target features -> [H]
    midlayer:  one Llama decoder layer whose attention reads cat(input_layernorm(embed),
               hidden_norm(feature)) -> q/k/v take 2H; the residual is the un-normed feature
    norm:      final RMSNorm
    lm_head:   [H] -> draft vocabulary; target_id = draft_id + d2t[draft_id]

The head's own output (before `norm`) is the feature of the next draft step, which is already
H wide and so skips `fc` (the engines do the same).
"""

from __future__ import annotations

import warnings

from dataclasses import asdict, dataclass, field
from typing import List, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import nn

KVCache = Tuple[torch.Tensor, torch.Tensor]  # (k, v), each (B, n_kv_heads, P, head_dim)


@dataclass
class Eagle3Config:
    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int  # the target's
    draft_vocab_size: int
    aux_layers: List[int]  # HF hidden_states indices of the low/mid/high features
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: Optional[dict] = None
    max_position_embeddings: int = 8192
    target_hidden_size: Optional[int] = None  # feature width if it differs from hidden_size
    num_target_layers: Optional[int] = None
    hidden_act: str = "silu"
    extra: dict = field(default_factory=dict)

    def __post_init__(self):
        self.target_hidden_size = self.target_hidden_size or self.hidden_size

    @classmethod
    def from_target(cls, tconf, draft_vocab_size: int, aux_layers: Optional[List[int]] = None,
                    intermediate_size: Optional[int] = None) -> "Eagle3Config":
        """Shapes from the target's HF config; aux layers default to [2, N//2, N-3]."""
        n = tconf.num_hidden_layers
        rope = getattr(tconf, "rope_parameters", None) or getattr(tconf, "rope_scaling", None) or {}
        theta = rope.get("rope_theta", getattr(tconf, "rope_theta", 10000.0))
        scaling = {k: v for k, v in rope.items() if k != "rope_theta"} or None
        if scaling and scaling.get("rope_type", "default") == "default":
            scaling = None
        return cls(
            hidden_size=tconf.hidden_size,
            intermediate_size=intermediate_size or tconf.intermediate_size,
            num_attention_heads=tconf.num_attention_heads,
            num_key_value_heads=getattr(tconf, "num_key_value_heads", tconf.num_attention_heads),
            head_dim=getattr(tconf, "head_dim", None) or tconf.hidden_size // tconf.num_attention_heads,
            vocab_size=tconf.vocab_size,
            draft_vocab_size=min(draft_vocab_size, tconf.vocab_size),
            aux_layers=check_aux_layers(aux_layers, n),
            rms_norm_eps=tconf.rms_norm_eps,
            rope_theta=float(theta),
            rope_scaling=scaling,
            max_position_embeddings=tconf.max_position_embeddings,
            num_target_layers=n,
            hidden_act=getattr(tconf, "hidden_act", "silu"),
        )

    def to_dict(self) -> dict:
        return asdict(self)


def default_aux_layers(num_layers: int) -> List[int]:
    """EAGLE-3's low/mid/high features as HF hidden_states indices (engine ids are these - 1);
    kept inside 1..N-1 for toy targets under 5 layers (N-3 would be 0 or negative)."""
    return [min(max(i, 1), num_layers - 1) for i in (2, num_layers // 2, num_layers - 3)]


def check_aux_layers(aux_layers, num_layers: int, where: str = "head.aux_layers") -> List[int]:
    """The aux layers every stage uses (dump, online and offline training, eval, export): None
    gives the default; each index must lie in 1..N-1 (HF hidden_states: 0 is the embedding output,
    which no engine captures, N the post-norm output, and -1 would silently read that); duplicates
    are legal but almost surely a mistake, so they warn."""
    from eagle_train.recipe import RecipeError

    aux = default_aux_layers(num_layers) if aux_layers is None else [int(i) for i in aux_layers]
    if len(aux) != 3:
        raise RecipeError(f"`{where}` = {aux} must list 3 layers (low, mid, high)")
    bad = [i for i in aux if not 1 <= i <= num_layers - 1]
    if bad:
        raise RecipeError(f"`{where}` = {aux}: {bad} out of range for a {num_layers}-layer target "
                          f"(HF hidden_states indices 1..{num_layers - 1})")
    if len(set(aux)) < 3 and aux_layers is not None:
        warnings.warn(f"`{where}` = {aux} repeats a layer: the head sees the same features twice", stacklevel=2)
    return aux


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


class MidLayer(nn.Module):
    def __init__(self, cfg: Eagle3Config):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, 2 * cfg.hidden_size)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def attn_input(self, embeds, hidden):
        return torch.cat([self.input_layernorm(embeds), self.hidden_norm(hidden)], dim=-1)

    def finish(self, hidden, attn_out):
        """Residual over the un-normed feature, then the MLP block."""
        h = hidden + attn_out
        return h + self.mlp(self.post_attention_layernorm(h))

    def forward(self, embeds, hidden, cos, sin, kv_cache=None, attn_mask=None):
        attn_out, kv = self.self_attn(self.attn_input(embeds, hidden), cos, sin, kv_cache, attn_mask)
        return self.finish(hidden, attn_out), kv


class Eagle3Head(nn.Module):
    def __init__(self, cfg: Eagle3Config):
        super().__init__()
        self.config = cfg
        H = cfg.hidden_size
        self.embed_tokens = nn.Embedding(cfg.vocab_size, H)  # frozen copy of the target's
        self.embed_tokens.weight.requires_grad_(False)
        self.fc = nn.Linear(3 * cfg.target_hidden_size, H, bias=False)
        self.midlayer = MidLayer(cfg)
        self.norm = RMSNorm(H, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(H, cfg.draft_vocab_size, bias=False)
        self.rotary = Rotary(cfg)
        # draft id i -> target id i + d2t[i]; t2d[target id] marks the draft vocabulary
        self.register_buffer("d2t", torch.zeros(cfg.draft_vocab_size, dtype=torch.long))
        self.register_buffer("t2d", torch.zeros(cfg.vocab_size, dtype=torch.bool))

    def load_target_embeddings(self, target) -> None:
        self.embed_tokens.weight.data.copy_(target.get_input_embeddings().weight.data.float())

    def set_draft_vocab(self, d2t: torch.Tensor, t2d: torch.Tensor) -> None:
        self.d2t.copy_(d2t)
        self.t2d.copy_(t2d)

    def draft_to_target(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids + self.d2t[draft_ids]

    def forward(self, input_ids, hidden, position_ids, kv_cache: Optional[KVCache] = None, attn_mask=None):
        """One draft pass.

        input_ids (B, n): the token *after* each feature (token t+1 beside feature t, as the
        engines shift them); hidden (B, n, 3H) target features (fused by
        `fc`) or (B, n, H) the head's own previous output; position_ids (B, n).
        Returns (out (B, n, H) pre-norm hidden = next step's feature, logits (B, n, draft_vocab),
        kv cache including these n tokens).
        """
        if hidden.shape[-1] == 3 * self.config.target_hidden_size:
            hidden = self.fc(hidden)
        embeds = self.embed_tokens(input_ids).to(hidden.dtype)
        cos, sin = self.rotary(hidden, position_ids)
        out, kv = self.midlayer(embeds, hidden, cos, sin, kv_cache, attn_mask)
        return out, self.lm_head(self.norm(out)), kv

    def target_logits(self, draft_logits: torch.Tensor) -> torch.Tensor:
        """Scatter draft-vocabulary logits into the target vocabulary (-inf elsewhere)."""
        full = draft_logits.new_full((*draft_logits.shape[:-1], self.config.vocab_size), float("-inf"))
        idx = torch.arange(self.config.draft_vocab_size, device=draft_logits.device)
        full[..., self.draft_to_target(idx)] = draft_logits
        return full
