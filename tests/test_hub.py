"""`eagle-train push`: dry run, refusals before any network call, and the real upload path against
a small recording hub on 127.0.0.1."""

from __future__ import annotations

import base64
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import torch
from omegaconf import OmegaConf
from safetensors.torch import load_file, save_file

from eagle_train import cli, export, hub
from eagle_train.heads import build_head
from eagle_train.recipe import HeadConfig

SECRET = "hf_testTOKENdoNotLeak1234567890"


class FakeHub(BaseHTTPRequestHandler):
    """Just enough of the hub API for create_repo, create_branch and upload_folder (regular,
    non-LFS files committed inline as base64 in the ndjson commit payload)."""

    requests: list = []
    fail_create: bool = False
    existing: dict | None = None  # {"private": bool, "files": [...]} for a repo already on the hub

    def log_message(self, *args):  # keep pytest output clean
        pass

    def _reply(self, code, body, headers=()):
        data = json.dumps(body).encode()
        self.send_response(code)
        for k, v in headers:
            self.send_header(k, v)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self):
        self.requests.append({"method": "GET", "path": self.path, "auth": self.headers.get("Authorization")})
        if self.path.startswith("/api/models/") and self.existing is not None:
            repo = self.path.split("/api/models/")[1].split("/revision/")[0].split("?")[0]
            return self._reply(200, {"id": repo, "private": self.existing["private"], "sha": "b" * 40,
                                     "siblings": [{"rfilename": f} for f in self.existing["files"]]})
        self._reply(404, {"error": "Repository not found"}, [("X-Error-Code", "RepoNotFound")])

    def do_POST(self):
        body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        path = self.path.split("?")[0]
        rec = {"method": "POST", "path": path, "auth": self.headers.get("Authorization"), "body": body}
        self.requests.append(rec)
        host = f"http://{self.server.server_address[0]}:{self.server.server_address[1]}"
        if path == "/api/repos/create":
            payload = json.loads(body)
            if self.fail_create:  # an error body that echoes the credentials back
                return self._reply(400, {"error": f"bad request with {self.headers.get('Authorization')}"})
            return self._reply(200, {"url": f"{host}/{payload['organization']}/{payload['name']}"})
        if path == "/api/validate-yaml":
            return self._reply(200, {"errors": [], "warnings": []})
        if "/preupload/" in path:
            files = json.loads(body)["files"]
            return self._reply(200, {"files": [{"path": f["path"], "uploadMode": "regular", "shouldIgnore": False}
                                               for f in files]})
        if "/branch/" in path:
            return self._reply(200, {})
        if "/commit/" in path:
            repo = path.split("/api/models/")[1].split("/commit/")[0]
            return self._reply(200, {"commitUrl": f"{host}/{repo}/commit/abc123", "commitOid": "a" * 40})
        return self._reply(404, {"error": f"no route {path}"})


@pytest.fixture
def fake_hub():
    FakeHub.requests = []
    FakeHub.fail_create = False
    FakeHub.existing = None
    server = ThreadingHTTPServer(("127.0.0.1", 0), FakeHub)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}", FakeHub
    server.shutdown()
    server.server_close()


@pytest.fixture
def exported(tmp_path, tiny_llama):
    torch.manual_seed(0)
    head = build_head(OmegaConf.structured(HeadConfig(draft_vocab_size=100)), tiny_llama.config)
    ids = torch.arange(0, 500, 5)
    t2d = torch.zeros(512, dtype=torch.bool)
    t2d[ids] = True
    head.set_draft_vocab(ids - torch.arange(100), t2d)
    return export.export_head(head, tmp_path / "export", dtype="bfloat16", card="---\ntags: [eagle3]\n---\n# card\n")


@pytest.fixture
def recipe(tmp_path, exported):
    path = tmp_path / "recipe.yaml"
    path.write_text(f"target: {{model: tiny}}\ndata: {{source: x}}\noutput_dir: {tmp_path}\n"
                    f"hub: {{export_dir: {exported}, repo_id: me/tiny-eagle3, token_env: EAGLE_TEST_TOKEN}}\n")
    return str(path)


@pytest.fixture
def no_token(monkeypatch):
    monkeypatch.delenv("EAGLE_TEST_TOKEN", raising=False)
    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.setattr("huggingface_hub.get_token", lambda: None)  # ignore a saved login


def test_dry_run_lists_files(recipe, exported, capsys, no_token, fake_hub):
    endpoint, server = fake_hub
    assert cli.run_stage("push", [recipe, "--dry-run", f"hub.endpoint={endpoint}"]) == 0
    out = capsys.readouterr().out
    assert "would upload 3 files" in out and "me/tiny-eagle3" in out
    for name in ("README.md", "config.json", "model.safetensors"):
        size = (exported / name).stat().st_size
        assert name in out and f"{size:,d} bytes" in out
    assert server.requests == []  # nothing sent, no token needed


def test_push_without_token_stops_before_network(recipe, capsys, no_token, fake_hub, monkeypatch):
    endpoint, server = fake_hub
    import huggingface_hub

    def boom(*a, **k):
        raise AssertionError("network client used without a token")

    monkeypatch.setattr(huggingface_hub.HfApi, "create_repo", boom)
    assert cli.main(["push", recipe, f"hub.endpoint={endpoint}"]) == 2
    err = capsys.readouterr().err
    assert "no Hugging Face token" in err and "EAGLE_TEST_TOKEN" in err and "HF_TOKEN" in err
    assert server.requests == []


