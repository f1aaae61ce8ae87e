"""Engine and checkpoints, for eagle_train/train.py: the accelerate/DeepSpeed set-up, the
learning-rate schedule, atomic checkpoints with per-file digests, the divergence checks that stop
a run before it saves exploded weights, and the learning-curve log."""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import shutil

import torch

from eagle_train.draft_vocab import build_draft_vocab, load_draft_vocab, save_draft_vocab
from eagle_train.dump_reader import sha256_file
from eagle_train.errors import CheckpointError, TrainingDiverged
from eagle_train.files import atomic_write_text, replace_dir
from eagle_train.recipe import RecipeError
from eagle_train.target import cpu_has_fast_bf16

# divergence: a loss above this is no cross-entropy over any vocabulary (ln 256k ~ 12.5 per TTT step)
LOSS_CAP = 1e4
# weights may grow to this many times their initial max |w| (at least 1): Adam moves a weight by
# about lr per step, so a sound run stays far below, and lr 1e6 (|w| ~ 1e6) does not
WEIGHT_GROWTH = 100


def lr_lambda(tc, plan=None):
    """The schedule's factor at a step. `plan`: the step counts (max_steps, shallow_steps) when train.budget_minutes
    may lower the recipe's during the run (read at every call, so a lowered count reshapes what is left)."""
    plan = plan if plan is not None else tc

    def shape(step, start):  # warmup from `start`, then decay to 0 at max_steps
        s = step - start
        if s < tc.warmup_steps:
            return (s + 1) / (tc.warmup_steps + 1)
        frac = min(1.0, (s - tc.warmup_steps) / max(1, plan.max_steps - start - tc.warmup_steps))
        return {"cosine": 0.5 * (1 + math.cos(math.pi * frac)), "linear": 1 - frac, "constant": 1.0}[tc.scheduler]

    def f(step):
        # train.deep_learning_rate: the deep steps get a schedule of their own; the shallow ones keep the single one
        if deep_restart(tc) and step >= plan.shallow_steps:
            return tc.deep_learning_rate / tc.learning_rate * shape(step, plan.shallow_steps)
        return shape(step, 0)
    return f


# train.budget_minutes: a phase's step time is the median over this many of its steps (its first 2 in a process left
# out; a step's time stops before its evaluation and save, timed apart) before the step counts are fitted to the budget
BUDGET_PROBE = 20
# ... and fitted once more over this many: 20 steps can read 10% slow (session 45: 0.60 s against the phase's 0.55 s,
# which left 300 of the recipe's shallow steps out); the refit starts again from the recipe's shallow counts
BUDGET_REFIT = 200


def adamw(params, tc):
    """AdamW at train.learning_rate; train.weight_decay decays the matrices only (norm gains and biases are not pulled
    toward 0). Without decay one parameter group, as checkpoints saved before the split hold."""
    params = list(params)
    groups = params if tc.weight_decay == 0 else [
        {"params": [p for p in params if p.dim() >= 2]},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=tc.learning_rate, weight_decay=tc.weight_decay, betas=tuple(tc.adam_betas))


# Muon's momentum, and its Newton-Schulz coefficients and steps: a quintic iteration that moves every singular value
# of a normalized matrix into ~[0.7, 1.2] in 5 steps (Jordan et al., 2024)
MUON_MOMENTUM = 0.95
# Muon's update is scaled by this times sqrt(max(rows, cols)) (train.muon_scale): 0.2 gives AdamW's update RMS
MUON_SCALE = 0.2
NEWTON_SCHULZ = (3.4445, -4.7750, 2.0315)
NS_STEPS = 5


def orthogonalize(g: torch.Tensor, steps: int = NS_STEPS, block: int = 0) -> torch.Tensor:
    """About U V^T of g's SVD (every singular value -> ~1), by Newton-Schulz on the short side's Gram matrix; in
    bf16 where the device computes it natively (as Muon does on GPUs), else in fp32. `block` > 0: each run of
    `block` rows on its own (one attention head's rows of q/k/v at the head size), a batched iteration ~rows/block
    times cheaper than the whole matrix's; a matrix it does not divide goes whole."""
    a, b, c = NEWTON_SCHULZ
    fast = g.is_cuda or cpu_has_fast_bf16()
    x = g.to(torch.bfloat16 if fast else torch.float32)
    if 0 < block < x.shape[0] and x.shape[0] % block == 0:
        x = x.reshape(-1, block, x.shape[1])
    tall = x.shape[-2] > x.shape[-1]
    x = x.mT if tall else x
    x = x / (x.norm(dim=(-2, -1), keepdim=True) + 1e-7)  # spectral norm <= Frobenius norm <= 1: inside the basin
    for _ in range(steps):
        s = x @ x.mT
        x = a * x + (b * s + c * (s @ s)) @ x
    return (x.mT if tall else x).reshape(g.shape).to(g.dtype)


