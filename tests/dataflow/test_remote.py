"""launcher="ray": every node in its own Ray worker process, same results as in-process."""
import os

import pytest

from hybridflow import DataFlow, Node
from hybridflow.dataflow import NodeError
from tests.dataflow.test_demo_flow import _truth

pytestmark = [pytest.mark.usefixtures("ray_cluster"), pytest.mark.timeout(180)]


def test_nodes_on_ray_workers_equal_local_and_run_elsewhere(actor):
    from hybridflow.rewards.registry import get_reward_fn

    rule = get_reward_fn("arithmetic")
    rollout = Node(name="rollout", model=actor,
                   forward_fn=lambda model, prompts: model.generate(prompts, max_new_tokens=8))
    reward = Node(name="reward", model=rule,
                  forward_fn=lambda fn, batch: [(fn("arithmetic", r, _truth(p)), os.getpid()) for p, r in batch])
    flow = DataFlow(nodes=[rollout, reward], edges=[(rollout, reward)])
    prompts = ["042+917=", "123+456=", "005+005=", "250+250="]
    local = flow.run(prompts)
    remote = flow.run(prompts, async_execution=True, min_batch=2, launcher="ray")
    assert [s for s, _ in remote.final] == [s for s, _ in local.final]
    assert remote.outputs["rollout"] == local.outputs["rollout"]
    assert {pid for _, pid in remote.final} != {os.getpid()}  # scored in another process


def test_failing_remote_node_surfaces_its_traceback():
    def broken(model, items):
        raise ValueError("bad item in remote_forward")

    src = Node(name="src", forward_fn=lambda m, items: items)
    bad = Node(name="bad", forward_fn=broken)
    with pytest.raises(NodeError, match="bad item in remote_forward"):
        DataFlow([src, bad], [(src, bad)]).run([1, 2], launcher="ray")
