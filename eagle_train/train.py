"""Train an EAGLE draft head (EAGLE-3, or EAGLE-1/2) against a frozen target.

    accelerate launch eagle_train/train.py recipe.yaml [key=value ...]
    accelerate launch --use_deepspeed --zero_stage 2 --num_processes 2 eagle_train/train.py recipe.yaml
    python eagle_train/train.py recipe.yaml      # or: eagle-train train recipe.yaml

Data: `train.mode=offline` reads the dump (`eagle-train dump`), `online` runs the frozen target
here on the prepared corpus (`eagle-train prep`). Engine: DeepSpeed ZeRO-2 (`train.zero_stage=3`
for ZeRO-3, `train.engine=ddp` for plain DDP); a single CPU process runs without an engine.

Alignment (engine convention): at position t the head reads (token_{t+1}, feature_t) and predicts
token_{t+2}, i.e. the target distribution at t+1. Only positions whose predicted token is
loss-masked (assistant) and present count.

Training-time test (EAGLE-3): step s>0 feeds step s-1's own output (pre-norm, H wide) as the
feature at the same position, the input tokens shifted s further, at position id t+s. Its
attention sees the step-0 keys causally plus, at the same position only, the keys of steps
1..s - what the head sees when it drafts s tokens ahead at inference. We never build the
(B, heads, L, L*steps) score matrix: each step scores causally against the step-0 keys (L x L)
and against its own diagonal (one dot product per earlier step, L x s), and takes one softmax over
the concatenation. Memory per step is O(L^2 + L*s), so the unroll grows linearly in steps.
"""

from __future__ import annotations

import contextlib
import faulthandler
import hashlib
import json
import math
import os
import shutil
import signal
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

if __package__ in (None, ""):  # `python eagle_train/train.py` / `accelerate launch eagle_train/train.py`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from eagle_train.dump_reader import check_contract, sha256_file
from eagle_train.eagle3 import check_aux_layers
from eagle_train.errors import CheckpointError, TrainingDiverged
from eagle_train.draft_vocab import build_draft_vocab, count_tokens, draft_ids_of, load_draft_vocab, save_draft_vocab
from eagle_train.features import decoder_of, target_features
from eagle_train.files import atomic_write_text
from eagle_train.heads import build_head, head_type, save_head
from eagle_train.recipe import RecipeError, load_recipe, split_args
from eagle_train.target import load_target, resolve_model_path, target_id, weights_digest


# divergence: a loss above this is no cross-entropy over any vocabulary (ln 256k ~ 12.5 per TTT step)
LOSS_CAP = 1e4
# weights may grow to this many times their initial max |w| (at least 1): Adam moves a weight by
# about lr per step, so a sound run stays far below, and lr 1e6 (|w| ~ 1e6) does not
WEIGHT_GROWTH = 100


# ---------------------------------------------------------------- losses
def shift(x, k, fill=0):
    """x[:, t + k] at index t (fill past the end); keeps the length."""
    if k == 0:
        return x
    pad = x.new_full((x.shape[0], k, *x.shape[2:]), fill)
    return torch.cat([x[:, k:], pad], dim=1)


def ttt_attention(q, k0, v0, ks, vs):
    """q (B, h, n, d); k0/v0 (B, kv, n, d) step-0 keys (causal); ks/vs: keys of steps 1..s at the
    same position (each (B, kv, n, d)). One softmax over [n causal scores | s diagonal scores]."""
    rep, scale, n = q.shape[1] // k0.shape[1], q.shape[-1] ** -0.5, q.shape[2]
    k0, v0 = k0.repeat_interleave(rep, 1), v0.repeat_interleave(rep, 1)
    scores = (q @ k0.transpose(-1, -2)) * scale  # (B, h, n, n)
    scores = scores.masked_fill(torch.ones(n, n, dtype=torch.bool, device=q.device).triu(1), float("-inf"))
    diag = torch.stack([(q * k.repeat_interleave(rep, 1)).sum(-1) for k in ks], dim=-1) * scale  # (B, h, n, s)
    probs = torch.softmax(torch.cat([scores, diag], dim=-1).float(), dim=-1).to(q.dtype)
    out = probs[..., :n] @ v0
    for i, v in enumerate(vs):
        out = out + probs[..., n + i, None] * v.repeat_interleave(rep, 1)
    return out


def soft_ce(logits, p, valid):
    """Sum over valid positions of -sum_v p log softmax(logits), and the count. `p` is dense
    (B, n, Vd), or sparse as (ids, probs) each (B, n, k) (the lean dump's top-k): then
    -sum_k p_k logits[ids_k] + logsumexp(logits) * sum_k p_k, without a dense (B, n, Vd) target."""
    logits = logits.float()
    if isinstance(p, tuple):
        ids, probs = p
        ce = torch.logsumexp(logits, dim=-1) * probs.sum(-1) - (logits.gather(-1, ids) * probs).sum(-1)
    else:
        ce = -(p * torch.log_softmax(logits, dim=-1)).sum(-1)
    return (ce * valid).sum(), valid.sum()


def shift_target(p, k):
    return tuple(shift(x, k) for x in p) if isinstance(p, tuple) else shift(p, k)


def cut(p, n):
    return tuple(x[:, :n] for x in p) if isinstance(p, tuple) else p[:, :n]


