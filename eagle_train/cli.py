"""`eagle-train <stage> recipe.yaml [key=value ...]`: one console command, one module per stage.

    regen   data_prep/regenerate.py  the target answers the corpus' user turns (regen.enabled: prep reads them)
    prep    data_prep/prepare.py   chat corpus -> tokenized dataset with assistant-only loss mask
    dump    data_prep/dump.py      frozen target -> sharded safetensors features (offline training)
    train   eagle_train/train.py   train the head (for several processes use `accelerate launch`)
    eval    eval/run.py            tau, acceptance by depth, speedup; report.md/json + plots
    sweep   eval/run.py --sweep    tau and speedup over the recipe's tree-setting grid
    deploy  eval/deploy.py         speedup vs batch size (batched generate vs the head): when to deploy
    export  eagle_train/export.py  head -> vLLM/SGLang layout + model card
    check   eagle_train/export.py  validate an exported folder against the contract and the target
    push    eagle_train/hub.py     upload an exported folder to the Hugging Face Hub
"""

from __future__ import annotations

import importlib
import os
import sys

STAGES = {
    "regen": ("eagle_train.data_prep.regenerate", "cli"),
    "prep": ("eagle_train.data_prep.prepare", "cli"),
    "dump": ("eagle_train.data_prep.dump", "cli"),
    "train": ("eagle_train.train", "cli"),
    "eval": ("eagle_train.eval.run", "cli"),
    "sweep": ("eagle_train.eval.run", "sweep_cli"),
    "deploy": ("eagle_train.eval.deploy", "cli"),
    "export": ("eagle_train.export", "cli"),
    "check": ("eagle_train.export", "check_cli"),
    "push": ("eagle_train.hub", "cli"),
}
# recipe sections each stage reads (shown by `eagle-train <stage> --help`)
READS = {
    "regen": "target, data, regen", "prep": "target, data, regen", "dump": "target, data, dump, head",
    "train": "target, data, dump, head, train", "eval": "target, head, eval", "sweep": "target, head, eval",
    "deploy": "target, head, eval",
    "export": "target, head, train, eval, hub", "check": "hub, target (when given a recipe)", "push": "hub",
}
# an output folder given as an existing file (or the reverse), a read-only folder: the user's path
PATH_ERRORS = (FileExistsError, NotADirectoryError, IsADirectoryError, PermissionError)
ARGPARSE = ("check", "push")  # these parse their own options and answer --help themselves


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in STAGES:
        print(__doc__)
        return 0 if argv and argv[0] in ("-h", "--help") else 2
    module, func = STAGES[argv[0]]
    return run_stage(argv[0], lambda args: getattr(importlib.import_module(module), func)(args), argv[1:])


def run_stage(stage: str, func, argv) -> int:
    """Run one stage's `cli(argv)`: `--help` prints its usage; a user-fixable error (EagleError,
    a missing file) prints one line and returns 2; `--debug` or EAGLE_TRAIN_DEBUG=1 re-raises it."""
    from eagle_train.errors import EagleError

    argv = list(argv)
    debug = "--debug" in argv or os.environ.get("EAGLE_TRAIN_DEBUG", "") not in ("", "0")
    argv = [a for a in argv if a != "--debug"]
    if debug:  # stages that print their own errors re-raise under it too
        os.environ["EAGLE_TRAIN_DEBUG"] = "1"
    if stage not in ARGPARSE and any(a in ("-h", "--help") for a in argv):
        print(stage_help(stage))
        return 0
    try:
        return func(argv) or 0
    except (EagleError, FileNotFoundError, *PATH_ERRORS) as err:
        if debug:
            raise
        what = one_line(err)
        if isinstance(err, PATH_ERRORS) and err.filename:
            what = f"{err.filename}: {err.strerror}: a path in the recipe or command is not usable; fix it or pick another"
        # on a line of its own: a progress bar the error interrupted leaves no newline behind
        print(f"\neagle-train {stage}: error: {what} (--debug shows the traceback)", file=sys.stderr)
        return 2


def one_line(err: BaseException) -> str:
    """The message on one line (a recipe's list of problems joined by spaces)."""
    return " ".join(line.strip() for line in str(err).splitlines() if line.strip())


def stage_help(stage: str) -> str:
    module = importlib.import_module(STAGES[stage][0])
    return (f"usage: eagle-train {stage} recipe.yaml [key=value ...] [--debug]\n\n{(module.__doc__ or '').strip()}\n\n"
            f"Recipe sections read: {READS[stage]} (every key: eagle_train/recipe.py).\n"
            f"Example: eagle-train {stage} recipes/smollm2-135m-eagle3.yaml output_dir=outputs/try\n"
            "--debug (or EAGLE_TRAIN_DEBUG=1): show the full traceback of an error.")


if __name__ == "__main__":
    sys.exit(main())
