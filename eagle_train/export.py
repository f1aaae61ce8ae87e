"""`eagle-train export` and `eagle-train check`: a trained head in the layout vLLM and SGLang load.

    eagle-train export recipe.yaml [key=value ...]     <train.output>/final -> hub.export_dir + README.md
    eagle-train check <folder | recipe.yaml> [--target <model | recipe.yaml>]

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

import argparse
import hashlib
import json
import os
import shutil
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file

from eagle_train.eagle1 import Eagle1Config, Eagle1Head
from eagle_train.eagle3 import Eagle3Config, Eagle3Head, default_aux_layers
from eagle_train.errors import HeadError
from eagle_train.heads import (check_head_matches, head_provenance, head_type, load_head, load_weights, read_config,
                               read_weights)
from eagle_train.target import DTYPES

ARCHITECTURES = {
    "eagle3": ["LlamaForCausalLMEagle3"],
    # SGLang resolves the first name (its EAGLE-1 class); vLLM maps `LlamaForCausalLM` to
    # `EagleLlamaForCausalLM` for method "eagle" and skips names it does not know
    "eagle1": ["LlamaForCausalLMEagle", "LlamaForCausalLM"],
}
EXPORT_KEY = "eagle_train_export"  # our provenance block in config.json (engines ignore it)
FORMAT_VERSION = 1
# no sound head holds a weight this large (trained ones stay within ~100 even with the feature scale
# folded into fc); a diverged run's head does (|w| ~ 1e6 after lr 1e6)
ABSURD_WEIGHT = 1e4


# ---------------------------------------------------------------------------------------------
# layout: config.json + tensors


def engine_config(head, dtype: str = "bfloat16", provenance: dict | None = None) -> dict:
    """config.json of the export (a plain dict)."""
    kind, c = head_type(head), head.config
    cfg = {
        "architectures": ARCHITECTURES[kind],
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
    meta = {"format_version": FORMAT_VERSION, "head_type": kind, "num_target_layers": c.num_target_layers}
    if kind == "eagle3":
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
    kind = head_type(head)
    state = {k: v.detach() for k, v in head.state_dict().items() if not k.startswith("rotary.")}
    if kind == "eagle1":
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
    """({name: (shape, kind)} required, {name: (shape, kind)} optional) from config.json fields;
    kind is float, int64 or bool. Raises KeyError for a missing field."""
    H, I = cfg["hidden_size"], cfg["intermediate_size"]
    nh, nkv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    hd = cfg.get("head_dim") or H // nh
    V = cfg["vocab_size"]
    f = "float"
    if _kind(cfg) == "eagle3":
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


# which config fields set each dimension, for messages
_DIM_SOURCES = {
    "fc.weight": "hidden_size, 3 * target_hidden_size (EAGLE-1: 2 * hidden_size)",
    "self_attn.q_proj.weight": "num_attention_heads * head_dim, 2 * hidden_size",
    "self_attn.k_proj.weight": "num_key_value_heads * head_dim, 2 * hidden_size",
    "self_attn.v_proj.weight": "num_key_value_heads * head_dim, 2 * hidden_size",
    "self_attn.o_proj.weight": "hidden_size, num_attention_heads * head_dim",
    "mlp.gate_proj.weight": "intermediate_size, hidden_size",
    "mlp.up_proj.weight": "intermediate_size, hidden_size",
    "mlp.down_proj.weight": "hidden_size, intermediate_size",
    "lm_head.weight": "draft_vocab_size, hidden_size",
    "d2t": "draft_vocab_size",
    "t2d": "vocab_size",
    "embed_tokens.weight": "vocab_size, hidden_size",
}


def _kind(cfg: dict) -> str:
    archs = cfg.get("architectures") or []
    return "eagle3" if any("Eagle3" in a for a in archs) or "draft_vocab_size" in cfg else "eagle1"


def _dims_of(name: str) -> str:
    for suffix, src in _DIM_SOURCES.items():
        if name.endswith(suffix):
            return src
    return "hidden_size"


# ---------------------------------------------------------------------------------------------
# export


def export_head(head, out_dir, dtype: str = "bfloat16", include_embed_tokens: bool = False,
                card: str | None = None, provenance: dict | None = None) -> Path:
    """Atomically write `out_dir` (config.json, model.safetensors, README.md when `card`)."""
    out = Path(out_dir)
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    save_file(engine_state(head, dtype, include_embed_tokens), tmp / "model.safetensors", metadata={"format": "pt"})
    (tmp / "config.json").write_text(json.dumps(engine_config(head, dtype, provenance), indent=2) + "\n")
    if card is not None:
        (tmp / "README.md").write_text(card)
    if out.exists():
        shutil.rmtree(out)
    os.replace(tmp, out)
    return out


# ---------------------------------------------------------------------------------------------
# check


def check_layout(cfg: dict, tensors: dict) -> list:
    """Problems of a config dict + {name: tensor} against the engine contract (values are only
    inspected on real tensors, so a meta-device export can be checked for shapes)."""
    problems = []
    kind = _kind(cfg)
    archs = cfg.get("architectures") or []
    if not set(archs) & {a for v in ARCHITECTURES.values() for a in v}:
        problems.append(f"config.json `architectures` = {archs}: engines pick the draft class from it; "
                        f"expected {ARCHITECTURES[kind]}")
    if cfg.get("model_type") != "llama":
        problems.append(f"config.json `model_type` = {cfg.get('model_type')!r}, expected 'llama'")
    if cfg.get("num_hidden_layers") != 1:
        problems.append(f"config.json `num_hidden_layers` = {cfg.get('num_hidden_layers')}: the export holds one "
                        "draft decoder layer; engines would build that many and leave the others uninitialised")
    if cfg.get("tie_word_embeddings", True) is not False:
        problems.append("config.json `tie_word_embeddings` must be false (SGLang would use embed_tokens as lm_head)")
    missing_fields = [k for k in ("hidden_size", "intermediate_size", "num_attention_heads",
                                  "num_key_value_heads", "vocab_size", "rms_norm_eps") if k not in cfg]
    if missing_fields:
        problems.append(f"config.json is missing {', '.join(f'`{k}`' for k in missing_fields)}")
        return problems
    if kind == "eagle3":
        problems += _check_aux_ids(cfg)
        if (cfg.get("draft_vocab_size") or 0) > cfg["vocab_size"]:
            problems.append(f"config.json `draft_vocab_size` = {cfg['draft_vocab_size']} exceeds "
                            f"`vocab_size` = {cfg['vocab_size']}")

    required, optional = expected_layout(cfg)
    for name in required:
        if name not in tensors:
            why = {"d2t": " (engines map draft ids to target ids with it; without it every drafted token "
                          "is a wrong id and nothing is accepted)",
                   "t2d": " (the target-vocabulary membership mask of the draft vocabulary)"}.get(name, "")
            problems.append(f"model.safetensors: `{name}` is missing{why}")
    for name in sorted(set(tensors) - set(required) - set(optional)):
        problems.append(f"model.safetensors: unexpected tensor `{name}` (not part of the {kind} layout)")
    float_dtype = DTYPES.get(cfg.get("torch_dtype"))
    for name, (shape, want) in {**required, **optional}.items():
        t = tensors.get(name)
        if t is None:
            continue
        if tuple(t.shape) != tuple(shape):
            problems.append(f"model.safetensors: `{name}` has shape {list(t.shape)}, config.json implies "
                            f"{list(shape)} ({_dims_of(name)})")
        if want == "int64" and t.dtype != torch.int64:
            problems.append(f"model.safetensors: `{name}` is {t.dtype}, engines load it as int64 offsets")
        elif want == "bool" and t.dtype != torch.bool:
            problems.append(f"model.safetensors: `{name}` is {t.dtype}, expected bool")
        elif want == "float":
            if not t.is_floating_point():
                problems.append(f"model.safetensors: `{name}` is {t.dtype}, expected a float dtype")
            elif float_dtype is not None and t.dtype != float_dtype:
                problems.append(f"model.safetensors: `{name}` is {t.dtype} but config.json `torch_dtype` is "
                                f"{cfg.get('torch_dtype')}")
            elif t.device.type != "meta" and not torch.isfinite(t.float()).all():
                problems.append(f"model.safetensors: `{name}` has NaN or inf values")
            elif t.device.type != "meta" and t.numel() and float(t.float().abs().max()) > ABSURD_WEIGHT:
                problems.append(f"model.safetensors: `{name}` has |w| up to {float(t.float().abs().max()):.3g} "
                                f"(> {ABSURD_WEIGHT:g}): exploded weights, not a trained head; retrain from a sound "
                                "checkpoint with a lower train.learning_rate")
    if kind == "eagle3" and not problems:
        problems += _check_vocab_maps(cfg, tensors["d2t"], tensors["t2d"])
    return problems


def _check_aux_ids(cfg: dict) -> list:
    problems = []
    top = cfg.get("eagle_aux_hidden_state_layer_ids")
    nested = (cfg.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    if top is None and nested is None:
        return problems  # engines fall back to hidden_states [2, N//2, N-3]
    if top is not None and len(top) != 3 or nested is not None and len(nested) != 3:
        problems.append(f"config.json aux layer ids {top or nested}: EAGLE-3 fuses exactly 3 layers (fc is 3H wide)")
    if top is not None and nested is not None and [i - 1 for i in top] != list(nested):
        problems.append(f"config.json `eagle_aux_hidden_state_layer_ids` = {top} (vLLM: input of layer id) and "
                        f"`eagle_config.eagle_aux_hidden_state_layer_ids` = {nested} (SGLang: output of layer id) "
                        "must differ by exactly one, or one engine reads features a layer off")
    return problems


def _hf_aux_ids(cfg: dict):
    """The aux layers as HF hidden_states indices, from whichever key is present."""
    if cfg.get("eagle_aux_hidden_state_layer_ids"):
        return [int(i) for i in cfg["eagle_aux_hidden_state_layer_ids"]]
    nested = (cfg.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    if nested:
        return [int(i) + 1 for i in nested]
    meta = cfg.get(EXPORT_KEY) or {}
    return meta.get("aux_layers_hf_hidden_states")


def _check_vocab_maps(cfg: dict, d2t: torch.Tensor, t2d: torch.Tensor) -> list:
    if d2t.device.type == "meta":
        return []
    problems, V, Vd = [], cfg["vocab_size"], d2t.numel()
    target_ids = torch.arange(Vd) + d2t.long()
    bad = ((target_ids < 0) | (target_ids >= V)).nonzero().flatten()
    if bad.numel():
        problems.append(f"model.safetensors: `d2t` maps {bad.numel()} draft ids (e.g. {bad[:5].tolist()}) outside "
                        f"the target vocabulary [0, {V}) (target id = i + d2t[i])")
        return problems
    if target_ids.unique().numel() != Vd:
        problems.append("model.safetensors: `d2t` maps several draft ids to the same target id")
    count = int(t2d.sum())
    if count != Vd:
        problems.append(f"model.safetensors: `t2d` marks {count} target tokens but `draft_vocab_size` is {Vd}")
    if not bool(t2d[target_ids].all()):
        problems.append("model.safetensors: `t2d` and `d2t` disagree (some i + d2t[i] are not marked in t2d)")
    return problems


def check_target(cfg: dict, target_config) -> list:
    """Problems of an exported config against the target's HF config (object or dict)."""
    t = target_config if isinstance(target_config, dict) else target_config.to_dict()
    if "text_config" in t and "hidden_size" not in t:
        t = t["text_config"]
    problems = []
    width = cfg.get("target_hidden_size") or cfg.get("hidden_size")
    if width != t.get("hidden_size"):
        problems.append(f"config.json `hidden_size` = {cfg.get('hidden_size')} (feature width {width}) but the "
                        f"target's `hidden_size` is {t.get('hidden_size')}")
    if cfg.get("vocab_size") != t.get("vocab_size"):
        problems.append(f"config.json `vocab_size` = {cfg.get('vocab_size')} but the target's `vocab_size` is "
                        f"{t.get('vocab_size')} (draft token ids would not be the target's)")
    n = t.get("num_hidden_layers")
    meta = cfg.get(EXPORT_KEY) or {}
    if meta.get("num_target_layers") and n and meta["num_target_layers"] != n:
        problems.append(f"the head was trained on a target with {meta['num_target_layers']} layers but this "
                        f"target's `num_hidden_layers` is {n}")
    if _kind(cfg) == "eagle3" and n:
        hf = _hf_aux_ids(cfg)
        if hf and not all(1 <= i <= n - 1 for i in hf):
            problems.append(f"config.json `eagle_aux_hidden_state_layer_ids` = {hf} must lie in [1, {n - 1}] for a "
                            f"target with `num_hidden_layers` = {n} (SGLang ids = these - 1)")
    return problems