def ttt_unroll(head, ids, aux, steps):
    """Yield (out (B, n, H), logits (B, n, Vd)) of TTT steps 0..steps-1 for n = L-1 positions:
    step s at position t reads (token_{t+1+s}, step s-1's out at t) and predicts token_{t+2+s}."""
    mid = head.midlayer
    attn = mid.self_attn
    hidden = head.fc(aux[:, :-1].to(head.fc.weight.dtype))  # feature_t, t = 0..n-1
    B, n = hidden.shape[:2]
    pos = torch.arange(n, device=ids.device).expand(B, n)
    ks, vs = [], []
    for s in range(steps):
        tok = shift(ids, 1 + s)[:, :n]
        cos, sin = head.rotary(hidden, pos + s)
        q, k, v = attn.qkv(mid.attn_input(head.embed_tokens(tok).to(hidden.dtype), hidden), cos, sin)
        if s == 0:
            k0, v0 = k, v
            rep = q.shape[1] // k.shape[1]
            o = F.scaled_dot_product_attention(q, k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1),
                                               is_causal=True)
        else:
            ks.append(k), vs.append(v)
            o = ttt_attention(q, k0, v0, ks, vs)
        out = mid.finish(hidden, attn.o_proj(o.transpose(1, 2).reshape(B, n, -1)))
        yield out, head.lm_head(head.norm(out))
        hidden = out


class DraftLoss(nn.Module):
    """Wraps the head so DDP/DeepSpeed see one forward: batch -> (loss, stats)."""

    def __init__(self, head, tc, feature_scale=None):
        super().__init__()
        self.head, self.tc = head, tc
        # per-dim RMS of the aux features; fc trains on aux / feature_scale and is folded back on save
        self.register_buffer("feature_scale", feature_scale, persistent=False)

    def forward(self, b, with_stats=True):
        """(loss, stats); stats (top-1 hits per TTT step) only when asked: logging steps and evals."""
        return self.eagle3(b, with_stats) if head_type(self.head) == "eagle3" else self.eagle1(b)

    def eagle3(self, b, with_stats=True):
        head, steps = self.head, self.tc.ttt_steps
        ids, valid_tok, p = b["input_ids"], b["valid"], b["p"]
        aux = b["aux"] / self.feature_scale if self.feature_scale is not None else b["aux"]
        loss, stats = 0.0, {}
        for s, (out, logits) in enumerate(ttt_unroll(head, ids, aux, steps)):
            n = logits.shape[1]
            # the predicted token t+2+s is real, trained on, and its target top-1 is in the draft vocabulary
            valid = shift(valid_tok, 2 + s)[:, :n].float()
            ce, cnt = soft_ce(logits, cut(shift_target(p, 1 + s), n), valid)
            loss = loss + self.tc.ttt_decay ** s * ce / cnt.clamp(min=1)
            if with_stats:
                with torch.no_grad():
                    hit = (draft_ids_of(head.d2t)[logits.argmax(-1)] == shift(b["top1"], 1 + s)[:, :n]).float()
                    stats[f"acc_{s}"] = torch.stack([(hit * valid).sum(), cnt.detach()])
        return loss, stats

    def eagle1(self, b):
        head, tc = self.head, self.tc
        ids, valid_tok, last = b["input_ids"], b["valid"], b["last"].to(head.fc.weight.dtype)
        feat, nxt = last[:, :-1], last[:, 1:]
        if self.training and tc.noise > 0:
            feat = feat + (torch.rand_like(feat) * 2 - 1) * tc.noise
        n = feat.shape[1]
        pos = torch.arange(n, device=ids.device).expand(ids.shape[0], n)
        out, logits, _ = head(ids[:, 1:], feat, pos)
        valid = shift(valid_tok, 2)[:, :n].to(feat.dtype)
        with torch.no_grad():
            p = torch.softmax(head.lm_head(nxt).float(), dim=-1)
        ce, cnt = soft_ce(logits, p, valid)
        l1 = (F.smooth_l1_loss(out.float(), nxt.float(), reduction="none").mean(-1) * valid).sum()
        loss = (tc.feature_weight * l1 + tc.token_weight * ce) / cnt.clamp(min=1)
        hit = (logits.argmax(-1) == p.argmax(-1)).to(valid.dtype)
        return loss, {"acc_0": torch.stack([(hit * valid).sum().detach(), cnt.detach()])}


# ---------------------------------------------------------------- targets and data
@torch.no_grad()
def add_targets(b, head_kind, lm_head_w, draft_ids, t2d_index, chunk=2048, positions="assistant"):
    """Training targets. `valid` (B, L): positions whose token is trained on (`positions`: the
    assistant replies, or every real token). EAGLE-3 adds `p`, the target distribution at every
    position restricted to the draft vocabulary and renormalized, and `top1` (target ids); a
    position whose target top-1 lies outside the draft vocabulary is not valid (the head cannot
    propose it). From the lean dump's top-k, `p` stays sparse: (draft ids, probs) each (B, L, k)."""
    real = b["attention_mask"].bool()
    b["valid"] = real & (b["loss_mask"].bool() if positions == "assistant" else real)
    if head_kind == "eagle1":
        return b
    if "last" in b:
        last = b["last"].to(lm_head_w.dtype)
        b["p"] = torch.softmax((last @ lm_head_w[draft_ids].T).float(), dim=-1)
        flat = last.reshape(-1, last.shape[-1])  # exact full-vocabulary argmax, in chunks of tokens
        b["top1"] = torch.cat([(c @ lm_head_w.T).argmax(-1) for c in flat.split(chunk)]).view(last.shape[:2])
    else:
        didx = t2d_index[b["topk_ids"].long()]  # draft id or -1
        probs = b["topk_logp"].float().exp() * (didx >= 0)
        b["p"] = (didx.clamp(min=0), probs / probs.sum(-1, keepdim=True).clamp(min=1e-20))
        b["top1"] = b["topk_ids"][..., 0].long()
    # p[t] predicts token t+1: token t+1 is learnable only if the target's top-1 at t is a draft token
    b["valid"][:, 1:] &= t2d_index[b["top1"][:, :-1]] >= 0
    return b


