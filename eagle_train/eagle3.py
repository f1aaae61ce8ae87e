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
from typing import List, Optional

import torch
from torch import nn

from eagle_train.layers import MLP, Attention, KVCache, RMSNorm, Rotary, frozen, target_shapes
from eagle_train.recipe import RecipeError


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
        return cls(**target_shapes(tconf, intermediate_size), draft_vocab_size=min(draft_vocab_size, tconf.vocab_size),
                   aux_layers=check_aux_layers(aux_layers, tconf.num_hidden_layers))

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
    head_type = "eagle3"  # recipes: head.type; manifests and saved heads: head_type

    def __init__(self, cfg: Eagle3Config):
        super().__init__()
        self.config = cfg
        H = cfg.hidden_size
        self.embed_tokens = frozen(nn.Embedding(cfg.vocab_size, H))
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
