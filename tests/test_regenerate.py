"""Regeneration: the target answers the corpus' user turns turn by turn; EOS, caps, resume, prep."""

import gzip
import json
import os
import subprocess
import sys

import pytest
import torch
from transformers import GenerationConfig

from conftest import ROOT, SHAREGPT, make_tiny_llama
from eagle_train.data_prep import regenerate
from eagle_train.data_prep.templates import render
from eagle_train.recipe import RecipeError
from eagle_train.recipe_load import load_recipe


def write_jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def sharegpt(id_, *turns):
    return {"id": id_, "conversations": [{"from": r, "value": v} for r, v in turns]}


def args(tmp, source, *extra):
    return [f"output_dir={tmp}", "target.model=smollm2-135m-instruct", f"data.source={source}",
            "regen.batch_size=4", *extra]


def test_turn_structure_eos_and_prep(tmp_path, smollm2):
    model, tok = smollm2
    src = write_jsonl(tmp_path / "c.jsonl", [
        sharegpt("short", ("human", "What is 2+2? Reply with only the number."), ("gpt", "four")),
        sharegpt("two", ("human", "Name a color."), ("gpt", "blue"), ("human", "Name another one."), ("gpt", "red")),
        sharegpt("sys", ("system", "You are terse."), ("human", "Say hello."), ("gpt", "Hi there, friend")),
        sharegpt("long", ("human", "Write a long essay about the history of Rome."), ("gpt", "...")),
    ])
    cfg = load_recipe(None, args(tmp_path, src, "regen.max_new_tokens=24", "regen.shard_size=3"))
    summary = regenerate.main(cfg, model, tok)
    assert summary["complete"] and summary["shards"] == 2
    recs = {}
    for f in sorted((tmp_path / "regen").glob("shard-*.jsonl")):
        recs.update({r["id"]: r["messages"] for r in map(json.loads, f.read_text().splitlines())})
    assert set(recs) == {"short", "two", "sys", "long"}
    # the corpus gives system prompts and user turns; every reply is the target's
    assert [m["role"] for m in recs["two"]] == ["user", "assistant", "user", "assistant"]
    assert [m["content"] for m in recs["two"] if m["role"] == "user"] == ["Name a color.", "Name another one."]
    assert recs["sys"][0] == {"role": "system", "content": "You are terse."}
    assert recs["two"][1]["content"] != "blue" and "4" in recs["short"][1]["content"]
    assert not any("<|im_end|>" in m["content"] for ms in recs.values() for m in ms)
    c = summary["counts"]
    assert c["replies"] == 5 and c["conversations"] == 4 and c["capped"] == 1  # the essay hits the cap

    # each reply is the target's plain greedy answer to the conversation so far (on its own earlier answers)
    eot = regenerate.end_of_turn_ids(tok, model)
    assert tok.convert_tokens_to_ids("<|im_end|>") in eot
    plain = GenerationConfig(do_sample=False, max_new_tokens=24, eos_token_id=eot, pad_token_id=eot[0])
    for cid, k in (("two", 3), ("short", 1)):
        ids = tok(render(tok, recs[cid][:k], add_generation_prompt=True), add_special_tokens=False,
                  return_tensors="pt")["input_ids"]
        out = model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=plain)[0, ids.shape[1]:]
        n = next((i for i, t in enumerate(out.tolist()) if t in eot), len(out))
        assert tok.decode(out[:n], skip_special_tokens=True) == recs[cid][k]["content"], cid

    # prep reads the regenerated replies when regen.enabled
    from eagle_train.data_prep.prepare import main as prep

    stats = prep(load_recipe(None, args(tmp_path, src, "regen.max_new_tokens=24", "regen.shard_size=3",
                                        "regen.enabled=true", "data.eval_fraction=0")))
    assert stats["conversations"]["kept"] == 4 and stats["source"] == str(tmp_path / "regen")
    assert stats["conversations"]["skipped"] == 0 and not stats["skipped"]  # regen.json and progress/ are not records
    # other generation settings into the same folder are refused, naming the setting
    with pytest.raises(RecipeError, match="max_new_tokens"):
        regenerate.main(load_recipe(None, args(tmp_path, src, "regen.max_new_tokens=32", "regen.shard_size=3")),
                        model, tok)
    with pytest.raises(RecipeError, match="max_new_tokens"):
        prep(load_recipe(None, args(tmp_path, src, "regen.enabled=true", "regen.max_new_tokens=32")))