class Muon(torch.optim.Optimizer):
    """Muon (Jordan et al., 2024) for the groups with `muon` set: Nesterov momentum, each update orthogonalized and
    scaled by `scale` sqrt(max(rows, cols)); at 0.2 that is AdamW's update RMS (Liu et al., 2025, "Muon is
    scalable"), so train.learning_rate, its schedule and the decoupled weight decay mean what they do for AdamW. The
    other groups (the lm_head, norm gains, biases) take AdamW steps with `betas`."""

    def __init__(self, groups, lr: float, betas=(0.9, 0.95), weight_decay: float = 0.0, eps: float = 1e-8,
                 ns_steps: int = NS_STEPS, block: int = 0, scale: float = MUON_SCALE):
        super().__init__(groups, dict(lr=lr, betas=tuple(betas), weight_decay=weight_decay, eps=eps, muon=False))
        self.ns_steps, self.block, self.scale = ns_steps, block, scale

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            lr, wd = group["lr"], group["weight_decay"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                g, state = p.grad, self.state[p]
                p.mul_(1 - lr * wd)
                if group["muon"]:
                    buf = state.setdefault("momentum_buffer", torch.zeros_like(p))
                    buf.lerp_(g, 1 - MUON_MOMENTUM)
                    # Nesterov: the gradient seen through the momentum. A blocked update keeps the whole matrix's
                    # scale (as measured): AdamW's RMS for a wide matrix, 15% above it for the MLP's tall gate/up
                    update = orthogonalize(g.lerp(buf, MUON_MOMENTUM), self.ns_steps, self.block)
                    p.add_(update, alpha=-lr * self.scale * math.sqrt(max(p.shape)))
                    continue
                b1, b2 = group["betas"]
                if not state:
                    state.update(step=0, exp_avg=torch.zeros_like(p), exp_avg_sq=torch.zeros_like(p))
                state["step"] += 1
                state["exp_avg"].lerp_(g, 1 - b1)
                state["exp_avg_sq"].mul_(b2).addcmul_(g, g, value=1 - b2)
                denom = (state["exp_avg_sq"] / (1 - b2 ** state["step"])).sqrt_().add_(group["eps"])
                p.addcdiv_(state["exp_avg"], denom, value=-lr / (1 - b1 ** state["step"]))


def optimizer(model, tc, deepspeed: bool = False):
    """train.optimizer over the model's trainable parameters: `adamw`, or `muon`: Muon for the hidden matrices (the
    fc, attention and MLP projections), AdamW for the lm_head (an output layer) and the vectors."""
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    if tc.optimizer == "adamw":
        if tc.muon_block or tc.muon_ns_steps != NS_STEPS or tc.muon_scale != MUON_SCALE:  # Muon options doing nothing
            raise RecipeError(f"`train.muon_block` = {tc.muon_block} / `train.muon_ns_steps` = {tc.muon_ns_steps} / "
                              f"`train.muon_scale` = {tc.muon_scale} are Muon's, but train.optimizer=adamw: set "
                              "train.optimizer=muon, or leave them out")
        return adamw([p for _, p in named], tc)
    if deepspeed:  # ZeRO hands the optimizer flat shards of the parameters, not matrices
        raise RecipeError("train.optimizer=muon orthogonalizes whole matrices, which DeepSpeed's ZeRO shards: "
                          "use train.engine=ddp (or one process) with it")
    hidden = [p for n, p in named if p.dim() == 2 and "lm_head" not in n and "embed" not in n]
    ids = {id(p) for p in hidden}
    rest = [p for _, p in named if id(p) not in ids]
    groups = [{"params": hidden, "muon": True},
              {"params": [p for p in rest if p.dim() >= 2]},
              {"params": [p for p in rest if p.dim() < 2], "weight_decay": 0.0}]
    return Muon([g for g in groups if g["params"]], tc.learning_rate, tc.adam_betas, tc.weight_decay,
                ns_steps=tc.muon_ns_steps, block=tc.muon_block, scale=tc.muon_scale)


def fit_budget(plan, step, left_s, step_s, deep_s, extra_s, deep_cap=None):
    """Lower plan.shallow_steps / plan.max_steps so the steps after `step` fit in `left_s` seconds: `step_s` is a
    shallow step's time, `deep_s` a deep one's, `extra_s` the evaluations and checkpoints per step. Both phases
    shrink by one factor, so the run keeps its proportions; a deep phase keeps a step. Counts grow only in the deep
    phase, which has measured its own step, and only up to `deep_cap` deep steps (the recipe's): a shallow phase's
    projection of the deep step that came out too long leaves time that more deep steps use (95% of it).
    Returns the factor on the steps left (1.0: the plan fits as it is)."""
    s_end = min(plan.shallow_steps, plan.max_steps)
    shallow_left, deep_left = max(0, s_end - step), plan.max_steps - max(step, s_end)
    need = shallow_left * (step_s + extra_s) + deep_left * (deep_s + extra_s)
    if need <= left_s:
        if deep_cap is None or shallow_left or deep_left <= 0:
            return 1.0
        room = deep_cap - (plan.max_steps - s_end)  # deep steps the recipe has that the plan left out
        more = min(room, int(0.95 * (left_s - need) / (deep_s + extra_s)))
        if more <= 0:
            return 1.0
        plan.max_steps += more
        return (deep_left + more) / deep_left
    f = max(0.0, left_s) / need
    if deep_left == 0:  # shallow to the end: only the end moves
        plan.max_steps = step + max(1, int(shallow_left * f))
    else:
        if shallow_left:
            plan.shallow_steps = step + int(shallow_left * f)
        plan.max_steps = max(step, plan.shallow_steps) + max(1, int(deep_left * f))
    return f


def deep_restart(tc):  # recipe validation has made sure 0 < shallow_steps < max_steps then
    return tc.deep_learning_rate > 0


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
    accelerator = Accelerator(**kw)
    if multi and accelerator.num_processes != int(os.environ["WORLD_SIZE"]):
        # independent single-process runs would overwrite each other's checkpoints in one folder
        raise RuntimeError(f"launched with WORLD_SIZE={os.environ['WORLD_SIZE']} but accelerate formed "
                           f"{accelerator.num_processes} process(es); check the accelerate launch flags")
    if "deepspeed_plugin" in kw and tc.zero_stage == 3:
        # Accelerator registers its ZeRO-3 config with transformers, whose from_pretrained would then
        # partition the frozen target at load; every rank needs all of it for its own forward. ZeRO-3
        # partitions only what deepspeed.initialize is given: the trained head.
        from transformers.integrations.deepspeed import unset_hf_deepspeed_config

        unset_hf_deepspeed_config()
    return accelerator


def mixed_precision(tc, cuda, multi):
    """accelerate's mixed_precision. GPU: bf16 under auto. CPU: bf16 autocast (fp32 master weights
    and losses) where the CPU has native bf16 matmuls (AVX512-BF16/AMX: 1.4-1.7x faster head
    steps measured, bench/RESULTS.md), else fp32; DeepSpeed's CPU ranks stay fp32."""
    asked = tc.mixed_precision
    if cuda:
        return "bf16" if asked == "auto" else asked
    if multi and tc.engine == "deepspeed":
        return "no"
    if asked == "auto":
        return "bf16" if cpu_has_fast_bf16() else "no"
    if asked == "bf16" and not cpu_has_fast_bf16():  # emulated: a phase-A step 39 s against 1.4 in fp32
        print("[train] warning: train.mixed_precision=bf16 on a CPU without native bf16 (AVX512-BF16/AMX): steps run "
              "~30x slower than fp32 here; use auto")
    return "no" if asked == "fp16" else asked


def merge(a, b):
    out = dict(a)
    for k, v in b.items():
        out[k] = merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def save_checkpoint(accelerator, out, state):
    """Atomic: write checkpoint.tmp on every rank, then swap it in for the old one."""
    ckpt, tmp, old = out / "checkpoint", out / "checkpoint.tmp", out / "checkpoint.old"
    if accelerator.is_main_process:
        shutil.rmtree(tmp, ignore_errors=True)
    accelerator.wait_for_everyone()
    accelerator.save_state(str(tmp))
    accelerator.wait_for_everyone()  # every rank's shard is in tmp before rank 0 moves it (a slow rank lost its folder)
    if accelerator.is_main_process:
        # sha256 of every file: resume refuses a checkpoint whose bytes changed (flipped, truncated)
        state = {**state, "files": {str(f.relative_to(tmp)): sha256_file(f) for f in sorted(tmp.rglob("*"))
                                    if f.is_file() and f.name != "train_state.json"}}
        (tmp / "train_state.json").write_text(json.dumps(state, indent=2))
        replace_dir(tmp, ckpt, old)  # checkpoint.old is what find_checkpoint falls back to
    accelerator.wait_for_everyone()


def shared_draft_vocab(accelerator, path, count, size, keep=None, swap=0):
    """(d2t, t2d): rank 0 counts tokens and writes `path`, the other ranks read it (`keep`, `swap`: see
    build_draft_vocab; the file holds the corpus counts as counted). Every rank enters
    the block whether or not the file exists yet: a rank that checked first and skipped it would miss
    the barrier rank 0 waits on (seen as a 2-rank hang when rank 1 arrived after the file was written)."""
    with accelerator.main_process_first():
        if not path.is_file():
            counts = count()
            save_draft_vocab(path, *build_draft_vocab(counts, size, keep, swap), counts)
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


# what a checkpoint was trained for (train_state.json "contract"); a resume under other values would
# load weights of another shape or train a head whose config lies about its layers
CONTRACT_KEYS = ("head_type", "aux_layers", "draft_vocab_size", "target_digest", "tokenizer_digest", "freeze_lm_head")


def check_resume_contract(ckpt, state, now):
    """Stop when the recipe differs from what the checkpoint recorded; keys it lacks (a checkpoint
    from before they were recorded) or recorded as unknown are not compared."""
    saved = state.get("contract") or {}
    for key in CONTRACT_KEYS:
        if saved.get(key) is not None and now.get(key) is not None and saved[key] != now[key]:
            raise CheckpointError(f"{ckpt} was trained with {key} = {saved[key]!r} but this run has {now[key]!r}; "
                                  "start over with train.resume=false or point train.output elsewhere")


def max_abs(params) -> float:
    """Largest |w| over this rank's parameters (its partition under ZeRO-3); inf when any is non-finite."""
    m = 0.0
    for p in params:
        if p.numel():
            w = p.detach().abs().max().float()
            m = max(m, float(w) if torch.isfinite(w) else math.inf)
    return m


def check_weights(accelerator, params, bound, step, out):
    """Stop before saving exploded weights; the last checkpoint (saved while they were sound) stays."""
    bad = accelerator.reduce(torch.tensor([float(not max_abs(params) <= bound)], device=accelerator.device), "sum")
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


def log_curve(accelerator, out, step, progress, metrics):
    """One line of <train.output>/curve.jsonl per evaluation: held-out metrics against training
    tokens, CPU seconds and wall seconds (bench/curves.py plots it)."""
    if accelerator.is_main_process:
        row = {"step": step, **progress, **{k: v for k, v in metrics.items() if k.startswith("eval/")}}
        with open(out / "curve.jsonl", "a") as f:
            f.write(json.dumps(row) + "\n")


def trim_curve(accelerator, out, step):
    path = out / "curve.jsonl"
    if accelerator.is_main_process and path.is_file():
        # resuming at `step`: keep the rows up to it; a fresh start (step 0) keeps none
        rows = [r for r in path.read_text().splitlines() if r.strip() and step and json.loads(r)["step"] <= step]
        atomic_write_text(path, "".join(r + "\n" for r in rows))


def param_digest(tensors) -> str:
    """sha256 of the tensors' float32 bytes: the saved head and every rank's parameters agree."""
    return hashlib.sha256(b"".join(t.detach().float().cpu().numpy().tobytes() for t in tensors)).hexdigest()


def gathered(params, zero3: bool):
    """Full parameters on every rank for the block (ZeRO-3 keeps only a partition per rank)."""
    if not zero3:
        return contextlib.nullcontext()
    from deepspeed.runtime.zero import GatheredParameters

    return GatheredParameters(params)


def gather_from_ranks(accelerator, obj):
    """[obj of rank 0, obj of rank 1, ...] on every rank."""
    from accelerate.utils import gather_object

    return gather_object([obj]) if accelerator.num_processes > 1 else [obj]
