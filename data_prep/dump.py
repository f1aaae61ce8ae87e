"""Dump stage: run the frozen target over the prepared corpus, write sharded safetensors features.

    eagle-train dump recipe.yaml [key=value ...]
    accelerate launch --num_processes N -m eagle_train.data_prep.dump recipe.yaml   # N GPUs, one share each
    accelerate launch --multi_gpu --num_processes 2 -m eagle_train.data_prep.dump recipe.yaml   # N processes on CPU (gloo)

Reads `data.output/{train,eval}` (written by `eagle-train prep`), keeps samples with any loss-masked
token, sorts them by length and cuts them into batches of at most `dump.batch_tokens` padded tokens.
Batch i goes to rank i % N; each rank writes its own `shard-r<rank>-<n>.safetensors` of about
`dump.shard_size_mb` MiB, and rank 0 merges the per-shard records into `manifest.json`.
`eagle_train.dump_reader.FeatureDataset(dump.output)` reads it back; the held-out split goes to
`<dump.output>/eval` when `dump.include_eval`.

What is stored per token (see eagle_train/features.py for the layer convention and fp8 format):
    head.type eagle3: aux (3 layers, `head.aux_layers`, default HF hidden_states [2, N//2, N-3])
                      + last (dump.storage=full) or topk_logp/topk_ids (dump.storage=topk)
                      topk only at the positions whose next token is a reply token (dump.targets=replies, the
                      default: all the loss reads; zeros elsewhere) or at every token (dump.targets=all)
    head.type eagle1: last (the target distribution is lm_head(last)); needs dump.storage=full
    always: input_ids (int32), loss_mask (uint8); per shard `offsets` (samples -> token rows)
Bytes per token for SmolLM2 (H=576, k=64), next to the 8*H = 4608 of a bf16 last+3-layer dump:
    full/bfloat16 4613, topk/bfloat16 3717, topk/float8 2001 (lean: <= 4*H = 2304), full/float8 2325.
    Measured numbers: bench/RESULTS.md (`python bench/dump.py`).

Resume and safety. Every shard is written to a temp name and renamed, then a record
`progress/<shard>.json` (ids, rows, lengths, sha256) is written the same way. A rerun checks every
recorded shard against its sha256 (a failure is printed by shard name and the shard redone), deletes
shards without a record (killed mid-write), and dumps only the rows no record holds, so samples are
never dropped or duplicated, whatever the number of processes. The first lines of manifest.json name
the target, layers, storage and a hash of the feature-relevant recipe settings; a rerun with other
ones into the same folder is refused, naming the differing field (data_prep/dump_folder.py).
"""

from __future__ import annotations

import json
import os
import random
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Dict, List, Optional

import numpy as np
import torch
from omegaconf import OmegaConf
from tqdm import tqdm

from eagle_train.data_prep.dump_folder import (FORMAT, check_folder, dump_header, merge_manifest, read_records,
                                               run_dtype, verify_and_clean, write_json)
from eagle_train.dump_reader import sha256_file
from eagle_train.errors import CorpusError
from eagle_train.features import quantize_fp8, target_features
from eagle_train.files import atomic_path
from eagle_train.recipe import RecipeError
from eagle_train.target import DTYPES, load_target, resolve_device

# called as on_shard_written(folder, record) after each shard and its record are on disk (tests, monitors)
on_shard_written = None


