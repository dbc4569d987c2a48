"""The shipped demo actor and tiny random reward model, loaded once per module."""
from pathlib import Path

import pytest

ASSETS = Path(__file__).resolve().parents[2] / "hybridflow" / "assets"
DEMO = ASSETS / "demo_model"
TINY_RM = ASSETS / "tiny_reward_model"


@pytest.fixture(scope="module")
def actor():
    from hybridflow.utils import load_hf_model
    return load_hf_model(DEMO, device_map="auto")


@pytest.fixture(scope="module")
def reward_model():
    from hybridflow.utils import load_hf_model
    return load_hf_model(TINY_RM)
