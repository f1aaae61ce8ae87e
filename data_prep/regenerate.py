"""Stage `regen`: the target writes the replies itself, so the head learns the text it will draft.

    eagle-train regen recipe.yaml [regen.max_new_tokens=256 ...]
    accelerate launch --multi_gpu --num_processes 2 -m data_prep.regenerate recipe.yaml   # CPU processes
    eagle-train prep recipe.yaml          # with regen.enabled=true, prep reads regen.output

Reads the conversations of `data.source` (data_prep/readers.py), keeps their system prompt and user
turns, and has the target answer them turn by turn on its own earlier answers: round r generates
the r-th reply of every conversation in a shard at once, prompts length-sorted and left-padded in
batches of `regen.batch_size`, greedy (`regen.temperature=0`) or sampled (temperature, top-p), at
most `regen.max_new_tokens` new tokens, stopping at the template's end-of-turn token.

What is kept, and counted in `regen.json`:
    a reply that ends with the end-of-turn token      kept
    a reply cut at max_new_tokens                     kept ("capped"), the conversation ends there
    an empty reply (end-of-turn first, or blank)      dropped ("empty"), the conversation ends before it
    a prompt longer than data.max_length tokens       not generated ("prompt_too_long"), the conversation ends
A conversation left with no reply is dropped ("no_reply").

Output: `<regen.output>/shard-<index>.jsonl` ({"id", "messages"} records, what `prep` reads) written
under a temp name and renamed, `<regen.output>/progress/shard-<index>.json` (its counts), and
`regen.json` (settings, counts, complete). A rerun skips the shards already written, so a killed run
resumes where it was and ends with the same files as an uninterrupted one (sampling is seeded per
shard); a rerun with other settings into the same folder is refused, naming the setting. Each record
carries its shard's sha256: a damaged shard is redone by a rerun, and prep refuses to read it.
"""

from __future__ import annotations

import json
import sys
import time
from collections import Counter
from pathlib import Path
from typing import List

import torch
from omegaconf import OmegaConf
from tqdm import tqdm

from eagle_train.data_prep.readers import Skips, read_conversations, with_system_prompt
from eagle_train.data_prep.templates import render, special_ids
from eagle_train.dump_reader import sha256_file
from eagle_train.errors import CorpusError
from eagle_train.files import atomic_write_text, refuse_orphan_pieces
from eagle_train.kv_cache import keep_rows
from eagle_train.recipe import RecipeError, data_keys_set
from eagle_train.target import compute_dtype, load_target, resolve_device, target_id

FORMAT = "eagle-train-regen/1"
# called as on_shard_written(folder, index) after a shard and its record are on disk (tests, monitors)
on_shard_written = None


def settings_of(cfg) -> dict:
    """Everything the generated text depends on (stored in regen.json, compared on reruns)."""
    d, r = cfg.data, cfg.regen
    skip = data_keys_set(d, ("skip_conversations", "min_prompt_chars", "prompt_template", "po_direction"))
    return {**skip, "format": FORMAT, "target": target_id(cfg.target), "revision": cfg.target.revision,
            "dtype": compute_dtype(cfg.target.dtype, cfg.target.device), "source": d.source, "data_format": d.format,
            "split": d.split,
            "max_conversations": d.max_conversations, "system_prompt": d.system_prompt, "max_length": d.max_length,
            "max_new_tokens": r.max_new_tokens, "temperature": r.temperature, "top_p": r.top_p,
            "max_turns": r.max_turns, "shard_size": r.shard_size, "batch_size": r.batch_size, "seed": r.seed}


