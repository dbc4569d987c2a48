# Two commands do all set-up on a fresh machine: `make demo` and `make test`.
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
# The CPU wheel of torch 2.13.0 lies on local disk; installing it first keeps
# any dependency from pulling a multi-GB CUDA build.
TORCH  := torch==2.13.0

.PHONY: test demo install clean test-scale

$(PY):
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip

$(STAMP): $(PY) setup.py
	$(PY) -m pip install -q $(TORCH)
	$(PY) -m pip install -q -e ".[dev]" $(TORCH)
	touch $(STAMP)

install: $(STAMP)

test: $(STAMP)
	$(PY) -m pytest -q tests

demo: $(STAMP)
	$(VENV)/bin/hybridflow train configs/demo.yaml trainer.overwrite=true

# The GPU-scale GRPO config on CPU: a random checkpoint with Qwen2.5-0.5B's exact shapes (2 of its
# 24 layers), GSM8K prompts, the actor at the config's own TP=2 over 2 processes, 2 steps (~3 min).
SCALE_MODEL := models/qwen2.5-0.5b-shaped
SCALE_RUN := model.path=$(SCALE_MODEL) model.dtype=float32 trainer.device=cpu trainer.n_devices=2 \
	data.val_files=[] data.train_batch_size=4 data.max_prompt_length=256 data.max_response_length=32 \
	rollout.n=2 actor.ppo_mini_batch_size=4 actor.ppo_micro_batch_size=2 rollout.log_prob_micro_batch_size=4 \
	reference.log_prob_micro_batch_size=4 trainer.total_steps=2 trainer.save_every=0 trainer.output_dir=runs \
	trainer.overwrite=true

test-scale: $(STAMP)
	test -f $(SCALE_MODEL)/config.json || $(PY) tools/make_qwen_shaped_model.py --out $(SCALE_MODEL) --layers 2
	test -f data/gsm8k/train.parquet || $(PY) tools/prepare_gsm8k.py --out data/gsm8k
	$(VENV)/bin/hybridflow train configs/qwen2.5-0.5b-grpo-gsm8k.yaml $(SCALE_RUN)

clean:
	rm -rf $(VENV) build *.egg-info
