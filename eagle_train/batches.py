"""Batches and their training targets, for eagle_train/train.py: where the samples come from (the
dump offline, the prepared corpus online), which of them form each rank's micro-batches (seeded,
length-bucketed), and the targets each position is trained on (`add_targets`)."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import torch

from eagle_train.draft_vocab import count_tokens
from eagle_train.dump_reader import ConcatFeatures, FeatureDataset, collate
from eagle_train.eagle3 import check_aux_layers
from eagle_train.recipe import RecipeError
from eagle_train.target import target_id


@torch.no_grad()
def add_targets(b, head_type, lm_head_w, draft_ids, t2d_index, chunk=2048, positions="assistant", temperature=1.0,
                copy_weight=1.0):
    """Training targets. `valid` (B, L): positions whose token is trained on (`positions`: the
    assistant replies, or every real token). EAGLE-3 adds `p`, the target distribution at every
    position restricted to the draft vocabulary and renormalized, and `top1` (target ids); a
    position whose target top-1 lies outside the draft vocabulary is not valid (the head cannot
    propose it). From the lean dump's top-k, `p` stays sparse: (draft ids, probs) each (B, L, k).
    `temperature` < 1 sharpens `p` (p ** (1 / T), renormalized) toward the target's top-1; `top1` is unchanged.
    `copy_weight` != 1 adds `weight` (B, L): copy_weight at the valid positions prompt lookup would get right
    (`copyable`), 1 at the other valid ones, 0 elsewhere."""
    real = b["attention_mask"].bool()
    b["valid"] = real & (b["loss_mask"].bool() if positions == "assistant" else real)
    if head_type == "eagle1":
        return b
    if "last" in b:
        last = b["last"].to(lm_head_w.dtype)
        b["p"] = torch.softmax((last @ lm_head_w[draft_ids].T).float() / temperature, dim=-1)
        flat = last.reshape(-1, last.shape[-1])  # exact full-vocabulary argmax, in chunks of tokens
        b["top1"] = torch.cat([(c @ lm_head_w.T).argmax(-1) for c in flat.split(chunk)]).view(last.shape[:2])
    else:
        didx = t2d_index[b["topk_ids"].long()]  # draft id or -1
        logp = b["topk_logp"].float()
        probs = (logp - logp[..., :1]).div(temperature).exp() * (didx >= 0)  # relative to the top-1: no underflow
        b["p"] = (didx.clamp(min=0), probs / probs.sum(-1, keepdim=True).clamp(min=1e-20))
        b["top1"] = b["topk_ids"][..., 0].long()
    # p[t] predicts token t+1: token t+1 is learnable only if the target's top-1 at t is a draft token
    b["valid"][:, 1:] &= t2d_index[b["top1"][:, :-1]] >= 0
    if copy_weight != 1.0:
        b["weight"] = b["valid"].float() * (1 + (copy_weight - 1) * copyable(b["input_ids"], b["top1"]))
    return b


COPY_NGRAM = 3


def copyable(ids, top1, n=COPY_NGRAM):
    """(B, L) bool: the target's top-1 for token t (top1[t-1]) is what prompt lookup proposes there, the
    token that followed the latest earlier occurrence of the n tokens before t. SmolLM2 repeats itself
    (bench/RESULTS.md "## Where in a reply the head is accepted"); these positions are where the head
    has to copy."""
    return copy_sources(ids, top1, n) >= 0


def copy_sources(ids, top1, n=COPY_NGRAM):
    """(B, L) long: for a `copyable` position t, the position of the token prompt lookup copies there
    (so bench/reply_position.py can tell a copy from the prompt from a repeat of the reply); -1 elsewhere."""
    out = torch.full(ids.shape, -1, dtype=torch.long)
    for r, (seq, nxt) in enumerate(zip(ids.tolist(), top1.tolist())):
        seen = {}
        for t in range(n, len(seq)):
            key = tuple(seq[t - n:t])
            j = seen.get(key)
            if j is not None and seq[j] == nxt[t - 1]:
                out[r, t] = j
            seen[key] = t
    return out.to(ids.device)


def pad_collate(batch):
    """Right-pad prepared-corpus samples (online mode) to the longest."""
    L = max(len(x["input_ids"]) for x in batch)
    out = {k: torch.zeros(len(batch), L, dtype=torch.long) for k in ("input_ids", "loss_mask", "attention_mask")}
    for i, x in enumerate(batch):
        n = len(x["input_ids"])
        out["input_ids"][i, :n] = torch.as_tensor(x["input_ids"])
        out["loss_mask"][i, :n] = torch.as_tensor(x["loss_mask"])
        out["attention_mask"][i, :n] = 1
    return out


def open_data(cfg, split):
    """(dataset, collate) for a split ("train" or "eval"); None for a missing or empty eval split
    (data.eval_fraction=0: no held-out metrics, rather than zeros from no batches)."""
    if cfg.train.extra_dumps and cfg.train.mode != "offline":
        raise RecipeError("`train.extra_dumps` are read by offline training; set train.mode=offline "
                          "or leave train.extra_dumps empty")
    if cfg.train.mode == "offline":
        held_out = cfg.train.eval_dump if split == "eval" else None
        folder = Path(held_out or cfg.dump.output) / ("eval" if split == "eval" else "")
        if held_out:  # named by the recipe: a missing or empty held-out split is an error, not "no metrics"
            ds = FeatureDataset(folder, key="train.eval_dump")
            if len(ds) == 0:
                raise FileNotFoundError(f"`train.eval_dump` = {held_out}: no held-out samples at {folder} (a dump "
                                        f"made with data.eval_fraction > 0 has them)")
            return ds, collate
        if not (folder / "manifest.json").is_file():
            if split == "eval":
                return None
            raise FileNotFoundError(f"no dump at {folder} (train.mode=offline reads dump.output); create it with "
                                    f"`eagle-train dump <recipe>` or train with train.mode=online")
        ds = FeatureDataset(folder)
        if split == "eval" and len(ds) == 0:
            return None
        if split == "train" and cfg.train.extra_dumps:
            ds = ConcatFeatures([ds] + [FeatureDataset(f, key=f"train.extra_dumps[{i}]")
                                        for i, f in enumerate(cfg.train.extra_dumps)])
        return ds, collate
    from eagle_train.data_prep.dump import load_split  # the dump's reader: names a damaged file

    folder = Path(cfg.data.output) / split
    if not folder.is_dir():
        if split == "eval":
            return None
        raise FileNotFoundError(f"no prepared corpus at {folder} (data.output); create it with `eagle-train prep <recipe>`")
    ds = load_split(folder).with_format(None)
    return (ds, pad_collate) if split == "train" or len(ds) else None


def dump_expectation(cfg, tconf, digest):
    """What the dump's manifest must say for this recipe (eagle_train.dump_reader.CONTRACT)."""
    storage = cfg.dump.storage
    aux = check_aux_layers(cfg.head.aux_layers, tconf.num_hidden_layers) if cfg.head.type == "eagle3" else None
    return {"target_id": target_id(cfg.target), "target_digest": digest, "head_type": cfg.head.type,
            "aux_layers": aux, "storage": storage, "dtype": cfg.dump.dtype,
            "topk": cfg.dump.topk if storage == "topk" else None, "max_length": cfg.data.max_length,
            "hidden_size": tconf.hidden_size, "num_layers": tconf.num_hidden_layers, "vocab_size": tconf.vocab_size,
            "tokenizer_digest": _read_json(Path(cfg.data.output) / "stats.json").get("tokenizer_digest")}