def pad_collate(batch):
    """Right-pad prepared-corpus samples (online mode) to the longest."""
    L = max(len(x["input_ids"]) for x in batch)
    out = {k: torch.zeros(len(batch), L, dtype=torch.long) for k in ("input_ids", "loss_mask", "attention_mask")}
    for i, x in enumerate(batch):
        n = len(x["input_ids"])
        out["input_ids"][i, :n] = torch.as_tensor(x["input_ids"])
        out["loss_mask"][i, :n] = torch.as_tensor(x["loss_mask"])
        out["attention_mask"][i, :n] = 1
    return out


def open_data(cfg, split):
    """(dataset, collate) for a split ("train" or "eval"); None for a missing eval split."""
    if cfg.train.mode == "offline":
        from eagle_train.dump_reader import FeatureDataset, collate

        folder = Path(cfg.dump.output) / ("eval" if split == "eval" else "")
        if not (folder / "manifest.json").is_file():
            if split == "eval":
                return None
            raise FileNotFoundError(f"no dump at {folder} (train.mode=offline reads dump.output); create it with "
                                    f"`eagle-train dump <recipe>` or train with train.mode=online")
        return FeatureDataset(folder), collate
    from datasets import load_from_disk

    folder = Path(cfg.data.output) / split
    if not folder.is_dir():
        if split == "eval":
            return None
        raise FileNotFoundError(f"no prepared corpus at {folder} (data.output); create it with `eagle-train prep <recipe>`")
    ds = load_from_disk(str(folder)).with_format(None)
    return ds, pad_collate


def dump_expectation(cfg, tconf, digest):
    """What the dump's manifest must say for this recipe (eagle_train.dump_reader.CONTRACT)."""
    storage = cfg.dump.storage
    aux = check_aux_layers(cfg.head.aux_layers, tconf.num_hidden_layers) if cfg.head.type == "eagle3" else None
    return {"target_id": target_id(cfg.target), "target_digest": digest, "head_type": cfg.head.type,
            "aux_layers": aux, "storage": storage, "dtype": cfg.dump.dtype,
            "topk": cfg.dump.topk if storage == "topk" else None, "max_length": cfg.data.max_length,
            "hidden_size": tconf.hidden_size, "num_layers": tconf.num_hidden_layers, "vocab_size": tconf.vocab_size,
            "tokenizer_digest": _read_json(Path(cfg.data.output) / "stats.json").get("tokenizer_digest")}


def _read_json(path) -> dict:
    try:
        return json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError):
        return {}


def corpus_pairs(cfg, ds):
    """(input_ids, loss_mask) of every training sample, for the draft-vocabulary counts."""
    from datasets import load_from_disk

    folder = Path(cfg.data.output) / "train"
    if cfg.train.mode == "offline" and folder.is_dir():  # the prepared corpus is cheaper to scan than the dump
        ds = load_from_disk(str(folder))
    if hasattr(ds, "column_names"):
        return zip(ds["input_ids"], ds["loss_mask"])
    return ((ds[i]["input_ids"], ds[i]["loss_mask"]) for i in range(len(ds)))