def test_prompt_template_makes_tasks_the_target_answers(tmp_path, smollm2):
    # data.prompt_template: each conversation becomes one user turn built from its own text; the target answers it,
    # a record without the text is counted, and prep refuses the tasks without the target's replies
    model, tok = smollm2
    src = write_jsonl(tmp_path / "c.jsonl", [
        sharegpt("a", ("human", "Tell me about owls."), ("gpt", "Owls hunt at night."), ("human", "More?"), ("gpt", "No")),
        sharegpt("empty", ("human", "Say nothing."), ("gpt", " ")),
        sharegpt("sys", ("system", "You are terse."), ("human", "Why is the sky blue?"), ("gpt", "Rayleigh scattering.")),
    ])
    # quoted: unquoted, "text: {assistant}" is a YAML mapping to OmegaConf
    template = ['data.prompt_template="Repeat this text word for word: {assistant}"']
    cfg = load_recipe(None, args(tmp_path, src, "regen.max_new_tokens=12", *template))
    summary = regenerate.main(cfg, model, tok)
    recs = {r["id"]: r["messages"] for r in map(json.loads, (tmp_path / "regen" / "shard-00000.jsonl").read_text()
                                                .splitlines())}
    assert set(recs) == {"a", "sys"} and summary["skipped_records"] == {"no_template_text": 1}
    assert [m["role"] for m in recs["a"]] == ["user", "assistant"]  # one task, not the conversation's two turns
    assert recs["a"][0]["content"] == "Repeat this text word for word: Owls hunt at night."
    assert recs["sys"][:2] == [{"role": "system", "content": "You are terse."},
                               {"role": "user", "content": "Repeat this text word for word: Rayleigh scattering."}]
    assert all(m[-1]["content"].strip() for m in recs.values())  # the replies are the target's, never the placeholder
    assert summary["prompt_template"] == "Repeat this text word for word: {assistant}"

    from eagle_train.data_prep.prepare import main as prep

    stats = prep(load_recipe(None, args(tmp_path, src, "regen.max_new_tokens=12", "regen.enabled=true",
                                        "data.eval_fraction=0", *template)))
    assert stats["conversations"]["kept"] == 2
    with pytest.raises(RecipeError, match=r"data\.prompt_template.*regen"):
        prep(load_recipe(None, args(tmp_path, src, *template)))
    # another template is other replies: the folder refuses to mix them
    with pytest.raises(RecipeError, match="prompt_template"):
        regenerate.main(load_recipe(None, args(tmp_path, src, "regen.max_new_tokens=12",
                                               "data.prompt_template='Summarize: {assistant}'")), model, tok)


def test_empty_reply_is_dropped_and_counted(tmp_path, smollm2, monkeypatch):
    model, tok = smollm2
    src = write_jsonl(tmp_path / "c.jsonl", [
        sharegpt("a", ("human", "Name a fruit."), ("gpt", "x"), ("human", "Another?"), ("gpt", "y")),
        sharegpt("b", ("human", "Hi"), ("gpt", "x"))])
    eot = regenerate.end_of_turn_ids(tok, model)
    real, calls = regenerate.sample, []

    def eos_first_in_round_two(logits, temperature, top_p, gen):
        # round 1 (both conversations): one real token, then end of turn; round 2 (only "a"): end of turn at once
        calls.append(logits.shape[0])
        nxt = real(logits, temperature, top_p, gen)
        return nxt if logits.shape[0] == 2 and len(calls) == 1 else torch.full_like(nxt, eot[0])

    monkeypatch.setattr(regenerate, "sample", eos_first_in_round_two)
    cfg = load_recipe(None, args(tmp_path, src, "regen.max_new_tokens=8"))
    summary = regenerate.main(cfg, model, tok)
    recs = {r["id"]: r["messages"] for r in map(json.loads, (tmp_path / "regen/shard-00000.jsonl").read_text().splitlines())}
    assert calls == [2, 2, 1] and summary["counts"]["empty"] == 1 and summary["counts"]["replies"] == 2
    assert [m["role"] for m in recs["a"]] == ["user", "assistant"]  # the turn with an empty answer is gone


