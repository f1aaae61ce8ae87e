"""Read a dump (data_prep/dump.py) back for offline training.

    ds = FeatureDataset("outputs/run/dump")          # held-out split: FeatureDataset(".../dump/eval")
    loader = DataLoader(ds, batch_size=8, shuffle=True, collate_fn=collate)

Shards are memory-mapped with `safetensors.safe_open` and only the rows of the asked sample are read.
An item is a dict of tensors for one sample of length L:
    input_ids (L,) int64, loss_mask (L,) int64 (1 on assistant reply tokens),
    aux (L, 3H)          EAGLE-3 dumps: HF hidden_states at manifest["aux_layers"], concatenated
    last (L, H)          storage full: post-norm last hidden state
    topk_logp (L, k) float32, topk_ids (L, k) int64   storage topk: target top-k next-token log-probs
Hidden features come back dequantized as `dtype` (float32 by default) whatever the stored dtype
(bfloat16, float16, float32 or float8 with per-token scales, see eagle_train/features.py).
"""

from __future__ import annotations

import bisect
import hashlib
import json
import os
from pathlib import Path
from typing import Dict, List

import numpy as np
import torch
from torch.utils.data import Dataset

from eagle_train.errors import DumpError
from eagle_train.features import dequantize_fp8

# manifest field -> the recipe key that sets it: offline training checks the dump against the
# recipe on these (a dump made with other aux layers would train a head whose config lies)
CONTRACT = [("target_id", "target.model"), ("target_digest", "target.model (its weights)"),
            ("head_type", "head.type"), ("aux_layers", "head.aux_layers"), ("storage", "dump.storage"),
            ("dtype", "dump.dtype"), ("topk", "dump.topk"), ("max_length", "data.max_length"),
            ("hidden_size", "target.model"), ("num_layers", "target.model"), ("vocab_size", "target.model"),
            ("tokenizer_digest", "data.output (the corpus was prepared with another tokenizer or chat template)")]


def check_contract(manifest: dict, expected: dict, folder) -> None:
    """Stop when the dump was made for another target or head than the recipe says (fields the
    manifest predates are skipped); names the key and both values."""
    for field, key in CONTRACT:
        ours, theirs = expected.get(field), manifest.get(field)
        if ours is not None and theirs is not None and ours != theirs:
            raise DumpError(f"{folder}/manifest.json: the dump has {field} = {theirs!r} but the recipe "
                            f"gives {ours!r} (`{key}`); set {key} to the dump's value or dump again "
                            "with this recipe into another dump.output")


def check_targets(manifest: dict, loss_positions: str, folder) -> None:
    """A dump made with dump.targets=replies holds no targets at user-turn positions: training there needs `all`."""
    if loss_positions == "all" and manifest.get("targets") == "replies":
        raise DumpError(f"{folder}/manifest.json: the dump keeps the target's top-k at reply positions only "
                        "(dump.targets=replies) but train.loss_positions=all trains on every token; dump again with "
                        "dump.targets=all into another dump.output, or set train.loss_positions=assistant")


def sha256_file(path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 24), b""):
            h.update(block)
    return h.hexdigest()


