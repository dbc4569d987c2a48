"""Data parallelism is not hard-coded away: DP=2 over gloo gives the DP=1 update."""
import pytest
import torch

from hybridflow.config.schema import ParallelConfig
from hybridflow.engine import MegatronEngine
from hybridflow.roles import Actor
from tests.engine.conftest import assert_one_adam_step_close, dp_case

pytestmark = pytest.mark.usefixtures("megatron_world")


@pytest.mark.timeout(600)  # its setup may run the 2-process launch (tests/conftest.py)
def test_dp2_update_equals_dp1_update(two_process_launch):
    dp2 = torch.load(two_process_launch["dp_step"])  # tests/engine/dp_step.py on 2 processes

    cfg, hf, batch, optim, actor_cfg = dp_case()
    engine = MegatronEngine(cfg, ParallelConfig(), optim, total_steps=10)
    engine.load_hf_state_dict(hf)
    metrics = Actor(actor_cfg, engine).update(batch, step=0)
    assert dp2["metrics"]["actor/grad_norm"] == pytest.approx(metrics["actor/grad_norm"], rel=1e-4)
    assert_one_adam_step_close(dp2["weights"], engine.hf_state_dict(), hf, optim.lr)


def test_padding_rows_change_no_loss_gradient_or_metric():
    """A share padded with masked rows (-1 in the plan) takes the same step and reports the same metrics:
    the padding is in no loss, gradient, token count or average, even as micro-batches of padding alone."""
    import dataclasses

    from hybridflow.data import fields as F

    cfg, hf, batch, optim, actor_cfg = dp_case()
    rows = torch.arange(len(batch[F.INPUT_IDS]))

    def update(index):
        engine = MegatronEngine(cfg, ParallelConfig(), optim, total_steps=10)
        engine.load_hf_state_dict(hf)
        actor = Actor(dataclasses.replace(actor_cfg, ppo_micro_batch_size=1), engine)
        return actor.update_share(batch, [index]), engine.hf_state_dict()

    (plain, weights), (padded, padded_weights) = update(rows), update(torch.cat([rows, torch.full((3,), -1)]))
    assert padded.keys() == plain.keys() and {"actor/entropy", "actor/clip_frac", "actor/pg_loss"} <= plain.keys()
    for key, value in plain.items():
        assert padded[key] == pytest.approx(value, rel=1e-6, abs=1e-9), key
    for name, value in weights.items():
        torch.testing.assert_close(padded_weights[name], value, atol=1e-7, rtol=0, msg=name)


def test_update_of_a_whole_batch_is_refused_at_dp2():
    """`update()` trains one replica on every row; at dp > 1 each replica must get its share instead."""
    from types import SimpleNamespace

    from hybridflow.roles.batching import one_replica_steps

    role = SimpleNamespace(engine=SimpleNamespace(layout=SimpleNamespace(dp=2)), plan=lambda rows, step: [[]])
    with pytest.raises(ValueError, match="at dp = 2 give each replica its share"):
        one_replica_steps(role, {"input_ids": torch.zeros(4, 2)}, 0)
    role.engine.layout.dp = 1
    assert one_replica_steps(role, {"input_ids": torch.zeros(4, 2)}, 0) == []