def _read_json(path) -> dict:
    try:
        return json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError):
        return {}


def corpus_pairs(cfg, ds):
    """(input_ids, loss_mask) of every training sample, for the draft-vocabulary counts."""
    from datasets import load_from_disk

    extra = ds.parts[1:] if isinstance(ds, ConcatFeatures) else []
    first = ds.parts[0] if extra else ds
    folder = Path(cfg.data.output) / "train"
    if cfg.train.mode == "offline" and folder.is_dir():  # the prepared corpus is cheaper to scan than the dump
        first = load_from_disk(str(folder))
    if hasattr(first, "token_pairs"):
        pairs = first.token_pairs()
    elif hasattr(first, "column_names"):
        pairs = zip(first["input_ids"], first["loss_mask"])
    else:
        pairs = ((first[i]["input_ids"], first[i]["loss_mask"]) for i in range(len(first)))
    return itertools.chain(pairs, *(p.token_pairs() for p in extra))  # extra dumps: their own token columns


def draft_vocab_counts(cfg, ds, vocab_size):
    """Counts (vocab_size,) the EAGLE-3 draft vocabulary is ranked by (`head.draft_vocab_counts`): the corpus' reply
    tokens, or the target's top-1 (the dumps' topk_ids[:, 0]) where a trained token follows."""
    if cfg.head.draft_vocab_counts == "replies":
        return count_tokens(corpus_pairs(cfg, ds), vocab_size)
    parts = ds.parts if isinstance(ds, ConcatFeatures) else [ds]
    if cfg.train.mode != "offline" or any(getattr(p, "storage", None) != "topk" for p in parts):
        raise RecipeError("head.draft_vocab_counts=target_top1 counts the target's top-1 from a dump.storage=topk "
                          f"dump (train.mode=offline); this run has train.mode={cfg.train.mode}, "
                          f"storage {[getattr(p, 'storage', None) for p in parts]}: use head.draft_vocab_counts=replies")
    return count_target_top1(parts, vocab_size, cfg.train.loss_positions)