def batch_indices(n, mb, world, rank, seed, epoch, lengths=None, bucket=64):
    """This rank's micro-batches of one epoch: a seeded permutation split into global batches.
    With `lengths`, each run of `bucket` global batches of the permutation is sorted by length
    before it is cut (samples padded to a similar length), and the batches are shuffled again."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
    perm = torch.randperm(n, generator=g).tolist()
    per = mb * world
    perm = perm[:n - n % per]
    if lengths is not None:
        span = per * bucket
        perm = [i for c in range(0, len(perm), span) for i in sorted(perm[c:c + span], key=lambda i: lengths[i])]
        order = torch.randperm(len(perm) // per, generator=g).tolist()
        perm = [i for j in order for i in perm[j * per:(j + 1) * per]]
    return [perm[i + rank * mb:i + (rank + 1) * mb] for i in range(0, len(perm), per)]


def sample_lengths(ds):
    """Token count of every sample (the dump's manifest, or the prepared corpus)."""
    if hasattr(ds, "lengths"):
        return list(ds.lengths)
    return [len(x) for x in ds["input_ids"]]


def load_batch(ds, collate, idx, device):
    return {k: v.to(device) for k, v in collate([ds[i] for i in idx]).items() if torch.is_tensor(v)}


# ---------------------------------------------------------------- setup helpers
def target_weights(cfg, target=None):
    """(hf_config, embed (V, H), lm_head (V, H), final norm (H,)) of the target, read from its
    safetensors when possible so offline training never loads the whole target."""
    from transformers import AutoConfig

    if target is not None:
        return (target.config, target.get_input_embeddings().weight.detach(),
                target.get_output_embeddings().weight.detach(), decoder_of(target).norm.weight.detach())
    path = Path(resolve_model_path(cfg.target.model, cfg.target.cache_dir, cfg.target.gguf_file))
    files = sorted(path.glob("*.safetensors")) if path.is_dir() else []
    if not files:
        model, _ = load_target(cfg.target, with_tokenizer=False)
        return target_weights(cfg, model)
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
        model, _ = load_target(cfg.target, with_tokenizer=False)
        return target_weights(cfg, model)
    conf = AutoConfig.from_pretrained(str(path), trust_remote_code=cfg.target.trust_remote_code)
    return conf, found["embed"], found.get("lm_head", found["embed"]), found["norm"]  # tied embeddings


INIT_NAMES = ("none", "lm_head", "last_layer")


def start_head(init, head):
    """The head of folder `init` (a training output or an export) when `head.init` names one; its
    trained tensors must have this recipe's shapes."""
    if init in INIT_NAMES:
        return None
    from eagle_train.heads import load_head

    start = load_head(init)
    theirs = start.state_dict()
    bad = [f"{k} {tuple(theirs[k].shape) if k in theirs else 'missing'} vs {tuple(p.shape)}"
           for k, p in head.named_parameters() if p.requires_grad and (k not in theirs or theirs[k].shape != p.shape)]
    if head_type(start) != head_type(head) or bad:
        raise RecipeError(f"head.init={init!r}: that {head_type(start)} head does not fit this recipe's "
                          f"{head_type(head)} head: {'; '.join(bad[:3]) or 'head type'}")
    return start


def init_from_target(head, target, feature_scale):
    """`head.init=last_layer`: EAGLE-3's norm and lm_head from the target's final norm and lm_head
    rows, the draft layer from the target's last decoder layer where shapes allow (q/k/v: the
    target's weights on the feature half, zeros on the token half), and fc passing the high aux
    feature through; so at step 0 the head reproduces the target's prediction of token t+1."""
    H = head.config.hidden_size
    with torch.no_grad():
        if head_type(head) == "eagle3":
            head.norm.weight.copy_(decoder_of(target).norm.weight.float())
            head.lm_head.weight.copy_(target.get_output_embeddings().weight.float()[draft_ids_of(head.d2t)])
        src = {k: v.float() for k, v in decoder_of(target).layers[-1].state_dict().items()}
        own = head.midlayer if head_type(head) == "eagle3" else head.layers[0]
        for name, p in own.named_parameters():
            w = src.get("input_layernorm.weight" if name == "hidden_norm.weight" else name)
            if w is None:
                continue
            if w.shape == p.shape:
                p.copy_(w)
            elif p.dim() == 2 and p.shape == (w.shape[0], 2 * H) and w.shape[1] == H:  # eagle3 q/k/v
                p.zero_()
                p[:, H:] = w
        if head_type(head) == "eagle3" and head.config.target_hidden_size == H:
            head.fc.weight.zero_()
            scale = feature_scale[2 * H:] if feature_scale is not None else torch.ones(H)
            head.fc.weight[:, 2 * H:] = torch.diag(scale)


def feature_rms(ds, collate, n=16):
    """Per-dim RMS of the aux features over the first `n` samples (feature normalization)."""
    b = collate([ds[i] for i in range(min(n, len(ds)))])
    aux, m = b["aux"].float(), b["attention_mask"].bool()
    return aux[m].pow(2).mean(0).add(1e-6).sqrt()


def lr_lambda(tc):
    def f(step):
        if step < tc.warmup_steps:
            return (step + 1) / (tc.warmup_steps + 1)
        frac = min(1.0, (step - tc.warmup_steps) / max(1, tc.max_steps - tc.warmup_steps))
        return {"cosine": 0.5 * (1 + math.cos(math.pi * frac)), "linear": 1 - frac, "constant": 1.0}[tc.scheduler]
    return f


def make_accelerator(cfg, out):
    from accelerate import Accelerator, DeepSpeedPlugin
    from accelerate.utils import InitProcessGroupKwargs

    tc, cuda = cfg.train, torch.cuda.is_available()
    multi = int(os.environ.get("WORLD_SIZE", "1")) > 1
    mp = mixed_precision(tc, cuda, multi)
    kw = dict(mixed_precision=mp, gradient_accumulation_steps=tc.grad_accum)
    if multi:  # gloo is what DeepSpeed/DDP need on CPU
        kw["kwargs_handlers"] = [InitProcessGroupKwargs(backend="nccl" if cuda else "gloo")]
    if tc.engine == "deepspeed" and multi:
        ds = {"train_micro_batch_size_per_gpu": tc.micro_batch_size, "gradient_accumulation_steps": tc.grad_accum,
              "gradient_clipping": tc.grad_clip, "steps_per_print": 10**9,
              "zero_optimization": {"stage": tc.zero_stage, "overlap_comm": False, "contiguous_gradients": True},
              "bf16": {"enabled": mp == "bf16"}, "fp16": {"enabled": mp == "fp16"}}
        ds = merge(ds, dict(tc.deepspeed))
        if not cuda:
            # DeepSpeed JIT-compiles a shared-memory all-reduce op for CPU ranks; only inference_all_reduce
            # uses it, never training, and the build needs a compiler and minutes on a small box.
            import deepspeed.ops

            deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
        if tc.zero_stage == 3:  # the final head is gathered from the partitions on rank 0
            ds["zero_optimization"].setdefault("stage3_gather_16bit_weights_on_model_save", True)
        kw["deepspeed_plugin"] = DeepSpeedPlugin(hf_ds_config=ds, zero3_init_flag=False)
    elif os.environ.get("ACCELERATE_USE_DEEPSPEED"):
        # launched with --use_deepspeed but one process (or engine ddp/none): run without DeepSpeed.
        # Only override what the launcher set, so in-process callers' environments stay untouched.
        os.environ["ACCELERATE_USE_DEEPSPEED"] = "false"
    if multi and not cuda and "deepspeed_plugin" not in kw:
        kw["cpu"] = True  # accelerate forms a CPU (gloo) process group for DDP only when told it is on CPU
    if tc.tracker != "none":
        if tc.tracker == "wandb" and not os.environ.get("WANDB_API_KEY"):
            os.environ.setdefault("WANDB_MODE", "offline")
        kw.update(log_with=tc.tracker, project_dir=str(out))
    acc = Accelerator(**kw)
    if multi and acc.num_processes != int(os.environ["WORLD_SIZE"]):
        # independent single-process runs would overwrite each other's checkpoints in one folder
        raise RuntimeError(f"launched with WORLD_SIZE={os.environ['WORLD_SIZE']} but accelerate formed "
                           f"{acc.num_processes} process(es); check the accelerate launch flags")
    if "deepspeed_plugin" in kw and tc.zero_stage == 3:
        # Accelerator registers its ZeRO-3 config with transformers, whose from_pretrained would then
        # partition the frozen target at load; every rank needs all of it for its own forward. ZeRO-3
        # partitions only what deepspeed.initialize is given: the trained head.
        from transformers.integrations.deepspeed import unset_hf_deepspeed_config

        unset_hf_deepspeed_config()
    return acc


def mixed_precision(tc, cuda, multi):
    """accelerate's mixed_precision. GPU: bf16 under auto. CPU: bf16 autocast (fp32 master weights
    and losses) where the CPU has native bf16 matmuls (AVX512-BF16/AMX: 1.4-1.7x faster head
    steps measured, bench/RESULTS.md), else fp32; DeepSpeed's CPU ranks stay fp32."""
    asked = "no" if str(tc.mixed_precision) == "False" else tc.mixed_precision
    if cuda:
        return "bf16" if asked == "auto" else asked
    if multi and tc.engine == "deepspeed":
        return "no"
    if asked == "auto":
        return "bf16" if cpu_has_fast_bf16() else "no"
    return "no" if asked == "fp16" else asked


def cpu_has_fast_bf16() -> bool:
    probes = ("_is_avx512_bf16_supported", "_is_amx_tile_supported")  # native bf16 dot products
    return any(getattr(torch.cpu, name, lambda: False)() for name in probes)


def merge(a, b):
    out = dict(a)
    for k, v in b.items():
        out[k] = merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def save_checkpoint(acc, out, state):
    """Atomic: write checkpoint.tmp on every rank, then swap it in for the old one."""
    ckpt, tmp, old = out / "checkpoint", out / "checkpoint.tmp", out / "checkpoint.old"
    if acc.is_main_process:
        shutil.rmtree(tmp, ignore_errors=True)
    acc.wait_for_everyone()
    acc.save_state(str(tmp))
    acc.wait_for_everyone()  # every rank's shard is in tmp before rank 0 moves it (a slow rank lost its folder)
    if acc.is_main_process:
        # sha256 of every file: resume refuses a checkpoint whose bytes changed (flipped, truncated)
        state = {**state, "files": {str(f.relative_to(tmp)): sha256_file(f) for f in sorted(tmp.rglob("*"))
                                    if f.is_file() and f.name != "train_state.json"}}
        (tmp / "train_state.json").write_text(json.dumps(state, indent=2))
        if ckpt.exists():
            os.replace(ckpt, old)
        os.replace(tmp, ckpt)
        shutil.rmtree(old, ignore_errors=True)
    acc.wait_for_everyone()


def shared_draft_vocab(acc, path, count, size):
    """(d2t, t2d): rank 0 counts tokens and writes `path`, the other ranks read it. Every rank enters
    the block whether or not the file exists yet: a rank that checked first and skipped it would miss
    the barrier rank 0 waits on (seen as a 2-rank hang when rank 1 arrived after the file was written)."""
    with acc.main_process_first():
        if not path.is_file():
            counts = count()
            save_draft_vocab(path, *build_draft_vocab(counts, size), counts)
    return load_draft_vocab(path)


def read_checkpoint(ckpt):
    """train_state.json of a checkpoint after checking every recorded file's sha256."""
    path = ckpt / "train_state.json"
    try:
        state = json.loads(path.read_text())
        state["step"], state["micro_step"]
    except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError):
        raise CheckpointError(f"{path} is damaged; move {ckpt} away to resume from checkpoint.old (if any) or "
                              "start over with train.resume=false") from None
    for name, digest in state.get("files", {}).items():
        f = ckpt / name
        if not f.is_file() or sha256_file(f) != digest:
            raise CheckpointError(f"{f}: {'missing' if not f.is_file() else 'sha256 check failed'} (the checkpoint "
                                  f"changed after it was saved); restore it, or start over with train.resume=false")
    return state


