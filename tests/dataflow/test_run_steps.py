"""DataFlow.run_steps: the trainer's off-policy modes on the DataFlow API, with the shipped demo model.

The flow's model (the rollout) is apart from the trained one: `publish` snapshots the trained weights,
`load` puts a snapshot into the rollout. Each update changes the trained weights by an amount that
depends on the step's rewards, so a result generated from the wrong version changes every later step.
"""
import pytest
import torch

from hybridflow import DataFlow, Node
from hybridflow.rewards.registry import get_reward_fn
from tests.dataflow.conftest import DEMO

PROMPTS = [f"{a:03d}+{b:03d}=" for a, b in [(42, 917), (123, 456), (5, 5), (250, 250), (999, 1), (314, 159)]]
STEPS = 4


def _truth(prompt: str) -> str:
    a, b = prompt.rstrip("=").split("+")
    return f"{int(a) + int(b):0{len(a) + 1}d}"


@pytest.fixture
def setup():
    """(flow, trained model, rollout model, update) with fresh weights for each test."""
    from hybridflow.utils import load_hf_model

    rollout_lm, trained = load_hf_model(DEMO), load_hf_model(DEMO)
    rule = get_reward_fn("arithmetic")
    rollout = Node(name="rollout", model=rollout_lm, forward_fn=lambda model, prompts: model.generate(
        prompts, max_new_tokens=6, temperature=1.0, seed=7))
    reward = Node(name="reward", model=rule,
                  forward_fn=lambda fn, batch: [fn("arithmetic", r, _truth(p)) for p, r in batch])
    flow = DataFlow(nodes=[rollout, reward], edges=[(rollout, reward)])

    def update(result, step):
        with torch.no_grad():  # a stand-in for an optimizer step: a change that depends on the results
            scale = 1.0 + 0.05 * (1 + sum(result.final))
            for p in trained.model.parameters():
                p.mul_(scale) if p.dim() > 1 else None
        return scale

    return flow, trained, rollout_lm, update


def _snapshot(lm):
    return {k: v.clone() for k, v in lm.model.state_dict().items()}


def _responses(results):
    return [[r for _, r in s.flow.outputs["rollout"]] for s in results]


def test_async_without_staleness_is_sync_and_one_step_is_the_delayed_push(setup):
    flow, trained, rollout_lm, update = setup
    start = _snapshot(trained)
    batches = [PROMPTS] * STEPS

    def publish():
        return _snapshot(trained)

    def load(weights):
        rollout_lm.model.load_state_dict(weights)

    def reset():
        trained.model.load_state_dict(start)
        rollout_lm.model.load_state_dict(start)

    sync = flow.run_steps(batches, update, publish=publish, load=load)
    reset()
    k0 = flow.run_steps(batches, update, publish=publish, load=load, off_policy="async", max_staleness=0)
    assert _responses(k0) == _responses(sync) and [s.update for s in k0] == [s.update for s in sync]
    assert [s.staleness for s in k0] == [0] * STEPS

    reset()
    one = flow.run_steps(batches, update, publish=publish, load=load, off_policy="one_step")
    assert [s.version for s in one] == [0, 0, 1, 2] and [s.staleness for s in one] == [0, 1, 1, 1]
    final_one = _snapshot(trained)

    # By hand: lock step, the rollout handed version t - 2's weights before step t.
    reset()
    published, hand = {0: start}, []
    for step in range(1, STEPS + 1):
        load(published[max(0, step - 2)])
        result = flow.run(PROMPTS)
        hand.append((result, update(result, step)))
        published[step] = publish()
    assert _responses(one) == [[r for _, r in res.outputs["rollout"]] for res, _ in hand]
    assert [s.update for s in one] == [u for _, u in hand]
    assert _responses(one) != _responses(sync)  # the lag shows: later steps sample from older weights
    for name, value in _snapshot(trained).items():
        assert torch.equal(final_one[name], value), name


def test_run_steps_refuses_overlap_without_publish_and_load(setup):
    flow, _, _, update = setup
    with pytest.raises(ValueError, match="give publish and load"):
        flow.run_steps([PROMPTS], update, off_policy="one_step")
    with pytest.raises(ValueError, match="max_staleness must be an int >= 0"):
        flow.run_steps([PROMPTS], update, publish=dict, load=print, off_policy="async", max_staleness=-1)
    with pytest.raises(ValueError, match="sync_every must be an int >= 1"):
        flow.run_steps([PROMPTS], update, publish=dict, load=print, off_policy="async", sync_every=0)
    with pytest.raises(ValueError, match="off_policy must be one of"):
        flow.run_steps([PROMPTS], update, off_policy="two_step")


def _counter_flow():
    """A flow whose one node reports the weight value its model holds: what a rollout from it 'generated'."""
    rollout_model = {"w": 0}
    node = Node(name="rollout", model=rollout_model, forward_fn=lambda model, items: [model["w"]] * len(items))
    return DataFlow(nodes=[node]), rollout_model


@pytest.mark.parametrize("stale_samples, sync_every, versions, dropped", [
    # wait, k = 1, pushes every 2 updates: the rollout waits for a version at most 1 behind.
    ("wait", 2, [0, 0, 2, 2, 4, 4], [0] * 6),
    # drop, k = 1, pushes every 3 updates: it runs 1 step ahead on whatever was pushed; a batch more than
    # 1 behind at its step is dropped and generated again from the weights of then (pushed at once).
    # Steps 3 and 4 were both submitted with version 0 (before step 3's drop pushed version 2): both drop.
    ("drop", 3, [0, 0, 2, 3, 3, 5], [0, 0, 1, 1, 0, 1]),
])
def test_async_staleness_bound_waits_or_drops(stale_samples, sync_every, versions, dropped):
    flow, rollout_model = _counter_flow()
    trained = {"w": 0}

    def update(result, step):
        trained["w"] = step  # the weights after update `step` are version `step`
        return result.final

    steps = flow.run_steps([[None]] * 6, update, publish=lambda: dict(trained), load=rollout_model.update,
                           off_policy="async", max_staleness=1, sync_every=sync_every, stale_samples=stale_samples)
    assert [s.version for s in steps] == versions
    assert [s.flow.final for s in steps] == [[v] for v in versions]  # each result came from the version it names
    assert [s.dropped for s in steps] == dropped
    assert all(s.staleness <= 1 for s in steps) and [s.staleness for s in steps] == [
        step - 1 - v for step, v in enumerate(versions, start=1)]