def count_target_top1(dumps, vocab_size, positions="assistant"):
    """Counts (vocab_size,) of the target's top-1 over top-k dumps, at the positions whose next token is trained
    (`positions` assistant: a reply token follows; all: every position but a sample's last)."""
    counts = torch.zeros(vocab_size, dtype=torch.long)
    for top1 in trained_top1(dumps, positions):
        counts += torch.bincount(top1, minlength=vocab_size)[:vocab_size]
    return counts


def trained_top1(dumps, positions="assistant"):
    """Per sample of top-k dumps, the target's top-1 where the next token is trained (the target at t is token t+1's
    distribution; the dump keeps it only there under dump.targets=replies)."""
    for part in dumps:
        for top1, mask in part.top1_pairs():
            trained = mask[1:].bool() if positions == "assistant" else torch.ones(len(mask) - 1, dtype=torch.bool)
            yield top1[:-1][trained]


def batch_indices(n, mb, world, rank, seed, epoch, lengths=None, bucket=64):
    """This rank's micro-batches of one epoch: a seeded permutation split into global batches.
    With `lengths`, each run of `bucket` global batches of the permutation is sorted by length
    before it is cut (samples padded to a similar length), and the batches are shuffled again."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
    perm = torch.randperm(n, generator=g).tolist()
    per = mb * world
    perm = perm[:n - n % per]
    if lengths is not None:
        span = per * bucket
        perm = [i for c in range(0, len(perm), span) for i in sorted(perm[c:c + span], key=lambda i: lengths[i])]
        order = torch.randperm(len(perm) // per, generator=g).tolist()
        perm = [i for j in order for i in perm[j * per:(j + 1) * per]]
    return [perm[i + rank * mb:i + (rank + 1) * mb] for i in range(0, len(perm), per)]


def sample_lengths(ds):
    """Token count of every sample (the dump's manifest, or the prepared corpus)."""
    if hasattr(ds, "lengths"):
        return list(ds.lengths)
    return [len(x) for x in ds["input_ids"]]


def load_batch(ds, collate, idx, device):
    return {k: v.to(device) for k, v in collate([ds[i] for i in idx]).items() if torch.is_tensor(v)}


def feature_rms(b):
    """Per-dim RMS of the aux features of batch `b` over its real tokens (feature normalization)."""
    aux, m = b["aux"].float(), b["attention_mask"].bool()
    return aux[m].pow(2).mean(0).add(1e-6).sqrt()


def eval_batches(accelerator, ds, collate, features, micro_batch_size, max_batches):
    """This rank's held-out batches with their target features, built once and kept for every
    evaluation (online mode would otherwise rerun the target on them each time), as (batch, weight).
    Every rank runs the same number of forwards (ZeRO-3 gathers weights inside them, and the stats
    tensor reduced in `evaluate` must have one length): a rank short of batches repeats one, weight 0."""
    every = [list(range(i, min(i + micro_batch_size, len(ds)))) for i in range(0, len(ds), micro_batch_size)]
    world, rank = accelerator.num_processes, accelerator.process_index
    n = min(max_batches, -(-len(every) // world))
    mine = every[rank::world][:n]
    return [(features(load_batch(ds, collate, mine[j] if j < len(mine) else every[0], accelerator.device)),
             int(j < len(mine))) for j in range(n)]
