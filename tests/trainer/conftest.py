"""Fixtures of the trainer tests on several processes."""
import pytest


@pytest.fixture(scope="session")
def single(tmp_path_factory):
    """The one-process run of a config (`THREE_STEPS`) that the layout tests compare with, run once each in
    the session: test_distributed_trainer.py and test_fsdp_roles.py compare with the same runs."""
    from tests.trainer.test_distributed_trainer import THREE_STEPS, run

    runs = {}

    def get(name: str, *overrides: str):
        key = (name, *overrides)
        if key not in runs:
            runs[key] = run(name, tmp_path_factory.mktemp("one"), *overrides, *THREE_STEPS)
        return runs[key]

    return get
