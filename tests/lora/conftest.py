"""Fixtures of the LoRA tests: the engine tests' one process group."""
from tests.engine.conftest import megatron_world  # noqa: F401  (a session fixture, shared by name)