def max_abs(params) -> float:
    """Largest |w| over this rank's parameters (its partition under ZeRO-3); inf when any is non-finite."""
    m = 0.0
    for p in params:
        if p.numel():
            w = p.detach().abs().max().float()
            m = max(m, float(w) if torch.isfinite(w) else math.inf)
    return m


def check_weights(acc, params, bound, step, out):
    """Stop before saving exploded weights; the last checkpoint (saved while they were sound) stays."""
    bad = acc.reduce(torch.tensor([float(not max_abs(params) <= bound)], device=acc.device), "sum")
    if bad.item() > 0:
        raise TrainingDiverged(f"weights exploded at step {step} (max |w| > {bound:g} = {WEIGHT_GROWTH} x their "
                               f"initial size) or went non-finite; stopped without saving. {last_sound(out)}; "
                               "resume with a lower train.learning_rate or train.grad_clip")


def last_sound(out) -> str:
    ckpt = find_checkpoint(out)
    if ckpt is None:
        return "No checkpoint was saved before"
    step = json.loads((ckpt / "train_state.json").read_text())["step"]
    return f"Last sound checkpoint: {ckpt} (step {step})"


def find_checkpoint(out):
    for name in ("checkpoint", "checkpoint.old"):  # .old survives a kill between the two renames
        if (out / name / "train_state.json").is_file():
            return out / name
    return None


