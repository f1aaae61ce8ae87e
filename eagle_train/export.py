"""`eagle-train export` and `eagle-train check`: a trained head in the layout vLLM and SGLang load.

    eagle-train export recipe.yaml [key=value ...]     <train.output>/final -> hub.export_dir + README.md
    eagle-train check <folder | recipe.yaml> [--target <model | recipe.yaml>]

What the export holds, per head type, and how the two engines read the aux layer ids:
eagle_train/layout.py (the layout this module writes and checks, and that heads.py loads back).
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from pathlib import Path

import torch
from omegaconf import OmegaConf
from safetensors.torch import save_file

from eagle_train import model_card
from eagle_train.errors import EagleError, HeadError, TargetError
from eagle_train.files import atomic_dir
from eagle_train.heads import check_head_matches, head_provenance, load_head
from eagle_train.layout import (ARCHITECTURES, EXPORT_KEY, config_head_type, engine_config, engine_state,
                                expected_layout, hf_aux_layers, read_config, read_weights)
from eagle_train.recipe import output_folder
from eagle_train.target import DTYPES, load_target, resolve_model_path, target_weights, weights_digest

# no sound head holds a weight this large (trained ones stay within ~100 even with the feature scale
# folded into fc); a diverged run's head does (|w| ~ 1e6 after lr 1e6)
ABSURD_WEIGHT = 1e4


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
    with atomic_dir(out_dir) as tmp:
        save_file(engine_state(head, dtype, include_embed_tokens), tmp / "model.safetensors", metadata={"format": "pt"})
        (tmp / "config.json").write_text(json.dumps(engine_config(head, dtype, provenance), indent=2) + "\n")
        if card is not None:
            (tmp / "README.md").write_text(card)
    return Path(out_dir)


# ---------------------------------------------------------------------------------------------
# check


def check_layout(cfg: dict, tensors: dict) -> list:
    """Problems of a config dict + {name: tensor} against the engine contract (values are only
    inspected on real tensors, so a meta-device export can be checked for shapes)."""
    problems = []
    head_type = config_head_type(cfg)
    archs = cfg.get("architectures") or []
    if not set(archs) & {a for v in ARCHITECTURES.values() for a in v}:
        problems.append(f"config.json `architectures` = {archs}: engines pick the draft class from it; "
                        f"expected {ARCHITECTURES[head_type]}")
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
    if head_type == "eagle3":
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
        problems.append(f"model.safetensors: unexpected tensor `{name}` (not part of the {head_type} layout)")
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
    if head_type == "eagle3" and not problems:
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
    if config_head_type(cfg) == "eagle3" and n:
        hf = hf_aux_layers(cfg)
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
# export stage


def _head_dir(cfg) -> Path:
    # eval.head first: it is the head the eval report in the card measured (a later phase's head, or one trained
    # elsewhere); by default it is train.output's final head anyway
    candidates = [Path(cfg.eval.head), Path(cfg.train.output) / "final"]
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

    try:
        path = resolve_model_path(tcfg.model, tcfg.cache_dir, tcfg.gguf_file)
        return AutoConfig.from_pretrained(path, revision=tcfg.revision, trust_remote_code=tcfg.trust_remote_code)
    except Exception as err:  # no network / gated model: export still works, the check says so
        print(f"[export] note: target config of {tcfg.model!r} not readable ({type(err).__name__}); "
              "checking the export without it")
        return None


def _target_digest(cfg):
    """weights_digest of the recipe's target from its files (None when they are not here)."""
    try:
        path = Path(resolve_model_path(cfg.target.model, cfg.target.cache_dir, cfg.target.gguf_file))
        if not list(path.glob("*.safetensors")):  # a hub id or another format: not worth loading the model
            return None
        _, embed, lm_head, norm = target_weights(cfg.target)
    except (OSError, EagleError, KeyError) as err:
        print(f"[export] note: target weights of {cfg.target.model!r} not readable ({type(err).__name__}); "
              "the head's target is not compared")
        return None
    return weights_digest(embed, lm_head, norm, cfg.target.dtype)


def main(cfg) -> int:
    output_folder(cfg.hub.export_dir, "hub.export_dir")
    src = _head_dir(cfg)
    target = None
    if cfg.hub.include_embed_tokens:
        target, _ = load_target(cfg.target, with_tokenizer=False)
    head = load_head(src, target=target)
    info = read_config(src / "config.json")
    made_for = head_provenance(src, cfg)  # a head without its own tokenizer digest: its corpus' one
    digest = _target_digest(cfg)
    check_head_matches(head, made_for, cfg, digest, f"the head at {src}")
    recipe_yaml = OmegaConf.to_yaml(cfg)
    provenance = {
        "target": cfg.target.model,
        "target_revision": cfg.target.revision,
        "source": str(src),
        "recipe_sha256": hashlib.sha256(recipe_yaml.encode()).hexdigest(),
        "target_digest": made_for.get("target_digest") or digest,
        # the text the head was trained on: eval refuses the export under another tokenizer/chat template
        "tokenizer_digest": made_for.get("tokenizer_digest"),
    }
    # the trainer writes {"step", "metrics", ...} beside the head and into its config.json (only the exported
    # head's own: train.output may hold another phase's)
    train_state = _read_json(src / "train_state.json") or info.get("eagle_train", {}).get("train_state")
    # data.output's corpus stats describe the head only if it trained on that corpus' dump (a later step may
    # have read another: the card then keeps what train_state recorded)
    trained_on = ((train_state or {}).get("data") or {}).get("dump") or {}
    own_corpus = not trained_on.get("folder") or Path(trained_on["folder"]).resolve() == Path(cfg.dump.output).resolve()
    card = model_card.render(
        head=head, cfg=cfg, recipe_yaml=recipe_yaml,
        train_state=train_state or None,
        data_stats=_read_json(Path(cfg.data.output) / "stats.json") if own_corpus else None,
        report=_read_json(Path(cfg.eval.output) / "report.json"),
        sweep=_read_json(Path(cfg.eval.output) / "sweep.json"),
        config=engine_config(head, cfg.hub.dtype, provenance),
    )
    out = export_head(head, cfg.hub.export_dir, cfg.hub.dtype, cfg.hub.include_embed_tokens, card, provenance)
    print(f"[export] {head.head_type} head {src} -> {out} ({cfg.hub.dtype})")
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


def check(folder, tcfg=None) -> int:
    """`eagle-train check`: 0 when the exported `folder` passes (against the target of the recipe
    section `tcfg` when given), else 1 with every problem listed."""
    target_config = _target_config(tcfg) if tcfg is not None else None
    if tcfg is not None and target_config is None:
        if _local_path(tcfg.model):  # asked for by path: checking without it would pass what it was meant to catch
            raise TargetError(f"target {tcfg.model!r}: no such model folder or file (or it does not load); "
                              "give the target's folder, or leave --target out")
        print("[check] warning: checked without the target config", file=sys.stderr)
    return _report(folder, check_export(folder, target_config))


def _local_path(model: str) -> bool:
    """A target given as a path (exists, absolute, ./ ~/, or deeper than a hub id's org/name)."""
    path = Path(os.path.expanduser(model))
    return path.exists() or model.startswith(("/", ".", "~")) or model.count("/") > 1 or path.suffix == ".gguf"


if __name__ == "__main__":
    from eagle_train.cli import run_stage

    sys.exit(run_stage("export", sys.argv[1:]))