def main(cfg, model=None) -> Dict[str, dict]:
    """Dump the train split (and eval, if asked); returns per-split stats of this process.

    `model` lets tests and the bench pass an already loaded target (it must match `cfg.target`)."""
    from accelerate import PartialState

    state = PartialState(cpu=resolve_device(cfg.target.device).type == "cpu")
    if cfg.head.type == "eagle1" and cfg.dump.storage != "full":
        raise RecipeError("head.type=eagle1 regresses the target's last hidden state, so it needs "
                          "dump.storage=full (got dump.storage=topk)")
    data = Path(cfg.data.output)
    train = load_split(data / "train")
    evals = load_split(data / "eval") if cfg.dump.include_eval else None
    if model is None:
        device = state.device if state.num_processes > 1 else cfg.target.device
        model, _ = load_target(OmegaConf.merge(cfg.target, {"device": str(device), "dtype": run_dtype(cfg)}),
                               with_tokenizer=False)
    header = dump_header(cfg, model)
    if cfg.dump.storage == "topk" and cfg.dump.topk > header["vocab_size"]:
        raise RecipeError(f"`dump.topk` = {cfg.dump.topk} exceeds the target's vocabulary ({header['vocab_size']} "
                          "tokens); set dump.topk below it")
    out = Path(cfg.dump.output)
    stats = {"train": dump_split(model, train, out, {**header, "split": "train"}, cfg.dump, state,
                                 cfg.dump.budget_minutes)}
    if evals is not None:
        stats["eval"] = dump_split(model, evals, out / "eval", {**header, "split": "eval"}, cfg.dump, state)
    return stats


def load_split(folder: Path):
    from datasets import Dataset, load_from_disk

    if not (folder / "state.json").is_file():
        raise FileNotFoundError(f"prepared corpus not found: {folder} (data.output); "
                                f"create it with `eagle-train prep <recipe>`")
    try:
        if not json.loads((folder / "state.json").read_text()).get("_data_files"):
            # a split saved with 0 rows (data.eval_fraction=0): datasets cannot load it back
            return Dataset.from_dict({"id": [], "input_ids": [], "loss_mask": []})
        return load_from_disk(str(folder))
    except (OSError, ValueError, AttributeError) as err:  # a cut-off .arrow file or damaged state.json
        raise CorpusError(f"prepared corpus {folder} (data.output) is damaged ({type(err).__name__}: "
                          f"{str(err)[:160]}); rerun `eagle-train prep <recipe>`") from None


def select_samples(ds) -> tuple[np.ndarray, np.ndarray]:
    """Rows with any loss-masked token and their lengths, computed on the Arrow columns (no Python lists)."""
    import pyarrow.compute as pc

    if len(ds) == 0:  # an empty held-out split (data.eval_fraction=0) has no Arrow chunks at all
        return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64)
    mask = ds.data.column("loss_mask").combine_chunks()
    lengths = pc.list_value_length(mask).to_numpy(zero_copy_only=False).astype(np.int64)
    flat = pc.list_flatten(mask).to_numpy(zero_copy_only=False).astype(np.int64)
    csum = np.concatenate([[0], np.cumsum(flat != 0)])
    ends = np.cumsum(lengths)
    masked = csum[ends] - csum[ends - lengths]
    rows = np.nonzero(masked > 0)[0]
    return rows, lengths[rows]


def target_rows(loss_masks, valid: torch.Tensor, targets: Optional[str]) -> torch.Tensor:
    """(B, L) bool: where the dump keeps the target's top-k. `replies`: position t when token t+1 is a reply token,
    the only targets train.loss_positions=assistant reads (the target at t is the distribution of token t+1)."""
    if targets != "replies":
        return valid
    rows = torch.zeros_like(valid)
    for i, mask in enumerate(loss_masks):
        rows[i, :len(mask) - 1] = torch.as_tensor(mask[1:], dtype=torch.bool)
    return rows


def plan_batches(rows, lengths, batch_tokens: int) -> List[List[int]]:
    """Longest first (an out-of-memory shows at once), each batch <= batch_tokens padded tokens."""
    order = sorted(zip(rows.tolist(), lengths.tolist()), key=lambda rl: (-rl[1], rl[0]))
    batches, cur, width = [], [], 0
    for row, length in order:
        width = width or length  # sorted descending: the first sample sets the padded width
        if cur and (len(cur) + 1) * width > batch_tokens:
            batches.append(cur)
            cur, width = [], length
        cur.append(row)
    if cur:
        batches.append(cur)
    return batches