# ---------------------------------------------------------------- main
def eval_batches(acc, ds, collate, features, tc):
    """This rank's held-out batches with their target features, built once and kept for every
    evaluation (online mode would otherwise rerun the target on them each time), as (batch, weight).
    Every rank runs the same number of forwards (ZeRO-3 gathers weights inside them, and the stats
    tensor reduced in `evaluate` must have one length): a rank short of batches repeats one, weight 0."""
    every = [list(range(i, min(i + tc.micro_batch_size, len(ds)))) for i in range(0, len(ds), tc.micro_batch_size)]
    n = min(tc.eval_batches, -(-len(every) // acc.num_processes))
    mine = every[acc.process_index::acc.num_processes][:n]
    return [(features(load_batch(ds, collate, mine[j] if j < len(mine) else every[0], acc.device)), int(j < len(mine)))
            for j in range(n)]


def evaluate(model, acc, batches, targets):
    model.eval()
    sums, loss_sum, n_b = {}, 0.0, 0
    with torch.no_grad():
        for b, w in batches:
            loss, stats = model(targets(dict(b)))
            loss_sum, n_b = loss_sum + w * float(loss), n_b + w
            for k, v in stats.items():
                sums[k] = sums.get(k, 0) + w * v
    model.train()
    keys = sorted(sums, key=lambda k: int(k.split("_")[1]))
    t = torch.tensor([loss_sum, n_b] + [x for k in keys for x in sums[k].tolist()], device=acc.device)
    t = acc.reduce(t, "sum").cpu()
    out = {"eval/loss": float(t[0] / max(1, t[1]))}
    for i, k in enumerate(keys):
        out[f"eval/{k}"] = float(t[2 + 2 * i] / max(1, t[3 + 2 * i]))
    return out


def main(cfg, target=None, stop_after=None):
    """Train per the recipe; returns {"final": path, "metrics": {...}}. `target`: an already loaded
    frozen target (tests, notebooks); `stop_after`: end after that many optimizer steps without the
    final save (a stand-in for a killed run)."""
    from tqdm.auto import tqdm

    tc, out = cfg.train, Path(cfg.train.output)
    out.mkdir(parents=True, exist_ok=True)
    acc = make_accelerator(cfg, out)
    dev, kind = acc.device, cfg.head.type
    ds, collate = open_data(cfg, "train")
    eval_data = open_data(cfg, "eval")
    if kind == "eagle1" and cfg.train.mode == "offline" and cfg.dump.storage != "full":
        raise FileNotFoundError("head.type=eagle1 regresses the last hidden state: dump with dump.storage=full")

    # frozen target: in-process for online mode, else only its embeddings and lm_head
    if cfg.train.mode == "online" and target is None:
        target, _ = load_target(cfg.target, with_tokenizer=False)
    if target is not None:
        target.to(dev).eval().requires_grad_(False)
    tconf, embed, lm_head_w, norm_w = target_weights(cfg, target)
    digest = weights_digest(embed, lm_head_w, norm_w, cfg.target.dtype)
    if cfg.train.mode == "offline":  # the dump is the contract: a dump of other layers would train a lying head
        check_contract(ds.manifest, dump_expectation(cfg, tconf, digest), ds.folder)

    torch.manual_seed(tc.seed)
    head = build_head(cfg.head, tconf)
    head.embed_tokens.weight.data.copy_(embed.float())
    if kind == "eagle1":
        head.lm_head.weight.data.copy_(lm_head_w.float())
    feature_scale = None
    start = start_head(cfg.head.init, head)  # head.init = a head folder: fine-tune that head
    if kind == "eagle3":
        if start is not None:  # its draft vocabulary is part of what it learned
            d2t, t2d = start.d2t, start.t2d
        else:
            d2t, t2d = shared_draft_vocab(acc, out / "draft_vocab.safetensors",
                                          lambda: count_tokens(corpus_pairs(cfg, ds), tconf.vocab_size),
                                          cfg.head.draft_vocab_size)
        head.set_draft_vocab(d2t, t2d)
        if tc.feature_norm:
            if cfg.train.mode == "online":
                b0 = pad_collate([ds[i] for i in range(min(16, len(ds)))])
                f = target_features(target, b0["input_ids"].to(dev), b0["attention_mask"].to(dev),
                                    head.config.aux_layers, "full")
                m = b0["attention_mask"].bool().to(dev)
                feature_scale = f["aux"][m].float().pow(2).mean(0).add(1e-6).sqrt().cpu()
            else:
                feature_scale = feature_rms(ds, collate)
    if cfg.head.init == "lm_head" and kind == "eagle3":
        with torch.no_grad():
            head.lm_head.weight.copy_(lm_head_w.float()[draft_ids_of(head.d2t)])
            head.norm.weight.copy_(norm_w.float())
    elif cfg.head.init == "last_layer":
        init_from_target(head, target if target is not None else load_target(cfg.target, False)[0], feature_scale)
    elif start is not None:
        with torch.no_grad():
            for name, p in head.named_parameters():
                if p.requires_grad:
                    p.copy_(start.state_dict()[name].float())
            if feature_scale is not None:  # a saved fc has the scale folded in (trained_head); unfold it
                head.fc.weight.mul_(feature_scale)
    draft_ids = draft_ids_of(head.d2t).to(dev) if kind == "eagle3" else None
    t2d_index = torch.full((tconf.vocab_size,), -1, dtype=torch.long)
    if kind == "eagle3":
        t2d_index[draft_ids.cpu()] = torch.arange(draft_ids.numel())
    t2d_index, lm_head_w = t2d_index.to(dev), lm_head_w.to(dev)

    def features(b):
        if cfg.train.mode == "online":
            b.update(target_features(target, b["input_ids"], b["attention_mask"],
                                     head.config.aux_layers if kind == "eagle3" else None, "full"))
        return b

    def targets(b):
        return add_targets(b, kind, lm_head_w, draft_ids, t2d_index, positions=tc.loss_positions)

    model = DraftLoss(head, tc, feature_scale)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=tc.learning_rate, weight_decay=tc.weight_decay, betas=tuple(tc.adam_betas))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(tc))
    model, opt = acc.prepare(model, opt)
    acc.register_for_checkpointing(sched)  # stepped by us once per optimizer step
    deepspeed = acc.state.deepspeed_plugin is not None

    # resume
    micro, metrics, done = 0, {}, {"tokens": 0, "cpu_s": 0.0, "wall_s": 0.0}
    resume = str(tc.resume).lower()
    ckpt = find_checkpoint(out) if resume != "false" else None
    if resume == "true" and ckpt is None:
        raise FileNotFoundError(f"train.resume=true but no checkpoint under {out}; use train.resume=auto to start over")
    bound = WEIGHT_GROWTH * max(1.0, max_abs(params))
    if ckpt is not None:
        state = read_checkpoint(ckpt)
        try:
            acc.load_state(str(ckpt))
        except Exception as err:  # truncated or foreign files in a checkpoint saved before digests were recorded
            raise CheckpointError(f"{ckpt}: cannot be loaded ({type(err).__name__}: {str(err)[:200]}); "
                                  "start over with train.resume=false") from err
        bound = state.get("weight_bound", bound)
        if not max_abs(params) <= bound:
            raise CheckpointError(f"{ckpt} holds exploded or non-finite weights; start over with train.resume=false")
        micro, metrics = state["micro_step"], state["metrics"]
        done.update(state.get("progress", {}))
        acc.print(f"[train] resumed from {ckpt} at step {state['step']}")
    if acc.is_main_process and tc.tracker != "none":
        acc.init_trackers(tc.project, config=_flat(_plain(cfg)),
                          init_kwargs={"wandb": {"name": tc.run_name}} if tc.tracker == "wandb" else {})

    held_out = eval_batches(acc, *eval_data, features, tc) if eval_data is not None else None
    step = micro // tc.grad_accum
    trim_curve(acc, out, step)  # rows of evaluations after the checkpoint we resume from are redone
    if micro == 0 and held_out is not None:  # the untrained head, for comparison and the curve's origin
        metrics.update({k.replace("eval/", "eval0/"): v for k, v in evaluate(model, acc, held_out, targets).items()})
        log_curve(acc, out, 0, done, {k.replace("eval0/", "eval/"): v for k, v in metrics.items()})
    lengths = sample_lengths(ds) if tc.length_buckets else None
    per_epoch = len(batch_indices(len(ds), tc.micro_batch_size, acc.num_processes, 0, 0, 0))
    if per_epoch == 0:
        raise ValueError(f"{len(ds)} training samples < train.micro_batch_size x processes; lower train.micro_batch_size")
    plan = {}  # epoch -> this rank's micro-batches
    bar = tqdm(total=tc.max_steps, initial=step, disable=not acc.is_main_process, desc="train", unit="step")
    model.train()
    t0, c0, tokens, last_loss = time.perf_counter(), time.process_time(), 0, float("nan")
    while step < tc.max_steps and (stop_after is None or step < stop_after):
        epoch, pos = divmod(micro, per_epoch)
        if epoch not in plan:
            plan = {epoch: batch_indices(len(ds), tc.micro_batch_size, acc.num_processes, acc.process_index,
                                         tc.seed, epoch, lengths)}
        b = targets(features(load_batch(ds, collate, plan[epoch][pos], dev)))
        logging = (step + 1) % tc.log_every == 0 or step + 1 == tc.max_steps
        with acc.accumulate(model):
            loss, stats = model(b, with_stats=logging)
            sound = torch.isfinite(loss.detach()) & (loss.detach().abs() < LOSS_CAP)
            bad = acc.reduce((~sound).float().reshape(1), "sum")  # every rank stops together
            if bad.item() > 0:
                what = "non-finite" if not torch.isfinite(loss.detach()) else "exploding"
                raise TrainingDiverged(f"{what} training loss at step {step} (micro-batch {micro}, this rank's loss "
                                       f"{float(loss.detach()):.3g}); stopped. {last_sound(out)}; resume with a lower "
                                       f"train.learning_rate or train.grad_clip")
            acc.backward(loss)
            if acc.sync_gradients and tc.grad_clip > 0 and not deepspeed:
                acc.clip_grad_norm_(params, tc.grad_clip)
            opt.step()
            opt.zero_grad()
        micro += 1
        tokens += int(b["attention_mask"].sum()) * acc.num_processes
        last_loss = float(loss.detach())
        if not acc.sync_gradients:
            continue
        sched.step()
        step += 1
        bar.update(1)
        # progress for the learning curves: tokens seen, CPU seconds of this process (all threads), wall
        now = {"tokens": done["tokens"] + tokens, "cpu_s": done["cpu_s"] + time.process_time() - c0,
               "wall_s": done["wall_s"] + time.perf_counter() - t0}
        if logging and stats:
            accs = {k: round(float(v[0] / v[1].clamp(min=1)), 3) for k, v in stats.items()}
            rate = tokens / (time.perf_counter() - t0)
            bar.set_postfix(loss=f"{last_loss:.3f}", tok_s=f"{rate:.0f}", **accs)
            metrics.update({"train/loss": last_loss, "train/lr": sched.get_last_lr()[0], "train/tokens_per_s": rate,
                            **{f"train/{k}": v for k, v in accs.items()}})
            acc.log({k: v for k, v in metrics.items() if k.startswith("train/")}, step=step)
        if held_out is not None and (step % tc.eval_every == 0 or step == tc.max_steps):
            metrics.update(evaluate(model, acc, held_out, targets))
            acc.log({k: v for k, v in metrics.items() if k.startswith("eval/")}, step=step)
            acc.print(f"[train] step {step}: " + ", ".join(f"{k}={v:.4f}" for k, v in metrics.items() if "eval" in k))
            log_curve(acc, out, step, now, metrics)
            if tc.snapshots and acc.is_main_process and not (deepspeed and tc.zero_stage == 3):
                save_head(trained_head(cfg, tconf, head, acc.get_state_dict(model), feature_scale),
                          out / "snapshots" / f"step-{step}", extra={"train_state": {"step": step, "progress": now}})
        if logging or step % tc.save_every == 0 or step == tc.max_steps:
            check_weights(acc, params, bound, step, out)
        if step % tc.save_every == 0 or step == tc.max_steps:
            save_checkpoint(acc, out, {"step": step, "micro_step": micro, "metrics": metrics, "progress": now,
                                       "weight_bound": bound})
    bar.close()
    if stop_after is not None and step < tc.max_steps:
        acc.end_training()
        return {"final": None, "metrics": metrics, "step": step}

    # final head: gather (ZeRO-3 safe), fold the feature scale into fc, save with metrics
    state = acc.get_state_dict(model)
    named = list(acc.unwrap_model(model).named_parameters())
    with _gathered([p for _, p in named], deepspeed and tc.zero_stage == 3):
        digests = _gather_object(acc, _sha256(p for _, p in named))
    final = out / "final"
    if acc.is_main_process:
        head_out = trained_head(cfg, tconf, head, state, feature_scale)
        # the saved weights are what the ranks trained: same digest as their (gathered) parameters
        info = {"step": step, "metrics": metrics, "rank_param_sha256": digests,
                "saved_param_sha256": _sha256(state[k] for k, _ in named), "target": cfg.target.model,
                "target_digest": digest,
                "train": {"mode": tc.mode, "ttt_steps": tc.ttt_steps, "max_steps": tc.max_steps,
                          "learning_rate": tc.learning_rate, "feature_norm": tc.feature_norm}}
        save_head(head_out, final, extra={"train_state": info})
        (final / "train_state.json").write_text(json.dumps(info, indent=2))
        acc.print(f"[train] saved {final}")
    acc.wait_for_everyone()
    acc.end_training()
    return {"final": final, "metrics": metrics, "step": step, "rank_param_sha256": digests}


