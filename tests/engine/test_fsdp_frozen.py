"""A reward model sharded by FSDP2 (engine/fsdp_frozen.py) scores exactly as the whole model in one process.

The 2-rank side runs in the session's two-process launch (tests/engine/fsdp_frozen_check.py). Sharding
changes where the weights live, not the arithmetic: each unit's weights are all-gathered whole before its
forward, so a micro-batch gives the same scores bit for bit, and the comparisons are `==`. They hold only
for the same micro-batches: a row's score depends (by float rounding) on the padded width of its
micro-batch, so the one-process side scores each rank's share on its own, in micro-batches of the same
size, rather than all rows in one stream.
"""
import pytest
import torch

from hybridflow.rollout.hf import load_hf_model
from tests.engine.fsdp_frozen_check import MICRO, RM, SHARES, pairs

pytestmark = [pytest.mark.usefixtures("megatron_world"), pytest.mark.timeout(600)]


@pytest.fixture(scope="module")
def frozen(two_process_launch):
    return torch.load(two_process_launch["fsdp_frozen"])


@pytest.fixture(scope="module")
def whole():
    return load_hf_model(RM)


def test_a_reward_model_under_fsdp_at_two_ranks_scores_exactly_as_one_process(frozen, whole):
    """Uneven shares (4 micro-batches against 1: rank 1 runs 3 idle passes; then 1 row against none)
    equal the whole model's scores of the same micro-batches, here and in each rank's own process."""
    rows = pairs()
    for case, shares in SHARES.items():
        for rank, (start, end) in enumerate(shares):
            want = whole.score(rows[start:end], MICRO)
            assert frozen[case][rank]["fsdp"] == want, (case, rank)
            assert frozen[case][rank]["whole"] == want, (case, rank)
    assert frozen["one_and_none"][1]["fsdp"] == []


def test_the_reward_worker_under_reward_engine_fsdp_scores_as_one_process(frozen, whole):
    """RewardModelWorker with reward.engine=fsdp behind the trainer's dispatch: DP_SPLIT gives each rank 6 of
    the 12 rows, an even number, so its micro-batches of 2 are those of one process scoring all 12."""
    rows = pairs()
    assert frozen["worker_is_sharded"] == "FSDPRewardModel"
    # Not `==`: the worker's path (RewardModelWorker behind DP_SPLIT, its own torch thread count) is another
    # computation than this process's whole model; on an AVX2 machine one score of 12 differed by 1.2e-7
    # relative (float32 last bits; which reduction order differs was not pinned down). A wrong shard or row
    # order moves scores by far more than 1e-6.
    assert frozen["worker"].tolist() == pytest.approx(whole.score(rows, MICRO), rel=1e-6, abs=1e-6)


def test_each_rank_holds_and_reads_half_of_the_model(frozen, whole):
    """Built on the meta device and loaded row by row: a rank allocates and reads only its dim-0 chunks."""
    params = list(whole.model.parameters())
    total = sum(p.numel() for p in params)
    assert frozen["local_fraction"] == pytest.approx(0.5, abs=0.01)
    assert frozen["local_numel"] < 0.51 * total
    assert frozen["bytes_read"] < 0.51 * sum(p.numel() * p.element_size() for p in params)


def test_at_one_rank_the_sharded_model_is_the_whole_model(whole):
    from hybridflow.engine.fsdp_frozen import load_sharded_classifier

    rm = load_sharded_classifier(RM)
    rows = pairs()
    assert rm.local_fraction() == 1.0
    assert rm.score(rows, MICRO) == whole.score(rows, MICRO)
    assert rm.score(rows[:5], 3) == whole.score(rows[:5], 3)
