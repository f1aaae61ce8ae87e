"""Build, save and load draft heads (both families) as a folder: config.json + model.safetensors.

The training output keeps the module's own parameter names plus `eagle_train` metadata in
config.json; `export` turns it into the engines' layout (eagle_train/layout.py), and `load_head`
reads both.
"""

from __future__ import annotations

import json
from pathlib import Path

from safetensors.torch import save_file

from eagle_train.eagle1 import Eagle1Config, Eagle1Head
from eagle_train.eagle3 import Eagle3Config, Eagle3Head
from eagle_train.errors import HeadError
from eagle_train.files import atomic_dir
from eagle_train.layout import load_exported, load_weights, read_config, read_weights

FROZEN = ("embed_tokens.weight",)  # copied from the target at load time, not stored


def build_head(head_cfg, target_config):
    """A fresh head for the recipe's `head` section and the target's HF config."""
    if head_cfg.type == "eagle3":
        cfg = Eagle3Config.from_target(target_config, head_cfg.draft_vocab_size,
                                       head_cfg.aux_layers, head_cfg.intermediate_size)
        return Eagle3Head(cfg)
    cfg = Eagle1Config.from_target(target_config, head_cfg.fc_bias, head_cfg.intermediate_size)
    return Eagle1Head(cfg)


def head_type(head) -> str:
    """"eagle3" or "eagle1" (the head class's `head_type`)."""
    return head.head_type


def save_head(head, out_dir, extra: dict | None = None) -> Path:
    """Atomically write `out_dir` (config.json + model.safetensors, frozen target weights left out)."""
    skip = FROZEN + (("lm_head.weight",) if head.head_type == "eagle1" else ())
    state = {k: v.detach().cpu().contiguous() for k, v in head.state_dict().items()
             if k not in skip and not k.startswith("rotary.")}
    meta = {"eagle_train": {"head_type": head.head_type, "config": head.config.to_dict(), **(extra or {})}}
    with atomic_dir(out_dir) as tmp:
        save_file(state, tmp / "model.safetensors")
        (tmp / "config.json").write_text(json.dumps(meta, indent=2))
    return Path(out_dir)


def load_head(path, target=None, map_location="cpu"):
    """Load a head folder written by `save_head` (or an export, see eagle_train.layout);
    frozen embeddings (and the EAGLE-1 lm_head) come from `target` when given."""
    path = Path(path)
    cfg_file = path / "config.json"
    if not cfg_file.is_file():
        if not path.exists() and str(path).count("/") == 1:  # a hub id (owner/name): exported layout
            return load_exported(str(path), target=target, map_location=map_location)
        raise FileNotFoundError(f"{cfg_file} not found: not a head folder (train writes <train.output>/final)")
    meta = read_config(cfg_file)
    if "eagle_train" not in meta:  # engine layout
        return load_exported(path, target=target, map_location=map_location)
    info = meta["eagle_train"]
    try:
        if info["head_type"] == "eagle3":
            head = Eagle3Head(Eagle3Config(**info["config"]))
        else:
            head = Eagle1Head(Eagle1Config(**info["config"]))
    except (KeyError, TypeError) as err:
        raise HeadError(f"{cfg_file}: `eagle_train` block is incomplete or has unknown fields ({err}); "
                        "save the head again (train writes <train.output>/final)") from None
    state = read_weights(path / "model.safetensors", map_location)
    missing, unexpected = load_weights(head, state, path / "model.safetensors")
    allowed = set(FROZEN) | {"lm_head.weight"} if info["head_type"] == "eagle1" else set(FROZEN)
    bad = [k for k in missing if k not in allowed and not k.startswith("rotary.")]
    if bad or unexpected:
        raise HeadError(f"{path}/model.safetensors: missing {bad}, unexpected {unexpected}")
    if target is not None:
        head.load_target_embeddings(target)
    return head


def head_provenance(path, cfg=None) -> dict:
    """{target, target_digest, tokenizer_digest} a head folder records (training output or export);
    {} when unknown. A head under this recipe's `train.output` that records no tokenizer digest takes
    the one of the corpus it was trained on (`data.output/stats.json`, else the dump manifest)."""
    cfg_file = Path(path) / "config.json"
    if not cfg_file.is_file():
        return {}
    meta = read_config(cfg_file)
    info = (meta.get("eagle_train") or {}).get("train_state") or meta.get("eagle_train_export") or {}
    out = {k: info.get(k) for k in ("target", "target_digest", "tokenizer_digest") if info.get(k) is not None}
    if "tokenizer_digest" not in out and cfg is not None and _inside(path, cfg.train.output):
        for record in (Path(cfg.data.output) / "stats.json", Path(cfg.dump.output) / "manifest.json"):
            digest = _json_field(record, "tokenizer_digest")
            if digest:
                out.update(tokenizer_digest=digest, tokenizer_record=str(record))
                break
    return out


def _inside(path, folder) -> bool:
    try:
        Path(path).expanduser().resolve().relative_to(Path(folder).expanduser().resolve())
        return True
    except ValueError:
        return False


def _json_field(path, key):
    try:
        return json.loads(Path(path).read_text()).get(key)
    except (OSError, ValueError, AttributeError):  # absent or damaged: its own reader reports it
        return None


def check_head_matches(head, provenance: dict, cfg, target_digest=None, where="eval.head",
                       tokenizer_digest=None) -> None:
    """Refuse a head made for another head type, aux layers, target weights or tokenizer / chat
    template than the recipe says."""
    problems = []
    if head.head_type != cfg.head.type:
        problems.append(f"it is an {head.head_type} head but the recipe says head.type={cfg.head.type}")
    aux = getattr(head.config, "aux_layers", None)
    if head.head_type == "eagle3" and cfg.head.aux_layers is not None and list(cfg.head.aux_layers) != list(aux):
        problems.append(f"it reads aux layers {list(aux)} but the recipe says head.aux_layers={list(cfg.head.aux_layers)}")
    theirs = provenance.get("target_digest")
    if theirs and target_digest and theirs != target_digest:
        problems.append(f"it was trained on target {provenance.get('target')!r} (weights digest {theirs}) but "
                        f"target.model={cfg.target.model!r} has weights digest {target_digest}")
    theirs = provenance.get("tokenizer_digest")
    if theirs and tokenizer_digest and theirs != tokenizer_digest:
        record = f" ({provenance['tokenizer_record']})" if provenance.get("tokenizer_record") else ""
        problems.append(f"it was trained on text rendered with tokenizer/chat-template digest {theirs}{record} but "
                        f"the tokenizer of target.model={cfg.target.model!r} has digest {tokenizer_digest} "
                        "(another vocabulary or chat template: the head drafts for other token sequences)")
    if problems:
        raise HeadError(f"{where}: " + "; ".join(problems) + ". Use the head trained for this recipe, or fix the recipe")
