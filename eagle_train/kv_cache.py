"""Keeping the accepted entries of a KV cache after a tree pass, for one sequence (`commit_cache`,
eagle_train/decoding.py) or a batch whose rows keep different paths and may leave (`compact_cache`,
eagle_train/batch_decoding.py): one mechanism, the batch of one a special case."""

from __future__ import annotations

from typing import List

import torch
from transformers import DynamicCache


def compact_index(lens: torch.Tensor, src: List[List[int]]) -> torch.Tensor:
    """Slot map (B, P') of the compacted cache: row b keeps its committed slots [0, L_b) and then
    the slots src[b] (its accepted entries) at [L_b, L_b + len(src[b])); the rest point at slot
    0 (a finite entry no query sees). P' = max_b L_b + len(src[b])."""
    dev = lens.device
    kept = torch.tensor([len(s) for s in src], device=dev)
    width = max(1, int(kept.max()))
    extra = torch.zeros(len(src), width, dtype=torch.long, device=dev)
    for b, s in enumerate(src):
        if s:
            extra[b, :len(s)] = torch.tensor(s, device=dev)
    s = torch.arange(int((lens + kept).max()), device=dev)[None]
    k = (s - lens[:, None]).clamp(0, width - 1)
    return torch.where(s < lens[:, None], s, torch.where(s < (lens + kept)[:, None], extra.gather(1, k), 0))


def compact(t: torch.Tensor, rows: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """t (B, heads, K, d) -> (B', heads, P', d): rows `rows`, slots `index` (B', P')."""
    t = t.index_select(0, rows)
    return t.gather(2, index[:, None, :, None].expand(-1, t.shape[1], -1, t.shape[3]))


def compact_cache(cache: DynamicCache, rows: torch.Tensor, lens: torch.Tensor, src: List[List[int]]) -> None:
    """Keep rows `rows` of every layer, row j with its committed slots [0, lens[j]) then the slots
    src[j]. While every row stays, the kept entries move down in place and the layer keeps a view
    (the next forward's cat copies the cache anyway: a gather here would copy it a second time);
    when rows leave, one gather drops them."""
    if len(rows) == cache.layers[0].keys.shape[0]:
        b = torch.tensor([j for j, s in enumerate(src) for _ in s], device=rows.device, dtype=torch.long)
        dst = torch.tensor([int(lens[j]) + k for j, s in enumerate(src) for k in range(len(s))], device=rows.device,
                           dtype=torch.long)  # long even when nothing is kept (an empty list is float)
        from_ = torch.tensor([i for s in src for i in s], device=rows.device, dtype=torch.long)
        end = max(int(lens[j]) + len(s) for j, s in enumerate(src))
        for layer in cache.layers:
            for name in ("keys", "values"):
                t = getattr(layer, name)
                t[b, :, dst] = t[b, :, from_]
                setattr(layer, name, t[:, :, :end])
    else:
        index = compact_index(lens, src)
        end = index.shape[1]
        for layer in cache.layers:
            layer.keys, layer.values = compact(layer.keys, rows, index), compact(layer.values, rows, index)
    for layer in cache.layers:
        if isinstance(getattr(layer, "cumulative_length", None), int):
            layer.cumulative_length = end


def keep_rows(cache: DynamicCache, rows: torch.Tensor) -> None:
    """Keep batch rows `rows` of every layer, all their slots (a batch whose finished rows leave)."""
    for layer in cache.layers:
        layer.keys, layer.values = layer.keys.index_select(0, rows), layer.values.index_select(0, rows)


def commit_cache(cache: DynamicCache, past_len: int, keep: torch.Tensor) -> None:
    """A batch of one: keep positions [0, past_len) plus the tree entries `keep` (the accepted path,
    as tree indices) in every layer."""
    dev = cache.layers[0].keys.device
    compact_cache(cache, torch.zeros(1, dtype=torch.long, device=dev), torch.tensor([past_len], device=dev),
                  [[past_len + int(k) for k in keep.tolist()]])
