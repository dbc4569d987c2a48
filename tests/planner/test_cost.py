"""The cost model's functions against hand-computed figures and the real models' own counts."""
import pytest
import torch
import yaml

from hybridflow.errors import ConfigError
from hybridflow.models.bridge import get_bridge
from hybridflow.models.config import DecoderConfig
from hybridflow.models.decoder import Decoder
from hybridflow.parallel.layout import ParallelDims
from hybridflow.planner import cost
from hybridflow.planner.devices import GIB, get_device, load_devices, parse_device
from hybridflow.planner.dryrun import dry_run, meta_decoder, stage_numel
from hybridflow.planner.cli import MODELS_FILE

KNOWN = yaml.safe_load(MODELS_FILE.read_text())
QWEN7B = DecoderConfig.from_hf_dict(KNOWN["Qwen2.5-7B-Instruct"])
LLAMA70B = DecoderConfig.from_hf_dict(KNOWN["Meta-Llama-3-70B-Instruct"])


def test_parameter_counts_equal_the_real_models():
    """A small model with real weights, and the 7B and 70B shapes on the meta device, per TP rank and stage."""
    small = DecoderConfig.from_hf_dict({**KNOWN["Qwen2.5-7B-Instruct"], "vocab_size": 256, "hidden_size": 64,
                                        "intermediate_size": 96, "num_hidden_layers": 4, "num_attention_heads": 4,
                                        "num_key_value_heads": 2})
    assert cost.total_params(small, divisible_by=128) == sum(p.numel() for p in Decoder(small).parameters())
    assert cost.total_params(QWEN7B) == sum(p.numel() for p in meta_decoder(QWEN7B).parameters()) == 7_615_616_512
    shapes = get_bridge(QWEN7B).megatron_shapes().values()
    assert cost.total_params(QWEN7B) == sum(torch.Size(s).numel() for s in shapes)
    for cfg, tp, pp in ((QWEN7B, 4, 2), (LLAMA70B, 8, 4), (small, 2, 4)):
        model = meta_decoder(cfg, tp)
        for stage in range(pp):
            assert cost.stage_params(cfg, stage, tp, pp) == stage_numel(model, stage, pp), (cfg.hidden_size, stage)
    # Qwen3 (QK-norm) and Qwen3-MoE: memory from all parameters, FLOPs from the active ones. Qwen's published
    # figures: 8.2B; 30.5B in all with 3.3B activated (the matrix products plus the embedding row looked up).
    for name, total in (("Qwen3-8B", 8_190_735_360), ("Qwen3-30B-A3B", 30_532_122_624)):
        cfg = DecoderConfig.from_hf_dict(KNOWN[name])
        assert cost.total_params(cfg) == sum(p.numel() for p in meta_decoder(cfg).parameters()) == total
        model = meta_decoder(cfg, 4)
        for stage in range(4):
            assert cost.stage_params(cfg, stage, 4, 4) == stage_numel(model, stage, 4), (name, stage)
    moe = DecoderConfig.from_hf_dict(KNOWN["Qwen3-30B-A3B"])
    assert 3.3e9 < cost.matmul_params(moe) + moe.vocab_size * moe.hidden_size < 3.4e9
    # The critic's value head is one replicated row instead of the vocabulary.
    h = QWEN7B.hidden_size
    assert cost.total_params(QWEN7B, value_head=True) == cost.total_params(QWEN7B) - 152064 * h + h


def test_optimizer_gradient_and_kv_cache_bytes_are_the_hand_computed_ones():
    assert cost.optimizer_bytes(1000, dtype_bytes=2) == 12_000  # fp32 master + two Adam moments
    assert cost.optimizer_bytes(1000, dtype_bytes=4) == 8_000  # fp32 weights are their own master
    assert cost.optimizer_bytes(1000, dtype_bytes=2, dp=4) == 3_000
    assert cost.optimizer_bytes(1000, dtype_bytes=2, dp=4, distributed=False) == 12_000
    assert cost.grad_bytes(1000) == 4000  # the engine's fp32 gradient buffer
    # 2 * layers * kv_heads * head_dim * tokens * bytes: Qwen2.5-7B, 1024 tokens in bf16 = 56 MiB.
    assert cost.kv_cache_bytes(QWEN7B, 1024, 2) == 2 * 28 * 4 * 128 * 1024 * 2 == 58_720_256
    assert cost.kv_cache_bytes(QWEN7B, 1024, 2, tg=2) == 58_720_256 // 2


