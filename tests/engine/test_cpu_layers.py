"""On CPU the engine's norms, SwiGLU and rotations run the one-pass C++ kernels (engine/cpu_layers.py),
and the rotation angles they share are computed once per forward pass and never go stale. That the
results are right is tested where the engine meets the plain decoder and a plain-PyTorch optimizer step
(test_megatron_engine.py), which therefore test these kernels."""
from collections import Counter

import pytest
import torch

from hybridflow.config.schema import OptimConfig, ParallelConfig
from hybridflow.engine import MegatronEngine, cpu_layers
from hybridflow.kernels import cpu_extension
from tests.engine.conftest import grouped_rl_batch, rl_batch, tiny_model

pytestmark = pytest.mark.usefixtures("megatron_world")
KERNELS = ("rms_norm_forward", "rms_norm_backward", "swiglu_forward", "swiglu_backward", "rotary")


def test_a_cpu_training_step_runs_every_norm_swiglu_and_rotation_in_the_kernels(monkeypatch):
    ext, calls = cpu_extension(), Counter()
    for name in KERNELS:
        def counted(*args, _fn=getattr(ext, name), _name=name, **kwargs):
            calls[_name] += 1
            return _fn(*args, **kwargs)
        monkeypatch.setattr(ext, name, counted)
    angles = cpu_layers._AnglesCache()
    monkeypatch.setattr(cpu_layers, "_angles", angles)
    cfg, _, hf = tiny_model()
    engine = MegatronEngine(cfg, ParallelConfig(), OptimConfig(lr=1e-3))
    engine.load_hf_state_dict(hf)
    batch = rl_batch(cfg.vocab_size)
    engine.run([batch], lambda out, mb: (out.float().pow(2).mean(), {}))
    layers = cfg.num_layers
    assert dict(calls) == {"rms_norm_forward": 2 * layers + 1, "rms_norm_backward": 2 * layers + 1,
                           "swiglu_forward": layers, "swiglu_backward": layers,
                           "rotary": 4 * layers}  # q and k, forward and backward
    assert angles.computed == 1
    assert all(p.grad is not None or getattr(p, "main_grad", None) is not None
               for p in engine.module.parameters())


def test_the_kernels_give_megatron_cores_own_logits_and_gradients():
    """The same engine with `layer_kernels=False` runs megatron-core's unfused ops: logits and every
    parameter's gradient agree, on shared-prompt rows (per-row rotation angles) and on plain rows."""
    cfg, _, hf = tiny_model()
    results = []
    for layer_kernels in (True, False):
        engine = MegatronEngine(cfg, ParallelConfig(), OptimConfig(lr=1e-3), layer_kernels=layer_kernels)
        engine.load_hf_state_dict(hf)
        logits = []
        for shared in (False, True):
            batch = grouped_rl_batch(cfg.vocab_size) if shared else rl_batch(cfg.vocab_size)
            reports = engine.run([batch], lambda out, mb: (out.float().pow(2).mean(), {"logits": out.detach()}),
                                 share_prompts=shared)
            logits.append(reports[0]["logits"])
        results.append(({name: p.main_grad.clone() for name, p in engine.module.named_parameters()}, logits))
    (grads, logits), (plain_grads, plain_logits) = results
    for got, want in zip(logits, plain_logits):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert grads.keys() == plain_grads.keys()
    for name in grads:
        torch.testing.assert_close(grads[name], plain_grads[name], rtol=1e-4, atol=1e-6, msg=name)


def test_rotation_angles_are_recomputed_when_the_frequencies_change():
    cache = cpu_layers._AnglesCache()
    freqs = torch.rand(5, 1, 1, 8)
    cos, sin = cache(freqs)
    assert cache(freqs)[0] is cos and cache.computed == 1  # the other layers' calls reuse them
    freqs.mul_(2.0)  # in place: the same tensor object, a new version
    torch.testing.assert_close(cache(freqs)[0], freqs[:, :, 0].cos())
    other = freqs + 1.0  # a new tensor
    torch.testing.assert_close(cache(other)[1], other[:, :, 0].sin())
    assert cache.computed == 3


def test_sequence_parallelism_without_the_layer_kernels_is_refused_by_name():
    """megatron-core's own norm (no apex) asserts `not sequence_parallel` while the model is built; the engine
    says which setting to change instead."""
    from hybridflow.engine.build import transformer_config

    cfg, _, _ = tiny_model()
    with pytest.raises(NotImplementedError, match=r"model.cpu_layer_kernels: true"):
        transformer_config(cfg, ParallelConfig(tp=2, sequence_parallel=True), torch.float32, "cpu",
                           layer_kernels=False)
