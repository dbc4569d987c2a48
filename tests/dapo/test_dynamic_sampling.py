"""DAPO's dynamic sampling on hand-built batches: it keeps exactly the groups whose scores differ, refills to
the asked count (leaving out the last batch's extra groups), stops at max_batches and says so; and the prompt
sampler's walk over refills, which a checkpoint continues exactly."""
from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest
import torch

from hybridflow.common import SEED_STRIDE, mix_seed
from hybridflow.data import fields as F
from hybridflow.dataflow.execute import FlowResult
from hybridflow.data.sampler import PromptSampler
from hybridflow.trainer import rl_steps as S
from hybridflow.trainer.dapo import DynamicSampling, one_batch, refill_seed

N = 2  # samples per prompt


def batch_of(groups: list[tuple[int, list[float]]]) -> dict:
    """A rollout batch as the driver holds it: (prompt index, its N scores) per group."""
    rows = [(index, score) for index, scores in groups for score in scores]
    return {F.UID: [str(i) for i, _ in rows], F.INDEX: [i for i, _ in rows],
            F.SCORES: torch.tensor([s for _, s in rows]), F.RESPONSE_LENGTH: torch.full((len(rows),), 3)}


def flow(seconds: float) -> FlowResult:
    return FlowResult({}, {"rollout": seconds, "reward": seconds / 10}, [], None, {}, (), wall_s=seconds)


class Refills:
    """Batch k of a step from a script; records the calls."""

    def __init__(self, script: list[list[tuple[int, list[float]]]]):
        self.script, self.calls = script, []

    def __call__(self, step: int, k: int):
        self.calls.append((step, k))
        return batch_of(self.script[k]), flow(1.0 + k)


FIRST = [(0, [1.0, 1.0]), (1, [0.0, 1.0]), (2, [0.0, 0.0]), (3, [1.0, 0.0])]  # prompts 1 and 3 have a signal


def test_a_full_first_batch_keeps_exactly_its_informative_groups_and_generates_no_more():
    refill = Refills([FIRST])
    got = DynamicSampling(2, 5, refill, S.nonuniform_rows)(7, (batch_of(FIRST), flow(1.0)))
    assert refill.calls == []
    assert got.batch[F.INDEX] == [1, 1, 3, 3] and got.batch[F.SCORES].tolist() == [0.0, 1.0, 1.0, 0.0]
    assert got.generated[F.INDEX] == [0, 0, 1, 1, 2, 2, 3, 3]  # the figures read every generated row
    assert got.metrics == {"dapo/kept_groups": 2.0, "dapo/generated_batches": 1.0,
                           "dapo/informative_fraction": 0.5, "dapo/filled": 1.0}


def test_refills_until_the_asked_groups_and_leaves_out_the_last_batchs_extra_groups():
    script = [FIRST, [(4, [1.0, 1.0]), (5, [0.0, 0.0]), (6, [0.0, 0.0]), (7, [0.0, 0.0])],  # nothing
              [(8, [0.5, 0.0]), (1, [1.0, 0.0]), (9, [0.0, 0.0]), (10, [0.0, 1.0])]]  # 3 more; prompt 1 again
    refill = Refills(script)
    got = DynamicSampling(4, 5, refill, S.nonuniform_rows)(3, (batch_of(FIRST), flow(1.0)))
    assert refill.calls == [(3, 1), (3, 2)]
    # Groups 1, 3 (batch 0), then 8 and 1 again (batch 2): prompt 1 drawn twice is two groups; 10 is left out.
    assert got.batch[F.INDEX] == [1, 1, 3, 3, 8, 8, 1, 1]
    assert got.batch[F.UID] == ["1", "1", "3", "3", "8/2", "8/2", "1/2", "1/2"]
    assert len(set(got.batch[F.UID])) == 4 and S.nonuniform_rows(got.batch).all()
    assert got.metrics == {"dapo/kept_groups": 4.0, "dapo/generated_batches": 3.0,
                           "dapo/informative_fraction": 5 / 12, "dapo/filled": 1.0}
    assert len(got.generated[F.SCORES]) == 24
    assert got.flow.timings == {"rollout": 6.0, "reward": pytest.approx(0.6)} and got.flow.wall_s == 6.0


