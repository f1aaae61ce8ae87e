"""Train an EAGLE draft head (EAGLE-3, or EAGLE-1/2) against a frozen target.

    accelerate launch eagle_train/train.py recipe.yaml [key=value ...]
    accelerate launch --use_deepspeed --zero_stage 2 --num_processes 2 eagle_train/train.py recipe.yaml
    python eagle_train/train.py recipe.yaml      # or: eagle-train train recipe.yaml

Data: `train.mode=offline` reads the dump (`eagle-train dump`), `online` runs the frozen target
here on the prepared corpus (`eagle-train prep`). Engine: DeepSpeed ZeRO-2 (`train.zero_stage=3`
for ZeRO-3, `train.engine=ddp` for plain DDP); a single CPU process runs without an engine.

The recipe, top to bottom: set-up (data, target weights, head, optimizer, resume), the loop
(batch, loss, step, log, evaluate, checkpoint), the final save. The pieces live beside it:
eagle_train/ttt.py (the training-time-test unroll and the loss), batches.py (samples, micro-batches,
targets), engine.py (accelerate/DeepSpeed, checkpoints, divergence checks), head_init.py (`head.init`).
"""

from __future__ import annotations

import faulthandler
import json
import os
import signal
import sys
import time
from pathlib import Path
from statistics import median
from types import SimpleNamespace

import torch

from eagle_train.batches import (add_targets, batch_indices, draft_vocab_counts, dump_expectation, eval_batches,
                                 feature_rms, load_batch, open_data, sample_lengths)
from eagle_train.draft_vocab import draft_ids_of
from eagle_train.dump_reader import check_contract, check_targets
from eagle_train.engine import (BUDGET_PROBE, BUDGET_REFIT, LOSS_CAP, WEIGHT_GROWTH, check_resume_contract,
                                check_weights, deep_restart, find_checkpoint, fit_budget, gather_from_ranks, gathered,
                                last_sound, log_curve, lr_lambda, make_accelerator, max_abs, optimizer, param_digest,
                                read_checkpoint, save_checkpoint, shared_draft_vocab, trim_curve)
from eagle_train.errors import CheckpointError, TrainingDiverged
from eagle_train.features import target_features
from eagle_train.files import atomic_write_text
from eagle_train.head_init import init_weights, start_head, trained_head
from eagle_train.heads import build_head, save_head
from eagle_train.recipe import RecipeError, data_keys_set
from eagle_train.target import load_target, target_weights, weights_digest
from eagle_train.ttt import DraftLoss


