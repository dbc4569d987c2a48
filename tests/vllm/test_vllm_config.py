"""Which generation layouts the vLLM engine takes, checked before any worker starts (runs with or without vLLM).

vLLM's tensor-parallel groups under `external_launcher` are blocks of tg consecutive ranks; a generation
group must be one. The paper's grouping at tg < t puts its ranks t/tg apart, so it is refused; tg = t
(any grouping) and `vanilla` (consecutive groups) are taken. Without vLLM installed a taken layout stops
at the missing package instead, never at the layout.
"""
from pathlib import Path

import pytest

from hybridflow.config.loader import load_config
from hybridflow.config.plan import RunPlan
from hybridflow.config.preflight import check_runnable
from hybridflow.errors import ConfigError
from hybridflow.models import DecoderConfig

ROOT = Path(__file__).resolve().parents[2]


def _check(*overrides: str) -> None:
    cfg = load_config(ROOT / "configs" / "tiny-grpo.yaml", ["rollout.engine=vllm", *overrides])
    cfg.model.path = str(ROOT / cfg.model.path)
    check_runnable(cfg, RunPlan.from_config(cfg), DecoderConfig.from_pretrained(cfg.model.path))


def _taken(*overrides: str) -> None:
    try:
        _check(*overrides)
    except ConfigError as exc:  # only the missing package may stop it
        assert str(exc).startswith("rollout.engine: 'vllm' needs the vLLM package"), exc


def test_the_paper_grouping_below_t_is_refused_with_the_way_out():
    with pytest.raises(ConfigError, match=r"rollout.grouping: 'hybridflow' at tg=2 < actor.parallel.tp=4 .*"
                                          r"rollout.grouping=vanilla"):
        _check("trainer.n_devices=4", "actor.parallel.tp=4", "rollout.tg=2")


@pytest.mark.parametrize("overrides", [
    ("trainer.n_devices=2", "actor.parallel.tp=2", "rollout.tg=2"),  # tg = t: one group of consecutive ranks
    ("trainer.n_devices=4", "actor.parallel.tp=2", "rollout.tg=2"),  # two replicas of 2
    ("trainer.n_devices=4", "actor.parallel.tp=4", "rollout.tg=2", "rollout.grouping=vanilla"),
])
def test_layouts_whose_generation_groups_are_consecutive_ranks_are_taken(overrides):
    _taken(*overrides)