def trained_head(cfg, tconf, head, state, feature_scale):
    """A fresh fp32 head holding the trained weights of `state` (the DraftLoss state dict), with the
    feature scale folded into fc. Built anew, not copied: under ZeRO-3 `head` holds a partition."""
    out = build_head(cfg.head, tconf).float()
    if head_type(out) == "eagle3":
        out.set_draft_vocab(head.d2t.cpu(), head.t2d.cpu())
    missing, unexpected = out.load_state_dict(
        {k[len("head."):]: v.float().cpu() for k, v in state.items() if k.startswith("head.")}, strict=False)
    assert not unexpected and not [k for k in missing if k in dict(out.named_parameters())], missing
    if feature_scale is not None:
        out.fc.weight.data /= feature_scale
    return out


def log_curve(acc, out, step, progress, metrics):
    """One line of <train.output>/curve.jsonl per evaluation: held-out metrics against training
    tokens, CPU seconds and wall seconds (bench/curves.py plots it)."""
    if acc.is_main_process:
        row = {"step": step, **progress, **{k: v for k, v in metrics.items() if k.startswith("eval/")}}
        with open(out / "curve.jsonl", "a") as f:
            f.write(json.dumps(row) + "\n")


def trim_curve(acc, out, step):
    path = out / "curve.jsonl"
    if acc.is_main_process and path.is_file():
        # resuming at `step`: keep the rows up to it; a fresh start (step 0) keeps none
        rows = [r for r in path.read_text().splitlines() if r.strip() and step and json.loads(r)["step"] <= step]
        atomic_write_text(path, "".join(r + "\n" for r in rows))


