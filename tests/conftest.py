"""Shared fixtures: the real SmolLM2 target (loaded once), tiny random Llama/Qwen2 targets,
and the real data in ../shared/data."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from eagle_train.recipe import TargetConfig

ROOT = Path(__file__).resolve().parents[1]
SHARED_DATA = ROOT.parent / "shared" / "data"
SHAREGPT = SHARED_DATA / "sharegpt" / "sharegpt_v3_salvaged.jsonl.gz"
MT_BENCH = SHARED_DATA / "mt_bench" / "question.jsonl"

torch.set_num_threads(max(1, min(2, torch.get_num_threads())))


@pytest.fixture(scope="module")
def one_thread():
    """Batch-1 decoding is latency bound; on a shared CPU a second thread only contends."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def shared_data() -> Path:
    assert SHARED_DATA.is_dir(), f"tests read real data from {SHARED_DATA}"
    return SHARED_DATA


@pytest.fixture(scope="session")
def smollm2():
    """(model, tokenizer) of the embedded default target, fp32 on the CPU."""
    from eagle_train.target import load_target

    return load_target(OmegaConf.structured(TargetConfig(model="smollm2-135m-instruct", device="cpu")))


@pytest.fixture(scope="session")
def smollm2_tokenizer(smollm2):
    return smollm2[1]


def make_tiny_llama(vocab_size: int = 512, layers: int = 6, hidden: int = 64, seed: int = 0, arch: str = "llama"):
    """A tiny random target (Llama or Qwen2) in eval mode, fp32, sdpa attention."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    kw = dict(hidden_size=hidden, intermediate_size=2 * hidden, num_attention_heads=4, num_key_value_heads=2,
              num_hidden_layers=layers, vocab_size=vocab_size, max_position_embeddings=2048,
              bos_token_id=1, eos_token_id=2, pad_token_id=0, attn_implementation="sdpa")
    if arch == "qwen2":
        model = Qwen2ForCausalLM(Qwen2Config(**kw))
    else:
        model = LlamaForCausalLM(LlamaConfig(**kw))
    return model.eval().requires_grad_(False)


@pytest.fixture
def tiny_llama():
    return make_tiny_llama()
