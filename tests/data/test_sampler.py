"""PromptSampler: the fixed order by default; with skip_uniform_passes, prompts whose group had no
signal skip their next passes, and the state a checkpoint saves continues the walk exactly."""
from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch

from hybridflow.data.dataset import iterate_batches
from hybridflow.data.sampler import PromptSampler

# Records need only their source index; 100 + i tells it apart from the position i.
DATA = [SimpleNamespace(index=100 + i) for i in range(20)]


def indices(records):
    return [r.index for r in records]


def scored(records, uniform_indices, n=2):
    """The prompt index of each of n rows per prompt, as in the trainer's batch, and the rows' flags."""
    rows = [r.index for r in records for _ in range(n)]
    return rows, torch.tensor([i in uniform_indices for i in rows])


def test_without_skipping_the_order_is_the_epochs_batches():
    sampler = PromptSampler(DATA, 6, True, 3)
    want = [indices(b) for epoch in range(3) for b in iterate_batches(DATA, 6, True, 3, epoch)]
    assert [indices(sampler.batch(step)) for step in range(1, 10)] == want
    assert indices(sampler.batch(2)) == want[1]  # any step, in any order: a function of the step
    assert sampler.state_dict() == {} and sampler.metrics() == {}


def test_a_uniform_prompt_skips_its_next_pass_and_returns_on_the_one_after():
    sampler = PromptSampler(DATA, 5, True, 0, skip_uniform_passes=1)
    seen = []
    for step in range(1, 5):  # the first epoch: nothing skipped yet, every prompt once
        batch = sampler.batch(step)
        seen += indices(batch)
        assert sampler.metrics()["data/skipped_fraction"] == 0.0
        uniform = set(indices(batch)[:2])  # two prompts of each batch had no signal
        sampler.observe(*scored(batch, uniform))
    assert sorted(seen) == [r.index for r in DATA]
    flat = {i for k, i in enumerate(seen) if k % 5 < 2}
    second, passed_over = [], 0
    for step in range(5, 8):  # 12 prompts left in epoch 2: 3 batches of 5 reach into epoch 3
        batch = sampler.batch(step)
        assert len(batch) == 5
        second += indices(batch)
        passed_over += sampler.skipped
        sampler.observe(*scored(batch, set()))
    epoch2, epoch3 = second[:12], second[12:]
    assert sorted(epoch2) == sorted({r.index for r in DATA} - flat)
    assert len(epoch3) == 3 and sampler.epoch == 2
    # The 8 uniform prompts were passed over once each, and epoch 3 skips none of them.
    assert passed_over == 8 and sampler.skips.sum() == 0


def test_skipped_fraction_counts_the_prompts_passed_over():
    sampler = PromptSampler(DATA, 10, False, 0, skip_uniform_passes=2)
    for step in (1, 2):
        batch = sampler.batch(step)
        sampler.observe(*scored(batch, set(indices(batch))))  # every group uniform
    # Every prompt skips its next two passes: step 3 walks 40 prompts past before it takes 10.
    assert indices(sampler.batch(3)) == [r.index for r in DATA[:10]]
    assert sampler.metrics()["data/skipped_fraction"] == pytest.approx(40 / 50)
    assert sampler.epoch == 3


def test_a_prompt_with_signal_again_is_not_skipped():
    sampler = PromptSampler(DATA, 10, False, 0, skip_uniform_passes=3)
    sampler.observe(*scored(sampler.batch(1), {100}))
    sampler.observe(*scored(sampler.batch(2), set()))
    assert sampler.skips[0] == 3
    sampler.skips[0] = 0
    sampler.observe([100, 100], torch.tensor([False, False]))
    assert sampler.skips[0] == 0


def test_saved_state_continues_the_walk_exactly():
    def run(sampler, steps):
        out = []
        for step in steps:
            batch = sampler.batch(step)
            out.append(indices(batch))
            sampler.observe(*scored(batch, {i for i in indices(batch) if i % 3 == 0}))
        return out

    whole = PromptSampler(DATA, 6, True, 1, skip_uniform_passes=2)
    want = run(whole, range(1, 13))
    first = PromptSampler(DATA, 6, True, 1, skip_uniform_passes=2)
    run(first, range(1, 6))
    state = json.loads(json.dumps(first.state_dict()))  # as trainer.json holds it
    assert state["step"] == 5 and state["skips"]
    resumed = PromptSampler(DATA, 6, True, 1, skip_uniform_passes=2)
    resumed.load_state_dict(state)
    assert run(resumed, range(6, 13)) == want[5:]


def test_steps_must_follow_on_and_a_foreign_state_is_refused():
    sampler = PromptSampler(DATA, 5, True, 0, skip_uniform_passes=1)
    sampler.batch(1)
    with pytest.raises(ValueError, match="stands after step 1 and cannot draw step 3"):
        sampler.batch(3)
    before = sampler.state_dict()
    with pytest.raises(KeyError, match="prompt index 7 is not among the training prompts"):
        sampler.load_state_dict({"step": 4, "epoch": 0, "at": 0, "skips": {"7": 1}})
    with pytest.raises(ValueError, match="outside 20 prompts"):
        sampler.load_state_dict({"step": 4, "epoch": 0, "at": 21, "skips": {}})
    assert sampler.state_dict() == before  # a refused state changes nothing


def test_start_after_takes_the_fixed_orders_place():
    fixed = PromptSampler(DATA, 5, True, 0)
    sampler = PromptSampler(DATA, 5, True, 0, skip_uniform_passes=1)
    sampler.start_after(5)  # epoch 1, after its first batch
    assert indices(sampler.batch(6)) == indices(fixed.batch(6))


def test_negative_passes_are_refused():
    with pytest.raises(ValueError, match="skip_uniform_passes must be >= 0"):
        PromptSampler(DATA, 5, True, 0, skip_uniform_passes=-1)
