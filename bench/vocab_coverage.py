"""How much of the target's greedy choice a draft vocabulary of each size can propose.

    python bench/vocab_coverage.py outputs/full/main/draft_vocab.safetensors outputs/regen/a/dump outputs/full/dump/eval

The first argument is a training run's `draft_vocab.safetensors` (its `counts`: loss-masked token counts of the
corpus the vocabulary was chosen on); each further argument a top-k dump (a split folder with manifest.json).
For every assistant position of each dump, the target's top-1 (the token greedy decoding emits next) is ranked
by that corpus count; the table gives the share of positions whose top-1 lies among the N most frequent tokens:
the ceiling on depth-0 acceptance of a head with draft vocabulary N, whatever it learns. `--heads FOLDER...` adds a
column per trained head: the share its own vocabulary (`t2d`) covers, e.g. one extended with `head.draft_vocab_size`.
`--top1-of DUMP...` adds a column per size for the vocabulary `head.draft_vocab_counts=target_top1` would choose:
ranked by the target's top-1 over those (training) dumps instead of the corpus' reply tokens.
--record files it under `## Draft vocabulary coverage` in bench/RESULTS.md.
"""

from __future__ import annotations

import argparse
import shlex
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from record import publish  # noqa: E402  (bench/record.py)

from eagle_train.batches import count_target_top1, trained_top1  # noqa: E402
from eagle_train.draft_vocab import build_draft_vocab, load_draft_vocab  # noqa: E402
from eagle_train.dump_reader import FeatureDataset  # noqa: E402

SIZES = (4096, 8192, 12288, 16384, 24576, 32768)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("vocab", help="draft_vocab.safetensors of a training run (holds the corpus counts)")
    ap.add_argument("dumps", nargs="+", help="top-k dump folders")
    ap.add_argument("--sizes", type=int, nargs="*", default=list(SIZES))
    ap.add_argument("--heads", nargs="*", default=[], help="head folders: the coverage of each one's vocabulary")
    ap.add_argument("--top1-of", nargs="*", default=[], help="training dumps: vocabularies ranked by the target's top-1")
    ap.add_argument("--record", action="store_true")
    args = ap.parse_args(argv)
    from safetensors.torch import load_file

    counts = load_file(args.vocab)["counts"]
    # the vocabulary training builds at each size (build_draft_vocab), then each head's own
    vocabs = [build_draft_vocab(counts, n)[1] for n in args.sizes]
    columns = [f"N={n:,}" for n in args.sizes]
    if args.top1_of:
        top1 = count_target_top1([FeatureDataset(d) for d in args.top1_of], counts.numel())
        vocabs += [build_draft_vocab(top1, n)[1] for n in args.sizes]
        columns += [f"top-1 N={n:,}" for n in args.sizes]
    for head in args.heads:
        path = Path(head) / "model.safetensors"
        try:
            vocabs.append(load_draft_vocab(path)[1].bool())
        except KeyError:
            raise SystemExit(f"{path}: no d2t/t2d tensors (not an EAGLE-3 head)") from None
        columns.append(head)
    rows = []
    for folder in args.dumps:
        ds = FeatureDataset(folder)
        if ds.storage != "topk":
            raise SystemExit(f"{folder}: not a top-k dump (dump.storage=topk keeps the target's top-1)")
        top1 = torch.cat(list(trained_top1([ds])))
        rows.append((folder, top1.numel(), [float(t2d[top1].float().mean()) for t2d in vocabs]))

    lines = [f"`python bench/vocab_coverage.py {shlex.join(sys.argv[1:] if argv is None else argv)}` "
             f"({time.strftime('%Y-%m-%d')}): share of assistant positions whose target top-1 is among the N most "
             f"frequent tokens of the vocabulary's corpus ({int(counts.sum()):,} counted tokens)", "",
             "| dump | positions | " + " | ".join(columns) + " |",
             "|---|---|" + "---|" * len(columns)]
    for folder, n, cover in rows:
        lines.append(f"| {folder} | {n:,} | " + " | ".join(f"{c:.3f}" for c in cover) + " |")
    publish("Draft vocabulary coverage", lines, args.record)


if __name__ == "__main__":
    main()
