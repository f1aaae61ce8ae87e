"""Stage `prep`: chat corpus -> tokenized `datasets` folder with an assistant-only loss mask.

    eagle-train prep recipes/smollm2-135m-eagle3.yaml [data.max_conversations=500 ...]
    python -m data_prep.prepare recipes/smollm2-135m-eagle3.yaml

Reads `data.source` (see data_prep/readers.py), renders every conversation with the target's own
chat template (only the tokenizer is loaded), masks the assistant replies incl. their end-of-turn
token (data_prep/templates.py), truncates to `data.max_length`, holds out `data.eval_fraction`
deterministically, and writes
    <data.output>/train, <data.output>/eval   datasets.save_to_disk; columns id, input_ids (int32),
                                              loss_mask (int8, 1 = train on this token)
    <data.output>/stats.json                  kept / skipped by reason, tokens, masked fraction, ...
Everything is written to a temp folder that is renamed at the end, so a failed run leaves no output.
"""

from __future__ import annotations

import hashlib
import json
import re
import sys
import time
from pathlib import Path

from tqdm import tqdm

from eagle_train.data_prep.readers import Skips, read_conversations, with_system_prompt
from eagle_train.data_prep.templates import TemplateError, special_ids, tokenize_conversation
from eagle_train.files import atomic_dir

def _features():
    import datasets  # imported late: slow, and `eagle-train --help` should not pay for it

    return datasets.Features({
        "id": datasets.Value("string"),
        "input_ids": datasets.Sequence(datasets.Value("int32")),
        "loss_mask": datasets.Sequence(datasets.Value("int8")),
        "truncated": datasets.Value("bool"),
        "error": datasets.Value("string"),
    })


def _tokenize(example, tok, max_length, specials):
    """datasets.map worker: one conversation -> ids + mask, or an error reason (never raises)."""
    try:
        out = tokenize_conversation(tok, example["messages"], max_length, specials)
    except TemplateError as err:
        return {"id": example["id"], "input_ids": [], "loss_mask": [], "truncated": False, "error": err.reason}
    if not any(out["loss_mask"]):
        # e.g. a first user turn longer than max_length: nothing left to learn from
        out["error"] = "no_loss_tokens"
    return {"id": example["id"], "input_ids": out["input_ids"], "loss_mask": out["loss_mask"],
            "truncated": out["truncated"], "error": out.get("error", "")}


def _eval_rank(conv_id: str) -> str:
    """Stable hold-out order; ShareGPT splits long chats into `<id>_0`, `<id>_1`, ...: keep the
    parts of one chat on the same side."""
    return hashlib.sha1(re.sub(r"_\d+$", "", conv_id).encode()).hexdigest() + conv_id


def split_indices(ids, eval_fraction: float):
    """(train indices, eval indices): the same ids always land on the same side."""
    n_eval = 0
    if eval_fraction > 0 and len(ids) > 1:
        n_eval = min(len(ids) - 1, max(1, round(len(ids) * eval_fraction)))
    order = sorted(range(len(ids)), key=lambda i: _eval_rank(ids[i]))
    eval_idx = sorted(order[:n_eval])
    held = set(eval_idx)
    return [i for i in range(len(ids)) if i not in held], eval_idx


def _write_atomic(out: Path, train, evl, stats: dict) -> None:
    with atomic_dir(out) as tmp:
        train.save_to_disk(str(tmp / "train"))
        evl.save_to_disk(str(tmp / "eval"))
        (tmp / "stats.json").write_text(json.dumps(stats, indent=2) + "\n")


