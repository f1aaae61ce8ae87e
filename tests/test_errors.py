"""Bad inputs at every stage, through the real CLI: each must end with a non-zero exit, one line naming
the culprit, no traceback, and nothing already on disk changed. One tiny pipeline (prep, dump, train,
export on a 6-layer random target with the SmolLM2 tokenizer) is built once and copied per case."""

from __future__ import annotations

import gzip
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf
from safetensors.torch import load_file, save_file

from conftest import ROOT, SHAREGPT, make_tiny_llama
from eagle_train import cli
from eagle_train.recipe import TargetConfig

RECIPE = """\
output_dir: {root}/run
target: {{model: {root}/target, device: cpu}}
data: {{source: {root}/corpus.jsonl, max_length: 96, eval_fraction: 0.25}}
dump: {{dtype: float32}}
head: {{draft_vocab_size: 49152}}  # the whole vocabulary: a random target's top-1 is a draft token
train: {{engine: none, max_steps: 2, warmup_steps: 1, micro_batch_size: 2, ttt_steps: 2, save_every: 1,
         eval_every: 2, eval_batches: 1, log_every: 1}}
eval: {{max_prompts: 1, max_new_tokens: 4, topk: 2, depth: 2, num_draft_tokens: 3, prompt_lookup_num_tokens: []}}
hub: {{dtype: float32}}
"""


def tiny_target(folder: Path, tok, seed: int) -> Path:
    make_tiny_llama(vocab_size=len(tok), layers=6, hidden=32, seed=seed).save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """root/{target, other_target, corpus.jsonl, recipe.yaml, run/{data, dump, train, export}}."""
    from eagle_train.target import load_tokenizer

    root = tmp_path_factory.mktemp("world")
    tok = load_tokenizer(OmegaConf.structured(TargetConfig(model="smollm2-135m-instruct")))
    tiny_target(root / "target", tok, seed=0)
    tiny_target(root / "other_target", tok, seed=1)  # same shapes, other weights
    with gzip.open(SHAREGPT, "rt") as f:
        (root / "corpus.jsonl").write_text("".join(next(f) for _ in range(16)))
    recipe = root / "recipe.yaml"
    recipe.write_text(RECIPE.format(root=root))
    for stage in ("prep", "dump", "train", "export"):
        assert cli.main([stage, str(recipe)]) == 0, stage
    return root


def digests(*folders) -> dict:
    return {p: hashlib.sha256(p.read_bytes()).hexdigest() for d in folders for p in sorted(Path(d).rglob("*"))
            if p.is_file()}


# ---------------------------------------------------------------- damage helpers
def truncate(path: Path, keep: float = 0.5) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: int(len(data) * keep)])


def flip(path: Path, at: float = 0.7) -> None:
    """Same length, one byte changed far from the header."""
    data = bytearray(path.read_bytes())
    data[int(len(data) * at)] ^= 0xFF
    path.write_bytes(bytes(data))


def copy(world, case, name) -> Path:
    src = world / "run" / name
    dst = case / name.replace("/", "_")
    shutil.copytree(src, dst)
    return dst


def first(folder: Path, pattern: str) -> Path:
    return sorted(folder.glob(pattern))[0]


def scale_weights(folder: Path, factor: float, name: str = "fc.weight") -> None:
    path = folder / "model.safetensors"
    state = load_file(path)
    state[name] = state[name] * factor
    save_file(state, path, metadata={"format": "pt"})


def edit_json(path: Path, fn) -> None:
    cfg = json.loads(path.read_text())
    fn(cfg)
    path.write_text(json.dumps(cfg))


# ---------------------------------------------------------------- cases
def recipe_list(w, c):
    (c / "r.yaml").write_text("- target\n- data\n")
    return ["prep", str(c / "r.yaml")]


def recipe_scalar_section(w, c):
    (c / "r.yaml").write_text("target:\n  model: x\ndata:\n  source: y\ntrain: 5\n")
    return ["train", str(c / "r.yaml")]


def train_online(w, c, *extra):
    return ["train", str(w / "recipe.yaml"), "train.mode=online", f"train.output={c}/train", *extra]


def offline(w, c, *extra):
    return ["train", str(w / "recipe.yaml"), f"train.output={c}/train", *extra]


def damaged_dump(damage):
    def build(w, c):
        dump = copy(w, c, "dump")
        damage(dump)
        return offline(w, c, f"dump.output={dump}")
    return build


