"""Token choice per step: greedy, temperature, top-k, top-p, and the log-probs returned."""
import math

import pytest
import torch

from hybridflow.rollout import SamplingParams, sample, truncate


def test_top_k_keeps_the_k_largest():
    logits = torch.tensor([[0.1, 3.0, -1.0, 2.0, 0.5]])
    kept = truncate(logits, top_k=2, top_p=1.0).isfinite()
    assert kept.tolist() == [[False, True, False, True, False]]
    assert truncate(logits, top_k=-1, top_p=1.0).isfinite().all()


@pytest.mark.parametrize("top_p, kept", [(0.75, 2), (0.85, 3), (0.01, 1), (1.0, 4)])
def test_top_p_keeps_the_smallest_nucleus(top_p, kept):
    probs = torch.tensor([0.05, 0.5, 0.15, 0.3])
    out = truncate(probs.log()[None], top_k=-1, top_p=top_p)
    assert out.isfinite().sum().item() == kept
    assert out[0, 1].isfinite()  # the most likely token is always kept
    assert torch.equal(out.isfinite()[0], probs >= probs.sort(descending=True).values[kept - 1])


def test_greedy_takes_the_argmax_with_untempered_log_probs():
    logits = torch.randn(6, 50, generator=torch.Generator().manual_seed(0)) * 3
    for params in (SamplingParams(4, do_sample=False), SamplingParams(4, temperature=0.0)):
        tokens, log_probs = sample(logits, params)
        assert torch.equal(tokens, logits.argmax(-1))
        torch.testing.assert_close(log_probs, logits.log_softmax(-1).gather(-1, tokens[:, None])[:, 0])


def test_sampling_follows_the_tempered_truncated_distribution():
    """Frequencies follow softmax(logits / T) restricted to the top-k; log-probs are before truncation."""
    logits = torch.tensor([2.0, 1.0, 0.0, -1.0]).log_softmax(-1).repeat(20000, 1)
    params = SamplingParams(4, temperature=0.5, top_k=3)
    tokens, log_probs = sample(logits, params, torch.Generator().manual_seed(0))
    tempered = (logits[0] / 0.5).softmax(-1)
    expected = torch.cat([tempered[:3] / tempered[:3].sum(), torch.zeros(1)])
    freq = torch.bincount(tokens, minlength=4).float() / len(tokens)
    torch.testing.assert_close(freq, expected, atol=0.01, rtol=0)
    torch.testing.assert_close(log_probs, tempered.log()[tokens])


@pytest.mark.parametrize("kwargs, message", [
    (dict(max_new_tokens=0), "max_new_tokens"), (dict(n=0), "n must be"),
    (dict(temperature=-1.0), "temperature"), (dict(top_p=0.0), "top_p"), (dict(top_k=0), "top_k"),
])
def test_invalid_parameters_are_rejected(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**{"max_new_tokens": 4, **kwargs})


def test_sample_accepts_low_precision_logits():
    logits = torch.randn(3, 10).to(torch.bfloat16)
    tokens, log_probs = sample(logits, SamplingParams(2), torch.Generator().manual_seed(0))
    assert log_probs.dtype == torch.float32 and (log_probs <= 0).all() and not math.isnan(log_probs.sum())


def test_counter_uniform_is_uniform_and_a_function_of_key_and_column():
    from hybridflow.rollout.sampling import counter_uniform
    keys = torch.arange(2000)
    u = counter_uniform(keys, 50)
    assert u.min() > 0 and u.max() < 1
    assert abs(u.mean().item() - 0.5) < 0.005 and abs(u.var().item() - 1 / 12) < 0.002
    assert torch.equal(counter_uniform(keys[5:7], 50), u[5:7])  # independent of the other rows
    assert (u[:, 1:] != u[:, :-1]).all()


def test_keyed_sampling_follows_the_softmax():
    from hybridflow.rollout.sampling import SamplingParams, sample
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]]).repeat(20000, 1)
    tokens, _ = sample(logits, SamplingParams(max_new_tokens=1, temperature=1.0), keys=torch.arange(20000))
    freq = torch.bincount(tokens, minlength=4).float() / 20000
    torch.testing.assert_close(freq, logits[0].softmax(-1), atol=0.01, rtol=0)
