"""Dump stage + reader: features read back equal a direct forward, resume after a kill, 2 processes == 1."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from datasets import Dataset, Features, Sequence, Value
from omegaconf import OmegaConf

from conftest import MT_BENCH, ROOT, make_tiny_llama
from eagle_train.data_prep import dump
from eagle_train.dump_reader import FeatureDataset, collate
from eagle_train.features import FP8_MAX, target_features
from eagle_train.recipe import RecipeError
from eagle_train.recipe_load import load_recipe


def write_corpus(folder: Path, samples, eval_samples=()):
    """A prepared corpus as `eagle-train prep` writes it: <folder>/{train,eval} + stats.json."""
    features = Features({"id": Value("string"), "input_ids": Sequence(Value("int32")),
                         "loss_mask": Sequence(Value("int8"))})
    for split, rows in (("train", samples), ("eval", eval_samples)):
        Dataset.from_dict({"id": [r[0] for r in rows], "input_ids": [r[1] for r in rows],
                           "loss_mask": [r[2] for r in rows]}, features=features).save_to_disk(str(folder / split))
    (folder / "stats.json").write_text("{}")


def random_samples(n, seed=0, vocab=512, lo=5, hi=60, prefix="s"):
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        length = int(torch.randint(lo, hi, (1,), generator=g))
        ids = torch.randint(3, vocab, (length,), generator=g).tolist()
        mask = [0] * (length // 2) + [1] * (length - length // 2)
        out.append((f"{prefix}{i}", ids, mask))
    return out


def overrides(tmp: Path, model_dir, *extra):
    return [f"target.model={model_dir}", "target.device=cpu", "data.source=unused", f"output_dir={tmp}", *extra]


def recipe(tmp: Path, model_dir, *extra):
    return load_recipe(None, overrides(tmp, model_dir, *extra))


def solo_hidden(model, ids, layers):
    """Direct forward of one sample alone: HF hidden_states at `layers` and the post-norm last state."""
    out = model.model(input_ids=torch.tensor([ids]), output_hidden_states=True, use_cache=False)
    return torch.cat([out.hidden_states[i] for i in layers], -1)[0], out.last_hidden_state[0]


def by_id(folder):
    ds = FeatureDataset(folder)
    return {sid: ds[i] for i, sid in enumerate(ds.ids)}


@pytest.fixture(autouse=True)
def one_thread():
    """These tests are small forwards; one thread avoids OpenMP spin-waits when the CPU cores are shared."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture
def tiny_dir(tmp_path_factory):
    model = make_tiny_llama(layers=6)
    path = tmp_path_factory.mktemp("tiny")
    model.save_pretrained(path)
    return model, path


def test_fp32_bit_exact_tiny(tmp_path, tiny_dir):
    model, mdir = tiny_dir
    samples = random_samples(12)
    samples.append(("nomask", [5, 6, 7, 8], [0, 0, 0, 0]))  # no loss-masked token: must be dropped
    write_corpus(tmp_path / "data", samples, random_samples(3, seed=1, prefix="e"))
    cfg = recipe(tmp_path, mdir, "dump.dtype=float32", "dump.storage=full", "dump.batch_tokens=1")
    dump.main(cfg, model)

    man = json.loads((tmp_path / "dump" / "manifest.json").read_text())
    assert man["complete"] and man["aux_layers"] == [2, 3, 3] and man["dtype"] == "float32"
    assert man["num_samples"] == 12 and "nomask" not in {i for s in man["shards"] for i in s["ids"]}
    for s in man["shards"]:
        assert dump.sha256_file(tmp_path / "dump" / s["file"]) == s["sha256"]
    feats = by_id(tmp_path / "dump")
    for sid, ids, mask in samples[:-1]:
        aux, last = solo_hidden(model, ids, [2, 3, 3])
        item = feats[sid]
        assert item["input_ids"].tolist() == ids and item["loss_mask"].tolist() == mask
        assert torch.equal(item["aux"], aux) and torch.equal(item["last"], last)
    assert sorted(FeatureDataset(tmp_path / "dump" / "eval").ids) == ["e0", "e1", "e2"]