def test_stops_at_max_batches_trains_on_what_it_found_and_logs_it(caplog):
    script = [FIRST, [(4, [1.0, 1.0]), (5, [0.0, 0.0]), (6, [1.0, 0.0]), (7, [0.0, 0.0])]]
    refill = Refills(script)
    with caplog.at_level(logging.WARNING, logger="hybridflow.trainer.dapo"):
        got = DynamicSampling(4, 2, refill, S.nonuniform_rows)(9, (batch_of(FIRST), flow(1.0)))
    assert refill.calls == [(9, 1)]
    assert got.batch[F.INDEX] == [1, 1, 3, 3, 6, 6]
    assert got.metrics["dapo/kept_groups"] == 3.0 and got.metrics["dapo/generated_batches"] == 2.0
    assert got.metrics["dapo/filled"] == 0.0
    assert "step 9: dynamic sampling generated 2 batches (algorithm.dynamic_sampling.max_batches) and found 3 " \
           "of 4 groups" in caplog.text


def test_no_group_with_a_signal_leaves_an_empty_batch(caplog):
    flat = [(0, [1.0, 1.0]), (1, [0.0, 0.0])]
    with caplog.at_level(logging.WARNING, logger="hybridflow.trainer.dapo"):
        got = DynamicSampling(2, 1, Refills([flat]), S.nonuniform_rows)(1, (batch_of(flat), flow(1.0)))
    assert "found 0 of 2 groups whose scores differ; the step takes no update" in caplog.text
    assert got.batch[F.INDEX] == [] and got.batch[F.SCORES].shape == (0,)
    assert got.metrics["dapo/kept_groups"] == 0.0 and got.metrics["dapo/informative_fraction"] == 0.0


def test_every_generated_row_is_observed_before_the_filter():
    """With data.skip_uniform_passes the sampler must hear of the uniform groups the filter leaves out."""
    seen = []
    script = [FIRST, [(4, [1.0, 0.0]), (5, [0.0, 0.0])]]
    DynamicSampling(3, 3, Refills(script), S.nonuniform_rows, observe=lambda b: seen.append(list(b[F.INDEX])))(
        1, (batch_of(FIRST), flow(1.0)))
    assert seen == [[0, 0, 1, 1, 2, 2, 3, 3], [4, 4, 5, 5]]


def test_without_dynamic_sampling_a_step_trains_on_its_one_batch():
    first = batch_of(FIRST)
    got = one_batch(1, (first, flow(1.0)))
    assert got.batch is first and got.generated is first and got.metrics == {}


def test_refill_seeds_differ_from_every_steps_seed_and_stay_in_int64_keys():
    assert refill_seed(5, 12, 0) == mix_seed(5, 12)
    seeds = {refill_seed(seed, step, k) for seed in (0, 1, 123456) for step in range(1, 50) for k in range(1, 8)}
    steps = {mix_seed(seed, step) for seed in (0, 1, 123456) for step in range(1, 50)}
    assert len(seeds) == 3 * 49 * 7 and not seeds & steps
    assert max(seeds) * SEED_STRIDE + SEED_STRIDE < 2 ** 63  # mix_seed(seed, dataset row) as an int64
    assert refill_seed(5, 12, 3) == refill_seed(5, 12, 3)  # a function of the three


DATA = [SimpleNamespace(index=100 + i) for i in range(10)]


def test_the_sampler_walks_on_over_refills_and_a_checkpoint_continues_the_walk():
    sampler = PromptSampler(DATA, 4, True, 0, refills=True)
    assert sampler.adaptive  # its walk is state a checkpoint keeps
    drawn = [r.index for r in sampler.batch(1) + sampler.more(1) + sampler.more(1)]
    order = [100 + i for i in __import__("numpy").random.default_rng([0, 0]).permutation(10)]
    assert drawn[:10] == order and len(drawn) == 12  # the epoch's order, into the next epoch
    assert sampler.metrics()["data/skipped_fraction"] == 0.0 and sampler.epoch == 1
    state = sampler.state_dict()
    want = [r.index for r in sampler.batch(2) + sampler.more(2)]
    resumed = PromptSampler(DATA, 4, True, 0, refills=True)
    resumed.load_state_dict(state)
    assert [r.index for r in resumed.batch(2) + resumed.more(2)] == want
    with pytest.raises(ValueError, match="stands in step 2 and cannot refill step 3"):
        resumed.more(3)
    with pytest.raises(ValueError, match="unless the sampler refills"):
        PromptSampler(DATA, 4, True, 0).more(1)
