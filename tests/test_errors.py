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


def damaged_copy(name, key, damage, run):
    """A copy of the world's `name` folder, damaged, given to `run` as `key`."""
    def build(w, c):
        folder = copy(w, c, name)
        damage(folder)
        return run(w, c, f"{key}={folder}")
    return build


def damaged_dump(damage):
    return damaged_copy("dump", "dump.output", damage, offline)


def damaged_checkpoint(damage, *extra):
    def build(w, c):
        out = copy(w, c, "train")
        damage(out / "checkpoint")
        return ["train", str(w / "recipe.yaml"), f"train.output={out}", "train.max_steps=4", *extra]
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


# ---------------------------------------------------------------- second round: new cases of every class
def regen_folder(w, c, *overrides, damage=None):
    """A complete regen output for the world recipe (what `eagle-train regen` leaves), then `damage`."""
    from eagle_train.data_prep.regenerate import settings_of
    from eagle_train.dump_reader import sha256_file
    from eagle_train.recipe_load import load_recipe

    out = c / "regen"
    (out / "progress").mkdir(parents=True)
    settings = settings_of(load_recipe(w / "recipe.yaml", [f"regen.output={out}", *overrides]))
    lines = (w / "corpus.jsonl").read_text().splitlines()[:4]
    (out / "shard-00000.jsonl").write_text("".join(
        json.dumps({"id": f"r{i}", "messages": [{"role": "user", "content": "hi"},
                                                {"role": "assistant", "content": f"reply {i} {len(x)}"}]}) + "\n"
        for i, x in enumerate(lines)))
    (out / "progress/shard-00000.json").write_text(json.dumps(
        {"conversations": 4, "replies": 4, "sha256": sha256_file(out / "shard-00000.jsonl")}))
    (out / "regen.json").write_text(json.dumps({**settings, "complete": True, "shards": 1}))
    if damage:
        damage(out)
    return out


def recipe_text(stage, text):
    def build(w, c):
        (c / "r.yaml").write_text(text)
        return [stage, str(c / "r.yaml")]
    return build


def prep_from_regen(damage):
    def build(w, c):
        out = regen_folder(w, c, damage=damage)
        return ["prep", str(w / "recipe.yaml"), "regen.enabled=true", f"regen.output={out}", f"data.output={c}/data"]
    return build


def regen_rerun_other_settings(w, c):
    out = regen_folder(w, c, "regen.max_new_tokens=8")
    return ["regen", str(w / "recipe.yaml"), f"regen.output={out}", "regen.max_new_tokens=16"]


def regen_json_damaged(w, c):
    out = regen_folder(w, c, damage=lambda o: truncate(o / "regen.json"))
    return ["regen", str(w / "recipe.yaml"), f"regen.output={out}"]


def regen_as(*extra):
    def build(w, c):
        return ["regen", str(w / "recipe.yaml"), f"regen.output={c}/regen", *extra]
    return build


def prep_from(make_source):
    def build(w, c):
        return ["prep", str(w / "recipe.yaml"), f"data.source={make_source(w, c)}", f"data.output={c}/data"]
    return build


def prepared_damaged(damage):
    """The dump reading a damaged copy of the prepared corpus."""
    def build(w, c):
        data = copy(w, c, "data")
        damage(data)
        return ["dump", str(w / "recipe.yaml"), f"data.output={data}", f"dump.output={c}/dump"]
    return build


def output_is_a_file(stage, key):
    def build(w, c):
        (c / "f").write_text("a file the user keeps")
        return [stage, str(w / "recipe.yaml"), f"{key}={c}/f"] + (["train.mode=online"] if stage == "train" else [])
    return build


def binary_jsonl(w, c):
    (c / "noise.jsonl").write_bytes(bytes(range(256)) * 64)
    return c / "noise.jsonl"


def empty_folder(w, c):
    (c / "corpus").mkdir()
    (c / "corpus/readme.txt").write_text("not a corpus")
    return c / "corpus"


def push_as(*extra, token=None):
    def build(w, c):
        env = {"HF_TOKEN": token or "", "EAGLE_TEST_TOKEN": token or "", "HF_HUB_DISABLE_IMPLICIT_TOKEN": "1",
               "HF_HOME": str(c / "hf-home")}  # no saved login either
        return ["push", str(w / "recipe.yaml"), f"hub.export_dir={w}/run/export", *extra], env
    return build