@pytest.mark.parametrize("targets", ["replies", "all"])
def test_batched_bf16_topk_tiny(tmp_path, tiny_dir, targets):
    """Padded batches: read-back == the same batches' direct forward rounded to bf16, and ~= lone forwards; with
    dump.targets=replies the top-k only where a reply token follows (zeros elsewhere)."""
    model, mdir = tiny_dir
    samples = random_samples(20, seed=2)
    write_corpus(tmp_path / "data", samples)
    cfg = recipe(tmp_path, mdir, "dump.storage=topk", "dump.topk=8", "dump.batch_tokens=200",
                 "dump.include_eval=false", "head.aux_layers=[1,3,5]", f"dump.targets={targets}")
    dump.main(cfg, model)
    feats = by_id(tmp_path / "dump")
    assert set(feats) == {s[0] for s in samples} and "last" not in feats["s0"]

    rows, lengths = dump.select_samples(Dataset.from_dict({"loss_mask": [s[2] for s in samples]}))
    batches = dump.plan_batches(rows, lengths, 200)
    assert len(batches) < len(samples)  # really batched
    for batch in batches:
        width = max(len(samples[r][1]) for r in batch)
        ids = torch.zeros(len(batch), width, dtype=torch.long)
        mask = torch.zeros(len(batch), width, dtype=torch.long)
        for i, r in enumerate(batch):
            ids[i, :len(samples[r][1])], mask[i, :len(samples[r][1])] = torch.tensor(samples[r][1]), 1
        direct = target_features(model, ids, None if mask.all() else mask, [1, 3, 5], "topk", 8)
        for i, r in enumerate(batch):
            sid, n = samples[r][0], len(samples[r][1])
            item = feats[sid]
            assert torch.equal(item["aux"], direct["aux"][i, :n].bfloat16().float())
            kept = torch.ones(n, dtype=torch.bool)
            if targets == "replies":  # the target at t is token t+1's: kept where t+1 is a reply token
                kept = torch.tensor(samples[r][2][1:] + [0], dtype=torch.bool)
                assert 0 < kept.sum() < n
                assert (item["topk_ids"][~kept] == 0).all() and (item["topk_logp"][~kept] == 0).all()
            assert torch.equal(item["topk_ids"][kept], direct["topk_ids"][i, :n][kept].long())
            assert torch.equal(item["topk_logp"][kept], direct["topk_logp"][i, :n][kept].half().float())
            aux, last = solo_hidden(model, samples[r][1], [1, 3, 5])
            torch.testing.assert_close(item["aux"], aux, rtol=2 ** -8, atol=1e-6)
            logp = torch.log_softmax(model.lm_head(last), -1).topk(8, -1).values
            torch.testing.assert_close(item["topk_logp"][kept], logp[kept], rtol=1e-3, atol=1e-3)


def chat_samples(tok, n=3):
    """A few short SmolLM2 chat samples with an assistant-only loss mask, tokenized here."""
    qs = [json.loads(line)["turns"][0] for line in MT_BENCH.read_text().splitlines()[:n]]
    out = []
    for i, q in enumerate(qs):
        msgs = [{"role": "user", "content": q[:100]}]
        prompt = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
        full = tok.apply_chat_template(msgs + [{"role": "assistant", "content": "Sure, here is a short answer."}],
                                       tokenize=False)
        p, f = tok(prompt, add_special_tokens=False)["input_ids"], tok(full, add_special_tokens=False)["input_ids"]
        assert f[:len(p)] == p
        out.append((f"mt{i}", f, [0] * len(p) + [1] * (len(f) - len(p))))
    return out