def damaged_checkpoint(damage):
    def build(w, c):
        out = copy(w, c, "train")
        damage(out / "checkpoint")
        return ["train", str(w / "recipe.yaml"), f"train.output={out}", "train.max_steps=4"]
    return build


def damaged_corpus(damage):
    def build(w, c):
        src = c / "corpus.jsonl.gz"
        with gzip.open(src, "wt") as f:
            f.write((w / "corpus.jsonl").read_text())
        damage(src)
        return ["prep", str(w / "recipe.yaml"), f"data.source={src}", f"data.output={c}/data"]
    return build


def damaged_head(name, damage, stage="eval"):
    def build(w, c):
        head = copy(w, c, name)
        damage(head)
        if stage == "check":
            return ["check", str(head)]
        return [stage, str(w / "recipe.yaml"), f"eval.head={head}", f"eval.output={c}/eval"]
    return build


def bad_benchmark(w, c):
    path = c / "bench.jsonl"
    path.write_text('{"question_id": 1, "category": "x", "turns": ["hello"]}\n{"question_id": 2, "turns": ["cut o')
    return ["eval", str(w / "recipe.yaml"), f"eval.benchmarks=[{path}]", f"eval.output={c}/eval"]


def eval_as(*extra):
    def build(w, c):
        return ["eval", str(w / "recipe.yaml"), "eval.benchmarks=[mt_bench]", f"eval.output={c}/eval", *extra]
    return build


def export_as(*extra):
    def build(w, c):
        return ["export", str(w / "recipe.yaml"), f"hub.export_dir={c}/export", *extra]
    return build


def half_dump(w, c):
    """A dump made with other aux layers, then offline training with the recipe's (default) ones."""
    return offline(w, c, "head.aux_layers=[1,2,4]")


