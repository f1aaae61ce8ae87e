"""Helpers the tests share: a prepared corpus from token lists, and a small head trained in-process."""

from __future__ import annotations

from pathlib import Path

from eagle_train import train
from eagle_train.heads import load_head
from eagle_train.recipe_load import load_recipe


def write_corpus(samples, folder, eval_samples=None):
    """A prepared corpus (`<folder>/train`, `<folder>/eval`) from [(input_ids, loss_mask), ...]."""
    from datasets import Dataset

    eval_samples = eval_samples if eval_samples is not None else samples[: max(1, len(samples) // 8)]
    for split, rows in (("train", samples), ("eval", eval_samples)):
        Dataset.from_dict({"id": [f"{split}-{i}" for i in range(len(rows))],
                           "input_ids": [list(map(int, r[0])) for r in rows],
                           "loss_mask": [list(map(int, r[1])) for r in rows]}).save_to_disk(str(Path(folder) / split))


def quick_train(target, samples, output, steps=30, overrides=()):
    """Train a small head in-process on `samples` [(input_ids, loss_mask), ...] with the target
    running online (no prep, no dump); returns the loaded head."""
    write_corpus(samples, Path(output) / "data")
    args = [f"output_dir={output}", "target.model=in-memory", "data.source=in-memory", "train.mode=online",
            "train.engine=none", f"train.max_steps={steps}", f"train.warmup_steps={min(5, steps)}",
            "train.learning_rate=1e-3", "train.micro_batch_size=4", "train.ttt_steps=3",
            f"train.eval_every={steps}", f"train.save_every={steps}", "train.eval_batches=2", "train.resume=false",
            f"head.draft_vocab_size={min(1024, target.config.vocab_size)}", *overrides]
    result = train.main(load_recipe(None, args), target=target)
    return load_head(result["final"], target=target)