class FeatureDataset(Dataset):
    def __init__(self, folder, dtype: torch.dtype = torch.float32, key: str | None = None):
        self.folder = Path(folder)
        path = self.folder / "manifest.json"
        if not path.is_file():  # `key`: the recipe key that named the folder, for the message
            named = f" ({key})" if key else ""
            raise FileNotFoundError(f"no dump at {self.folder}{named} (manifest.json missing); "
                                    f"create it with `eagle-train dump <recipe>`")
        try:
            self.manifest = json.loads(path.read_text())
            self.manifest["shards"]
        except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError):
            raise DumpError(f"{path} is damaged (not the JSON the dump writes); rerun `eagle-train dump <recipe>` "
                            "with the same recipe: it rebuilds the manifest from the progress/ records") from None
        if not self.manifest.get("complete"):
            raise FileNotFoundError(f"the dump at {self.folder} is incomplete (interrupted?); rerun "
                                    f"`eagle-train dump <recipe>` with the same recipe to finish it")
        self.dtype = dtype
        self.shards = [s["file"] for s in self.manifest["shards"]]
        self.ids: List[str] = [i for s in self.manifest["shards"] for i in s["ids"]]
        self.lengths: List[int] = [n for s in self.manifest["shards"] for n in s["lengths"]]
        # sample i lives in shard j = bisect(first, i) - 1, at rows offsets[j][i - first[j]] ...
        self.first = np.concatenate([[0], np.cumsum([s["num_samples"] for s in self.manifest["shards"]])]).tolist()
        self.offsets = [np.concatenate([[0], np.cumsum(s["lengths"])]).tolist() for s in self.manifest["shards"]]
        self._handles, self._pid = {}, None
        self._verified = set()  # shards whose sha256 this process checked (once per shard per process)

    aux_layers = property(lambda self: self.manifest["aux_layers"])
    storage = property(lambda self: self.manifest["storage"])
    hidden_size = property(lambda self: self.manifest["hidden_size"])

    def __len__(self) -> int:
        return len(self.ids)

    def _open(self, j: int):
        from safetensors import safe_open

        if self._pid != os.getpid():  # DataLoader workers open their own maps
            self._handles, self._pid = {}, os.getpid()
        if j not in self._handles:
            path = self.folder / self.shards[j]
            self.verify(j)
            try:
                self._handles[j] = safe_open(str(path), framework="pt")
            except Exception as err:  # safetensors raises its own error type for a damaged header
                raise DumpError(f"{path}: not a readable safetensors shard ({err}); rerun the dump") from None
        return self._handles[j]

    def verify(self, j: int) -> None:
        """sha256 of shard j against its manifest record: flipped or missing bytes stop here, not in training."""
        if j in self._verified:
            return
        path, want = self.folder / self.shards[j], self.manifest["shards"][j].get("sha256")
        if not path.is_file():
            raise DumpError(f"{path}: shard listed in manifest.json is missing; rerun `eagle-train dump <recipe>` "
                            "with the same recipe (it redoes the shard)")
        if want is not None and sha256_file(path) != want:
            raise DumpError(f"{path}: sha256 check failed (the shard changed after the dump wrote it); rerun "
                            "`eagle-train dump <recipe>` with the same recipe: it redoes that shard")
        self._verified.add(j)

    def _rows(self, i: int):
        """(open shard, first row, end row) of sample i."""
        if not 0 <= i < len(self):
            raise IndexError(i)
        j = bisect.bisect_right(self.first, i) - 1
        k = i - self.first[j]
        return self._open(j), self.offsets[j][k], self.offsets[j][k + 1]

    def __getitem__(self, i: int) -> Dict[str, torch.Tensor]:
        f, a, b = self._rows(i)
        names = set(f.keys())
        item = {"input_ids": f.get_slice("input_ids")[a:b].long(),
                "loss_mask": f.get_slice("loss_mask")[a:b].long()}
        for name in ("aux", "last"):
            if name in names:
                x = f.get_slice(name)[a:b]
                if name + "_scale" in names:
                    x = dequantize_fp8(x, f.get_slice(name + "_scale")[a:b], self.dtype)
                item[name] = x.to(self.dtype)
        if "topk_logp" in names:
            item["topk_logp"] = f.get_slice("topk_logp")[a:b].float()
            item["topk_ids"] = f.get_slice("topk_ids")[a:b].to(torch.int64)
        return item

    def top1_pairs(self):
        """(target top-1 ids, loss_mask) of every sample of a topk dump, without reading the features."""
        for i in range(len(self)):
            f, a, b = self._rows(i)
            yield f.get_slice("topk_ids")[a:b][:, 0].long(), f.get_slice("loss_mask")[a:b].long()

    def token_pairs(self):
        """(input_ids, loss_mask) of every sample, without reading the features (draft-vocabulary counts)."""
        for i in range(len(self)):
            f, a, b = self._rows(i)
            yield f.get_slice("input_ids")[a:b].tolist(), f.get_slice("loss_mask")[a:b].tolist()


class ConcatFeatures(Dataset):
    """Several dumps read as one (train.extra_dumps): the samples of `parts` in order. `folder` and
    `manifest` are the first part's (the recipe's dump.output)."""

    def __init__(self, parts: List[FeatureDataset]):
        self.parts = parts
        self.folder, self.manifest = parts[0].folder, parts[0].manifest
        self.lengths = [n for p in parts for n in p.lengths]
        self.first = np.concatenate([[0], np.cumsum([len(p) for p in parts])]).tolist()

    def __len__(self) -> int:
        return self.first[-1]

    def __getitem__(self, i: int) -> Dict[str, torch.Tensor]:
        if not 0 <= i < len(self):
            raise IndexError(i)
        j = bisect.bisect_right(self.first, i) - 1
        return self.parts[j][i - self.first[j]]


def collate(batch: List[Dict[str, torch.Tensor]]) -> Dict[str, torch.Tensor]:
    """Pad every field to the longest sample with zeros; adds attention_mask (B, L) int64."""
    width = max(len(x["input_ids"]) for x in batch)
    out = {}
    for name in batch[0]:
        first = batch[0][name]
        t = first.new_zeros((len(batch), width, *first.shape[1:]))
        for i, x in enumerate(batch):
            t[i, :len(x[name])] = x[name]
        out[name] = t
    out["attention_mask"] = torch.zeros(len(batch), width, dtype=torch.int64)
    for i, x in enumerate(batch):
        out["attention_mask"][i, :len(x["input_ids"])] = 1
    return out