def main(cfg, model=None, tok=None) -> dict:
    """Regenerate; returns the summary written to regen.json. `model`/`tok`: an already loaded target."""
    from accelerate import PartialState

    state = PartialState(cpu=resolve_device(cfg.target.device).type == "cpu")
    out = Path(cfg.regen.output)
    settings = settings_of(cfg)
    check_values(cfg)
    check_folder(out, settings)
    if model is None:
        device = state.device if state.num_processes > 1 else cfg.target.device
        model, tok = load_target(OmegaConf.merge(cfg.target, {"device": str(device)}))
    model.eval()
    eot = end_of_turn_ids(tok, model)

    skips = Skips()
    convs = []
    for c in read_conversations(cfg.data.source, cfg.data.format, cfg.data.split, skips, cfg.data.max_conversations,
                                cfg.data.skip_conversations, cfg.data.min_prompt_chars, cfg.data.prompt_template,
                                cfg.data.po_direction):
        convs.append((c.id, with_system_prompt(c.messages, cfg.data.system_prompt)))
    if not convs:
        raise CorpusError(f"data.source={cfg.data.source!r}: no usable conversation (skipped: {dict(skips.counts)}, "
                          f"data.max_conversations={cfg.data.max_conversations}); check data.source and data.format")
    size = cfg.regen.shard_size
    shards = [convs[i:i + size] for i in range(0, len(convs), size)]
    todo = [i for i in range(len(shards)) if i % state.num_processes == state.process_index
            and shard_record(out, i) is None]  # a damaged shard is redone (sampling is seeded per shard)
    (out / "progress").mkdir(parents=True, exist_ok=True)

    bar = tqdm(total=sum(len(shards[i]) for i in todo), desc=f"regen [rank {state.process_index}]",
               unit="conv", disable=not todo, dynamic_ncols=True)
    t0, new_tokens = time.perf_counter(), 0
    for i in todo:
        records, counts = regenerate_shard(model, tok, shards[i], cfg, eot, seed=cfg.regen.seed * 100_003 + i)
        new_tokens += counts["new_tokens"]
        atomic_write_text(out / f"shard-{i:05d}.jsonl", "".join(json.dumps(r, ensure_ascii=False) + "\n"
                                                               for r in records))
        atomic_write_text(out / "progress" / f"shard-{i:05d}.json",
                          json.dumps({**counts, "sha256": sha256_file(out / f"shard-{i:05d}.jsonl")}))
        if on_shard_written is not None:
            on_shard_written(out, i)
        bar.update(len(shards[i]))
        bar.set_postfix(tok_s=f"{new_tokens / (time.perf_counter() - t0):.1f}")
    bar.close()

    state.wait_for_everyone()
    summary = {}
    if state.is_main_process:
        total, records = Counter(), [shard_record(out, i) for i in range(len(shards))]
        for r in filter(None, records):
            total.update({k: v for k, v in r.items() if k != "sha256"})
        summary = {**settings, "complete": all(records), "shards": len(shards), "conversations_read": len(convs),
                   "skipped_records": dict(skips.counts), "counts": dict(sorted(total.items()))}
        atomic_write_text(out / "regen.json", json.dumps(summary, indent=2) + "\n")
        c = summary["counts"]
        print(f"[regen] {out}: {c.get('conversations', 0)} conversations, {c.get('replies', 0)} replies, "
              f"{c.get('new_tokens', 0)} new tokens; capped {c.get('capped', 0)}, empty {c.get('empty', 0)}, "
              f"prompt_too_long {c.get('prompt_too_long', 0)}, no_reply {c.get('no_reply', 0)}")
    state.wait_for_everyone()
    return summary


def check_values(cfg) -> None:
    """What regen reads that the recipe's validate leaves open (a negative max_turns would slice
    off the last user turns without a word)."""
    problems = []
    if cfg.regen.max_turns is not None and cfg.regen.max_turns < 1:
        problems.append(f"`regen.max_turns` = {cfg.regen.max_turns} must be >= 1 (None: every user turn)")
    if cfg.data.max_conversations is not None and cfg.data.max_conversations < 1:
        problems.append(f"`data.max_conversations` = {cfg.data.max_conversations} must be >= 1 (None: all)")
    if problems:
        raise RecipeError("; ".join(problems))


def read_summary(path: Path) -> dict:
    """regen.json as a dict, or one error naming it."""
    try:
        summary = json.loads(path.read_text())
        if not isinstance(summary, dict):
            raise TypeError(type(summary).__name__)
    except (ValueError, TypeError) as err:
        raise CorpusError(f"{path} is damaged ({type(err).__name__}: {str(err)[:120]}); it holds the settings the "
                          f"replies were generated with, so they cannot be checked: delete {path.parent} and rerun "
                          "`eagle-train regen <recipe>`, or use another regen.output") from None
    return summary