def check_export(folder, target_config=None) -> list:
    """Every problem of an exported folder, each naming the file, key or tensor; [] when it is fine."""
    folder = Path(folder)
    cfg_file, weights = folder / "config.json", folder / "model.safetensors"
    missing = [p.name for p in (cfg_file, weights) if not p.is_file()]
    if missing:
        return [f"{folder}: {', '.join(missing)} missing (write it with `eagle-train export recipe.yaml`)"]
    try:
        cfg = read_config(cfg_file)
        tensors = read_weights(weights)
    except HeadError as err:
        return [str(err)]
    problems = check_layout(cfg, tensors)
    if target_config is not None:
        problems += check_target(cfg, target_config)
    return problems


# ---------------------------------------------------------------------------------------------
# load back


def _resolve_folder(path) -> Path:
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


def _rope(cfg: dict):
    """(rope_theta, rope_scaling) from legacy keys or transformers 5 `rope_parameters`."""
    params = dict(cfg.get("rope_parameters") or {})
    theta = cfg.get("rope_theta", params.pop("rope_theta", 10000.0))
    scaling = cfg.get("rope_scaling") or {k: v for k, v in params.items() if k != "rope_theta"} or None
    if scaling:
        scaling = {k: v for k, v in scaling.items() if k != "rope_theta"}
        if "type" in scaling and "rope_type" not in scaling:
            scaling["rope_type"] = scaling.pop("type")
        if scaling.get("rope_type", "default") == "default":
            scaling = None
    return float(theta), scaling


