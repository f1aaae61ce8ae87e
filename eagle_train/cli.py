"""`eagle-train <stage> recipe.yaml [key=value ...]`: one console command, one module per stage.

    regen   data_prep/regenerate.py  the target answers the corpus' user turns (regen.enabled: prep reads them)
    prep    data_prep/prepare.py   chat corpus -> tokenized dataset with assistant-only loss mask
    dump    data_prep/dump.py      frozen target -> sharded safetensors features (offline training)
    train   eagle_train/train.py   train the head (for several processes use `accelerate launch`)
    eval    eval/run.py            tau, acceptance by depth, speedup; report.md/json + plots
    sweep   eval/run.py --sweep    tau and speedup over the recipe's tree-setting grid
    export  eagle_train/export.py  head -> vLLM/SGLang layout + model card
    check   eagle_train/export.py  validate an exported folder against the contract and the target
    push    eagle_train/hub.py     upload an exported folder to the Hugging Face Hub
"""

from __future__ import annotations

import importlib
import sys

STAGES = {
    "regen": ("data_prep.regenerate", "cli"),
    "prep": ("data_prep.prepare", "cli"),
    "dump": ("data_prep.dump", "cli"),
    "train": ("eagle_train.train", "cli"),
    "eval": ("eval.run", "cli"),
    "sweep": ("eval.run", "sweep_cli"),
    "export": ("eagle_train.export", "cli"),
    "check": ("eagle_train.export", "check_cli"),
    "push": ("eagle_train.hub", "cli"),
}


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in STAGES:
        print(__doc__)
        return 0 if argv and argv[0] in ("-h", "--help") else 2
    module, func = STAGES[argv[0]]
    from eagle_train.recipe import RecipeError

    try:
        return getattr(importlib.import_module(module), func)(argv[1:]) or 0
    except (RecipeError, FileNotFoundError) as err:
        print(f"eagle-train {argv[0]}: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