CASES = [
    # recipe structure and values
    ("recipe-top-level-list", recipe_list, r"top level must be a mapping"),
    ("recipe-section-scalar", recipe_scalar_section, r"`train` is a section"),
    ("recipe-bad-override", lambda w, c: ["train", str(w / "recipe.yaml"), "train..lr=1"], r"override 'train\.\.lr=1'"),
    ("recipe-missing-file", lambda w, c: ["dump", str(c / "nope.yaml")], r"recipe file not found: .*nope\.yaml"),
    ("negative-learning-rate", lambda w, c: train_online(w, c, "train.learning_rate=-1e-3"), r"train\.learning_rate"),
    ("nan-learning-rate", lambda w, c: train_online(w, c, "train.learning_rate=nan"), r"train\.learning_rate"),
    ("aux-minus-one", lambda w, c: train_online(w, c, "head.aux_layers=[-1,2,3]"), r"head\.aux_layers"),
    ("tree-nodes-below-depth", eval_as("eval.num_draft_tokens=2", "eval.depth=5"), r"eval\.num_draft_tokens"),
    # target
    ("target-path-missing", lambda w, c: train_online(w, c, f"target.model={c}/no-such-model"),
     r"target\.model=.*no-such-model"),
    ("aux-past-depth-online", lambda w, c: train_online(w, c, "head.aux_layers=[1,2,6]"), r"head\.aux_layers.*6"),
    # corpus
    ("corpus-truncated-gz", damaged_corpus(truncate), r"corpus\.jsonl\.gz is truncated"),
    ("corpus-not-gzip", damaged_corpus(lambda p: p.write_text('{"conversations": []}\n')),
     r"corpus\.jsonl\.gz cannot be read"),
    # dump
    ("shard-truncated", damaged_dump(lambda d: truncate(first(d, "shard-*.safetensors"))), r"shard-r000-.*sha256"),
    ("shard-byte-flipped", damaged_dump(lambda d: flip(first(d, "shard-*.safetensors"))), r"shard-r000-.*sha256"),
    ("shard-missing", damaged_dump(lambda d: first(d, "shard-*.safetensors").unlink()), r"shard-r000-.*missing"),
    ("manifest-broken", damaged_dump(lambda d: truncate(d / "manifest.json")), r"manifest\.json is damaged"),
    ("dump-other-aux-layers", half_dump, r"aux_layers = \[2, 3, 3\].*\[1, 2, 4\]"),
    ("dump-other-storage", lambda w, c: offline(w, c, "dump.storage=topk"), r"storage = 'full'.*'topk'"),
    ("dump-other-max-length", lambda w, c: offline(w, c, "data.max_length=64"), r"max_length = 96.*64"),
    ("dump-other-target", lambda w, c: offline(w, c, f"target.model={w}/other_target"), r"target_id|target_digest"),
    # checkpoint
    ("checkpoint-weights-truncated", damaged_checkpoint(lambda k: truncate(k / "model.safetensors")),
     r"checkpoint/model\.safetensors: sha256"),
    ("checkpoint-weights-flipped", damaged_checkpoint(lambda k: flip(k / "model.safetensors")),
     r"checkpoint/model\.safetensors: sha256"),
    ("checkpoint-optimizer-truncated", damaged_checkpoint(lambda k: truncate(first(k, "optimizer*"))),
     r"checkpoint/optimizer.*sha256"),
    ("checkpoint-state-truncated", damaged_checkpoint(lambda k: truncate(k / "train_state.json")),
     r"train_state\.json is damaged"),
    # divergence
    ("learning-rate-1e6", lambda w, c: train_online(w, c, "train.learning_rate=1e6"),
     r"(weights exploded|exploding training loss|non-finite training loss) at step"),
    # heads and exports
    ("head-shape-mismatch", damaged_head("train/final", lambda h: edit_json(
        h / "config.json", lambda m: m["eagle_train"]["config"].update(intermediate_size=100))),
     r"model\.safetensors: tensor shapes do not match"),
    ("head-config-broken", damaged_head("train/final", lambda h: truncate(h / "config.json")),
     r"config\.json: not valid JSON"),
    ("head-weights-truncated", damaged_head("train/final", lambda h: truncate(h / "model.safetensors")),
     r"model\.safetensors: not a readable safetensors"),
    ("export-shape-mismatch", damaged_head("export", lambda h: edit_json(
        h / "config.json", lambda m: m.update(intermediate_size=100))), r"tensor shapes do not match"),
    ("check-config-broken", damaged_head("export", lambda h: truncate(h / "config.json"), "check"),
     r"config\.json: not valid JSON"),
    ("check-weights-truncated", damaged_head("export", lambda h: truncate(h / "model.safetensors"), "check"),
     r"model\.safetensors: not a readable"),
    ("check-absurd-weights", damaged_head("export", lambda h: scale_weights(h, 1e8), "check"), r"exploded weights"),
    ("check-nan-weights", damaged_head("export", lambda h: scale_weights(h, float("nan")), "check"),
     r"NaN or inf"),
    ("eval-other-head-type", eval_as("head.type=eagle1"), r"eagle3 head but the recipe says head\.type=eagle1"),
    ("eval-other-target", eval_as(f"target.model={{w}}/other_target"), r"weights digest"),
    ("eval-benchmark-truncated", bad_benchmark, r"bench\.jsonl:2: not a JSON record"),
    ("export-other-head-type", export_as("head.type=eagle1"), r"head\.type=eagle1"),
    ("export-other-aux-layers", export_as("head.aux_layers=[1,2,4]"), r"aux layers \[2, 3, 3\]"),
]