def other_chat_template(w, c):
    """The world's target with one character more in its chat template: same weights, other token sequences."""
    target = shutil.copytree(w / "target", c / "target_tpl")
    jinja = target / "chat_template.jinja"
    if jinja.is_file():
        jinja.write_text(jinja.read_text() + " ")
    else:
        edit_json(target / "tokenizer_config.json", lambda t: t.update(chat_template=t["chat_template"] + " "))
    return eval_as(f"target.model={target}")(w, c)


def head_records_tokenizer(digest):
    def damage(h):
        edit_json(h / "config.json", lambda m: m["eagle_train"]["train_state"].update(tokenizer_digest=digest))
    return damaged_head("train/final", damage)


def drop_tensor(name):
    def damage(h):
        state = load_file(h / "model.safetensors")
        del state[name]
        save_file(state, h / "model.safetensors", metadata={"format": "pt"})
    return damage


def reshape_tensor(name):
    def damage(h):
        state = load_file(h / "model.safetensors")
        state[name] = state[name][:, :-1].contiguous()
        save_file(state, h / "model.safetensors", metadata={"format": "pt"})
    return damage


def benchmark(text):
    def build(w, c):
        (c / "bench.jsonl").write_text(text)
        return ["eval", str(w / "recipe.yaml"), f"eval.benchmarks=[{c}/bench.jsonl]", f"eval.output={c}/eval"]
    return build


