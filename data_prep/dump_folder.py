"""A dump folder (data_prep/dump.py): the header that names what made it, whether the folder belongs
to this recipe (`check_folder` refuses to mix runs, naming the differing field), its per-shard
progress records and their check on resume, and the manifest rank 0 merges at the end."""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path
from typing import Dict

import numpy as np
from omegaconf import OmegaConf

from eagle_train.dump_reader import sha256_file
from eagle_train.eagle3 import check_aux_layers
from eagle_train.errors import CorpusError, DumpError
from eagle_train.files import atomic_save, refuse_orphan_pieces
from eagle_train.recipe import RecipeError, data_keys_set
from eagle_train.target import compute_dtype, model_digest, target_id

FORMAT = "eagle-train-dump/1"


def run_dtype(cfg) -> str:
    """The dtype the target runs in for the dump (`auto` resolved on this machine: the manifest names the real one)."""
    return compute_dtype(cfg.dump.target_dtype or cfg.target.dtype, cfg.target.device)


def targets_of(cfg):
    """Where the dump keeps target top-k (`dump.targets`); None when it keeps the last hidden state (every position)."""
    return cfg.dump.targets if cfg.dump.storage == "topk" and cfg.head.type == "eagle3" else None


def dump_header(cfg, model) -> dict:
    """Everything the features depend on; stored in the manifest and compared on reruns."""
    conf = model.config.get_text_config()
    n = conf.num_hidden_layers
    aux = check_aux_layers(cfg.head.aux_layers, n) if cfg.head.type == "eagle3" else None
    t, d = cfg.target, cfg.data
    settings = {
        "target": {"model": target_id(t), "revision": t.revision, "gguf_file": t.gguf_file, "dtype": run_dtype(cfg)},
        "data": {k: d[k] for k in ("source", "format", "split", "max_length", "max_conversations",
                                   "system_prompt", "eval_fraction")},
        "dump": {"storage": cfg.dump.storage, "dtype": cfg.dump.dtype,
                 "topk": cfg.dump.topk if cfg.dump.storage == "topk" else None},
        "targets": targets_of(cfg),
        "head": {"type": cfg.head.type, "aux_layers": aux},
    }
    settings["data"] |= data_keys_set(d, ("skip_conversations", "prompt_template", "po_direction"))
    if cfg.regen.enabled:  # the replies are the target's: what generated them is part of the features' identity
        settings["regen"] = {k: cfg.regen[k] for k in ("max_new_tokens", "temperature", "top_p", "max_turns", "seed")}
    settings = json.loads(json.dumps(OmegaConf.to_container(OmegaConf.create(settings))))
    vocab = model.get_output_embeddings().weight.shape[0]
    return {
        "format": FORMAT,
        "target_id": target_id(t),
        "revision": t.revision,
        "commit": getattr(model.config, "_commit_hash", None),
        "target_digest": model_digest(model, t.dtype),
        "tokenizer_digest": _corpus_tokenizer_digest(cfg),
        "aux_layers": aux,
        "head_type": cfg.head.type,
        "storage": cfg.dump.storage,
        "dtype": cfg.dump.dtype,
        "topk": settings["dump"]["topk"],
        "targets": settings["targets"],
        "hidden_size": conf.hidden_size,
        "num_layers": n,
        "vocab_size": vocab,
        "max_length": d.max_length,
        "recipe_hash": hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:16],
        "settings": settings,
    }


# header field -> recipe key the user changes, checked in this order on a rerun
IDENTITY = [("format", None), ("target_id", "target.model"), ("target_digest", "target.model (its weights)"),
            ("revision", "target.revision"),
            ("head_type", "head.type"), ("aux_layers", "head.aux_layers"), ("storage", "dump.storage"),
            ("dtype", "dump.dtype"), ("topk", "dump.topk"), ("targets", "dump.targets"), ("recipe_hash", None)]


def check_folder(out: Path, header: dict) -> None:
    """Refuse to add to a folder that holds a dump made with other settings."""
    path = out / "manifest.json"
    refuse_orphan_pieces(out, path, "shard-*.safetensors", "dump.output")
    if not path.is_file():
        return
    try:
        old = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError):
        _check_records(out, header)
        print(f"[dump] {path} is unreadable; rebuilding it from the progress/ records", file=sys.stderr)
        return
    for field, key in IDENTITY:
        if field == "target_digest" and field not in old:  # a dump from before digests were recorded
            continue
        if old.get(field) != header[field]:
            what = f"`{key}`" if key else field
            if field == "recipe_hash":
                diff = _diff(old.get("settings", {}), header["settings"])
                what = "recipe settings " + ", ".join(f"`{k}` ({a!r} there, {b!r} now)" for k, a, b in diff)
                raise RecipeError(f"{out} (dump.output) holds a dump made with other {what}; refusing to mix them. "
                                  f"Use another dump.output or delete the folder.")
            raise RecipeError(f"{out} (dump.output) holds a dump with {field} = {old.get(field)!r}, but this recipe "
                              f"gives {header[field]!r} ({what}); refusing to mix them. "
                              f"Use another dump.output or delete the folder.")