def encode(feats: Dict[str, torch.Tensor], valid: torch.Tensor, dtype: str) -> Dict[str, torch.Tensor]:
    """Batch features (B, L, ...) -> stored tensors over the valid tokens (T, ...), on the CPU."""
    enc = {}
    for name, x in feats.items():
        x = x[valid]  # (T, D), samples one after another
        if name in ("aux", "last"):
            if dtype == "float8":
                enc[name], enc[name + "_scale"] = quantize_fp8(x, 3 if name == "aux" else 1)
            else:
                enc[name] = x.to(DTYPES[dtype])
                if dtype == "float16" and not torch.isfinite(enc[name]).all():
                    raise OverflowError(f"{name} features overflow float16 (|x| > 65504); use dump.dtype=bfloat16")
        elif name == "topk_logp":
            enc[name] = x.to(torch.float32 if dtype == "float32" else torch.float16)
        else:  # topk_ids: uint16 when the vocabulary fits
            enc[name] = x
    return {k: v.cpu() for k, v in enc.items()}


class ShardWriter:
    """Collects samples and writes a shard (temp name, rename, then its progress record) when full.

    Writes run on one background thread so the target keeps computing; at most one shard waits."""

    def __init__(self, out: Path, rank: int, start: int, shard_bytes: int, ids_dtype, recipe_hash: str = None):
        self.out, self.rank, self.n, self.shard_bytes, self.ids_dtype = out, rank, start, shard_bytes, ids_dtype
        self.recipe_hash = recipe_hash  # in every record: a lost manifest can be rebuilt from them
        self.samples, self.bytes = [], 0
        self.pool, self.pending = ThreadPoolExecutor(1), None
        self.written = []

    def add(self, row: int, sid: str, tensors: Dict[str, torch.Tensor]) -> None:
        self.samples.append((row, sid, tensors))
        self.bytes += sum(t.numel() * t.element_size() for t in tensors.values())
        if self.bytes >= self.shard_bytes:
            self.flush()

    def flush(self) -> None:
        if not self.samples:
            return
        samples, self.samples, self.bytes = self.samples, [], 0
        name = f"shard-r{self.rank:03d}-{self.n:05d}.safetensors"
        self.n += 1
        self.wait()
        self.pending = self.pool.submit(self._write, name, samples)

    def wait(self) -> None:
        if self.pending is not None:
            self.written.append(self.pending.result())  # re-raises a failed write here
            self.pending = None

    def close(self) -> None:
        self.flush()
        self.wait()
        self.pool.shutdown()

    def _write(self, name: str, samples) -> dict:
        from safetensors.torch import save_file

        keys = samples[0][2].keys()
        tensors = {k: torch.cat([s[2][k] for s in samples]) for k in keys}
        lengths = [len(s[2]["input_ids"]) for s in samples]
        tensors["offsets"] = torch.tensor(np.concatenate([[0], np.cumsum(lengths)]), dtype=torch.int64)
        if "topk_ids" in tensors:
            tensors["topk_ids"] = tensors["topk_ids"].to(self.ids_dtype)
        path = self.out / name
        with atomic_path(path) as tmp:
            save_file(tensors, str(tmp), metadata={"format": FORMAT})
            with open(tmp, "rb") as f:
                os.fsync(f.fileno())
            digest = sha256_file(tmp)
        rec = {"file": name, "num_samples": len(samples), "num_tokens": int(sum(lengths)),
               "bytes": path.stat().st_size, "sha256": digest,
               "ids": [s[1] for s in samples], "rows": [s[0] for s in samples], "lengths": lengths,
               "recipe_hash": self.recipe_hash}
        write_json(self.out / "progress" / (name + ".json"), rec)
        if on_shard_written is not None:
            on_shard_written(self.out, rec)
        return rec