def load_exported(path, target=None, map_location="cpu"):
    """Rebuild an Eagle3Head / Eagle1Head (fp32) from an exported folder or hub id; embed_tokens
    (and the EAGLE-1 lm_head) come from the file when present, else from `target`."""
    folder = _resolve_folder(path)
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
    theta, scaling = _rope(cfg)
    common = dict(hidden_size=H, intermediate_size=cfg["intermediate_size"], num_attention_heads=nh,
                  num_key_value_heads=cfg.get("num_key_value_heads", nh), head_dim=cfg.get("head_dim") or H // nh,
                  vocab_size=cfg["vocab_size"], rms_norm_eps=cfg["rms_norm_eps"], rope_theta=theta,
                  rope_scaling=scaling, max_position_embeddings=cfg.get("max_position_embeddings", 8192),
                  num_target_layers=n_target, hidden_act=cfg.get("hidden_act", "silu"))
    if _kind(cfg) == "eagle3":
        aux = _hf_aux_ids(cfg)
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
        raise HeadError(f"{folder}/model.safetensors does not fit the {_kind(cfg)} layout: missing {bad}, "
                         f"unexpected {unexpected} (run `eagle-train check {folder}`)")
    if target is not None:
        embed_in_file = "embed_tokens.weight" in state
        saved = head.embed_tokens.weight.data.clone() if embed_in_file else None
        head.load_target_embeddings(target)
        if embed_in_file:
            head.embed_tokens.weight.data.copy_(saved)
    return head.to(map_location)