def test_smollm2_fp32_bf16_fp8(tmp_path, smollm2):
    model, tok = smollm2
    samples = chat_samples(tok, n=2)
    write_corpus(tmp_path / "data", samples)
    layers = [2, 15, 27]  # default_aux_layers(30)
    runs = {"fp32": ("dump.dtype=float32", "dump.storage=full"), "bf16": ("dump.dtype=bfloat16", "dump.storage=full"),
            "lean": ("dump.dtype=float8", "dump.storage=topk", "dump.topk=64")}
    for name, extra in runs.items():
        cfg = recipe(tmp_path, "smollm2-135m-instruct", "dump.batch_tokens=1", "dump.include_eval=false",
                     f"dump.output={tmp_path}/{name}", *extra)
        dump.main(cfg, model)
    fp32, bf16, lean = (by_id(tmp_path / n) for n in runs)
    for sid, ids, mask in samples:
        aux, last = solo_hidden(model, ids, layers)
        assert json.loads((tmp_path / "fp32" / "manifest.json").read_text())["aux_layers"] == layers
        assert torch.equal(fp32[sid]["aux"], aux) and torch.equal(fp32[sid]["last"], last)
        assert torch.equal(bf16[sid]["aux"], aux.bfloat16().float())
        assert torch.equal(bf16[sid]["last"], last.bfloat16().float())
        # fp8 e4m3: <= 2^-4 relative error on normal values, one subnormal step (2^-9 * scale) below
        q = lean[sid]["aux"]
        scale = aux.reshape(len(ids), 3, -1).abs().amax(-1, keepdim=True) / FP8_MAX
        bound = aux.abs() * 2 ** -4 + (scale * 2 ** -9).expand(-1, -1, 576).reshape(len(ids), -1)
        assert ((q - aux).abs() <= bound * 1.001).all()
        assert (q - aux).norm() / aux.norm() < 0.04
        assert aux.abs().max() > FP8_MAX  # the scales are needed: SmolLM2's residual exceeds e4m3's range
        logp, top = torch.log_softmax(model.lm_head(last), -1).topk(64, -1)
        kept = torch.tensor(mask[1:] + [0], dtype=torch.bool)  # dump.targets=replies: where a reply token follows
        assert (lean[sid]["topk_ids"][kept, 0] == top[kept, 0]).all() and (lean[sid]["topk_ids"][~kept] == 0).all()
        torch.testing.assert_close(lean[sid]["topk_logp"][kept], logp[kept], rtol=1e-3, atol=2e-3)
    man = json.loads((tmp_path / "lean" / "manifest.json").read_text())
    assert man["bytes"] / man["num_tokens"] <= 4 * 576  # lean goal: <= 4*H bytes per token


def test_resume_after_kill_and_bad_checksum(tmp_path, tiny_dir, capfd):
    model, mdir = tiny_dir
    samples = random_samples(40, seed=3, lo=20, hi=40)  # ~1 KiB/token in fp32 -> ~5 shards of 0.25 MiB
    write_corpus(tmp_path / "data", samples)
    args = ("dump.dtype=float32", "dump.shard_size_mb=0.25", "dump.batch_tokens=200", "dump.include_eval=false")
    dump.main(recipe(tmp_path, mdir, f"dump.output={tmp_path}/ref", *args), model)
    ref = by_id(tmp_path / "ref")
    assert len(json.loads((tmp_path / "ref" / "manifest.json").read_text())["shards"]) >= 3

    # a real kill: a dump process SIGKILLs itself once its first shard and record are on disk (no
    # Python cleanup runs, like an OOM kill or a preempted node)
    out = tmp_path / "dump"
    driver = ("import os, signal, sys; from eagle_train.data_prep import dump; "
              "dump.on_shard_written = lambda folder, rec: os.kill(os.getpid(), signal.SIGKILL); "
              "from eagle_train.cli import run_stage; run_stage('dump', sys.argv[1:])")
    proc = subprocess.run([sys.executable, "-c", driver, *overrides(tmp_path, mdir, *args)], cwd=ROOT,
                          capture_output=True, text=True, timeout=300,
                          env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)})
    assert proc.returncode == -9, proc.stderr[-3000:]
    cfg = recipe(tmp_path, mdir, *args)
    assert len(list(out.glob("shard-*.safetensors"))) == 1
    with pytest.raises(FileNotFoundError, match="incomplete"):
        FeatureDataset(out)
    (out / "shard-r000-00001.safetensors.tmp999").write_bytes(b"torn write")  # a kill mid-write
    first = sorted(out.glob("shard-*.safetensors"))[0]
    first_bytes = first.read_bytes()

    dump.main(cfg, model)
    assert first.read_bytes() == first_bytes  # the finished shard was kept, not redone
    assert not list(out.glob("*.tmp*"))
    got = by_id(out)
    assert sorted(got) == sorted(ref) and len(FeatureDataset(out)) == len(ref)
    for sid in ref:
        assert torch.equal(got[sid]["input_ids"], ref[sid]["input_ids"])
        torch.testing.assert_close(got[sid]["aux"], ref[sid]["aux"], rtol=1e-5, atol=1e-6)

    # a corrupted shard is reported by name and redone; nothing is lost or doubled
    data = bytearray(first.read_bytes())
    data[-5] ^= 0xFF
    first.write_bytes(bytes(data))
    capfd.readouterr()
    dump.main(cfg, model)
    assert f"{first.name}: sha256 check FAILED" in capfd.readouterr().err
    man = json.loads((out / "manifest.json").read_text())
    assert sorted(i for s in man["shards"] for i in s["ids"]) == sorted(ref)
    for s in man["shards"]:
        assert dump.sha256_file(out / s["file"]) == s["sha256"]