def dump_split(model, ds, out: Path, header: dict, dcfg, state, budget_minutes: Optional[float] = None) -> dict:
    rank, world = state.process_index, state.num_processes
    check_folder(out, header)  # every rank checks, so every rank fails with the same message
    state.wait_for_everyone()
    if rank == 0:
        (out / "progress").mkdir(parents=True, exist_ok=True)
        write_json(out / "manifest.json", {**header, "complete": False, "shards": []})
        if budget_minutes is not None and not (out / "budget.json").is_file():  # the clock starts once
            write_json(out / "budget.json", {"started": time.time()})
    state.wait_for_everyone()
    # the time.time() past which a budgeted dump stops: its first start + the budget
    deadline = (None if budget_minutes is None
                else json.loads((out / "budget.json").read_text())["started"] + 60 * budget_minutes)
    verify_and_clean(out, rank, world)
    state.wait_for_everyone()

    recs = read_records(out)
    done = {r for rec in recs.values() for r in rec["rows"]}
    rows, lengths = select_samples(ds)
    keep = np.array([r not in done for r in rows.tolist()], dtype=bool)
    batches = plan_batches(rows[keep], lengths[keep], dcfg.batch_tokens)
    if deadline is not None:  # a cut must keep every length: the longest batches first (memory), then shuffled
        rest = batches[world:]
        random.Random(0).shuffle(rest)
        batches = batches[:world] + rest
    batches = batches[rank::world]
    ids = ds.data.column("id").to_pylist() if len(ds) else []
    mine = [int(r.split("-")[2].split(".")[0]) for r in recs if r.startswith(f"shard-r{rank:03d}-")]
    ids_dtype = torch.uint16 if header["vocab_size"] <= 65536 else torch.int32
    writer = ShardWriter(out, rank, max(mine, default=-1) + 1, int(dcfg.shard_size_mb * 2**20), ids_dtype,
                         header["recipe_hash"])
    device = next(model.parameters()).device
    storage = header["storage"] if header["head_type"] == "eagle3" else "full"

    length_of = dict(zip(rows.tolist(), lengths.tolist()))
    n_tokens = sum(length_of[r] for b in batches for r in b)
    bar = tqdm(total=n_tokens, unit="tok", unit_scale=True, dynamic_ncols=True,
               desc=f"dump {header['split']} [rank {rank}/{world}]", disable=not state.is_local_main_process)
    t0, dumped = time.perf_counter(), 0
    for batch in batches:
        # past the budget: stop, once the dump holds something (a resume of a finished cut adds nothing)
        if deadline is not None and time.time() > deadline and (done or dumped):
            break
        got = ds[batch]
        seqs = [torch.tensor(x, dtype=torch.int64) for x in got["input_ids"]]
        lens = [len(s) for s in seqs]
        width = max(lens)
        input_ids = torch.zeros(len(seqs), width, dtype=torch.int64)
        valid = torch.zeros(len(seqs), width, dtype=torch.bool)
        for i, s in enumerate(seqs):
            input_ids[i, :len(s)], valid[i, :len(s)] = s, True
        # no mask when nothing is padded: the plain causal path, bit-identical to a lone forward
        attn = None if valid.all() else valid.long().to(device)
        feats = target_features(model, input_ids.to(device), attn, header["aux_layers"], storage, dcfg.topk,
                                target_rows=target_rows(got["loss_mask"], valid, header.get("targets")).to(device))
        enc = encode(feats, valid.to(device), dcfg.dtype)
        starts = np.concatenate([[0], np.cumsum(lens)])
        for i, row in enumerate(batch):
            a, b = int(starts[i]), int(starts[i + 1])
            sample = {"input_ids": seqs[i].to(torch.int32),
                      "loss_mask": torch.tensor(got["loss_mask"][i], dtype=torch.uint8)}
            sample.update({k: v[a:b] for k, v in enc.items()})
            writer.add(row, ids[row], sample)
        bar.update(sum(lens))
        dumped += len(batch)
    writer.close()
    bar.close()
    seconds = time.perf_counter() - t0
    state.wait_for_everyone()
    if rank == 0:
        merge_manifest(out, header, rows, cut=deadline is not None and time.time() > deadline)
    state.wait_for_everyone()
    mine_new = writer.written
    return {"num_samples": sum(r["num_samples"] for r in mine_new), "num_tokens": sum(r["num_tokens"] for r in mine_new),
            "bytes": sum(r["bytes"] for r in mine_new), "seconds": seconds,
            "tokens_per_s": sum(r["num_tokens"] for r in mine_new) / max(seconds, 1e-9)}


if __name__ == "__main__":
    from eagle_train.cli import exit_stage, run_stage

    exit_stage(run_stage("dump", sys.argv[1:]))