def main(cfg, target=None, stop_after=None):
    """Train per the recipe; returns {"final": path, "metrics": {...}}. `target`: an already loaded
    frozen target (tests, notebooks); `stop_after`: end after that many optimizer steps without the
    final save (a stand-in for a killed run)."""
    from tqdm.auto import tqdm

    # ------------------------------------------------------------ set-up
    tc, out, head_type = cfg.train, Path(cfg.train.output), cfg.head.type
    out.mkdir(parents=True, exist_ok=True)
    accelerator = make_accelerator(cfg, out)
    dev = accelerator.device
    ds, collate = open_data(cfg, "train")
    eval_data = open_data(cfg, "eval")
    per_epoch = len(batch_indices(len(ds), tc.micro_batch_size, accelerator.num_processes, 0, 0, 0))
    if per_epoch == 0:  # said before the target is loaded or anything is counted
        raise RecipeError(f"`train.micro_batch_size` = {tc.micro_batch_size} x {accelerator.num_processes} "
                          f"process(es) exceeds the {len(ds)} training samples; lower train.micro_batch_size")
    if head_type == "eagle1" and tc.mode == "offline" and cfg.dump.storage != "full":
        raise FileNotFoundError("head.type=eagle1 regresses the last hidden state: dump with dump.storage=full")

    # frozen target: in-process for online mode, else only its embeddings and lm_head
    if tc.mode == "online" and target is None:
        target, _ = load_target(cfg.target, with_tokenizer=False)
    if target is not None:
        target.to(dev).eval().requires_grad_(False)
    tconf, embed, lm_head_w, norm_w = target_weights(cfg.target, target)
    digest = weights_digest(embed, lm_head_w, norm_w, cfg.target.dtype)
    if tc.mode == "offline":  # the dump is the contract: a dump of other layers would train a lying head
        expected = dump_expectation(cfg, tconf, digest)
        for part in getattr(ds, "parts", [ds]):
            check_contract(part.manifest, expected, part.folder)
            check_targets(part.manifest, tc.loss_positions, part.folder)
            expected = {**expected, "max_length": None}  # train.extra_dumps may be cut at another length
        if tc.eval_dump and eval_data is not None:  # held-out features of another dump: the same contract
            check_contract(eval_data[0].manifest, expected, eval_data[0].folder)

    torch.manual_seed(tc.seed)
    head = build_head(cfg.head, tconf)
    # what this run trains for: recorded in every checkpoint and the final head, compared on resume
    contract = {"head_type": head_type, "aux_layers": list(head.config.aux_layers) if head_type == "eagle3" else None,
                "draft_vocab_size": cfg.head.draft_vocab_size if head_type == "eagle3" else None,
                "target_digest": digest, "tokenizer_digest": tokenizer_digest(cfg, ds),
                "freeze_lm_head": cfg.head.freeze_lm_head if head_type == "eagle3" else None}
    ckpt = find_checkpoint(out) if tc.resume is not False else None  # None (auto): when there is one
    saved = read_checkpoint(ckpt) if ckpt is not None else None
    if saved is not None:  # before anything is counted or loaded for the recipe's head
        check_resume_contract(ckpt, saved, contract)
    start = start_head(cfg.head.init, head)  # head.init = a head folder: fine-tune that head
    if head_type == "eagle3":  # the draft vocabulary: the start head's (part of what it learned), else counted
        # a larger head.draft_vocab_size or a re-ranked one: counted on this corpus
        grow = start is not None and (head.d2t.numel() > start.d2t.numel() or cfg.head.draft_vocab_swap > 0)
        head.set_draft_vocab(*((start.d2t, start.t2d) if start is not None and not grow else shared_draft_vocab(
            accelerator, out / "draft_vocab.safetensors",
            lambda: draft_vocab_counts(cfg, ds, tconf.vocab_size), cfg.head.draft_vocab_size,
            keep=start.t2d if grow else None, swap=cfg.head.draft_vocab_swap)))  # a start head's tokens first
    aux_layers = head.config.aux_layers if head_type == "eagle3" else None

    def features(b):  # online mode: the frozen target's features of the batch, computed here
        if tc.mode == "online":
            b.update(target_features(target, b["input_ids"], b["attention_mask"], aux_layers, "full"))
        return b

    feature_scale = None
    if head_type == "eagle3" and tc.feature_norm:  # per-dim RMS of the aux features over the first 16 samples
        feature_scale = feature_rms(features(load_batch(ds, collate, range(min(16, len(ds))), dev))).cpu()
    init_weights(head, cfg.head.init, embed, lm_head_w, norm_w, start,
                 lambda: target if target is not None else load_target(cfg.target, False)[0], feature_scale,
                 cfg.head.freeze_lm_head)
    draft_ids = draft_ids_of(head.d2t).to(dev) if head_type == "eagle3" else None
    t2d_index = torch.full((tconf.vocab_size,), -1, dtype=torch.long)  # target id -> draft id, or -1
    if head_type == "eagle3":
        t2d_index[draft_ids.cpu()] = torch.arange(draft_ids.numel())
    t2d_index, lm_head_w = t2d_index.to(dev), lm_head_w.to(dev)

    def targets(b, positions=tc.loss_positions, temperature=tc.target_temperature, copy_weight=tc.copy_weight):
        return add_targets(b, head_type, lm_head_w, draft_ids, t2d_index, positions=positions, temperature=temperature,
                           copy_weight=copy_weight)

    def held_out_targets(b):  # always the replies, the target's own distribution, uniform weights: comparable
        return targets(b, "assistant", 1.0, 1.0)

    deepspeed = accelerator.state.deepspeed_plugin is not None
    model = DraftLoss(head, ttt_steps=tc.ttt_steps, ttt_decay=tc.ttt_decay, feature_weight=tc.feature_weight,
                      token_weight=tc.token_weight, noise=tc.noise, feature_scale=feature_scale,
                      recompute_attention=tc.recompute_attention, ttt_mask_topk=tc.ttt_mask_topk, ttt_rows=tc.ttt_rows,
                      step0_rows=tc.step0_rows, dropout=tc.dropout,
                      fused=not (deepspeed and tc.zero_stage == 3))
    params = [p for p in model.parameters() if p.requires_grad]
    opt = optimizer(model, tc, deepspeed)
    # the step counts: the recipe's, lowered by train.budget_minutes where the steps would not fit in it
    plan = SimpleNamespace(max_steps=tc.max_steps, shallow_steps=tc.shallow_steps, fitted=[], eval_s=0.0, save_s=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(tc, plan))
    model, opt = accelerator.prepare(model, opt)
    accelerator.register_for_checkpointing(sched)  # stepped by us once per optimizer step

    # resume
    micro, metrics, done = 0, {}, {"tokens": 0, "cpu_s": 0.0, "wall_s": 0.0}
    if tc.resume is True and ckpt is None:
        raise FileNotFoundError(f"train.resume=true but no checkpoint under {out}; use train.resume=auto to start over")
    bound = WEIGHT_GROWTH * max(1.0, max_abs(params))
    if ckpt is not None:
        state = saved
        try:
            accelerator.load_state(str(ckpt))
        except Exception as err:  # truncated or foreign files in a checkpoint saved before digests were recorded
            raise CheckpointError(f"{ckpt}: cannot be loaded ({type(err).__name__}: {str(err)[:200]}); "
                                  "start over with train.resume=false") from err
        bound = state.get("weight_bound", bound)
        if not max_abs(params) <= bound:
            raise CheckpointError(f"{ckpt} holds exploded or non-finite weights; start over with train.resume=false")
        micro, metrics = state["micro_step"], state["metrics"]
        done.update(state.get("progress", {}))
        if tc.budget_minutes is not None and state.get("budget", {}).get("fitted"):  # the counts it was fitted to
            vars(plan).update(state["budget"])
        accelerator.print(f"[train] resumed from {ckpt} at step {state['step']}")
    if accelerator.is_main_process and tc.tracker != "none":
        accelerator.init_trackers(tc.project, config=_flat(_plain(cfg)),
                                  init_kwargs={"wandb": {"name": tc.run_name}} if tc.tracker == "wandb" else {})

    held_out = None if eval_data is None else eval_batches(accelerator, *eval_data, features, tc.micro_batch_size,
                                                           tc.eval_batches)
    step = micro // tc.grad_accum
    trim_curve(accelerator, out, step)  # rows of evaluations after the checkpoint we resume from are redone
    if micro == 0 and held_out is not None:  # the untrained head, for comparison and the curve's origin
        t_eval = time.perf_counter()
        metrics.update({k.replace("eval/", "eval0/"): v
                        for k, v in evaluate(model, accelerator, held_out, held_out_targets).items()})
        log_curve(accelerator, out, 0, done, {k.replace("eval0/", "eval/"): v for k, v in metrics.items()})
        accelerator.print("[train] step 0 (the head before training): "
                          + ", ".join(f"{k}={v:.4f}" for k, v in metrics.items() if k.startswith("eval0/")))
        plan.eval_s = time.perf_counter() - t_eval
    lengths = sample_lengths(ds) if tc.length_buckets else None

    # ------------------------------------------------------------ the loop
    order = {}  # epoch -> this rank's micro-batches
    bar = tqdm(total=plan.max_steps, initial=step, disable=not accelerator.is_main_process, desc="train", unit="step")
    core = accelerator.unwrap_model(model)  # its ttt_steps: train.shallow_ttt early, train.ttt_steps after and in evals
    model.train()
    t0, c0, tokens, last_loss = time.perf_counter(), time.process_time(), 0, float("nan")
    t_step, timed = t0, {"shallow": [], "deep": []}  # train.budget_minutes: this process' step times per phase
    while step < plan.max_steps and (stop_after is None or step < stop_after):
        epoch, pos = divmod(micro, per_epoch)
        if epoch not in order:
            order = {epoch: batch_indices(len(ds), tc.micro_batch_size, accelerator.num_processes,
                                         accelerator.process_index, tc.seed, epoch, lengths)}
        b = targets(features(load_batch(ds, collate, order[epoch][pos], dev)))
        logging = (step + 1) % tc.log_every == 0 or step + 1 == plan.max_steps
        phase = "shallow" if step < plan.shallow_steps else "deep"
        core.ttt_steps = tc.shallow_ttt if phase == "shallow" else tc.ttt_steps
        if step == plan.shallow_steps and micro % tc.grad_accum == 0 and deep_restart(tc) and not deepspeed:
            # the deep unroll's gradients are not the shallow ones': AdamW's moments start over with the schedule
            # (a checkpoint saved after this step holds the fresh ones, so a resume matches)
            opt.optimizer.state.clear()
        with accelerator.accumulate(model):
            loss, stats = model(b, with_stats=logging)
            sound = torch.isfinite(loss.detach()) & (loss.detach().abs() < LOSS_CAP)
            bad = accelerator.reduce((~sound).float().reshape(1), "sum")  # every rank stops together
            if bad.item() > 0:
                what = "non-finite" if not torch.isfinite(loss.detach()) else "exploding"
                raise TrainingDiverged(f"{what} training loss at step {step} (micro-batch {micro}, this rank's loss "
                                       f"{float(loss.detach()):.3g}); stopped. {last_sound(out)}; resume with a lower "
                                       f"train.learning_rate or train.grad_clip")
            accelerator.backward(loss)
            if accelerator.sync_gradients and tc.grad_clip > 0 and not deepspeed:
                accelerator.clip_grad_norm_(params, tc.grad_clip)
            opt.step()
            opt.zero_grad()
        micro += 1
        tokens += int(b["attention_mask"].sum()) * accelerator.num_processes
        last_loss = float(loss.detach())
        if not accelerator.sync_gradients:
            continue
        sched.step()
        step += 1
        bar.update(1)
        timed[phase].append(time.perf_counter() - t_step)  # from the end of the last step's evaluation and save
        # progress for the learning curves: tokens seen, CPU seconds of this process (all threads), wall
        now = {"tokens": done["tokens"] + tokens, "cpu_s": done["cpu_s"] + time.process_time() - c0,
               "wall_s": done["wall_s"] + time.perf_counter() - t0}
        if logging and stats:
            accs = {k: round(float(v[0] / v[1].clamp(min=1)), 3) for k, v in stats.items()}
            rate = tokens / (time.perf_counter() - t0)
            bar.set_postfix(loss=f"{last_loss:.3f}", tok_s=f"{rate:.0f}", **accs)
            metrics.update({"train/loss": last_loss, "train/lr": sched.get_last_lr()[0], "train/tokens_per_s": rate,
                            **{f"train/{k}": v for k, v in accs.items()}})
            accelerator.log({k: v for k, v in metrics.items() if k.startswith("train/")}, step=step)
        fits = plan.fitted.count(phase)  # each phase is fitted twice: after BUDGET_PROBE steps, after BUDGET_REFIT
        if tc.budget_minutes is not None and fits < 2 and len(timed[phase]) >= (BUDGET_PROBE, BUDGET_REFIT)[fits] + 2:
            fit_to_budget(tc, plan, accelerator, step, phase, timed[phase][2:], tc.budget_minutes * 60 - now["wall_s"])
            bar.total = plan.max_steps
            bar.refresh()
        evaluating = held_out is not None and (step % tc.eval_every == 0 or step == plan.max_steps)
        saving = step % tc.save_every == 0 or step == plan.max_steps
        if evaluating:
            t_eval = time.perf_counter()
            core.ttt_steps = tc.ttt_steps
            metrics.update(evaluate(model, accelerator, held_out, held_out_targets))
            accelerator.log({k: v for k, v in metrics.items() if k.startswith("eval/")}, step=step)
            accelerator.print(f"[train] step {step}: "
                              + ", ".join(f"{k}={v:.4f}" for k, v in metrics.items() if k.startswith("eval/")))
            log_curve(accelerator, out, step, now, metrics)
            if tc.snapshots and accelerator.is_main_process and not (deepspeed and tc.zero_stage == 3):
                save_head(trained_head(cfg, tconf, head, accelerator.get_state_dict(model), feature_scale),
                          out / "snapshots" / f"step-{step}", extra={"train_state": {"step": step, "progress": now}})
            plan.eval_s = time.perf_counter() - t_eval
        if logging or saving:
            check_weights(accelerator, params, bound, step, out)
        if saving:
            t_save = time.perf_counter()
            save_checkpoint(accelerator, out, {"step": step, "micro_step": micro, "metrics": metrics, "progress": now,
                                               "weight_bound": bound, "contract": contract, "budget": vars(plan)})
            plan.save_s = time.perf_counter() - t_save
        t_step = time.perf_counter()
    bar.close()
    if stop_after is not None and step < plan.max_steps:
        accelerator.end_training()
        return {"final": None, "metrics": metrics, "step": step}

    # ------------------------------------------------------------ final head
    # gather (ZeRO-3 safe), fold the feature scale into fc, save with metrics
    state = accelerator.get_state_dict(model)
    named = list(accelerator.unwrap_model(model).named_parameters())
    with gathered([p for _, p in named], deepspeed and tc.zero_stage == 3):
        digests = gather_from_ranks(accelerator, param_digest(p for _, p in named))
    final = out / "final"
    if accelerator.is_main_process:
        head_out = trained_head(cfg, tconf, head, state, feature_scale)
        # the saved weights are what the ranks trained: same digest as their (gathered) parameters
        info = {"step": step, "metrics": metrics, "rank_param_sha256": digests,
                "saved_param_sha256": param_digest(state[k] for k, _ in named), "target": cfg.target.model,
                "target_digest": digest, "tokenizer_digest": contract["tokenizer_digest"],
                # what the model card reports: the settings this head was trained with
                "train": {"mode": tc.mode, "storage": cfg.dump.storage if tc.mode == "offline" else None,
                          "ttt_steps": tc.ttt_steps, "max_steps": plan.max_steps,
                          "shallow_steps": plan.shallow_steps, "shallow_ttt": tc.shallow_ttt,
                          "budget_minutes": tc.budget_minutes, "recipe_max_steps": tc.max_steps,
                          "recipe_shallow_steps": tc.shallow_steps,
                          "deep_learning_rate": tc.deep_learning_rate,
                          "learning_rate": tc.learning_rate, "feature_norm": tc.feature_norm,
                          "init": cfg.head.init},
                "data": {"source": cfg.data.source, "max_conversations": cfg.data.max_conversations,
                         "skip_conversations": cfg.data.skip_conversations,
                         "max_length": cfg.data.max_length, "loss_positions": tc.loss_positions,
                         **data_keys_set(cfg.data, ("prompt_template", "po_direction")),
                         # the dump it read (offline): export attaches data.output's stats only when they are its own
                         "dump": ({"folder": str(ds.folder), "num_tokens": ds.manifest.get("num_tokens")}
                                  if tc.mode == "offline" else None),
                         "extra_dumps": [{"folder": str(p.folder), "num_tokens": p.manifest.get("num_tokens"),
                                          "data": p.manifest.get("settings", {}).get("data")}
                                         for p in getattr(ds, "parts", [])[1:]]}}
        save_head(head_out, final, extra={"train_state": info})
        atomic_write_text(final / "train_state.json", json.dumps(info, indent=2))
        accelerator.print(f"[train] saved {final}")
    accelerator.wait_for_everyone()
    accelerator.end_training()
    return {"final": final, "metrics": metrics, "step": step, "rank_param_sha256": digests}


