"""Data parallelism is not hard-coded away: DP=2 over gloo gives the DP=1 update."""
import pytest
import torch

from hybridflow.config.schema import ParallelConfig
from hybridflow.engine import MegatronEngine
from hybridflow.roles import Actor
from tests.engine.conftest import dp_case

pytestmark = pytest.mark.usefixtures("megatron_world")


@pytest.mark.timeout(300)
def test_dp2_update_equals_dp1_update(two_process_launch):
    dp2 = torch.load(two_process_launch["dp_step"])  # tests/engine/dp_step.py on 2 processes

    cfg, hf, batch, optim, actor_cfg = dp_case()
    engine = MegatronEngine(cfg, ParallelConfig(), optim, total_steps=10)
    engine.load_hf_state_dict(hf)
    metrics = Actor(actor_cfg, engine).update(batch, step=0)
    assert dp2["metrics"]["actor/grad_norm"] == pytest.approx(metrics["actor/grad_norm"], rel=1e-4)
    for name, value in engine.hf_state_dict().items():
        # Adam's first step is ~lr * sign(grad): allow sign flips of ~0 gradients.
        torch.testing.assert_close(dp2["weights"][name], value, atol=0.05 * optim.lr, rtol=0, msg=name)