def shard_record(out: Path, i: int):
    """progress/shard-<i>.json when it and the shard it describes are intact (sha256), else None."""
    try:
        record = json.loads((out / "progress" / f"shard-{i:05d}.json").read_text())
    except (OSError, ValueError):
        return None
    shard = out / f"shard-{i:05d}.jsonl"
    if not isinstance(record, dict) or not shard.is_file():
        return None
    if "sha256" in record and record["sha256"] != sha256_file(shard):
        return None
    return record


def check_folder(out: Path, settings: dict) -> None:
    path = out / "regen.json"
    refuse_orphan_pieces(out, path, "progress/shard-*.json", "regen.output")
    if not path.is_file():
        out.mkdir(parents=True, exist_ok=True)
        atomic_write_text(path, json.dumps({**settings, "complete": False}, indent=2) + "\n")
        return
    differ = first_difference(read_summary(path), settings)
    if differ:
        k, theirs, ours = differ
        raise RecipeError(f"{out} (regen.output) holds replies generated with {k} = {theirs!r}, but this "
                          f"recipe gives {ours!r}; refusing to mix them. Use another regen.output or delete it.")


def first_difference(old: dict, settings: dict):
    """(key, old value, new value) of the first setting that differs, or None."""
    return next(((k, old.get(k), v) for k, v in settings.items() if old.get(k) != v), None)


def end_of_turn_ids(tok, model) -> List[int]:
    """Ids that end a reply: the special token the template puts right after an assistant turn
    (e.g. <|im_end|>, <|eot_id|>), the tokenizer's EOS and the model's generation-config EOS."""
    marker = "REPLY-END-MARKER"
    text = render(tok, [{"role": "user", "content": "hi"}, {"role": "assistant", "content": marker}])
    ids = tok(text[text.index(marker) + len(marker):], add_special_tokens=False)["input_ids"]
    specials = special_ids(tok)
    found = [i for i in ids if i in specials][:1]
    gen = model.generation_config.eos_token_id
    gen = gen if isinstance(gen, list) else [gen]
    return sorted({i for i in found + [tok.eos_token_id] + gen if i is not None})


def regenerate_shard(model, tok, convs, cfg, eot: List[int], seed: int):
    """Answer every user turn of `convs` with the target, one round per turn index; returns
    ([{"id", "messages"}], counts)."""
    r = cfg.regen
    gen = torch.Generator().manual_seed(seed)
    counts = Counter()
    # per conversation: the messages so far (system + alternating user/assistant) and the user turns to come
    live = []
    for cid, msgs in convs:
        head = [m for m in msgs[:1] if m["role"] == "system"]
        users = [m for m in msgs if m["role"] == "user"][:r.max_turns]
        live.append({"id": cid, "messages": head, "users": users, "open": True})
    for turn in range(max(len(c["users"]) for c in live)):
        active = [c for c in live if c["open"] and turn < len(c["users"])]
        prompts = []
        for c in active:
            c["messages"] = c["messages"] + [c["users"][turn]]
            ids = tok(render(tok, c["messages"], add_generation_prompt=True), add_special_tokens=False)["input_ids"]
            if len(ids) >= cfg.data.max_length:
                counts["prompt_too_long"] += 1
                c["messages"], c["open"] = c["messages"][:-1], False
                continue
            prompts.append((c, ids))
        prompts.sort(key=lambda x: len(x[1]))
        for s in range(0, len(prompts), r.batch_size):
            batch = prompts[s:s + r.batch_size]
            for (c, _), (reply, n_new, ended) in zip(batch, generate(model, [p for _, p in batch], r, eot, tok, gen)):
                counts["new_tokens"] += n_new
                if not reply.strip():
                    counts["empty"] += 1
                    c["messages"], c["open"] = c["messages"][:-1], False
                    continue
                c["messages"].append({"role": "assistant", "content": reply})
                counts["replies"] += 1
                if not ended:
                    counts["capped"] += 1
                    c["open"] = False
    records = []
    for c in live:
        if not any(m["role"] == "assistant" for m in c["messages"]):
            counts["no_reply"] += 1
            continue
        while c["messages"][-1]["role"] != "assistant":
            c["messages"].pop()
        records.append({"id": c["id"], "messages": c["messages"]})
    counts["conversations"] = len(records)
    return records, counts


