"""`eagle-train push recipe.yaml [--dry-run] [--private] [--delete-stale] [--revision R] [key=value ...]`

Uploads the exported folder (`hub.export_dir`, written by `eagle-train export`) to the Hugging Face
Hub repo `hub.repo_id` in one commit (huggingface_hub's create_repo + create_commit). The flags can
also be set as hub.dry_run / hub.private / hub.delete_stale / hub.revision. Visibility is sent only
when asked (--private), so a new repo otherwise gets the owner's default (an organisation may make
repos private by default); an existing repo keeps its visibility, and a warning says so when
--private meets a public one. Files in the repo that the export no longer has are listed, and
deleted in the same commit with --delete-stale. Before anything touches the network the folder
must pass the export check and a token must be found (env `hub.token_env`, then HF_TOKEN, then a
saved `hf auth login`); the token is passed to the client and never printed.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from eagle_train.errors import EagleError


class PushError(EagleError, RuntimeError):
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


def _remote(api, repo_id: str, revision: str | None):
    """(exists, is private, files at `revision`) of the hub repo; (False, None, []) when it is new."""
    from huggingface_hub.errors import HfHubHTTPError, RepositoryNotFoundError, RevisionNotFoundError

    try:
        info = api.model_info(repo_id)
    except RepositoryNotFoundError:
        return False, None, []
    except HfHubHTTPError as err:  # a plain 404 without the hub's error code
        if getattr(err.response, "status_code", None) == 404:
            return False, None, []
        raise
    files = [s.rfilename for s in info.siblings or []]
    if revision and revision != "main":
        try:
            files = [s.rfilename for s in api.model_info(repo_id, revision=revision).siblings or []]
        except RevisionNotFoundError:
            files = []
    return True, info.private, files


def _hub_failure(err, token) -> str:
    """The client's error in one line, token scrubbed, and what to do about it."""
    from huggingface_hub.errors import HfHubHTTPError, OfflineModeIsEnabled

    said = " ".join(line.strip() for line in _scrub(str(err), token).splitlines() if line.strip())[:400]
    if isinstance(err, OfflineModeIsEnabled):
        todo = "the hub client is offline (HF_HUB_OFFLINE is set): unset it and push again"
    elif isinstance(err, HfHubHTTPError) and getattr(err.response, "status_code", None) in (401, 403):
        todo = "the token was refused: check it has write access to the repo (hf auth login) and push again"
    elif isinstance(err, HfHubHTTPError):
        todo = "the hub answered with an error: check hub.repo_id and hub.revision, then push again"
    else:  # connection refused, DNS, timeout, proxy
        todo = "the hub is not reachable: check the network (or hub.endpoint / HF_ENDPOINT) and push again"
    return f"{type(err).__name__}: {said}; {todo} (the files go in one commit: a failed push leaves no partial upload)"


def main(cfg) -> int:
    from eagle_train.export import check_export

    hub = cfg.hub
    dry_run, delete_stale, revision = hub.dry_run, hub.delete_stale, hub.revision
    private = hub.private  # None: leave visibility to the owner's default
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
    from huggingface_hub import CommitOperationAdd, CommitOperationDelete, HfApi

    endpoint = hub.endpoint or os.environ.get("HF_ENDPOINT") or None
    api = HfApi(endpoint=endpoint, token=token)
    names = [str(f.relative_to(folder)) for f in files]
    try:
        exists, is_private, remote = _remote(api, hub.repo_id, revision)
        if exists and private and not is_private:
            print(f"[push] warning: {hub.repo_id} already exists and is public; --private does not change an "
                  "existing repo's visibility (change it in the repo's settings)", file=sys.stderr)
        stale = sorted(set(remote) - set(names) - {".gitattributes"})
        if stale and not delete_stale:
            print(f"[push] warning: {hub.repo_id} has {len(stale)} file(s) this export does not: {', '.join(stale)}; "
                  "push with --delete-stale (hub.delete_stale=true) to remove them", file=sys.stderr)
        url = api.create_repo(hub.repo_id, repo_type="model", private=private, exist_ok=True)
        if revision and revision != "main":
            api.create_branch(hub.repo_id, branch=revision, exist_ok=True)
        ops = [CommitOperationAdd(path_in_repo=n, path_or_fileobj=str(f)) for n, f in zip(names, files)]
        ops += [CommitOperationDelete(path_in_repo=n) for n in stale] if delete_stale else []
        info = api.create_commit(repo_id=hub.repo_id, operations=ops, revision=revision,
                                 commit_message=f"eagle-train export of {cfg.head.type} head for {cfg.target.model}")
    except Exception as err:  # report without a traceback that could carry request headers
        raise PushError(f"upload to {where} failed: {_hub_failure(err, token)}") from None
    deleted = f", deleted {len(stale)} stale" if delete_stale and stale else ""
    print(f"[push] uploaded {len(files)} files{deleted} to {url} ({getattr(info, 'commit_url', '')})")
    return 0


if __name__ == "__main__":
    from eagle_train.cli import run_stage

    sys.exit(run_stage("push", sys.argv[1:]))