def fit_to_budget(tc, plan, accelerator, step, phase, times, left_s):
    """train.budget_minutes, twice per phase: the median step time of this phase (every rank's mean, so the ranks
    agree) and the evaluations' and checkpoints' share per step; lowers the plan's counts where they do not fit. The
    shallow phase's second fit starts from the recipe's counts, so a first probe that read slow gives its steps back."""
    again, before = phase in plan.fitted, (plan.shallow_steps, plan.max_steps)
    anew = again and phase == "shallow"
    if anew:
        plan.shallow_steps, plan.max_steps = tc.shallow_steps, tc.max_steps
    t = torch.tensor([median(times), plan.eval_s, plan.save_s, left_s], dtype=torch.float64, device=accelerator.device)
    step_s, eval_s, save_s, left_s = accelerator.reduce(t, "mean").tolist()
    deep_s = step_s * tc.ttt_steps / tc.shallow_ttt if phase == "shallow" else step_s
    # the last step's evaluation and checkpoint come whatever the count: set apart, the rest spread over the steps
    per_step = eval_s / tc.eval_every + save_s / tc.save_every
    f = fit_budget(plan, step, left_s - eval_s - save_s, step_s, deep_s, per_step,
                   deep_cap=max(0, tc.max_steps - tc.shallow_steps) if phase == "deep" else None)
    plan.fitted = plan.fitted + [phase]
    # the deep phase measures its own step; the shallow phase projects the deep one from its own
    steps = f"shallow steps {step_s:.2f} s, deep {deep_s:.2f} s (projected)" if phase == "shallow" \
        else f"deep steps {step_s:.2f} s"
    said = (f"{f'refit over {len(times)} steps, ' if again else ''}{steps}, evaluations and checkpoints "
            f"{eval_s:.1f} + {save_s:.1f} s; {left_s / 60:.1f} of train.budget_minutes={tc.budget_minutes} left")
    counts = f"shallow_steps {before[0]} -> {plan.shallow_steps}, max_steps {before[1]} -> {plan.max_steps}"
    if (plan.shallow_steps, plan.max_steps) == before:
        what = f"the {plan.max_steps - step} steps left fit"
    elif f > 1:
        what = f"time for more deep steps, max_steps {before[1]} -> {plan.max_steps}"
    elif f < 1:
        what = f"steps lowered x{f:.2f}{' from the recipe' if anew else ''}, {counts}"
    else:  # the shallow refit's reset alone moved them
        what = f"the recipe's steps fit, {counts}"
    accelerator.print(f"[train] budget at step {step}: {said}: {what}")


