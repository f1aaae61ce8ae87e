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
import json
import os
from pathlib import Path
from typing import Dict, List

import numpy as np
import torch
from torch.utils.data import Dataset

from eagle_train.features import dequantize_fp8


class FeatureDataset(Dataset):
    def __init__(self, folder, dtype: torch.dtype = torch.float32):
        self.folder = Path(folder)
        path = self.folder / "manifest.json"
        if not path.is_file():
            raise FileNotFoundError(f"no dump at {self.folder} (manifest.json missing); "
                                    f"create it with `eagle-train dump <recipe>`")
        self.manifest = json.loads(path.read_text())
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
            self._handles[j] = safe_open(str(self.folder / self.shards[j]), framework="pt")
        return self._handles[j]

    def __getitem__(self, i: int) -> Dict[str, torch.Tensor]:
        if not 0 <= i < len(self):
            raise IndexError(i)
        j = bisect.bisect_right(self.first, i) - 1
        k = i - self.first[j]
        a, b = self.offsets[j][k], self.offsets[j][k + 1]
        f = self._open(j)
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
