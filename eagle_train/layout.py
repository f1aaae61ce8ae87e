"""The engine layout of a draft head (what vLLM and SGLang load) and reading a head folder back.

`eagle_train/heads.py` (training output) and `eagle_train/export.py` (writing and checking an
export) both build on this module; it imports neither of them.

EAGLE-3 (`LlamaForCausalLMEagle3`; vLLM method `eagle3`, SGLang `EAGLE3`):
    config.json        Llama fields of the single draft layer, `vocab_size` (the target's),
                       `draft_vocab_size`, `target_hidden_size` when it differs, the aux layer ids
    model.safetensors  fc, midlayer.*, norm, lm_head (draft vocabulary), d2t (int64 offsets:
                       target id = i + d2t[i], as both engines read it), t2d (bool over the target
                       vocabulary); embed_tokens only with hub.include_embed_tokens
EAGLE-1/2 (`LlamaForCausalLMEagle`; vLLM method `eagle`, SGLang `EAGLE`):
    model.safetensors  fc (+ bias), layers.0.* without input_layernorm; no norm and no lm_head,
                       the engines share embed_tokens and lm_head with the target

Aux layer ids: the two engines read different keys with different meanings, so both are written.
Our `head.aux_layers` are HF `hidden_states` indices (i = output of decoder layer i - 1).
  - vLLM reads top-level `eagle_aux_hidden_state_layer_ids` and captures the residual stream
    *entering* decoder layer id: the same index.
  - SGLang reads `eagle_config.eagle_aux_hidden_state_layer_ids` and captures the *output* of
    decoder layer id (it adds one): the index minus one.
Writing one convention under the other key shifts every feature by a layer: the head loads and
quietly accepts less. `check` verifies the two keys agree.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from safetensors.torch import load_file

from eagle_train.eagle1 import Eagle1Config, Eagle1Head
from eagle_train.eagle3 import Eagle3Config, Eagle3Head, default_aux_layers
from eagle_train.errors import HeadError
from eagle_train.layers import rope_settings
from eagle_train.target import DTYPES

ARCHITECTURES = {
    "eagle3": ["LlamaForCausalLMEagle3"],
    # SGLang resolves the first name (its EAGLE-1 class); vLLM maps `LlamaForCausalLM` to
    # `EagleLlamaForCausalLM` for method "eagle" and skips names it does not know
    "eagle1": ["LlamaForCausalLMEagle", "LlamaForCausalLM"],
}
EXPORT_KEY = "eagle_train_export"  # our provenance block in config.json (engines ignore it)
FORMAT_VERSION = 1


# ---------------------------------------------------------------------------------------------
# layout: config.json + tensors


def engine_config(head, dtype: str = "bfloat16", provenance: dict | None = None) -> dict:
    """config.json of the export (a plain dict)."""
    head_type, c = head.head_type, head.config
    cfg = {
        "architectures": ARCHITECTURES[head_type],
        "model_type": "llama",
        "num_hidden_layers": 1,
        "hidden_size": c.hidden_size,
        "intermediate_size": c.intermediate_size,
        "num_attention_heads": c.num_attention_heads,
        "num_key_value_heads": c.num_key_value_heads,
        "head_dim": c.head_dim,
        "hidden_act": c.hidden_act,
        "rms_norm_eps": c.rms_norm_eps,
        "rope_theta": c.rope_theta,
        "rope_scaling": c.rope_scaling,
        "max_position_embeddings": c.max_position_embeddings,
        "vocab_size": c.vocab_size,
        # SGLang ties lm_head to embed_tokens when true, and neither is the draft lm_head
        "tie_word_embeddings": False,
        "attention_bias": False,
        "mlp_bias": False,
        "torch_dtype": dtype,
    }
    meta = {"format_version": FORMAT_VERSION, "head_type": head_type, "num_target_layers": c.num_target_layers}
    if head_type == "eagle3":
        cfg["draft_vocab_size"] = c.draft_vocab_size
        if c.target_hidden_size != c.hidden_size:
            cfg["target_hidden_size"] = c.target_hidden_size
        hf_ids = [int(i) for i in c.aux_layers]
        cfg["eagle_aux_hidden_state_layer_ids"] = hf_ids  # vLLM: input of layer id
        cfg["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": [i - 1 for i in hf_ids],  # SGLang: output
                               "use_aux_hidden_state": True}
        # our residual is the un-normed feature (vLLM's default; SGLang has only this one)
        cfg["norm_before_residual"] = False
        meta["aux_layers_hf_hidden_states"] = hf_ids
    cfg[EXPORT_KEY] = {**meta, **(provenance or {})}
    return cfg


def engine_state(head, dtype: str = "bfloat16", include_embed_tokens: bool = False) -> dict:
    """The export's tensors under the engines' names (float weights in `dtype`, d2t int64, t2d bool).
    Works on meta-device heads too (shapes only)."""
    state = {k: v.detach() for k, v in head.state_dict().items() if not k.startswith("rotary.")}
    if head.head_type == "eagle1":
        del state["lm_head.weight"]  # the target's own lm_head
        if "fc.bias" not in state:  # SGLang's EAGLE-1 fc always has a bias; zeros keep the math
            w = state["fc.weight"]
            state["fc.bias"] = torch.zeros(w.shape[0], dtype=w.dtype, device=w.device)
    if not include_embed_tokens:
        del state["embed_tokens.weight"]
    required, optional = expected_layout(engine_config(head))
    if set(required) - set(state) or set(state) - set(required) - set(optional):
        raise RuntimeError(f"head parameters {sorted(state)} do not match the engine layout {sorted(required)}")
    out = {}
    for k, v in state.items():
        out[k] = v.to(DTYPES[dtype]) if v.is_floating_point() else v
    return {k: (v.cpu().contiguous() if v.device.type != "meta" else v) for k, v in out.items()}


def expected_layout(cfg: dict):
    """({name: (shape, dtype class)} required, {name: (shape, dtype class)} optional) from config.json
    fields; the dtype class is float, int64 or bool. Raises KeyError for a missing field."""
    H, I = cfg["hidden_size"], cfg["intermediate_size"]
    nh, nkv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    hd = cfg.get("head_dim") or H // nh
    V = cfg["vocab_size"]
    f = "float"
    if config_head_type(cfg) == "eagle3":
        Vd = cfg.get("draft_vocab_size") or V
        Ht = cfg.get("target_hidden_size") or H
        p = "midlayer."
        req = {
            "fc.weight": ((H, 3 * Ht), f),
            p + "input_layernorm.weight": ((H,), f),
            p + "hidden_norm.weight": ((H,), f),
            p + "self_attn.q_proj.weight": ((nh * hd, 2 * H), f),
            p + "self_attn.k_proj.weight": ((nkv * hd, 2 * H), f),
            p + "self_attn.v_proj.weight": ((nkv * hd, 2 * H), f),
            p + "self_attn.o_proj.weight": ((H, nh * hd), f),
            p + "post_attention_layernorm.weight": ((H,), f),
            p + "mlp.gate_proj.weight": ((I, H), f),
            p + "mlp.up_proj.weight": ((I, H), f),
            p + "mlp.down_proj.weight": ((H, I), f),
            "norm.weight": ((H,), f),
            "lm_head.weight": ((Vd, H), f),
            "d2t": ((Vd,), "int64"),
            "t2d": ((V,), "bool"),
        }
        return req, {"embed_tokens.weight": ((V, H), f)}
    p = "layers.0."
    req = {
        "fc.weight": ((H, 2 * H), f),
        p + "self_attn.q_proj.weight": ((nh * hd, H), f),
        p + "self_attn.k_proj.weight": ((nkv * hd, H), f),
        p + "self_attn.v_proj.weight": ((nkv * hd, H), f),
        p + "self_attn.o_proj.weight": ((H, nh * hd), f),
        p + "post_attention_layernorm.weight": ((H,), f),
        p + "mlp.gate_proj.weight": ((I, H), f),
        p + "mlp.up_proj.weight": ((I, H), f),
        p + "mlp.down_proj.weight": ((H, I), f),
    }
    opt = {"fc.bias": ((H,), f), "embed_tokens.weight": ((V, H), f), p + "input_layernorm.weight": ((H,), f)}
    return req, opt


def config_head_type(cfg: dict) -> str:
    """The head type ("eagle3" or "eagle1") an engine config.json describes."""
    archs = cfg.get("architectures") or []
    return "eagle3" if any("Eagle3" in a for a in archs) or "draft_vocab_size" in cfg else "eagle1"


def hf_aux_layers(cfg: dict):
    """The aux layers as HF hidden_states indices, from whichever key is present."""
    if cfg.get("eagle_aux_hidden_state_layer_ids"):
        return [int(i) for i in cfg["eagle_aux_hidden_state_layer_ids"]]
    nested = (cfg.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    if nested:
        return [int(i) + 1 for i in nested]
    meta = cfg.get(EXPORT_KEY) or {}
    return meta.get("aux_layers_hf_hidden_states")


# ---------------------------------------------------------------------------------------------
# read back


def read_config(path) -> dict:
    """A head's config.json as a dict, or one HeadError naming the file."""
    try:
        meta = json.loads(Path(path).read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise HeadError(f"{path}: not valid JSON ({err}); export or train the head again") from None
    if not isinstance(meta, dict):
        raise HeadError(f"{path}: expected a JSON object, got {type(meta).__name__}")
    return meta


def read_weights(path, map_location="cpu") -> dict:
    """model.safetensors of a head; a truncated or damaged file is one HeadError naming it."""
    if not Path(path).is_file():
        raise HeadError(f"{path} is missing; export or train the head again")
    try:
        return load_file(path, device=str(map_location))
    except Exception as err:  # safetensors raises its own error type for a cut-off header or data
        raise HeadError(f"{path}: not a readable safetensors file ({str(err)[:160]}); export or train "
                        "the head again") from None


def load_weights(head, state: dict, path):
    """load_state_dict(strict=False) naming every tensor whose shape disagrees with the config."""
    own = head.state_dict()
    wrong = [f"`{k}` {list(v.shape)} (config.json implies {list(own[k].shape)})"
             for k, v in state.items() if k in own and tuple(v.shape) != tuple(own[k].shape)]
    if wrong:
        raise HeadError(f"{path}: tensor shapes do not match config.json: {', '.join(wrong[:4])}"
                        f"{' ...' if len(wrong) > 4 else ''}")
    return head.load_state_dict(state, strict=False)


def resolve_folder(path) -> Path:
    p = Path(os.path.expanduser(str(path)))
    if p.is_dir():
        return p
    if p.exists() or str(path).count("/") != 1:
        raise FileNotFoundError(f"{path}: not an exported head folder or hub id (owner/name)")
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(repo_id=str(path), allow_patterns=["config.json", "*.safetensors", "README.md"]))
    except Exception as err:  # offline, missing or gated repo
        raise FileNotFoundError(f"{path}: no such folder, and downloading it as a hub id failed "
                                f"({type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''})") from None


