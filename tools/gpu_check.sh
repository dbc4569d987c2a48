#!/usr/bin/env bash
# The prepared GPU checks, in one call on a bare, offline GPU machine, in this order:
#   pytest    pytest -m gpu: the CUDA kernels against the eager reference, the CUDA generation and training
#             paths against the CPU ones (tests/trainer/test_on_cuda.py), and the static decode path's CUDA
#             graph and reduce-overhead replays against the eager loop (tests/rollout/test_static_decode.py);
#   fsdp      pytest -m gpu tests/engine/test_fsdp_cuda.py, alone (an NCCL world of one): the FSDP engine's
#             CPU offload, bfloat16 mixed precision, the transformers model code and the gathered generator
#             on the GPU (issue 42; none of it has run on a GPU yet);
#   step      benchmarks/gpu_suite.py --only step: the Qwen2.5-0.5B-shaped GRPO step (24 layers, bf16,
#             32 prompts x 8 x 256 tokens, 3 steps) stage by stage, generated tokens/s, the decode step
#             against its HBM roofline, the update's MFU (issue 30);
#   generate  its generate section: the eager loop against the static decode path replayed as a CUDA graph
#             and as torch.compile(mode="reduce-overhead"), 256 rows x 256 tokens, tokens/s, capture time,
#             peak memory, the decode step against the HBM roofline;
#   train     the demo's GRPO run on CUDA for 20 steps (megatron-core from .whl, local launcher); its
#             held-out accuracy is comparable with the CPU's 20-step figure (28.7% -> 44.0%);
#   suite     benchmarks/gpu_suite.py's kernel sections: speed, memory and bandwidth side by side;
#   reshard   its reshard section: `hybridflow reshard` on a Qwen2.5-0.5B-shaped model, time and peak
#             memory against its dry run and a whole-model load + save (host work).
#   make gpu-prep   (here, first: megatron-core's wheel into .whl; GSM8K ships in hybridflow/assets/gsm8k)
#   tools/gpu_check.sh [STEP,STEP,...]   (there, with carry [".whl"]; default: all, in the order above)
# The whole call keeps to BUDGET seconds (default 470, under 8 minutes): each step's timeout is its cap or
# what is left of the budget, whichever is less, and a step with under 30 s left is skipped, saying so
# (the skipped ones are in $OUT/skipped.txt). Logs go to $OUT.
set -o pipefail
OUT=${OUT:-/tmp/gpu_check}; mkdir -p "$OUT"
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1
steps=${1:-pytest,fsdp,step,generate,train,suite,reshard}
BUDGET=${BUDGET:-470}
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl || exit 1
fi
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm,driver_version --format=csv | tee "$OUT/gpu.txt"
python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)" | tee -a "$OUT/gpu.txt"
rc=0
step() {  # NAME CAP LOG COMMAND...: run COMMAND when NAME was asked for, within the budget
  local name=$1 cap=$2 log=$3 left
  shift 3
  [[ ",$steps," == *",$name,"* ]] || return 0
  left=$((BUDGET - SECONDS))
  if ((left < 30)); then
    echo "[$name] skipped: ${left} s of the ${BUDGET} s budget left" | tee -a "$OUT/skipped.txt"
    return 0
  fi
  ((cap > left)) && cap=$left
  echo "[$name] up to ${cap} s"
  timeout "$cap" "$@" 2>&1 | tee "$OUT/$log" || rc=1
}
step pytest 200 pytest_gpu.log python3 -m pytest -m gpu tests/kernels tests/trainer/test_on_cuda.py \
  tests/rollout/test_static_decode.py -q -p no:cacheprovider -rs
# the FSDP engine on the GPU (NCCL, CPU offload, bf16, transformers models): alone, it joins an NCCL world
step fsdp 90 fsdp_cuda.log python3 -m pytest -m gpu tests/engine/test_fsdp_cuda.py -q -p no:cacheprovider -rs
step step 170 gpu_step.log python3 benchmarks/gpu_suite.py --only step
step generate 200 gpu_suite_generate.log python3 benchmarks/gpu_suite.py --only generate
step train 120 train_cuda.log python3 -m hybridflow.cli train configs/demo.yaml trainer.device=cuda \
  trainer.total_steps=20 trainer.val_every=10 trainer.save_every=0 trainer.output_dir=/tmp/runs trainer.overwrite=true
step suite 200 gpu_suite.log python3 benchmarks/gpu_suite.py --only logprob,bandwidth,gae
step reshard 240 gpu_suite_reshard.log python3 benchmarks/gpu_suite.py --only reshard
exit $rc