def test_budget_cuts_the_dump_keeps_the_cut_and_a_rerun_without_it_completes(tmp_path, tiny_dir):
    model, mdir = tiny_dir
    samples = random_samples(30, seed=5, lo=20, hi=40)
    write_corpus(tmp_path / "data", samples)
    out = tmp_path / "dump"
    args = ("dump.dtype=float32", "dump.batch_tokens=100", "dump.include_eval=false")
    # a budget spent at once: the dump still holds its first (longest) batch, and says what it left out
    dump.main(recipe(tmp_path, mdir, *args, "dump.budget_minutes=1e-6"), model)
    man = json.loads((out / "manifest.json").read_text())
    longest = max(len(s[1]) for s in samples)
    assert man["complete"] and 0 < man["num_samples"] < 30 and man["planned_samples"] == 30
    assert len(FeatureDataset(out)) == man["num_samples"]
    assert max(len(FeatureDataset(out)[i]["input_ids"]) for i in range(man["num_samples"])) == longest
    shards = sorted(p.name for p in out.glob("shard-*.safetensors"))
    # a rerun (`make full` resumed) keeps the cut: its clock started with the first run (budget.json)
    dump.main(recipe(tmp_path, mdir, *args, "dump.budget_minutes=1e-6"), model)
    assert json.loads((out / "manifest.json").read_text())["num_samples"] == man["num_samples"]
    assert sorted(p.name for p in out.glob("shard-*.safetensors")) == shards
    # without the budget the same folder completes: every sample once, nothing left out
    dump.main(recipe(tmp_path, mdir, *args), model)
    full = json.loads((out / "manifest.json").read_text())
    assert full["num_samples"] == 30 and "planned_samples" not in full
    assert sorted(FeatureDataset(out).ids) == sorted(s[0] for s in samples)


def test_refuses_other_settings_and_missing_corpus(tmp_path, tiny_dir):
    model, mdir = tiny_dir
    with pytest.raises(FileNotFoundError, match=r"data/train.*eagle-train prep <recipe>"):
        dump.main(recipe(tmp_path, mdir), model)
    write_corpus(tmp_path / "data", random_samples(4))
    dump.main(recipe(tmp_path, mdir, "dump.include_eval=false"), model)
    for extra, key in [("dump.dtype=float16", "dump.dtype"), ("head.aux_layers=[1,2,3]", "head.aux_layers"),
                       ("dump.storage=topk", "dump.storage"), ("data.max_length=99", "data.max_length")]:
        with pytest.raises(RecipeError, match=key.replace(".", r"\.")):
            dump.main(recipe(tmp_path, mdir, "dump.include_eval=false", extra), model)
    with pytest.raises(RecipeError, match=r"target\.model"):
        dump.main(recipe(tmp_path, str(mdir) + "/", "dump.include_eval=false"), model)
    # unrelated sections and batching knobs do not matter: the rerun finds everything done
    dump.main(recipe(tmp_path, mdir, "dump.include_eval=false", "train.max_steps=7", "dump.batch_tokens=64"), model)
    with pytest.raises(RecipeError, match="dump.storage=full"):
        dump.main(recipe(tmp_path, mdir, "head.type=eagle1", "dump.storage=topk"), model)