CASES += [
    # recipe structure
    ("recipe-empty-file", recipe_text("dump", ""), r"target\.model"),
    ("recipe-yaml-syntax", recipe_text("prep", "target: [unclosed\n"), r"r\.yaml: not valid YAML"),
    ("recipe-key-typo-in-file", recipe_text("train", "target: {model: x}\ndata: {source: y}\ntrain: {lerning_rate: 1}\n"),
     r"train\.lerning_rate"),
    ("recipe-unknown-key", lambda w, c: offline(w, c, "train.lerning_rate=1e-3"), r"train\.lerning_rate"),
    ("recipe-wrong-type", lambda w, c: offline(w, c, "train.max_steps=abc"), r"train\.max_steps"),
    ("recipe-two-files", lambda w, c: ["eval", str(w / "recipe.yaml"), str(w / "recipe.yaml")],
     r"expected one recipe file"),
    # missing target
    ("regen-target-missing", regen_as(f"target.model={{c}}/no-such-model"), r"target\.model=.*no-such-model"),
    ("eval-target-missing", eval_as("target.model={c}/no-such-model"), r"target\.model=.*no-such-model"),
    ("prep-target-missing", lambda w, c: ["prep", str(w / "recipe.yaml"), f"target.model={c}/no-such-model",
                                          f"data.output={c}/data"], r"no-such-model"),
    # invalid values
    ("regen-max-turns-negative", regen_as("regen.max_turns=-1"), r"regen\.max_turns"),
    ("regen-top-p-zero", regen_as("regen.top_p=0"), r"regen\.top_p"),
    ("regen-shard-size-zero", regen_as("regen.shard_size=0"), r"regen\.shard_size"),
    ("regen-temperature-negative", regen_as("regen.temperature=-0.5"), r"regen\.temperature"),
    ("regen-max-conversations-zero", regen_as("data.max_conversations=0"), r"data\.max_conversations"),
    ("negative-warmup", lambda w, c: offline(w, c, "train.warmup_steps=-1"), r"train\.warmup_steps"),
    ("skip-conversations-negative", lambda w, c: offline(w, c, "data.skip_conversations=-1"), r"data\.skip_conversations"),
    ("prompt-template-unknown-field", lambda w, c: offline(w, c, "data.prompt_template=Summarize {text}"),
     r"data\.prompt_template.*\{user\}.*'text'"),
    ("min-prompt-chars-negative", lambda w, c: offline(w, c, "data.min_prompt_chars=-5"), r"data\.min_prompt_chars"),
    ("extra-dump-missing", lambda w, c: offline(w, c, f"train.extra_dumps=[{c}/no-such-dump]"),
     r"no-such-dump \(train\.extra_dumps\[0\]\)"),
    ("extra-dumps-online", lambda w, c: train_online(w, c, f"train.extra_dumps=[{w}/dump]"), r"train\.extra_dumps.*offline"),
    ("eval-depth-zero", eval_as("eval.depth=0"), r"eval\.depth"),
    # regen artifacts
    ("regen-rerun-other-settings", regen_rerun_other_settings, r"max_new_tokens = 8.*16"),
    ("regen-json-damaged", regen_json_damaged, r"regen\.json is damaged"),
    ("regen-shard-truncated", prep_from_regen(lambda o: truncate(o / "shard-00000.jsonl")),
     r"shard-00000\.jsonl.*sha256"),
    ("regen-shard-missing", prep_from_regen(lambda o: (o / "shard-00000.jsonl").unlink()),
     r"shard-00000\.jsonl.*missing"),
    ("regen-incomplete", prep_from_regen(lambda o: edit_json(o / "regen.json", lambda r: r.update(complete=False))),
     r"no complete regeneration"),
    # corpus
    ("corpus-hub-offline", prep_from(lambda w, c: "nobody/no-such-dataset"),
     r"data\.source='nobody/no-such-dataset' is not a local file"),
    ("corpus-binary-jsonl", prep_from(binary_jsonl), r"no usable conversation"),
    ("corpus-folder-without-files", prep_from(empty_folder), r"folder has no"),
    ("corpus-missing-file", prep_from(lambda w, c: c / "none.jsonl"), r"none\.jsonl.*not found"),
    ("dump-prepared-arrow-truncated", prepared_damaged(lambda d: truncate(first(d, "train/*.arrow"))),
     r"prepared corpus .*train \(data\.output\) is damaged"),
    ("dump-prepared-state-broken", prepared_damaged(lambda d: truncate(d / "train/state.json")),
     r"prepared corpus .*train \(data\.output\) is damaged"),
    ("dump-prepared-stats-broken", prepared_damaged(lambda d: truncate(d / "stats.json")),
     r"stats\.json \(data\.output\) is damaged"),
    ("dump-topk-over-vocab", lambda w, c: ["dump", str(w / "recipe.yaml"), "dump.storage=topk", "dump.topk=100000",
                                           f"dump.output={c}/dump"], r"dump\.topk` = 100000 exceeds"),
    # shard
    ("shard-emptied", damaged_dump(lambda d: first(d, "shard-*.safetensors").write_bytes(b"")),
     r"shard-r000-.*sha256"),
    ("eval-shard-flipped", damaged_dump(lambda d: flip(first(d, "eval/shard-*.safetensors"))),
     r"eval/shard-r000-.*sha256"),
    # manifest
    ("manifest-not-an-object", damaged_dump(lambda d: (d / "manifest.json").write_text("[]")),
     r"manifest\.json is damaged"),
    ("manifest-incomplete", damaged_dump(lambda d: edit_json(d / "manifest.json", lambda m: m.update(complete=False))),
     r"incomplete"),
    ("manifest-other-tokenizer", damaged_dump(lambda d: edit_json(
        d / "manifest.json", lambda m: m.update(tokenizer_digest="0" * 16))), r"tokenizer_digest = '0000000000000000'"),
    # checkpoint
    ("checkpoint-weights-missing", damaged_checkpoint(lambda k: (k / "model.safetensors").unlink()),
     r"checkpoint/model\.safetensors"),
    ("checkpoint-state-not-object", damaged_checkpoint(lambda k: (k / "train_state.json").write_text("[1, 2]")),
     r"train_state\.json"),
    # head shapes
    ("head-tensor-missing", damaged_head("train/final", drop_tensor("fc.weight")), r"missing \['fc\.weight'\]"),
    ("head-tensor-reshaped", damaged_head("train/final", reshape_tensor("fc.weight")),
     r"tensor shapes do not match.*fc\.weight"),
    # tokenizer / chat template (eval)
    ("eval-other-chat-template", other_chat_template, r"tokenizer/chat-template digest"),
    ("eval-head-records-other-tokenizer", head_records_tokenizer("f" * 16), r"digest ffffffffffffffff"),
    # check
    ("check-weights-missing", damaged_head("export", lambda h: (h / "model.safetensors").unlink(), "check"),
     r"model\.safetensors"),
    ("check-config-not-object", damaged_head("export", lambda h: (h / "config.json").write_text("[1]"), "check"),
     r"config\.json"),
    ("check-no-folder", lambda w, c: ["check", str(c / "no-such-export")],
     r"no-such-export: config\.json, model\.safetensors missing"),
    # benchmark file
    ("benchmark-missing", lambda w, c: eval_as(f"eval.benchmarks=[{c}/none.jsonl]")(w, c), r"none\.jsonl"),
    ("benchmark-no-turns", benchmark('{"question_id": 1, "text": "hello"}\n'), r"bench\.jsonl:1: record has neither"),
    ("benchmark-empty", benchmark(""), r"bench\.jsonl: no prompts"),
    # an output path that is an existing file
    ("train-output-is-a-file", output_is_a_file("train", "train.output"), r"/f: File exists"),
    ("dump-output-is-a-file", output_is_a_file("dump", "dump.output"), r"/f/progress: Not a directory"),
    ("eval-output-is-a-file", output_is_a_file("eval", "eval.output"), r"/f: File exists"),
    ("regen-output-is-a-file", output_is_a_file("regen", "regen.output"), r"/f: File exists"),
    ("regen-source-not-json", lambda w, c: (c / "c.txt").write_text("hello\n") and regen_as(
        f"data.source={c}/c.txt")(w, c), r"c\.txt: not a JSON array"),
    # hub
    ("push-no-token", push_as("hub.repo_id=me/tiny"), r"no Hugging Face token"),
    ("push-no-repo-id", push_as(), r"hub\.repo_id"),
    ("push-hub-unreachable", push_as("hub.repo_id=me/tiny", "hub.endpoint=http://127.0.0.1:9", token="hf_x"),
     r"hub is not reachable"),
    ("push-export-missing", push_as("hub.repo_id=me/tiny", "hub.export_dir={c}/no-export"), r"no-export"),
]


