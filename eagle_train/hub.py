"""`eagle-train push recipe.yaml [--dry-run] [--private] [--revision R] [key=value ...]`

Uploads the exported folder (`hub.export_dir`, written by `eagle-train export`) to the Hugging Face
Hub repo `hub.repo_id` with huggingface_hub's create_repo + upload_folder. The flags can also be
set as hub.dry_run / hub.private / hub.revision. Before anything touches the network the folder
must pass the export check and a token must be found (env `hub.token_env`, then HF_TOKEN, then a
saved `hf auth login`); the token is passed to the client and never printed.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path


class PushError(RuntimeError):
    """A push that cannot start or failed; the message is safe to print (no token)."""


def _files(folder: Path) -> list:
    return sorted(p for p in folder.rglob("*") if p.is_file() and not p.name.startswith("."))


def _token(token_env: str):
    """The token from the recipe's variable, HF_TOKEN, or a saved login; None when there is none."""
    for var in dict.fromkeys([token_env, "HF_TOKEN"]):
        if os.environ.get(var):
            return os.environ[var]
    from huggingface_hub import get_token

    return get_token()


def _scrub(text: str, token: str | None) -> str:
    return text.replace(token, "***") if token else text


def main(cfg, dry_run: bool = False, private: bool = False, revision: str | None = None) -> int:
    from eagle_train.export import check_export

    hub = cfg.hub
    dry_run, private = dry_run or hub.dry_run, private or hub.private
    revision = revision or hub.revision
    folder = Path(hub.export_dir)
    if not hub.repo_id:
        raise PushError("`hub.repo_id` is not set: add hub.repo_id=<you>/<repo> to the command or the recipe")
    problems = check_export(folder)
    if problems:
        raise PushError(f"{folder} fails the export check, nothing uploaded:\n  - " + "\n  - ".join(problems)
                        + "\n(re-export with `eagle-train export recipe.yaml`)")
    files = _files(folder)
    where = f"{hub.repo_id}" + (f"@{revision}" if revision else "") + (" (private)" if private else "")
    if dry_run:
        total = sum(f.stat().st_size for f in files)
        print(f"[push] dry run: would upload {len(files)} files ({total / 2**20:.2f} MiB) from {folder} to {where}")
        for f in files:
            print(f"  {str(f.relative_to(folder)):24s} {f.stat().st_size:>14,d} bytes")
        return 0

    token = _token(hub.token_env)
    if not token:
        raise PushError(f"no Hugging Face token: set the environment variable {hub.token_env}"
                        + ("" if hub.token_env == "HF_TOKEN" else " (or HF_TOKEN)")
                        + " or run `hf auth login`; nothing was uploaded")
    from huggingface_hub import HfApi

    endpoint = hub.endpoint or os.environ.get("HF_ENDPOINT") or None
    api = HfApi(endpoint=endpoint, token=token)
    try:
        url = api.create_repo(hub.repo_id, repo_type="model", private=private, exist_ok=True)
        if revision and revision != "main":
            api.create_branch(hub.repo_id, branch=revision, exist_ok=True)
        info = api.upload_folder(repo_id=hub.repo_id, folder_path=str(folder), revision=revision,
                                 commit_message=f"eagle-train export of {cfg.head.type} head for {cfg.target.model}")
    except Exception as err:  # report without a traceback that could carry request headers
        raise PushError(f"upload to {where} failed: {type(err).__name__}: {_scrub(str(err), token)}") from None
    print(f"[push] uploaded {len(files)} files to {url} ({getattr(info, 'commit_url', '')})")
    return 0


def cli(argv) -> int:
    from eagle_train.recipe import load_recipe, split_args

    ap = argparse.ArgumentParser(prog="eagle-train push", description=__doc__.splitlines()[0])
    ap.add_argument("--dry-run", action="store_true", help="list the files that would be uploaded")
    ap.add_argument("--private", action="store_true", help="create the repo private")
    ap.add_argument("--revision", help="branch to push to (created when missing)")
    args, rest = ap.parse_known_args(list(argv))
    path, overrides = split_args(rest)
    cfg = load_recipe(path, overrides)
    try:
        return main(cfg, args.dry_run, args.private, args.revision)
    except PushError as err:
        print(f"eagle-train push: error: {err}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(cli(sys.argv[1:]))