def write_corpus(samples, folder, eval_samples=None):
    """A prepared corpus (`<folder>/train`, `<folder>/eval`) from [(input_ids, loss_mask), ...]."""
    from datasets import Dataset

    eval_samples = eval_samples if eval_samples is not None else samples[: max(1, len(samples) // 8)]
    for split, rows in (("train", samples), ("eval", eval_samples)):
        Dataset.from_dict({"id": [f"{split}-{i}" for i in range(len(rows))],
                           "input_ids": [list(map(int, r[0])) for r in rows],
                           "loss_mask": [list(map(int, r[1])) for r in rows]}).save_to_disk(str(Path(folder) / split))


def quick_train(target, samples, output, steps=30, overrides=()):
    """Train a small head in-process on `samples` [(input_ids, loss_mask), ...] with the target
    running online (no prep, no dump); returns the loaded head. For tests and notebooks."""
    from eagle_train.heads import load_head

    write_corpus(samples, Path(output) / "data")
    args = [f"output_dir={output}", "target.model=in-memory", "data.source=in-memory", "train.mode=online",
            "train.engine=none", f"train.max_steps={steps}", f"train.warmup_steps={min(5, steps)}",
            "train.learning_rate=1e-3", "train.micro_batch_size=4", "train.ttt_steps=3",
            f"train.eval_every={steps}", f"train.save_every={steps}", "train.eval_batches=2", "train.resume=false",
            f"head.draft_vocab_size={min(1024, target.config.vocab_size)}", *overrides]
    result = main(load_recipe(None, args), target=target)
    return load_head(result["final"], target=target)


def _plain(cfg):
    from omegaconf import OmegaConf

    return OmegaConf.to_container(cfg, resolve=True)


def _flat(d, prefix=""):
    """Recipe as flat `section.key` scalars (what tensorboard's hparams accept)."""
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v if isinstance(v, (int, float, str, bool)) else str(v)
    return out


def _sha256(tensors) -> str:
    return hashlib.sha256(b"".join(t.detach().float().cpu().numpy().tobytes() for t in tensors)).hexdigest()


def _gathered(params, zero3: bool):
    """Full parameters on every rank for the block (ZeRO-3 keeps only a partition per rank)."""
    if not zero3:
        return contextlib.nullcontext()
    from deepspeed.runtime.zero import GatheredParameters

    return GatheredParameters(params)


def _gather_object(acc, obj):
    from accelerate.utils import gather_object

    return gather_object([obj]) if acc.num_processes > 1 else [obj]


def cli(argv=None) -> int:
    path, overrides = split_args(list(sys.argv[1:] if argv is None else argv))
    cfg = load_recipe(path, overrides)
    try:
        main(cfg)
    finally:
        # tear the process group down before exit: a rank leaving with live gloo connections can
        # abort its peer's background thread at interpreter shutdown
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
    return 0


if __name__ == "__main__":
    if hasattr(signal, "SIGUSR1"):  # `kill -USR1 <pid>` prints every thread's stack: where a stuck rank waits
        faulthandler.register(signal.SIGUSR1, all_threads=True)
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", torch.get_num_threads())))
    from eagle_train.cli import run_stage

    sys.exit(run_stage("train", cli, sys.argv[1:]))