# ---------------------------------------------------------------- third round
def resume_with(*extra):
    """Resume the world's (intact) checkpoint under another recipe."""
    return damaged_checkpoint(lambda k: None, *extra)


def online_on_damaged(damage):
    return damaged_copy("data", "data.output", damage, train_online)


CASES += [
    ("micro-batch-over-corpus", lambda w, c: train_online(w, c, "train.micro_batch_size=64"),
     r"`train\.micro_batch_size` = 64 .* exceeds the \d+ training samples"),
    ("resume-other-aux-layers", resume_with("train.mode=online", "head.aux_layers=[1,2,4]"),  # online: no dump check
     r"aux_layers = \[2, 3, 3\] but this run has \[1, 2, 4\].*train\.resume=false"),
    ("resume-other-draft-vocab", resume_with("head.draft_vocab_size=1000"),
     r"draft_vocab_size = 49152 but this run has 1000"),
    ("online-prepared-arrow-truncated", online_on_damaged(lambda d: truncate(first(d, "train/*.arrow"))),
     r"prepared corpus .*train \(data\.output\) is damaged"),
    ("sweep-topk-zero", lambda w, c: ["sweep", str(w / "recipe.yaml"), "eval.sweep_topk=[0]", f"eval.output={c}/eval"],
     r"`eval\.sweep_topk` = \[0\] must be > 0"),
    ("sweep-tree-two-numbers", lambda w, c: ["sweep", str(w / "recipe.yaml"), "eval.sweep_trees=[[10,6,60],[4,4]]",
                                             f"eval.output={c}/eval"],
     r"`eval\.sweep_trees\[1\]` = \[4, 4\] must be \[topk, depth, num_draft_tokens\]"),
    ("eval-max-prompts-zero", eval_as("eval.max_prompts=0"), r"`eval\.max_prompts` = 0 must be > 0"),
    ("head-mlp-width-zero", lambda w, c: train_online(w, c, "head.intermediate_size=0"),
     r"`head\.intermediate_size` = 0 must be > 0"),
    ("prep-output-is-a-file", output_is_a_file("prep", "data.output"), r"`data\.output` = '.*/f' is an existing file"),
    ("export-output-is-a-file", output_is_a_file("export", "hub.export_dir"),
     r"`hub\.export_dir` = '.*/f' is an existing file"),
    ("check-target-missing", lambda w, c: ["check", str(w / "run/export"), "--target", str(c / "no-such-model")],
     r"no-such-model"),
    ("eval-export-other-chat-template", lambda w, c: other_chat_template(w, c) + [f"eval.head={w}/run/export"],
     r"tokenizer/chat-template digest"),
]


