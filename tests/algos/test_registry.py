"""The three name registries: lookup, registration, and unknown-name errors."""
import pytest
import torch

from hybridflow.algos import (ADV_ESTIMATORS, KL_ESTIMATORS, POLICY_LOSSES, AdvantageInputs,
                              compute_advantages, get_adv_estimator, get_kl_estimator, get_policy_loss,
                              kl_penalty, register_adv_estimator, register_kl_estimator,
                              register_policy_loss)

REGISTRIES = [
    (ADV_ESTIMATORS, register_adv_estimator, get_adv_estimator, "advantage estimator"),
    (POLICY_LOSSES, register_policy_loss, get_policy_loss, "policy loss"),
    (KL_ESTIMATORS, register_kl_estimator, get_kl_estimator, "KL estimator"),
]


def test_expected_names_are_registered():
    assert set(ADV_ESTIMATORS) == {"gae", "grpo", "rloo", "reinforce_plus_plus",
                                   "reinforce_plus_plus_baseline", "remax"}
    assert set(POLICY_LOSSES) == {"ppo", "gspo"}
    assert set(KL_ESTIMATORS) == {"k1", "k2", "mse", "k3", "low_var_kl", "abs"}


@pytest.mark.parametrize("table,register,get,what", REGISTRIES)
def test_register_then_lookup_and_duplicate_rejected(table, register, get, what):
    def custom(*args, **kwargs):
        return None

    register("test-custom")(custom)
    try:
        assert get("test-custom") is custom
        with pytest.raises(ValueError, match=f"{what} 'test-custom' is already registered"):
            register("test-custom")(lambda: None)
        assert get("test-custom") is custom
    finally:
        del table["test-custom"]


@pytest.mark.parametrize("get,typo,nearest", [
    (get_adv_estimator, "reinforce_plus_plus_basline", "reinforce_plus_plus_baseline"),
    (get_adv_estimator, "GRPO", "grpo"),
    (get_policy_loss, "ppo2", "ppo"),
    (get_kl_estimator, "lowvar_kl", "low_var_kl"),
])
def test_unknown_name_error_names_it_and_the_nearest(get, typo, nearest):
    with pytest.raises(KeyError) as err:
        get(typo)
    message = str(err.value)
    assert repr(typo) in message and f"nearest registered: {nearest!r}" in message


def test_a_registered_estimator_is_usable_through_compute_advantages():
    @register_adv_estimator("test-constant")
    def constant(x: AdvantageInputs):
        adv = torch.where(x.mask.bool(), torch.full(x.mask.shape, 2.0), torch.zeros(x.mask.shape))
        return adv, adv

    try:
        adv, _ = compute_advantages("test-constant", AdvantageInputs(mask=torch.tensor([[1, 0]])))
        assert adv.tolist() == [[2.0, 0.0]]
    finally:
        del ADV_ESTIMATORS["test-constant"]


def test_registered_kl_estimator_reaches_kl_penalty():
    register_kl_estimator("test-double-k1")(lambda lp, ref: 2 * (lp - ref))
    try:
        assert kl_penalty(torch.tensor([1.0]), torch.tensor([0.25]), "test-double-k1").item() == 1.5
    finally:
        del KL_ESTIMATORS["test-double-k1"]