def test_resume_after_sigkill_equals_uninterrupted(tmp_path, smollm2_tokenizer):
    """Sampled replies from a tiny random target: a run killed after its first shard, then rerun, writes
    the same files as an uninterrupted run (finished shards are kept, sampling is seeded per shard)."""
    target = tmp_path / "target"
    make_tiny_llama(vocab_size=len(smollm2_tokenizer), layers=2, hidden=32).save_pretrained(target)
    smollm2_tokenizer.save_pretrained(target)
    src = tmp_path / "c.jsonl"
    with gzip.open(SHAREGPT, "rt") as f:
        src.write_text("".join(next(f) for _ in range(6)))
    common = [f"target.model={target}", f"data.source={src}", "regen.max_new_tokens=6", "regen.shard_size=2",
              "regen.temperature=1.0", "regen.top_p=0.9", "regen.max_turns=2", "data.max_length=4096"]
    ref = regenerate.main(load_recipe(None, [f"output_dir={tmp_path}/ref", *common]))
    assert ref["complete"] and ref["shards"] == 3

    driver = ("import os, signal, sys; from eagle_train.data_prep import regenerate; "
              "regenerate.on_shard_written = lambda folder, i: os.kill(os.getpid(), signal.SIGKILL); "
              "from eagle_train.cli import run_stage; run_stage('regen', sys.argv[1:])")
    cfg_args = [f"output_dir={tmp_path}/run", *common]
    recipe = tmp_path / "r.yaml"
    recipe.write_text("target:\n  model: x\ndata:\n  source: x\n")
    proc = subprocess.run([sys.executable, "-c", driver, str(recipe), *cfg_args], cwd=ROOT, capture_output=True, text=True,
                          timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)})
    assert proc.returncode == -9, proc.stderr[-3000:]
    run = tmp_path / "run/regen"
    assert len(list(run.glob("shard-*.jsonl"))) == 1
    assert not json.loads((run / "regen.json").read_text())["complete"]
    first = sorted(run.glob("shard-*.jsonl"))[0]
    before = first.stat().st_mtime_ns
    got = regenerate.main(load_recipe(recipe, cfg_args))
    assert got["complete"] and first.stat().st_mtime_ns == before  # kept, not redone
    for f in sorted((tmp_path / "ref/regen").glob("shard-*.jsonl")):
        assert (run / f.name).read_text() == f.read_text(), f.name
    assert got["counts"] == ref["counts"] and got["counts"]["replies"] > 0


def test_finished_rows_leave_the_batch_and_the_rest_decode_as_alone():
    """Rows that reach end-of-turn leave the batch (cache rows dropped); every row's reply equals
    generating its prompt alone, which equals `model.generate` (greedy, fp32)."""
    from types import SimpleNamespace

    model = make_tiny_llama(vocab_size=96, layers=2)
    tok = SimpleNamespace(pad_token_id=0, decode=lambda ids, skip_special_tokens: " ".join(map(str, ids)))
    r = SimpleNamespace(max_new_tokens=20, temperature=0.0, top_p=1.0)
    g = torch.Generator()
    prompts = [[5, 9, 3, 7], [11, 4], [8, 8, 21, 30, 2, 6], [40]]
    free = [regenerate.generate(model, [p], r, [95], tok, g)[0][0].split() for p in prompts]
    eot = sorted({int(free[0][2]), int(free[1][9])})  # rows end at different steps
    alone = [regenerate.generate(model, [p], r, eot, tok, g)[0] for p in prompts]
    batch = regenerate.generate(model, prompts, r, eot, tok, g)
    assert batch == alone
    assert len({n for _, n, _ in batch}) > 1 and any(fin for _, _, fin in batch)
    for p, (text, n, fin) in zip(prompts, batch):
        ref = model.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                             max_new_tokens=r.max_new_tokens, do_sample=False, eos_token_id=eot, pad_token_id=0)
        ref = ref[0, len(p):].tolist()
        assert n == len(ref) and fin == (ref[-1] in eot) and text.split() == list(map(str, ref[:n - fin]))