def test_activations_follow_the_layer_and_shrink_with_recompute_and_tp():
    per_token = cost.activation_bytes_per_token(QWEN7B, seq=1024, tp=1, dtype_bytes=2)
    h, ffn = 3584, 18944
    assert per_token == (4 * h + (4608 + 3584) + 3 * ffn + 28 * 1024) * 2
    assert cost.activation_bytes_per_token(QWEN7B, 1024, 1, 2, recompute=True) == h * 2
    assert cost.activation_bytes_per_token(QWEN7B, 1024, 4, 2) < per_token
    full = cost.activation_bytes(QWEN7B, ParallelDims(1, 1, 1), 4, 1024, 8, 2, logits=False)
    assert cost.activation_bytes(QWEN7B, ParallelDims(1, 1, 1), 4, 1024, 8, 2, recompute=True, logits=False) < full / 10
    # 1F1B keeps p micro-batches of L/p layers in flight: the first stage holds about as much as p = 1.
    assert cost.activation_bytes(QWEN7B, ParallelDims(1, 4, 1), 4, 1024, 8, 2, logits=False) == pytest.approx(full, rel=0.01)


def test_time_and_collectives_are_flops_and_bytes_over_the_peaks():
    a100 = get_device("a100")
    gemm, attention = cost.forward_flops(QWEN7B, tokens=1000, ctx=0)
    assert attention == 0 and gemm == 2 * cost.matmul_params(QWEN7B) * 1000
    assert cost.compute_time(gemm, 0, 2, a100) == pytest.approx(gemm / (2 * 312e12 * 0.45))
    ring = cost.allreduce_time(1e9, 4, 4, a100)
    assert ring == pytest.approx(2 * 3 / 4 * 1e9 / (300e9 * 0.75) + 6 * 15e-6)
    assert cost.allreduce_time(1e9, 4, 16, a100) > 10 * ring  # a group across nodes rides the NICs
    assert cost.allreduce_time(1e9, 1, 1, a100) == 0
    m = 1e9
    assert cost.transition_bytes(m, tp=4, pp=1, tg=2) == (4 - 2) / (2 * 4) * m


def test_transition_bytes_of_the_real_reshard_plan_match_the_formula():
    run = dry_run(QWEN7B, ParallelDims(tp=4, pp=2, dp=1), tg=2, dtype_bytes=2)
    assert run.exact_params == run.model_params
    assert run.exact_transition == pytest.approx(run.model_transition, rel=0.01)  # norms are not split
    assert run.plan_ranks == 8


def test_device_specs_load_and_a_bad_entry_names_its_key(tmp_path):
    devices = load_devices()
    assert {"a100", "h100", "h200", "cpu"} <= set(devices)
    assert devices["h200"].memory_bytes == 139 * GIB and devices["a100"].peak_flops == 312e12
    entry = yaml.safe_load((MODELS_FILE.parent / "devices.yaml").read_text())["a100"]
    with pytest.raises(ConfigError, match=r"a100.memory_gbps: must be a positive number"):
        parse_device("a100", {**entry, "memory_gbps": "fast"})
    with pytest.raises(ConfigError, match=r"a100.efficiency.gemm: is a fraction"):
        parse_device("a100", {**entry, "efficiency": {**entry["efficiency"], "gemm": 45}})
    with pytest.raises(ConfigError, match=r"a100.peak_tflop: unknown key \(did you mean 'peak_tflops'"):
        parse_device("a100", {**entry, "peak_tflop": 1})
    with pytest.raises(ConfigError, match=r"--device: unknown device 'h10'.*did you mean 'h100'"):
        get_device("h10")