def test_push_refuses_failing_export(recipe, exported, capsys, fake_hub, monkeypatch):
    endpoint, server = fake_hub
    monkeypatch.setenv("EAGLE_TEST_TOKEN", SECRET)
    state = load_file(exported / "model.safetensors")
    del state["d2t"]
    save_file(state, exported / "model.safetensors")
    assert cli.main(["push", recipe, f"hub.endpoint={endpoint}"]) == 2
    err = capsys.readouterr().err
    assert "fails the export check" in err and "`d2t` is missing" in err and "eagle-train export" in err
    assert server.requests == []


def test_push_uploads_to_local_hub(recipe, exported, capsys, fake_hub, monkeypatch):
    endpoint, server = fake_hub
    monkeypatch.setenv("EAGLE_TEST_TOKEN", SECRET)
    assert cli.run_stage("push", [recipe, "--private", "--revision", "v1", f"hub.endpoint={endpoint}"]) == 0
    paths = [r["path"] for r in server.requests if r["method"] == "POST"]
    assert paths[0] == "/api/repos/create"
    assert "/api/models/me/tiny-eagle3/branch/v1" in paths
    assert "/api/models/me/tiny-eagle3/preupload/v1" in paths
    assert paths[-1] == "/api/models/me/tiny-eagle3/commit/v1"
    assert all(r["auth"] == f"Bearer {SECRET}" for r in server.requests)
    create = json.loads(next(r["body"] for r in server.requests if r["path"] == "/api/repos/create"))
    assert create["name"] == "tiny-eagle3" and create["organization"] == "me" and create["visibility"] == "private"
    # the commit carries every file of the export, byte for byte
    lines = [json.loads(line) for line in server.requests[-1]["body"].decode().splitlines()]
    assert lines[0]["key"] == "header" and "eagle3" in lines[0]["value"]["summary"]
    files = {entry["value"]["path"]: base64.b64decode(entry["value"]["content"]) for entry in lines[1:]}
    assert set(files) == {"README.md", "config.json", "model.safetensors"}
    for name, data in files.items():
        assert data == (exported / name).read_bytes()
    captured = capsys.readouterr()
    assert "uploaded 3 files" in captured.out
    assert SECRET not in captured.out + captured.err


def test_push_error_never_shows_token(recipe, capsys, fake_hub, monkeypatch):
    endpoint, server = fake_hub
    server.fail_create = True
    monkeypatch.setenv("EAGLE_TEST_TOKEN", SECRET)
    assert cli.main(["push", recipe, f"hub.endpoint={endpoint}"]) == 2
    captured = capsys.readouterr()
    assert "upload to me/tiny-eagle3 failed" in captured.err and "***" in captured.err
    assert SECRET not in captured.out + captured.err
    assert server.requests and all(r["auth"] == f"Bearer {SECRET}" for r in server.requests)


def test_push_needs_repo_id(tmp_path, exported, capsys, no_token):
    path = tmp_path / "r.yaml"
    path.write_text(f"target: {{model: tiny}}\ndata: {{source: x}}\nhub: {{export_dir: {exported}}}\n")
    assert cli.main(["push", str(path), "--dry-run"]) == 2
    assert "hub.repo_id" in capsys.readouterr().err


def _create_payload(server):
    return json.loads(next(r["body"] for r in server.requests if r["path"] == "/api/repos/create"))


def _commit_lines(server):
    return [json.loads(line) for line in server.requests[-1]["body"].decode().splitlines()]


def test_push_leaves_visibility_to_the_owner_unless_asked(recipe, capsys, fake_hub, monkeypatch):
    """Without --private no visibility is sent, so an organisation's private default holds."""
    endpoint, server = fake_hub
    monkeypatch.setenv("EAGLE_TEST_TOKEN", SECRET)
    assert cli.run_stage("push", [recipe, f"hub.endpoint={endpoint}"]) == 0
    create = _create_payload(server)
    assert "visibility" not in create and "private" not in create
    assert "warning" not in capsys.readouterr().err


def test_private_on_an_existing_public_repo_warns_and_stale_files_are_listed_or_deleted(recipe, capsys, fake_hub,
                                                                                         monkeypatch):
    endpoint, server = fake_hub
    monkeypatch.setenv("EAGLE_TEST_TOKEN", SECRET)
    server.existing = {"private": False, "files": [".gitattributes", "README.md", "config.json", "model.safetensors",
                                                   "pytorch_model.bin"]}
    assert cli.run_stage("push", [recipe, "--private", f"hub.endpoint={endpoint}"]) == 0
    err = capsys.readouterr().err
    assert "already exists and is public" in err and "--private does not change" in err
    assert "pytorch_model.bin" in err and "--delete-stale" in err
    assert not any(line["key"] == "deletedFile" for line in _commit_lines(server))

    server.requests = []
    assert cli.run_stage("push", [recipe, "--delete-stale", f"hub.endpoint={endpoint}"]) == 0
    out, err = capsys.readouterr()
    deleted = [line["value"]["path"] for line in _commit_lines(server) if line["key"] == "deletedFile"]
    assert deleted == ["pytorch_model.bin"] and "deleted 1 stale" in out and "already exists" not in err