def load_exported(path, target=None, map_location="cpu"):
    """Rebuild an Eagle3Head / Eagle1Head (fp32) from an exported folder or hub id; embed_tokens
    (and the EAGLE-1 lm_head) come from the file when present, else from `target`."""
    folder = resolve_folder(path)
    cfg = read_config(folder / "config.json")
    state = read_weights(folder / "model.safetensors", map_location)
    missing_fields = [k for k in ("hidden_size", "num_attention_heads", "intermediate_size", "vocab_size",
                                  "rms_norm_eps") if k not in cfg]
    if missing_fields:
        raise HeadError(f"{folder}/config.json lacks {', '.join(missing_fields)} (run `eagle-train check {folder}`)")
    meta = cfg.get(EXPORT_KEY) or {}
    tconf = getattr(target, "config", None)
    n_target = meta.get("num_target_layers") or getattr(tconf, "num_hidden_layers", None)
    H, nh = cfg["hidden_size"], cfg["num_attention_heads"]
    theta, scaling = rope_settings(cfg)
    common = dict(hidden_size=H, intermediate_size=cfg["intermediate_size"], num_attention_heads=nh,
                  num_key_value_heads=cfg.get("num_key_value_heads", nh), head_dim=cfg.get("head_dim") or H // nh,
                  vocab_size=cfg["vocab_size"], rms_norm_eps=cfg["rms_norm_eps"], rope_theta=theta,
                  rope_scaling=scaling, max_position_embeddings=cfg.get("max_position_embeddings", 8192),
                  num_target_layers=n_target, hidden_act=cfg.get("hidden_act", "silu"))
    if config_head_type(cfg) == "eagle3":
        aux = hf_aux_layers(cfg)
        if not aux:
            if not n_target:
                raise ValueError(f"{folder}/config.json names no aux layers; pass the target so the engines' "
                                 "default [2, N//2, N-3] can be used")
            aux = default_aux_layers(n_target)
        head = Eagle3Head(Eagle3Config(**common, draft_vocab_size=cfg.get("draft_vocab_size") or cfg["vocab_size"],
                                       aux_layers=aux, target_hidden_size=cfg.get("target_hidden_size")))
        if "d2t" not in state:  # a full-vocabulary head
            state["d2t"] = torch.zeros(head.config.draft_vocab_size, dtype=torch.long)
            state["t2d"] = torch.ones(head.config.vocab_size, dtype=torch.bool)
        allowed_missing = {"embed_tokens.weight"}
    else:
        bias = state.get("fc.bias")
        fc_bias = bias is not None and bool(bias.abs().sum() > 0)
        if not fc_bias:
            state.pop("fc.bias", None)
        state.pop("layers.0.input_layernorm.weight", None)  # EAGLE skips it on layer 0
        head = Eagle1Head(Eagle1Config(**common, fc_bias=fc_bias))
        allowed_missing = {"embed_tokens.weight", "lm_head.weight"}
    state = {k: v.float() if v.is_floating_point() else v for k, v in state.items()}
    missing, unexpected = load_weights(head, state, folder / "model.safetensors")
    bad = [k for k in missing if k not in allowed_missing and not k.startswith("rotary.")]
    if bad or unexpected:
        raise HeadError(f"{folder}/model.safetensors does not fit the {config_head_type(cfg)} layout: missing {bad}, "
                         f"unexpected {unexpected} (run `eagle-train check {folder}`)")
    if target is not None:
        embed_in_file = "embed_tokens.weight" in state
        saved = head.embed_tokens.weight.data.clone() if embed_in_file else None
        head.load_target_embeddings(target)
        if embed_in_file:
            head.embed_tokens.weight.data.copy_(saved)
    return head.to(map_location)