def test_context_parallelism_divides_a_ranks_tokens_and_adds_the_gathered_keys_and_values():
    """At cp = 2 a rank keeps the layers' activations of S/2 tokens (each token's probabilities still span
    all S keys) plus each layer's all-gathered K and V of the whole sequence; the logits are of the whole
    sequence (the output is gathered before the loss). Hand-computed for Qwen2.5-7B at S = 8192."""
    seq, micro, layers = 8192, 1, 28
    one = cost.activation_bytes(QWEN7B, ParallelDims(tp=1, pp=1, dp=2), micro, seq, 4, 2, logits=False)
    two = cost.activation_bytes(QWEN7B, ParallelDims(tp=1, pp=1, dp=1, cp=2), micro, seq, 4, 2, logits=False)
    per_token = cost.activation_bytes_per_token(QWEN7B, seq, 1, 2)
    kv = 2 * 4 * 128 * seq * 2  # K and V: 4 KV heads x 128, bf16, the whole sequence
    assert cost.cp_kv_bytes(QWEN7B, micro, seq, 1, 2, 2) == kv and cost.cp_kv_bytes(QWEN7B, micro, seq, 1, 1, 2) == 0
    value = seq * 4  # logits=False: the critic's one fp32 value per token
    assert one == layers * seq * per_token + value
    assert two == layers * (seq // 2 * per_token + kv) + value
    assert 0.5 < two / one < 0.51  # the gathered K and V are small beside the probabilities at this length
    vocab = 152064 * 4 * seq  # fp32 logits of every token, on every CP rank
    assert cost.activation_bytes(QWEN7B, ParallelDims(tp=1, pp=1, dp=1, cp=2), micro, seq, 4, 2) == two - value + vocab
    # The exchange: per layer and micro-batch, an all-gather of K and V (each rank receives the other
    # half) and, training, the reduce-scatter of their gradients.
    h100 = get_device("h100")
    layout = ParallelDims(tp=1, pp=1, dp=4, cp=2)
    gather = cost.gather_time(kv / 2, 2, layout.span("cp"), h100)
    assert cost.cp_time(QWEN7B, layout, micro, seq, 2, h100) == pytest.approx(2 * gather)
    assert cost.cp_time(QWEN7B, layout, micro, seq, 2, h100, backward=False) == pytest.approx(gather)
    assert cost.cp_time(QWEN7B, ParallelDims(tp=1, pp=1, dp=8), micro, seq, 2, h100) == 0


def test_the_interleaved_pipeline_shrinks_the_bubble_and_holds_more_chunks_in_flight():
    """virtual_pp = v: the bubble (p - 1) / v, the micro-batches padded to a multiple of p with full-size
    empty ones (megatron-core's interleaved schedule; the engine pads), and rank 0's warm-up of 2(p - 1) + (v - 1)p chunk-micro-batches,
    each 1/v of its layers, against 1F1B's min(p, m) micro-batches."""
    assert cost.pipeline_factor(4, 8) == (8 + 3) / 8
    assert cost.pipeline_factor(4, 8, 2) == (8 + 1.5) / 8
    assert cost.pipeline_factor(2, 3, 2) == (4 + 0.5) / 3  # 3 micro-batches run as 4 (one full-size empty)
    assert cost.pipeline_factor(2, 1, 2) == 2.5 > cost.pipeline_factor(2, 1)  # one micro-batch: 1F1B is faster
    assert cost.chunks_in_flight(2, 8) == 2 and cost.chunks_in_flight(2, 1) == 1
    assert cost.chunks_in_flight(2, 8, 2) == (2 + 2 + 1) / 2
    assert cost.chunks_in_flight(4, 8, 2) == (6 + 4 + 1) / 2
    assert cost.chunks_in_flight(2, 1, 4) == min(2 * 4, 2 + 6 + 1) / 4  # every chunk of both micro-batches
    layout = ParallelDims(tp=1, pp=2, dp=1)
    one, two = (cost.activation_bytes(QWEN7B, layout, 1, 1024, 8, 2, vpp=v) for v in (1, 2))
    assert two > one