# ---------------------------------------------------------------------------------------------
# export stage


def _head_dir(cfg) -> Path:
    candidates = [Path(cfg.train.output) / "final", Path(cfg.eval.head)]
    for c in candidates:
        if (c / "config.json").is_file():
            return c
    raise FileNotFoundError(f"no trained head at {' or '.join(map(str, candidates))}; train one with "
                            "`accelerate launch eagle_train/train.py <recipe.yaml>` (or set eval.head=<folder>)")


def _read_json(path: Path):
    try:
        return json.loads(path.read_text()) if path.is_file() else None
    except json.JSONDecodeError as err:
        print(f"[export] warning: {path} is not valid JSON ({err}); left out of the model card")
        return None


def _target_config(tcfg):
    """The target's HF config, or None when it cannot be read offline (the check then skips it)."""
    from transformers import AutoConfig

    from eagle_train.target import resolve_model_path

    try:
        path = resolve_model_path(tcfg.model, tcfg.cache_dir, tcfg.gguf_file)
        return AutoConfig.from_pretrained(path, revision=tcfg.revision, trust_remote_code=tcfg.trust_remote_code)
    except Exception as err:  # no network / gated model: export still works, the check says so
        print(f"[export] note: target config of {tcfg.model!r} not readable ({type(err).__name__}); "
              "checking the export without it")
        return None