def tokenizer_digest(cfg, ds):
    """The tokenizer/chat-template digest of the training data: the dump's manifest (offline), else
    the prepared corpus' stats.json; None when neither records one."""
    manifest = getattr(ds, "manifest", None)
    if cfg.train.mode == "offline" and isinstance(manifest, dict) and manifest.get("tokenizer_digest"):
        return manifest["tokenizer_digest"]
    try:
        return json.loads((Path(cfg.data.output) / "stats.json").read_text()).get("tokenizer_digest")
    except (OSError, ValueError, AttributeError):
        return None


def evaluate(model, accelerator, batches, targets):
    """Held-out loss and per-step top-1 accuracy (acc_s), summed over every rank's batches."""
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
    t = torch.tensor([loss_sum, n_b] + [x for k in keys for x in sums[k].tolist()], device=accelerator.device)
    t = accelerator.reduce(t, "sum").cpu()
    out = {"eval/loss": float(t[0] / max(1, t[1]))}
    for i, k in enumerate(keys):
        out[f"eval/{k}"] = float(t[2 + 2 * i] / max(1, t[3 + 2 * i]))
    if "eval/chain_1" in out:  # tau of a chain as deep as the unroll, drafted at every held-out position
        out["eval/chain_tau"] = 1 + out["eval/acc_0"] + sum(v for k, v in out.items() if k.startswith("eval/chain_"))
    return out


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


if __name__ == "__main__":
    if hasattr(signal, "SIGUSR1"):  # `kill -USR1 <pid>` prints every thread's stack: where a stuck rank waits
        faulthandler.register(signal.SIGUSR1, all_threads=True)
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", torch.get_num_threads())))
    from eagle_train.cli import exit_stage, run_stage

    exit_stage(run_stage("train", sys.argv[1:]))