def _check_records(out: Path, header: dict) -> None:
    """With manifest.json unreadable, the shard records still say which recipe made them."""
    try:
        recs = read_records(out)
    except DumpError:
        recs = None
    hashes = {r.get("recipe_hash") for r in (recs or {}).values()}
    if recs is None or hashes - {header["recipe_hash"]}:
        raise DumpError(f"{out}/manifest.json is unreadable and its progress/ records do not show this recipe made "
                        "the shards; use another dump.output or delete the folder")


def _corpus_tokenizer_digest(cfg):
    """The tokenizer + chat template digest `eagle-train prep` recorded for the corpus (None: not recorded)."""
    path = Path(cfg.data.output) / "stats.json"
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text()).get("tokenizer_digest")
    except (OSError, ValueError, AttributeError) as err:  # without it no later stage could compare tokenizers
        raise CorpusError(f"{path} (data.output) is damaged ({type(err).__name__}); it records the tokenizer the "
                          "corpus was rendered with: rerun `eagle-train prep <recipe>`") from None


def _diff(a: dict, b: dict, prefix: str = "") -> list:
    out = []
    for k in sorted(set(a) | set(b)):
        x, y = a.get(k), b.get(k)
        if isinstance(x, dict) and isinstance(y, dict):
            out += _diff(x, y, f"{prefix}{k}.")
        elif x != y:
            out.append((f"{prefix}{k}", x, y))
    return out


def write_json(path: Path, obj) -> None:
    atomic_save(path, obj, indent=1)


def read_records(out: Path) -> Dict[str, dict]:
    recs = {}
    for p in sorted((out / "progress").glob("shard-*.json")):
        try:
            rec = json.loads(p.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise DumpError(f"{p}: shard record is not valid JSON; delete it and the shard {p.stem} beside it "
                            "and rerun the dump (it redoes that shard's samples)") from None
        recs[rec["file"]] = rec
    return recs


def verify_and_clean(out: Path, rank: int, world: int) -> None:
    """Each rank checks its share of the recorded shards; rank 0 also removes temp files and unrecorded shards."""
    recs = read_records(out)
    for name in sorted(recs)[rank::world]:
        shard, rec_path = out / name, out / "progress" / (name + ".json")
        if not shard.is_file():
            print(f"[dump] {shard}: recorded but missing; redoing its {recs[name]['num_samples']} samples")
            rec_path.unlink(missing_ok=True)
        elif (digest := sha256_file(shard)) != recs[name]["sha256"]:
            print(f"[dump] {shard}: sha256 check FAILED (expected {recs[name]['sha256'][:12]}..., "
                  f"got {digest[:12]}...); redoing its {recs[name]['num_samples']} samples", file=sys.stderr)
            rec_path.unlink(missing_ok=True)
            shard.unlink()
    if rank == 0:
        for p in list(out.glob("*.tmp*")) + list((out / "progress").glob("*.tmp*")):
            p.unlink(missing_ok=True)
        for p in out.glob("shard-*.safetensors"):
            if p.name not in recs:  # renamed but its record never written: killed in between
                p.unlink(missing_ok=True)


def merge_manifest(out: Path, header: dict, rows: np.ndarray, cut: bool = False) -> dict:
    """Rank 0, after every rank finished: all records -> manifest.json; checks nothing is lost or doubled (`cut`: the
    dump stopped at dump.budget_minutes, so a subset of the rows is expected and `planned_samples` records all)."""
    recs = read_records(out)
    got = [r for rec in recs.values() for r in rec["rows"]]
    expected = set(rows.tolist())
    if len(got) != len(set(got)) or not set(got) <= expected or (set(got) != expected and not cut):
        raise RuntimeError(f"{out}: shards hold {len(set(got))} distinct of {len(rows)} expected samples "
                           f"({len(got) - len(set(got))} duplicated); rerun the dump to repair")
    shards = [recs[k] for k in sorted(recs)]
    manifest = {**header, "complete": True, "num_samples": len(got),
                "num_tokens": sum(s["num_tokens"] for s in shards), "bytes": sum(s["bytes"] for s in shards),
                "shards": shards}
    if len(got) < len(expected):
        manifest["planned_samples"] = len(expected)
    write_json(out / "manifest.json", manifest)
    print(f"[dump] {out}: {manifest['num_samples']} samples, {manifest['num_tokens']} tokens, "
          f"{len(shards)} shards, {manifest['bytes'] / max(manifest['num_tokens'], 1):.0f} bytes/token"
          + (f"; dump.budget_minutes left {len(expected) - len(got)} of {len(expected)} samples out"
             if len(got) < len(expected) else ""))
    return manifest