def test_eagle1_and_collate(tmp_path, tiny_dir):
    model, mdir = tiny_dir
    write_corpus(tmp_path / "data", random_samples(5, seed=4))
    dump.main(recipe(tmp_path, mdir, "head.type=eagle1", "dump.dtype=float8"), model)
    assert len(FeatureDataset(tmp_path / "dump" / "eval")) == 0  # an empty held-out split is a valid dump
    ds = FeatureDataset(tmp_path / "dump")
    assert ds.aux_layers is None and set(ds[0]) == {"input_ids", "loss_mask", "last"}
    batch = collate([ds[0], ds[1], ds[2]])
    n = [len(ds[i]["input_ids"]) for i in range(3)]
    assert batch["last"].shape == (3, max(n), 64) and batch["last"].dtype == torch.float32
    assert batch["attention_mask"].sum(1).tolist() == n
    assert batch["loss_mask"][batch["attention_mask"] == 0].sum() == 0


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_processes_equal_one(tmp_path, tiny_dir):
    model, mdir = tiny_dir
    samples = random_samples(24, seed=5, lo=20, hi=60)
    write_corpus(tmp_path / "data", samples, random_samples(5, seed=6, prefix="e"))
    rec = tmp_path / "recipe.yaml"
    OmegaConf.save({"output_dir": str(tmp_path), "target": {"model": str(mdir), "device": "cpu"},
                    "data": {"source": "unused"},
                    "dump": {"shard_size_mb": 0.1, "batch_tokens": 200, "dtype": "float32"}}, rec)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    # on a CPU-only machine accelerate needs --multi_gpu to start N processes (they use gloo)
    cmd = [str(Path(sys.executable).with_name("accelerate")), "launch", "--multi_gpu", "--num_processes", "2",
           "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
           "--main_process_port", str(_free_port()), "-m", "eagle_train.data_prep.dump", str(rec), f"dump.output={tmp_path}/two"]
    proc = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    dump.main(load_recipe(str(rec), [f"dump.output={tmp_path}/one"]), model)

    two, one = json.loads((tmp_path / "two" / "manifest.json").read_text()), by_id(tmp_path / "one")
    assert {s["file"][:10] for s in two["shards"]} == {"shard-r000", "shard-r001"}  # both ranks wrote
    got = by_id(tmp_path / "two")
    assert sorted(got) == sorted(one) == sorted(s[0] for s in samples)
    for sid in one:
        assert torch.equal(got[sid]["input_ids"], one[sid]["input_ids"])
        torch.testing.assert_close(got[sid]["aux"], one[sid]["aux"])
    assert sorted(FeatureDataset(tmp_path / "two" / "eval").ids) == sorted(FeatureDataset(tmp_path / "one" / "eval").ids)


def test_dump_of_real_prep_output(tmp_path, smollm2):
    """The prep stage's real output (ShareGPT, SmolLM2 template) dumps and reads back sample for sample."""
    from conftest import SHAREGPT
    from eagle_train.data_prep import prepare

    cfg = load_recipe(None, [f"output_dir={tmp_path}", f"data.source={SHAREGPT}", "data.max_conversations=8",
                             "data.max_length=128", "data.eval_fraction=0.3", "target.model=smollm2-135m-instruct",
                             "target.device=cpu", "dump.storage=topk", "dump.dtype=float8"])
    prepare.main(cfg)
    dump.main(cfg, smollm2[0])
    for split in ("train", "eval"):
        prepared = Dataset.load_from_disk(str(tmp_path / "data" / split))
        kept = {r["id"]: r for r in prepared if any(r["loss_mask"])}
        ds = FeatureDataset(tmp_path / "dump" / split if split == "eval" else tmp_path / "dump")
        assert sorted(ds.ids) == sorted(kept)
        for i, sid in enumerate(ds.ids):
            assert ds[i]["input_ids"].tolist() == kept[sid]["input_ids"]
            assert ds[i]["loss_mask"].tolist() == kept[sid]["loss_mask"]
            assert ds[i]["aux"].shape == (len(kept[sid]["input_ids"]), 3 * 576)