def _target_digest(cfg):
    """weights_digest of the recipe's target from its files (None when they are not here)."""
    from eagle_train.errors import EagleError
    from eagle_train.target import resolve_model_path, weights_digest
    from eagle_train.train import target_weights

    try:
        path = Path(resolve_model_path(cfg.target.model, cfg.target.cache_dir, cfg.target.gguf_file))
        if not list(path.glob("*.safetensors")):  # a hub id or another format: not worth loading the model
            return None
        _, embed, lm_head, norm = target_weights(cfg)
    except (OSError, EagleError, KeyError) as err:
        print(f"[export] note: target weights of {cfg.target.model!r} not readable ({type(err).__name__}); "
              "the head's target is not compared")
        return None
    return weights_digest(embed, lm_head, norm, cfg.target.dtype)


def main(cfg) -> int:
    from omegaconf import OmegaConf

    from eagle_train import model_card

    src = _head_dir(cfg)
    target = None
    if cfg.hub.include_embed_tokens:
        from eagle_train.target import load_target

        target, _ = load_target(cfg.target, with_tokenizer=False)
    head = load_head(src, target=target)
    info = read_config(src / "config.json")
    made_for = head_provenance(src)
    digest = _target_digest(cfg)
    check_head_matches(head, made_for, cfg, digest, f"the head at {src}")
    recipe_yaml = OmegaConf.to_yaml(cfg)
    provenance = {
        "target": cfg.target.model,
        "target_revision": cfg.target.revision,
        "source": str(src),
        "recipe_sha256": hashlib.sha256(recipe_yaml.encode()).hexdigest(),
        "target_digest": made_for.get("target_digest") or digest,
    }
    # the trainer writes {"step", "metrics", ...} beside the head and into its config.json
    train_state = (_read_json(src / "train_state.json") or info.get("eagle_train", {}).get("train_state")
                   or _read_json(Path(cfg.train.output) / "train_state.json"))
    card = model_card.render(
        head=head, cfg=cfg, recipe_yaml=recipe_yaml,
        train_state=train_state or None,
        data_stats=_read_json(Path(cfg.data.output) / "stats.json"),
        report=_read_json(Path(cfg.eval.output) / "report.json"),
        sweep=_read_json(Path(cfg.eval.output) / "sweep.json"),
        config=engine_config(head, cfg.hub.dtype, provenance),
    )
    out = export_head(head, cfg.hub.export_dir, cfg.hub.dtype, cfg.hub.include_embed_tokens, card, provenance)
    print(f"[export] {head_type(head)} head {src} -> {out} ({cfg.hub.dtype})")
    for f in sorted(out.iterdir()):
        print(f"  {f.name:20s} {f.stat().st_size / 2**20:9.2f} MiB")
    problems = check_export(out, _target_config(cfg.target))
    return _report(out, problems)


def _report(folder, problems) -> int:
    if problems:
        print(f"[check] {folder}: {len(problems)} problem(s):", file=sys.stderr)
        for p in problems:
            print(f"  - {p}", file=sys.stderr)
        return 1
    print(f"[check] {folder}: OK (layout, shapes, dtypes, d2t/t2d)")
    return 0


def cli(argv) -> int:
    from eagle_train.recipe import load_recipe, split_args

    path, overrides = split_args(list(argv))
    return main(load_recipe(path, overrides))


def check_cli(argv) -> int:
    """`eagle-train check <folder | recipe.yaml> [--target <model | recipe.yaml>] [key=value ...]`."""
    from omegaconf import OmegaConf

    from eagle_train.recipe import TargetConfig, load_recipe

    ap = argparse.ArgumentParser(prog="eagle-train check", description=check_cli.__doc__)
    ap.add_argument("folder", help="exported folder, or a recipe (checks its hub.export_dir against its target)")
    ap.add_argument("--target", help="target model (hub id, folder, alias) or a recipe whose target to use")
    args, overrides = ap.parse_known_args(list(argv))
    folder, tcfg = Path(args.folder), None
    if folder.suffix in (".yaml", ".yml"):
        rcfg = load_recipe(folder, overrides)
        folder, tcfg = Path(rcfg.hub.export_dir), rcfg.target
    if args.target:
        if args.target.endswith((".yaml", ".yml")):
            tcfg = load_recipe(args.target, overrides).target
        else:
            tcfg = OmegaConf.structured(TargetConfig(model=args.target))
    target_config = _target_config(tcfg) if tcfg is not None else None
    if tcfg is not None and target_config is None:
        print("[check] warning: checked without the target config", file=sys.stderr)
    return _report(folder, check_export(folder, target_config))


if __name__ == "__main__":
    from eagle_train.cli import run_stage

    sys.exit(run_stage("export", cli, sys.argv[1:]))