@pytest.mark.parametrize("build,culprit", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_input_is_one_line(world, tmp_path, capsys, monkeypatch, build, culprit):
    argv, env = build(world, tmp_path), {}
    if isinstance(argv, tuple):
        argv, env = argv
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    argv = [str(a).replace("{w}", str(world)).replace("{c}", str(tmp_path)) for a in argv]
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
    from eagle_train.recipe_load import load_recipe

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
    # the tokenizer/chat template the head was trained with travels with it into the export
    assert head["tokenizer_digest"] == stats["tokenizer_digest"] == export["tokenizer_digest"]
    ckpt = json.loads((world / "run/train/checkpoint/train_state.json").read_text())
    assert ckpt["contract"] == {"head_type": "eagle3", "aux_layers": [2, 3, 3], "draft_vocab_size": 49152,
                                "target_digest": man["target_digest"], "tokenizer_digest": stats["tokenizer_digest"],
                                "freeze_lm_head": False}
    assert man["max_length"] == 96 and man["head_type"] == "eagle3" and man["aux_layers"] == [2, 3, 3]


@pytest.mark.parametrize("stage", sorted(cli.STAGES))
def test_every_stage_answers_help(stage, capsys):
    assert cli.main([stage, "--help"]) == 0
    out = capsys.readouterr().out
    assert "usage" in out.lower() and "Recipe sections read" in out


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
    proc = subprocess.run([sys.executable, "-m", "eagle_train.data_prep.dump", str(world / "recipe.yaml"),
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


def test_out_of_range_library_is_one_line_at_every_entry_point(tmp_path):
    """A fake older transformers (a dist-info ahead of site-packages: importlib.metadata reports it,
    the real package still imports): each command prints one line naming installed and declared
    versions and what to do, exits non-zero; a library import raises DependencyError; the skip
    variable lets it run."""
    meta = tmp_path / "transformers-4.56.0.dist-info"
    meta.mkdir()
    (meta / "METADATA").write_text("Metadata-Version: 2.1\nName: transformers\nVersion: 4.56.0\n")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": f"{tmp_path}{os.pathsep}{ROOT}"}
    env.pop("EAGLE_TRAIN_SKIP_VERSION_CHECK", None)
    env.pop("EAGLE_TRAIN_DEBUG", None)
    recipe = str(ROOT / "recipes/smollm2-135m-eagle3.yaml")
    for argv in ([str(Path(sys.executable).parent / "eagle-train"), "prep", recipe],
                 [sys.executable, "eagle_train/train.py", recipe], [sys.executable, "-m", "eagle_train.data_prep.dump", recipe]):
        proc = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=600, env=env)
        lines = [line for line in proc.stderr.splitlines() if line.strip()]
        assert proc.returncode != 0 and "Traceback" not in proc.stderr and len(lines) == 1, (argv, proc.stderr)
        assert re.search(r"^eagle-train: error: .*transformers 4\.56\.0 \(declared <6,>=5\.24\)\. Install the "
                         r"declared ranges \(pip install -e \.\), or set EAGLE_TRAIN_SKIP_VERSION_CHECK=1", lines[0])
        assert proc.stdout == ""
    catch = "try:\n    import eagle_train\nexcept ImportError as err:\n    print('raised', type(err).__name__, err)"
    proc = subprocess.run([sys.executable, "-c", catch], cwd=ROOT, capture_output=True, text=True, timeout=600,
                          env=env)
    assert proc.returncode == 0 and proc.stdout.startswith("raised DependencyError eagle-train was tested"), proc.stderr
    proc = subprocess.run([str(Path(sys.executable).parent / "eagle-train"), "prep", "--help"], cwd=ROOT,
                          capture_output=True, text=True, timeout=600,
                          env={**env, "EAGLE_TRAIN_SKIP_VERSION_CHECK": "1"})
    assert proc.returncode == 0 and "usage: eagle-train prep" in proc.stdout, proc.stderr


def test_regen_shard_is_done_only_while_it_matches_its_record(tmp_path):
    """What a regen rerun skips and prep accepts: a shard whose progress record is readable and
    whose sha256 matches; a damaged one is redone (records from before sha256 was kept still count)."""
    from eagle_train.data_prep.regenerate import shard_record
    from eagle_train.dump_reader import sha256_file

    (tmp_path / "progress").mkdir()
    shard, record = tmp_path / "shard-00000.jsonl", tmp_path / "progress/shard-00000.json"
    shard.write_text('{"id": "a", "messages": []}\n' * 8)
    record.write_text(json.dumps({"conversations": 8, "sha256": sha256_file(shard)}))
    assert shard_record(tmp_path, 0)["conversations"] == 8
    flip(shard)
    assert shard_record(tmp_path, 0) is None
    record.write_text(json.dumps({"conversations": 8}))  # an older record: no digest to compare
    assert shard_record(tmp_path, 0) == {"conversations": 8}
    truncate(record)
    assert shard_record(tmp_path, 0) is None
    assert shard_record(tmp_path, 1) is None


@pytest.mark.parametrize("stage", sorted(cli.STAGES))
def test_every_stage_answers_short_help(stage, capsys, monkeypatch):
    monkeypatch.setenv("EAGLE_TRAIN_DEBUG", "0")  # --debug sets it for the process: undone after the test
    assert cli.main([stage, "-h", "--debug"]) == 0
    assert "usage" in capsys.readouterr().out.lower()


def test_unknown_stage_prints_the_stage_list(capsys):
    assert cli.main(["trian", "recipe.yaml"]) == 2
    assert cli.main([]) == 2
    out = capsys.readouterr().out
    assert out.count("eagle-train <stage> recipe.yaml") == 2 and all(s in out for s in cli.STAGES)
