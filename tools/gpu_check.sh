#!/usr/bin/env bash
# The prepared GPU checks, in one call of the device tool (../shared/gpu/README.md):
#   1. pytest -m gpu: the CUDA kernels against the eager reference, and the CUDA generation and
#      training paths against the CPU ones (tests/trainer/test_on_cuda.py);
#   2. the demo's GRPO run on CUDA for 20 steps (megatron-core from .whl, local launcher, NCCL), the
#      first time the engine's CUDA path runs; its held-out accuracy is comparable with the CPU's
#      20-step figure (28.7% -> 44.0% on this commit; not bit-equal: other kernels, other sums);
#   3. benchmarks/gpu_suite.py: kernel speed, memory and bandwidth side by side;
#   3b. (`reshard`) its reshard section: `hybridflow reshard` on a Qwen2.5-0.5B-shaped model (24 layers,
#      random bfloat16), time and peak memory of each conversion against its dry run and a whole-model
#      load + save (host work; the dist_checkpointing rows need megatron-core from .whl);
#   3c. (`generate`) its generate section: the built-in generator's eager loop against the static decode
#      path replayed as a CUDA graph and as torch.compile(mode="reduce-overhead"), 0.5B-shaped bf16 model,
#      256 rows x 256 tokens: tokens/s, capture time, peak memory, decode step against the HBM roofline;
#   4. (only when asked: `scale`) the Qwen2.5-0.5B GRPO config on one GPU against a random checkpoint
#      of the real shapes (all 24 layers, bfloat16), 3 steps of 32 prompts x 8 samples x 256 tokens:
#      the step's time split at GPU scale. Needs the GSM8K jsonl in data/gsm8k_src and data/gsm8k's
#      parquet files (carry `data`).
# Each step has its own timeout, so one hang cannot eat the lease; logs go to $OUT.
#   tools/gpu_check.sh [pytest,train,suite,reshard,generate]   (default: all five)
# The timeouts add up to more than 8 minutes; measured runs end well before them. For the decode path alone:
#   tools/gpu_check.sh pytest,generate
set -o pipefail
OUT=${OUT:-/tmp/gpu_check}; mkdir -p "$OUT"
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1
steps=${1:-pytest,train,suite,reshard,generate}
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl || exit 1
fi
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm,driver_version --format=csv | tee "$OUT/gpu.txt"
python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)" | tee -a "$OUT/gpu.txt"
rc=0
if [[ $steps == *pytest* ]]; then
  timeout 240 python3 -m pytest -m gpu tests/kernels tests/trainer/test_on_cuda.py tests/rollout/test_static_decode.py \
    -q -p no:cacheprovider -rs 2>&1 | tee "$OUT/pytest_gpu.log" || rc=1
fi
if [[ $steps == *train* ]]; then
  timeout 120 python3 -m hybridflow.cli train configs/demo.yaml trainer.device=cuda trainer.total_steps=20 \
    trainer.val_every=10 trainer.save_every=0 trainer.output_dir=/tmp/runs trainer.overwrite=true \
    2>&1 | tee "$OUT/train_cuda.log" || rc=1
fi
if [[ $steps == *suite* ]]; then
  timeout 200 python3 benchmarks/gpu_suite.py --only logprob,bandwidth,gae 2>&1 | tee "$OUT/gpu_suite.log" || rc=1
fi
if [[ $steps == *reshard* ]]; then
  timeout 240 python3 benchmarks/gpu_suite.py --only reshard 2>&1 | tee "$OUT/gpu_suite_reshard.log" || rc=1
fi
if [[ $steps == *generate* ]]; then
  timeout 240 python3 benchmarks/gpu_suite.py --only generate 2>&1 | tee "$OUT/gpu_suite_generate.log" || rc=1
fi
if [[ $steps == *scale* ]]; then
  python3 tools/make_qwen_shaped_model.py --out /tmp/qwen-shaped --src data/gsm8k_src > "$OUT/make_model.log" 2>&1 &&
  timeout 200 python3 -m hybridflow.cli train configs/qwen2.5-0.5b-grpo-gsm8k.yaml model.path=/tmp/qwen-shaped \
    trainer.n_devices=1 actor.parallel.tp=1 data.train_batch_size=32 data.max_response_length=256 \
    data.val_files=[] actor.ppo_mini_batch_size=32 trainer.total_steps=3 trainer.save_every=0 \
    trainer.output_dir=/tmp/runs trainer.overwrite=true 2>&1 | tee "$OUT/train_scale.log" || rc=1
  cp /tmp/runs/qwen2.5-0.5b-grpo-gsm8k/metrics.jsonl "$OUT/scale_metrics.jsonl" 2>/dev/null
fi
exit $rc
