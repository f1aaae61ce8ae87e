"""Build, save and load draft heads (both families) as a folder: config.json + model.safetensors.

The training output keeps the module's own parameter names plus `eagle_train` metadata in
config.json; `export` turns it into the engines' layout, and `load_head` reads both.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from eagle_train.eagle1 import Eagle1Config, Eagle1Head
from eagle_train.eagle3 import Eagle3Config, Eagle3Head

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
    return "eagle3" if isinstance(head, Eagle3Head) else "eagle1"


def save_head(head, out_dir, extra: dict | None = None) -> Path:
    """Atomically write `out_dir` (config.json + model.safetensors, frozen target weights left out)."""
    out = Path(out_dir)
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    skip = FROZEN + (("lm_head.weight",) if head_type(head) == "eagle1" else ())
    state = {k: v.detach().cpu().contiguous() for k, v in head.state_dict().items()
             if k not in skip and not k.startswith("rotary.")}
    save_file(state, tmp / "model.safetensors")
    meta = {"eagle_train": {"head_type": head_type(head), "config": head.config.to_dict(), **(extra or {})}}
    (tmp / "config.json").write_text(json.dumps(meta, indent=2))
    if out.exists():
        shutil.rmtree(out)
    os.replace(tmp, out)
    return out


def load_head(path, target=None, map_location="cpu"):
    """Load a head folder written by `save_head` (or an export, see eagle_train.export);
    frozen embeddings (and the EAGLE-1 lm_head) come from `target` when given."""
    path = Path(path)
    cfg_file = path / "config.json"
    if not cfg_file.is_file():
        if not path.exists() and str(path).count("/") == 1:  # a hub id (owner/name): exported layout
            from eagle_train import export

            return export.load_exported(str(path), target=target, map_location=map_location)
        raise FileNotFoundError(f"{cfg_file} not found: not a head folder (train writes <train.output>/final)")
    meta = json.loads(cfg_file.read_text())
    if "eagle_train" not in meta:
        from eagle_train import export  # engine layout

        return export.load_exported(path, target=target, map_location=map_location)
    info = meta["eagle_train"]
    if info["head_type"] == "eagle3":
        head = Eagle3Head(Eagle3Config(**info["config"]))
    else:
        head = Eagle1Head(Eagle1Config(**info["config"]))
    state = load_file(path / "model.safetensors", device=str(map_location))
    missing, unexpected = head.load_state_dict(state, strict=False)
    allowed = set(FROZEN) | {"lm_head.weight"} if info["head_type"] == "eagle1" else set(FROZEN)
    bad = [k for k in missing if k not in allowed and not k.startswith("rotary.")]
    if bad or unexpected:
        raise ValueError(f"{path}/model.safetensors: missing {bad}, unexpected {unexpected}")
    if target is not None:
        head.load_target_embeddings(target)
    return head
