"""`eagle-train <stage> recipe.yaml [key=value ...]`: one console command, one module per stage.

    regen   data_prep/regenerate.py  the target answers the corpus' user turns (regen.enabled: prep reads them)
    prep    data_prep/prepare.py   chat corpus -> tokenized dataset with assistant-only loss mask
    dump    data_prep/dump.py      frozen target -> sharded safetensors features (offline training)
    train   eagle_train/train.py   train the head (for several processes use `accelerate launch`)
    eval    eval/run.py            tau, acceptance by depth, speedup; report.md/json + plots
    sweep   eval/sweep.py          tau and speedup over the recipe's tree-setting grid
    deploy  eval/deploy.py         speedup vs batch size (batched generate vs the head): when to deploy
    export  eagle_train/export.py  head -> vLLM/SGLang layout + model card
    check   eagle_train/export.py  validate an exported folder against the contract and the target
    push    eagle_train/hub.py     upload an exported folder to the Hugging Face Hub

Each stage module exposes `main(cfg)` (check: `check(folder, target section)`); this module is the one
place that splits the arguments, loads the recipe and turns a user-fixable error into one line and exit
code 2, for this command and for every stage's own `python -m ...` / `accelerate launch ...` entry.
"""

from __future__ import annotations

import importlib
import os
import sys
from pathlib import Path

STAGES = {  # stage -> (module, its function of the loaded recipe)
    "regen": ("eagle_train.data_prep.regenerate", "main"),
    "prep": ("eagle_train.data_prep.prepare", "main"),
    "dump": ("eagle_train.data_prep.dump", "main"),
    "train": ("eagle_train.train", "main"),
    "eval": ("eagle_train.eval.run", "main"),
    "sweep": ("eagle_train.eval.sweep", "sweep_main"),
    "deploy": ("eagle_train.eval.deploy", "main"),
    "export": ("eagle_train.export", "main"),
    "check": ("eagle_train.export", "check"),  # of a folder (see check_args), not of a recipe
    "push": ("eagle_train.hub", "main"),
}
# push's options are recipe keys too: `push --dry-run` is hub.dry_run=true
PUSH_OPTIONS = {"--dry-run": "hub.dry_run", "--private": "hub.private", "--delete-stale": "hub.delete_stale"}
# errors besides EagleError, a missing file and PATH_ERRORS that a stage reports as one line: bad
# corpus data or chat templates (prep), bad benchmark files or heads (eval, sweep, deploy)
STAGE_ERRORS = {"prep": (ValueError,), "eval": (ValueError,), "sweep": (ValueError,), "deploy": (ValueError,)}
# recipe sections each stage reads (shown by `eagle-train <stage> --help`)
READS = {
    "regen": "target, data, regen", "prep": "target, data, regen", "dump": "target, data, dump, head",
    "train": "target, data, dump, head, train", "eval": "target, head, eval", "sweep": "target, head, eval",
    "deploy": "target, head, eval",
    "export": "target, head, train, eval, hub", "check": "hub, target (when given a recipe)", "push": "hub",
}
# an output folder given as an existing file (or the reverse), a read-only folder: the user's path
PATH_ERRORS = (FileExistsError, NotADirectoryError, IsADirectoryError, PermissionError)


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in STAGES:
        print(__doc__)
        return 0 if argv and argv[0] in ("-h", "--help") else 2
    return run_stage(argv[0], argv[1:])


def run_stage(stage: str, argv) -> int:
    """Run one stage from its command line (`eagle-train <stage> ...`, `python -m <module>`, `accelerate
    launch`): split the arguments, load the recipe, call the stage's function. `--help` prints its
    usage; a user-fixable error prints one line and returns 2; `--debug` or EAGLE_TRAIN_DEBUG=1 re-raises
    it. Returns the stage's exit code (0 unless it returns one)."""
    from eagle_train.errors import EagleError

    argv = list(argv)
    debug = "--debug" in argv or os.environ.get("EAGLE_TRAIN_DEBUG", "") not in ("", "0")
    argv = [a for a in argv if a != "--debug"]
    if debug:  # stages that print their own errors re-raise under it too
        os.environ["EAGLE_TRAIN_DEBUG"] = "1"
    if any(a in ("-h", "--help") for a in argv):
        print(stage_help(stage))
        return 0
    module, func = STAGES[stage]
    finished = False
    try:
        run = getattr(importlib.import_module(module), func)
        result = run(*check_args(argv)) if stage == "check" else run(load_args(push_args(argv) if stage == "push"
                                                                                   else argv))
        finished = True
    except (EagleError, FileNotFoundError, *PATH_ERRORS, *STAGE_ERRORS.get(stage, ())) as err:
        if debug:
            raise
        what = one_line(err)
        if isinstance(err, PATH_ERRORS) and err.filename:
            what = f"{err.filename}: {err.strerror}: a path in the recipe or command is not usable; fix it or pick another"
        # on a line of its own: a progress bar the error interrupted leaves no newline behind
        print(f"\neagle-train {stage}: error: {what} (--debug shows the traceback)", file=sys.stderr)
        return 2
    finally:
        leave_process_group(wait=finished)
    if isinstance(result, Path):
        print(f"[{stage}] wrote {result}")
    return result if isinstance(result, int) else 0


