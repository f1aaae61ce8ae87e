"""EAGLE-3 draft vocabulary: the most frequent loss-masked target tokens of the training corpus.

The head's lm_head only scores these tokens. Engines map a draft id back with
`target_id = draft_id + d2t[draft_id]` and test membership with `t2d[target_id]`. Draft ids are
assigned in increasing target-id order, so `d2t` is a non-decreasing offset table.

A draft vocabulary larger than the number of distinct tokens seen is filled with the lowest
unused target ids (deterministic; the head then simply never sees those tokens as targets).
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterable, Optional, Tuple

import torch

from eagle_train.files import atomic_save


def count_tokens(samples: Iterable[Tuple[object, object]], vocab_size: int) -> torch.Tensor:
    """Counts (vocab_size,) of loss-masked tokens over `(input_ids, loss_mask)` pairs."""
    counts = torch.zeros(vocab_size, dtype=torch.long)
    for ids, mask in samples:
        ids = torch.as_tensor(ids, dtype=torch.long)
        mask = torch.as_tensor(mask).bool()
        counts += torch.bincount(ids[mask], minlength=vocab_size)[:vocab_size]
    return counts


def build_draft_vocab(counts: torch.Tensor, draft_vocab_size: int,
                      keep: Optional[torch.Tensor] = None, swap: int = 0) -> Tuple[torch.Tensor, torch.Tensor]:
    """(d2t (Vd,) int64 offsets, t2d (V,) bool) for the `draft_vocab_size` most frequent tokens;
    `keep` (V,) bool: tokens chosen before any other (a head's vocabulary being extended or re-ranked);
    `swap`: up to that many kept tokens, the least counted, give their slots to the most counted tokens
    outside `keep`, each only to one counted more often than itself.

    Ties are broken by the lower token id; the size is capped at the target vocabulary."""
    vocab_size = counts.numel()
    size = min(draft_vocab_size, vocab_size)
    if keep is not None and swap > 0:
        kept, outside = keep.nonzero().squeeze(1), (~keep).nonzero().squeeze(1)
        weakest = kept[torch.sort(counts[kept], stable=True).indices[:swap]]
        best = outside[torch.sort(-counts[outside], stable=True).indices[:swap]]
        n = min(len(weakest), len(best))
        # weakest ascends and best descends: the pairs where the newcomer leads are a prefix
        n = int((counts[best[:n]] > counts[weakest[:n]]).sum())
        keep = keep.clone()
        keep[weakest[:n]] = False  # the freed slots go to the next most frequent, i.e. best[:n]
    if keep is not None:  # ranked above every count
        counts = counts + keep.long() * (int(counts.sum()) + 1)
    # stable sort on -count keeps lower ids first among equal counts
    order = torch.sort(-counts, stable=True).indices
    seen = int((counts > 0).sum())
    chosen = order[:min(size, seen)]
    if chosen.numel() < size:  # fewer distinct tokens than slots: lowest unused ids fill the rest
        unused = torch.ones(vocab_size, dtype=torch.bool)
        unused[chosen] = False
        chosen = torch.cat([chosen, unused.nonzero().squeeze(1)[: size - chosen.numel()]])
    draft_to_target = chosen.sort().values
    d2t = draft_to_target - torch.arange(size)
    t2d = torch.zeros(vocab_size, dtype=torch.bool)
    t2d[draft_to_target] = True
    return d2t, t2d


def draft_ids_of(d2t: torch.Tensor) -> torch.Tensor:
    """Target ids of the draft vocabulary in draft order (draft id i -> i + d2t[i])."""
    return torch.arange(d2t.numel(), device=d2t.device) + d2t


def save_draft_vocab(path: Path, d2t: torch.Tensor, t2d: torch.Tensor, counts: torch.Tensor) -> None:
    """Atomic safetensors file so resumed and multi-process runs reuse the same vocabulary."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    atomic_save(path, {"d2t": d2t, "t2d": t2d, "counts": counts})


def load_draft_vocab(path: Path) -> Tuple[torch.Tensor, torch.Tensor]:
    from safetensors.torch import load_file

    state = load_file(str(path))
    return state["d2t"], state["t2d"]
