"""The FSDP2 engine on a GPU (pytest -m gpu; skipped without a CUDA device): NCCL, CPU offload, bfloat16
mixed precision, the `transformers` model code and the gathered generator (issue 42, item 1's GPU half).

Its process joins an NCCL world of one, so it runs alone (tools/gpu_check.sh's `fsdp` step), not in the
pytest process of the other GPU tests, which hold a gloo world. The FSDP engine imports no megatron-core,
so the GPU machine's bare Python runs it. A GPU's kernels (cuBLAS, SDPA) are not the CPU's, and an
offloaded Adam steps on the CPU: figures are compared within tolerances that say why, never `==`.
"""
import pytest
import torch

from hybridflow.data import fields as F
from hybridflow.data.batch import rows_for_plan
from tests.engine.conftest import assert_one_adam_step_close, dp_case

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def nccl_world():
    import torch.distributed as dist

    from hybridflow.parallel.process_group import init_process_group

    init_process_group("cuda")
    assert dist.get_backend() == "nccl", "run this file alone: its process must join an NCCL world"


def _update(engine, actor_cfg, batch):
    from hybridflow.roles import Actor

    actor = Actor(actor_cfg, engine)
    rows, steps = rows_for_plan(batch, actor.plan(len(batch[F.INPUT_IDS]), step=0, replicas=1)[0])
    return actor.update_share(rows, steps)


def _close(got: dict, want: dict, rel: float) -> None:
    assert sorted(got) == sorted(want)
    for key, value in want.items():
        assert got[key] == pytest.approx(value, rel=rel, abs=1e-6), key


def test_an_update_with_cpu_offload_equals_one_without(nccl_world):
    """offload=True keeps parameters, gradients and Adam's state in CPU memory between uses (FSDP's
    CPUOffloadPolicy): the same update as on the GPU, within rel 1e-5 (Adam steps on the CPU there, on the
    GPU here: the same formula in another device's arithmetic); weights within 5% of the lr."""
    from hybridflow.engine.fsdp import FSDPEngine

    cfg, hf, batch, optim, actor_cfg = dp_case()
    engines = {}
    for offload in (False, True):
        engine = FSDPEngine(cfg, optim, device="cuda", offload=offload, total_steps=10)
        engine.load_hf_state_dict(hf)
        engines[offload] = (engine, _update(engine, actor_cfg, batch))
    (plain, want), (offloaded, got) = engines[False], engines[True]
    _close(got, want, rel=1e-5)
    assert {p.to_local().device.type for p in offloaded.module.parameters()} == {"cpu"}
    assert {p.to_local().device.type for p in plain.module.parameters()} == {"cuda"}
    assert_one_adam_step_close(offloaded.hf_state_dict(), plain.hf_state_dict(), hf, optim.lr)


def test_bfloat16_mixed_precision_on_the_gpu(nccl_world):
    """Compute in bfloat16 over float32 parameters and Adam state: the float32 update's figures to
    bfloat16's precision (8 mantissa bits: ~0.4% a rounding, a few % through the model and the loss)."""
    from hybridflow.engine.fsdp import FSDPEngine

    cfg, hf, batch, optim, actor_cfg = dp_case()
    metrics = {}
    for dtype in ("float32", "bfloat16"):
        engine = FSDPEngine(cfg, optim, device="cuda", dtype=dtype, total_steps=10)
        engine.load_hf_state_dict(hf)
        metrics[dtype] = _update(engine, actor_cfg, batch)
        assert {p.dtype for p in engine.module.parameters()} == {torch.float32}
    _close(metrics["bfloat16"], metrics["float32"], rel=0.1)


def test_the_transformers_model_code_on_the_gpu(nccl_world, tmp_path):
    """LlamaForCausalLM under FSDP on the GPU updates as hybridflow's decoder there: rel 1e-4 (the GPU's SDPA
    may pick another kernel for a 4-D mask than for its own causal one)."""
    from hybridflow.engine.fsdp import FSDPEngine
    from hybridflow.engine.fsdp_hf import TransformersFSDPEngine
    from hybridflow.models.checkpoint import save_hf_checkpoint

    cfg, hf, batch, optim, actor_cfg = dp_case()
    save_hf_checkpoint(hf, cfg.to_hf_dict(), tmp_path / "hf")
    ours = FSDPEngine(cfg, optim, device="cuda", total_steps=10)
    ours.load_hf_checkpoint(tmp_path / "hf")
    theirs = TransformersFSDPEngine(tmp_path / "hf", cfg, optim, device="cuda", total_steps=10)
    theirs.load_hf_checkpoint(tmp_path / "hf")
    _close(_update(theirs, actor_cfg, batch), _update(ours, actor_cfg, batch), rel=1e-4)


def test_the_gathered_generator_samples_on_the_gpu_as_on_the_cpu(nccl_world, tmp_path):
    """A GPT-2 (a model only transformers builds) under FSDP on the GPU: its generator, gathered from the
    shards, samples the CPU model's tokens (keyed sampling; log-probs within 1e-4)."""
    import transformers

    from hybridflow.engine.fsdp_hf import TransformersFSDPEngine
    from hybridflow.hybrid_engine.fsdp_gather import FSDPGatheredWeights
    from hybridflow.models.config import DecoderConfig
    from hybridflow.rollout.hf_generate import HFGenerator
    from hybridflow.rollout.sampling import SamplingParams
    from tests.rollout.conftest import left_padded_prompts

    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=101, n_positions=128,
                                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, initializer_range=0.3)
    transformers.GPT2LMHeadModel(config).save_pretrained(tmp_path / "gpt2")
    cpu_model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "gpt2").eval()
    engine = TransformersFSDPEngine(tmp_path / "gpt2", DecoderConfig.from_pretrained(tmp_path / "gpt2", True),
                                    device="cuda")
    engine.load_hf_checkpoint(tmp_path / "gpt2")
    generation = FSDPGatheredWeights(engine)
    ids, mask = left_padded_prompts(101)
    params = SamplingParams(max_new_tokens=8, n=2, temperature=1.0)
    keys = torch.tensor([1, 2, 3, 4])
    on_gpu = HFGenerator(generation.model, 0).generate(ids, mask, params, row_keys=keys)
    on_cpu = HFGenerator(cpu_model, 0).generate(ids, mask, params, row_keys=keys)
    assert on_gpu.responses.device.type == "cpu"  # answered where the prompts came from
    assert torch.equal(on_gpu.responses, on_cpu.responses)
    torch.testing.assert_close(on_gpu.log_probs, on_cpu.log_probs, atol=1e-4, rtol=0)