def load_args(argv):
    """`recipe.yaml key=value ...` -> the loaded recipe."""
    from eagle_train.recipe_load import load_recipe, split_args

    return load_recipe(*split_args(argv))


def push_args(argv) -> list:
    """push's options as the recipe keys they stand for (`--revision R` -> hub.revision=R)."""
    out, rest = [], list(argv)
    while rest:
        a = rest.pop(0)
        if a in PUSH_OPTIONS:
            out.append(f"{PUSH_OPTIONS[a]}=true")
        elif a == "--revision" and rest:
            out.append(f"hub.revision={rest.pop(0)}")
        elif a.startswith("--revision="):
            out.append(f"hub.revision={a.split('=', 1)[1]}")
        else:
            out.append(a)
    return out


def check_args(argv) -> tuple:
    """`check <folder | recipe.yaml> [--target <model | recipe.yaml>] [key=value ...]` -> (folder, the
    target's recipe section or None)."""
    import argparse

    from omegaconf import OmegaConf

    from eagle_train.recipe import TargetConfig
    from eagle_train.recipe_load import load_recipe

    ap = argparse.ArgumentParser(prog="eagle-train check")
    ap.add_argument("folder")
    ap.add_argument("--target")
    args, overrides = ap.parse_known_args(list(argv))
    folder, tcfg = Path(args.folder), None
    if folder.suffix in (".yaml", ".yml"):
        rcfg = load_recipe(folder, overrides)
        folder, tcfg = Path(rcfg.hub.export_dir), rcfg.target
    if args.target:
        if args.target.endswith((".yaml", ".yml")):
            tcfg = load_recipe(args.target, overrides).target
        else:
            tcfg = OmegaConf.structured(TargetConfig(model=args.target))
    return folder, tcfg


def leave_process_group(wait: bool = False) -> None:
    """Tear a torch process group down before exit: a rank leaving with live gloo connections can
    abort its peer's background thread at interpreter shutdown. `wait` (the stage finished on this
    rank): first a barrier, so no rank closes its connections while a peer still uses them (a rank
    that failed leaves at once: its peers may never reach the barrier)."""
    torch = sys.modules.get("torch")
    if torch is not None and torch.distributed.is_available() and torch.distributed.is_initialized():
        if wait:
            torch.distributed.barrier()
        torch.distributed.destroy_process_group()


def exit_stage(code: int):
    """sys.exit(code) for a stage's `python -m` / `accelerate launch` entry. A rank of a multi-process launch
    (WORLD_SIZE > 1) leaves through os._exit once its stage has returned: its files are written and closed and its
    process group is torn down, while the interpreter's teardown of native thread pools (gloo, Arrow's under
    `datasets`) has aborted such a finished rank at exit ("terminate called without an active exception", no Python
    frame left; the 2-rank DDP test in 2 of 5 full-suite runs), which fails the whole launch."""
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        import logging

        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)


def one_line(err: BaseException) -> str:
    """The message on one line (a recipe's list of problems joined by spaces)."""
    return " ".join(line.strip() for line in str(err).splitlines() if line.strip())


USAGE = {"check": "<folder | recipe.yaml> [--target <model | recipe.yaml>] [key=value ...]",
         "push": "recipe.yaml [--dry-run] [--private] [--delete-stale] [--revision R] [key=value ...]"}


def stage_help(stage: str) -> str:
    module = importlib.import_module(STAGES[stage][0])
    return (f"usage: eagle-train {stage} {USAGE.get(stage, 'recipe.yaml [key=value ...]')} [--debug]\n\n{(module.__doc__ or '').strip()}\n\n"
            f"Recipe sections read: {READS[stage]} (every key: eagle_train/recipe.py).\n"
            f"Example: eagle-train {stage} recipes/smollm2-135m-eagle3.yaml output_dir=outputs/try\n"
            "--debug (or EAGLE_TRAIN_DEBUG=1): show the full traceback of an error.")


if __name__ == "__main__":
    sys.exit(main())