def main(cfg) -> dict:
    """Run the stage for a loaded recipe; returns the stats written to stats.json."""
    import datasets

    from eagle_train.recipe import RecipeError, output_folder
    from eagle_train.target import load_tokenizer, tokenizer_digest

    t0 = time.perf_counter()
    d = cfg.data
    if d.prompt_template is not None and not cfg.regen.enabled:
        raise RecipeError(f"`data.prompt_template` = {d.prompt_template!r} makes tasks for the target to answer: run "
                          "`eagle-train regen <recipe>` first, then prep with regen.enabled=true")
    out = output_folder(d.output, "data.output")
    tok = load_tokenizer(cfg.target)
    if not tok.is_fast:
        raise ValueError(f"target.model={cfg.target.model!r}: prep needs a fast tokenizer (offset mappings)")
    if not tok.chat_template:
        raise ValueError(f"target.model={cfg.target.model!r}: the tokenizer has no chat template; "
                         "prep renders conversations with the target's own template")
    # 1. read + normalize (bad records are counted, never fatal); regen.enabled: the target's own replies
    source, fmt, limit, source_name = d.source, d.format, d.max_conversations, d.source
    if cfg.regen.enabled:  # its shard files, not the bookkeeping beside them
        from eagle_train.data_prep.regenerate import regenerated_source

        source, fmt, limit, source_name = regenerated_source(cfg), "messages", None, str(cfg.regen.output)
    skips = Skips()
    rows = []
    selection = {} if cfg.regen.enabled else {  # regen applied them
        "skip": d.skip_conversations, "min_prompt_chars": d.min_prompt_chars, "po_direction": d.po_direction}
    bar = tqdm(read_conversations(source, fmt, d.split, skips, limit, **selection),
               total=limit, desc="read", unit="conv", dynamic_ncols=True)
    for conv in bar:
        rows.append({"id": conv.id, "messages": with_system_prompt(conv.messages, d.system_prompt)})
    bar.close()
    n_read = len(rows) + sum(skips.counts.values()) - skips.counts.get("truncated_file_tail", 0)
    if not rows:
        raise ValueError(f"data.source={d.source!r}: no usable conversation "
                         f"(skipped: {dict(skips.counts) or 'none read'}; examples: {skips.examples})")

    # 2. render + tokenize + mask
    raw = datasets.Dataset.from_list(rows)
    del rows
    tokenized = raw.map(_tokenize, fn_kwargs=dict(tok=tok, max_length=d.max_length, specials=special_ids(tok)),
                        remove_columns=raw.column_names, features=_features(), num_proc=d.num_proc if d.num_proc > 1
                        else None, desc="tokenize")
    errors = tokenized["error"]
    for conv_id, err in zip(tokenized["id"], errors):
        if err:
            skips.add(err, conv_id)
    good = tokenized.filter(lambda e: not e, input_columns="error").remove_columns("error")
    if len(good) == 0:
        raise ValueError(f"data.source={d.source!r}: no conversation left after rendering with the chat template of "
                         f"target.model={cfg.target.model!r} and truncating to data.max_length={d.max_length} "
                         f"(skipped: {dict(skips.counts)}; examples: {skips.examples})")

    # 3. deterministic train/eval split
    train_idx, eval_idx = split_indices(good["id"], d.eval_fraction)
    truncated = sum(good["truncated"])
    good = good.remove_columns("truncated")
    train, evl = good.select(train_idx), good.select(eval_idx)

    lengths = [len(x) for x in good["input_ids"]]
    loss_tokens = sum(sum(m) for m in good["loss_mask"])
    tokens = sum(lengths)
    stats = {
        "source": source_name,
        "target": cfg.target.model,
        "tokenizer_digest": tokenizer_digest(tok),  # the dump copies it into its manifest
        "max_length": d.max_length,
        "conversations": {"read": n_read, "kept": len(good), "train": len(train), "eval": len(evl),
                          "skipped": sum(v for k, v in skips.counts.items() if k != "truncated_file_tail")},
        "skipped": dict(sorted(skips.counts.items())),
        "skipped_examples": skips.examples,
        "dropped_turns": dict(sorted(skips.dropped_turns.items())),
        "bytes_dropped": skips.bytes_dropped,
        "tokens": tokens,
        "loss_tokens": loss_tokens,
        "masked_fraction": round(loss_tokens / max(tokens, 1), 4),
        "mean_length": round(tokens / max(len(lengths), 1), 1),
        "truncated": truncated,
        "seconds": round(time.perf_counter() - t0, 2),  # excluding the final write
    }
    _write_atomic(out, train, evl, stats)
    print(f"[prep] {out}: {len(train)} train + {len(evl)} eval conversations, {tokens} tokens "
          f"({stats['masked_fraction']:.1%} trained on), {truncated} truncated to {d.max_length}, "
          f"skipped {dict(skips.counts) or 'none'} in {stats['seconds']:.1f}s")
    return stats


if __name__ == "__main__":
    from eagle_train.cli import run_stage

    sys.exit(run_stage("prep", sys.argv[1:]))