@torch.no_grad()
def generate(model, prompts: List[List[int]], r, eot: List[int], tok, gen: torch.Generator):
    """Left-padded batch generation with a KV cache; per prompt (reply text, new tokens, ended at
    end-of-turn). Greedy is plain argmax; sampling draws from softmax(logits / T) within top-p. A row
    that ends leaves the batch with its cache rows (a decode step costs little more per extra row on
    a CPU: 1.05x faster at batch 16 and 512 tokens, bench/regen.py; more where rows are dearer)."""
    from transformers import DynamicCache

    dev = model.device
    width = max(map(len, prompts))
    pad = tok.pad_token_id if tok.pad_token_id is not None else eot[0]
    step_ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts], device=dev)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=dev)
    eot_t = torch.tensor(eot, device=dev)
    cache = DynamicCache()
    live = list(range(len(prompts)))  # the prompt each batch row answers
    out, ended = [[] for _ in prompts], [False] * len(prompts)
    for _ in range(r.max_new_tokens):
        pos = (mask.cumsum(-1) - 1).clamp(min=0)[:, -step_ids.shape[1]:]
        logits = model(input_ids=step_ids, attention_mask=mask, position_ids=pos, cache=cache,
                       use_cache=True).logits[:, -1].float()
        nxt = sample(logits, r.temperature, r.top_p, gen)
        hit = torch.isin(nxt, eot_t)
        for row, t, h in zip(live, nxt.tolist(), hit.tolist()):
            out[row].append(t)
            ended[row] = h
        if hit.any():
            keep = (~hit).nonzero().squeeze(-1)
            if len(keep) == 0:
                break
            live = [live[k] for k in keep.tolist()]
            nxt, mask = nxt[keep], mask[keep]
            keep_rows(cache, keep)
        step_ids = nxt[:, None]
        mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
    results = []
    for row, fin in zip(out, ended):
        n = len(row) - int(fin)
        results.append((tok.decode(row[:n], skip_special_tokens=True), len(row), fin))
    return results


def sample(logits: torch.Tensor, temperature: float, top_p: float, gen: torch.Generator) -> torch.Tensor:
    if temperature == 0:
        return logits.argmax(-1)
    probs = torch.softmax(logits / temperature, dim=-1)
    if top_p < 1:
        sorted_p, idx = probs.sort(dim=-1, descending=True)
        keep = sorted_p.cumsum(-1) - sorted_p < top_p  # the smallest prefix reaching top_p
        probs = torch.zeros_like(probs).scatter_(-1, idx, sorted_p * keep)
    return torch.multinomial(probs.cpu(), 1, generator=gen).squeeze(-1).to(logits.device)


def regenerated_source(cfg) -> List[str]:
    """What prep reads with regen.enabled: the regen output's shard files, once it is complete."""
    out = Path(cfg.regen.output)
    path = out / "regen.json"
    summary = read_summary(path) if path.is_file() else {}
    if not summary.get("complete"):
        raise FileNotFoundError(f"regen.enabled=true but {cfg.regen.output} (regen.output) holds no complete "
                                f"regeneration; run `eagle-train regen <recipe>` first (it resumes)")
    differ = first_difference(summary, settings_of(cfg))
    if differ:
        raise RecipeError(f"{path} was generated with {differ[0]} = {differ[1]!r}, this recipe gives {differ[2]!r}; "
                          f"rerun `eagle-train regen` into another regen.output")
    damaged = [f"shard-{i:05d}.jsonl" for i in range(int(summary.get("shards", 0))) if shard_record(out, i) is None]
    if damaged:
        raise CorpusError(f"{out} (regen.output): {', '.join(damaged[:4])}{' ...' if len(damaged) > 4 else ''} "
                          "missing, damaged or not matching its progress/ record (sha256); rerun `eagle-train regen "
                          "<recipe>`: it redoes those shards")
    return [str(out / f"shard-{i:05d}.jsonl") for i in range(int(summary["shards"]))]


if __name__ == "__main__":
    from eagle_train.cli import exit_stage, run_stage

    exit_stage(run_stage("regen", sys.argv[1:]))
