"""`eagle-train deploy`: with an oracle drafter (its drafts are the target's own greedy continuation,
so tau is maximal) on a tiny target, every batch size gets complete rows and batch 1 reproduces
`generate`; the report files and the model card name the crossover. How the speedup moves with the
batch size is a wall-clock figure: it is measured by `eagle-train deploy` and recorded in
bench/RESULTS.md ("When to deploy"), not asserted here."""

from __future__ import annotations

import json

import matplotlib.image as mpimg
import pytest
import torch
from omegaconf import OmegaConf

from conftest import make_tiny_llama
from eagle_train.decoding import SpecConfig
from eagle_train.model_card import deploy_section
from eagle_train.eval import deploy
from test_batch_decoding import oracle_for
from eagle_train.cli import run_stage

pytestmark = pytest.mark.usefixtures("one_thread")

RECIPE = "recipes/smollm2-135m-eagle3.yaml"


@pytest.fixture(scope="module")
def oracle_rows():
    model = make_tiny_llama(vocab_size=128, layers=2, hidden=32, seed=3)
    prompts = [torch.tensor(p) for p in ([1, 5, 9, 12], [1, 7, 3, 22, 40, 41], [1, 30, 8], [1, 60, 61, 62, 63])]
    head = oracle_for(model, prompts, 24)
    cfg = SpecConfig(tree="chain", depth=4, max_new_tokens=24)
    return model, cfg, deploy.measure(model, head, prompts, [1, 4, 16], cfg)


def test_oracle_rows_are_complete(oracle_rows):
    _, cfg, rows = oracle_rows
    by = {r["batch_size"]: r for r in rows}
    assert by[1]["tau"] > 3  # the oracle's chains are accepted nearly whole: tau near depth + 1
    assert by[1]["rows_differing"] == 0  # batch 1: the head reproduces generate
    assert by[16]["requests"] == 16 and by[1]["requests"] == 4  # 4 prompts cycled to fill the batch of 16
    for r in rows:
        for m in ("generate", "head"):
            assert r[m]["tokens"] > 0 and r[m]["latency_max_s"] >= r[m]["latency_mean_s"] > 0
        # the speedup is the ratio of the two throughputs measured in the same row, nothing else
        assert r["speedup"] == pytest.approx(r["head"]["tokens_per_s"] / r["generate"]["tokens_per_s"])


def test_report_names_the_crossover(oracle_rows, tmp_path):
    model, cfg, rows = oracle_rows
    rep = deploy.build_report(rows, model, cfg, 4, {"start": [0.5, 0.5, 0.5], "end": [0.6, 0.5, 0.5]},
                              target="tiny", head="oracle", machine="test")
    out = deploy.write_deploy(rep, tmp_path)
    back = json.loads((out / "deploy.json").read_text())
    assert [r["batch_size"] for r in back["rows"]] == [1, 4, 16] and back["device"].startswith("CPU")
    n = deploy.crossover(rows)
    sentence = f"use EAGLE up to batch {n if n is not None else 'none'} on this hardware"
    assert back["advice"].startswith(sentence)
    md = (out / "deploy.md").read_text()
    assert sentence in md and "load average" in md and "| 16 |" in md
    img = mpimg.imread(out / "deploy_speedup.png")
    assert img.ndim == 3 and img.shape[0] > 100 and img.shape[1] > 100
    card = "\n".join(deploy_section(out))  # the model card's section reads <eval dir>/deploy.json
    assert sentence in card and "## When to deploy" in card and card.count("x |") == 3
    assert deploy_section(tmp_path / "missing") == []


def test_crossover_is_the_last_winning_batch_size():
    rows = lambda *s: [{"batch_size": b, "speedup": x} for b, x in zip([1, 2, 4, 8], s)]  # noqa: E731
    assert deploy.crossover(rows(1.6, 1.3, 1.05, 0.7)) == 4
    assert deploy.crossover(rows(1.6, 1.3, 1.05, 1.01)) == 8
    assert deploy.crossover(rows(0.9, 1.2, 0.8, 0.5)) is None  # not faster at batch 1: no batch range to advise
    assert "batch none" in deploy.advice(None)
    assert deploy.batches_of(list("abc"), 2) == [["a", "b"], ["c", "a"]]
    assert deploy.batches_of(list("ab"), 4) == [["a", "b", "a", "b"]]


def test_deploy_cli_smollm2(smollm2, tmp_path, monkeypatch):
    """The stage end to end on the embedded target with a random head, tiny settings."""
    from eagle_train.cli import STAGES, stage_help
    from eagle_train.heads import build_head, save_head
    from eagle_train.recipe import HeadConfig

    assert STAGES["deploy"] == ("eagle_train.eval.deploy", "main") and "eval.batch_sizes" in stage_help("deploy")
    model, _ = smollm2
    torch.manual_seed(0)
    head = build_head(OmegaConf.structured(HeadConfig(type="eagle3", draft_vocab_size=1024)), model.config)
    head_dir = save_head(head, tmp_path / "head")
    monkeypatch.setattr("eagle_train.target.load_target", lambda tcfg: (model, smollm2[1]))
    out = tmp_path / "eval"
    assert run_stage("deploy", [RECIPE, f"eval.head={head_dir}", f"eval.output={out}", "eval.max_prompts=2",
                       "eval.max_new_tokens=4", "eval.batch_sizes=[1,2]", "eval.prompt_lookup_num_tokens=[]",
                       "eval.tree=chain", "eval.depth=2"]) == 0
    rep = json.loads((out / "deploy.json").read_text())
    assert [r["batch_size"] for r in rep["rows"]] == [1, 2] and len(rep["load_average"]["start"]) == 3
    assert rep["n_prompts"] == 2 and "on this hardware" in (out / "deploy.md").read_text()
    assert run_stage("deploy", [RECIPE, f"eval.head={head_dir}", "eval.batch_sizes=[0]"]) == 2