@pytest.mark.parametrize("build,culprit", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_input_is_one_line(world, tmp_path, capsys, build, culprit):
    argv = [a.replace("{w}", str(world)) for a in build(world, tmp_path)]
    before = digests(world, tmp_path)
    rc = cli.main(argv)
    out, err = capsys.readouterr()
    assert rc != 0, (argv, err[-2000:])
    assert "Traceback" not in out + err
    named = [line for line in err.splitlines() if re.search(culprit, line)]
    assert len(named) == 1, f"culprit {culprit!r} not on exactly one stderr line:\n{err[-3000:]}"
    if argv[0] != "check":  # check lists its problems; every other stage says one line
        assert named[0].startswith(f"eagle-train {argv[0]}: error: "), named[0]
    after = digests(world, tmp_path)
    changed = [str(p) for p, h in before.items() if after.get(p) != h]
    assert not changed, f"a failed command changed files already on disk: {changed}"


def test_diverged_run_keeps_only_the_sound_checkpoint(world, tmp_path, monkeypatch):
    """Weights blown up after step 2: the run stops before saving them, naming step 2 as the last
    sound checkpoint, and the checkpoint left on disk holds finite, small weights."""
    from eagle_train import train
    from eagle_train.errors import TrainingDiverged
    from eagle_train.recipe import load_recipe

    real, calls = train.DraftLoss.forward, {"n": 0}

    def blow_up(self, b, with_stats=True):
        calls["n"] += self.training
        if calls["n"] == 3 and self.training:  # the third training forward: step 2 was saved
            with torch.no_grad():
                self.head.fc.weight.mul_(1e7)
        return real(self, b, with_stats)

    monkeypatch.setattr(train.DraftLoss, "forward", blow_up)
    cfg = load_recipe(world / "recipe.yaml", [f"train.output={tmp_path}/train", "train.max_steps=6",
                                              "train.save_every=2", "train.log_every=1"])
    with pytest.raises(TrainingDiverged, match=r"(weights exploded|exploding).*\(step 2\)"):
        train.main(cfg)
    ckpt = tmp_path / "train/checkpoint"
    assert json.loads((ckpt / "train_state.json").read_text())["step"] == 2
    w = load_file(ckpt / "model.safetensors")
    assert all(torch.isfinite(v).all() and v.abs().max() < 1e3 for v in w.values() if v.is_floating_point())
    assert not (tmp_path / "train/final").exists()


def test_broken_manifest_is_rebuilt_by_a_dump_rerun(world, tmp_path, capsys):
    dump = shutil.copytree(world / "run/dump", tmp_path / "dump")
    good = json.loads((dump / "manifest.json").read_text())
    truncate(dump / "manifest.json")
    shards = {p.name: p.stat().st_mtime_ns for p in dump.glob("shard-*.safetensors")}
    assert cli.main(["dump", str(world / "recipe.yaml"), f"dump.output={dump}", "dump.include_eval=false"]) == 0
    assert "rebuilding it from the progress/ records" in capsys.readouterr().err
    back = json.loads((dump / "manifest.json").read_text())
    assert back["complete"] and back["shards"] == good["shards"]
    assert {p.name: p.stat().st_mtime_ns for p in dump.glob("shard-*.safetensors")} == shards  # nothing redone


def test_artifacts_carry_their_contract(world):
    """The manifest names the target's weights and the corpus' tokenizer; the head and the export
    name the same target digest."""
    man = json.loads((world / "run/dump/manifest.json").read_text())
    stats = json.loads((world / "run/data/stats.json").read_text())
    head = json.loads((world / "run/train/final/config.json").read_text())["eagle_train"]["train_state"]
    export = json.loads((world / "run/export/config.json").read_text())["eagle_train_export"]
    assert len(man["target_digest"]) == 16 and man["tokenizer_digest"] == stats["tokenizer_digest"]
    assert head["target_digest"] == man["target_digest"] == export["target_digest"]
    assert man["max_length"] == 96 and man["head_type"] == "eagle3" and man["aux_layers"] == [2, 3, 3]


@pytest.mark.parametrize("stage", sorted(cli.STAGES))
def test_every_stage_answers_help(stage, capsys):
    with pytest.raises(SystemExit) if stage in cli.ARGPARSE else _nothing():
        assert cli.main([stage, "--help"]) == 0
    out = capsys.readouterr().out
    assert "usage" in out.lower() and ("Recipe sections read" in out or stage in cli.ARGPARSE)


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def test_scripts_answer_help_and_fail_in_one_line(world, tmp_path):
    """`python eagle_train/train.py --help` (the launch line of accelerate) and an unknown hub id
    with the hub offline, through real processes."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run([sys.executable, "eagle_train/train.py", "--help"], cwd=ROOT, capture_output=True,
                          text=True, timeout=120, env=env)
    assert proc.returncode == 0 and "accelerate launch eagle_train/train.py" in proc.stdout, proc.stderr[-2000:]
    proc = subprocess.run([sys.executable, "-m", "data_prep.dump", str(world / "recipe.yaml"),
                           "target.model=nobody/no-such-model", f"dump.output={tmp_path}/dump"],
                          cwd=ROOT, capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert proc.stderr.strip().splitlines()[-1].startswith("eagle-train dump: error: target.model='nobody/no-such-model'")


def test_version_check_names_the_versions():
    from eagle_train import declared_requirements, version_problems

    reqs = declared_requirements()
    assert any(r.startswith("transformers>=5") for r in reqs), reqs
    assert version_problems(reqs, {"transformers": "4.56.0"}.get) == ["transformers 4.56.0 (declared <6,>=5.24)"]
    assert version_problems(reqs, {"torch": "2.13.0+cpu", "transformers": "5.24.0"}.get) == []
