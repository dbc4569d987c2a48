"""Placement -> resource pools: colocated roles share a pool, split roles do not, bad placements fail."""
import pytest

from hybridflow.config.plan import ROLES, devices_for
from hybridflow.config.schema import Config
from hybridflow.config.validate import validate
from hybridflow.errors import ConfigError
from hybridflow.controller import ResourcePool, pools_from_placement


def _cfg(n_devices=4, **placement) -> Config:
    cfg = Config()
    cfg.model.path = "model"
    cfg.trainer.n_devices = n_devices
    for role, devices in placement.items():
        setattr(cfg.placement, role, devices)
    return cfg


def _pools(cfg: Config, roles=ROLES) -> dict[str, ResourcePool]:
    """As the trainer builds them: each role's resolved devices, and the device kind."""
    return pools_from_placement({role: devices_for(cfg, role) for role in roles}, cfg.trainer.device)


def test_colocated_roles_share_one_pool():
    pools = _pools(_cfg(4))  # empty placement: every role on every device
    assert len({id(p) for p in pools.values()}) == 1
    pool = pools["training"]
    assert pool.devices == [0, 1, 2, 3] and pool.world_size == 4 and pool.device == "cpu"
    assert pool.fraction(0) == 1.0 and pool.actor_options(0) == {"num_cpus": 1.0, "num_gpus": 0}


def test_split_roles_get_their_own_pools_and_share_overlapping_devices():
    pools = _pools(_cfg(4, rollout=[0, 1], reference=[1, 0], reward=[2], training=[0, 1, 2, 3],
                        critic=[3]))
    assert pools["rollout"] is pools["reference"]  # same set, listed in another order
    assert pools["rollout"] is not pools["training"]
    assert pools["reward"].devices == [2] and pools["critic"].devices == [3]
    # device 0 serves the rollout and training pools: each process asks for half of it
    assert pools["rollout"].fraction(0) == 0.5 and pools["training"].fraction(0) == 0.5
    assert pools["training"].fraction(2) == 0.5 and pools["training"].devices == [0, 1, 2, 3]


@pytest.mark.parametrize("n_devices, placement, path, message", [
    (2, {"reward": [2]}, "placement.reward", "device(s) [2] do not exist: trainer.n_devices is 2"),
    (4, {"rollout": [1, 1]}, "placement.rollout", "lists a device twice"),
    (0, {}, "trainer.n_devices", "must be >= 1"),
])
def test_bad_placement_names_the_key(n_devices, placement, path, message):
    """Checked once, when the config is loaded: the pools trust a validated placement."""
    with pytest.raises(ConfigError) as err:
        validate(_cfg(n_devices, **placement))
    assert err.value.path == path and message in str(err.value)


def test_pool_validation():
    with pytest.raises(ValueError, match="at least one device"):
        ResourcePool([], "cpu")
    with pytest.raises(ValueError, match="'cpu' or 'cuda'"):
        ResourcePool([0], "tpu")
    with pytest.raises(ValueError, match="listed twice"):
        ResourcePool([0, 0])
    with pytest.raises(ValueError, match="integers >= 0"):
        ResourcePool([-1])
    with pytest.raises(ValueError, match="unknown role 'actor'"):
        _pools(_cfg(2), roles=["actor"])


def test_pools_take_plain_values():
    """The controller gets the resolved placement and device kind, not the app's config."""
    pools = pools_from_placement({"training": [0, 1], "reference": [1, 0], "rollout": [2]}, "cpu")
    assert pools["training"] is pools["reference"] and pools["rollout"].devices == [2]
    assert pools["training"].device == "cpu" and pools["training"].fraction(0) == 1.0
