"""The preflight: what the config names, asked of the world outside it, before any worker starts.

`check_runnable(cfg, plan, model)` runs the value checks that need the run
plan and the model (`validate.check_plan`), then asks the machine: the run
directory can be written and holds no previous run it would clobber, the
paths named exist, a Ray address answers, env.function loads, vLLM imports
when it is the engine, the libraries of the wandb / mlflow loggers are
installed, and torch reaches CUDA when the device is "cuda".
The trainer calls it once it has read the model's config.json
(`config/inputs.py`, `load_model_config`). Each failure is a `ConfigError`
naming the key to change.
"""
from __future__ import annotations

import importlib.util
import os
import socket
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Optional

from hybridflow.config.plan import RunPlan
from hybridflow.config.schema import Config
from hybridflow.config.validate import check_plan
from hybridflow.errors import ConfigError

RAY_ADDRESS_TIMEOUT_S = 5.0

if TYPE_CHECKING:
    from hybridflow.models.config import DecoderConfig


def _check_previous_run(cfg: Config, where: Path) -> None:
    """Starting afresh in `where` (the run directory), where a previous run lives, would truncate its metrics
    and prune its checkpoints."""
    t = cfg.trainer
    if t.resume == "auto" or t.overwrite:
        return
    metrics = where / "metrics.jsonl"
    steps = sorted(p.name for p in (where / "checkpoints").glob("step_*")) if (where / "checkpoints").is_dir() else []
    found = ([f"metrics.jsonl ({metrics.stat().st_size} bytes)"] if metrics.is_file() and metrics.stat().st_size
             else []) + ([f"checkpoints {steps[0]}..{steps[-1]}"] if steps else [])
    if found:
        raise ConfigError("trainer.resume", f"{where} holds a previous run ({', '.join(found)}); set "
                          "trainer.resume=auto to continue it, or trainer.overwrite=true to start over there "
                          "(or choose another trainer.output_dir / trainer.experiment)")


def _check_output_dir(run_dir: Path) -> None:
    """The run directory can be created and written: its nearest existing ancestor is a writable directory.

    Tried, not only asked (os.access): root passes every permission check, yet cannot create a directory on
    a read-only mount or under /proc.
    """
    where = run_dir.absolute()
    existing = next(p for p in (where, *where.parents) if p.exists())
    if not existing.is_dir():
        raise ConfigError("trainer.output_dir", f"{existing} is a file, so {where} cannot be created")
    why = None if os.access(existing, os.W_OK | os.X_OK) else "permission denied"
    if why is None:
        try:
            os.rmdir(tempfile.mkdtemp(prefix=".hybridflow-write-test-", dir=existing))
        except OSError as exc:
            why = exc.strerror or str(exc)
    if why is not None:
        raise ConfigError("trainer.output_dir", f"{existing} is not writable ({why}), so {where} cannot be created")

def _check_env_function(cfg: Config) -> None:
    """env.function loads and makes an environment (a user file's error names the key, before any worker)."""
    if cfg.env.function is None:
        return
    from hybridflow.envs import load_env_factory

    try:
        load_env_factory(cfg.env.function)
    except Exception as exc:
        raise ConfigError("env.function", f"{cfg.env.function!r}: {type(exc).__name__}: {exc}") from None

def _check_ray_address(cfg: Config) -> None:
    """A cluster address nothing answers at: Ray would retry for minutes before failing; one TCP connect says so
    in seconds. ("auto" finds the cluster through Ray's own files and is left to Ray.)"""
    address = cfg.trainer.ray_address
    if address is None or address == "auto":
        return
    host, _, port = address.removeprefix("ray://").rpartition(":")
    if not host or not port.isdigit():
        raise ConfigError("trainer.ray_address", f"expected 'auto' or host:port, got {address!r}")
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=RAY_ADDRESS_TIMEOUT_S).close()
    except OSError as exc:
        raise ConfigError("trainer.ray_address", f"nothing answers at {address} "
                          f"({exc.strerror or type(exc).__name__}); is the cluster's head node running?") from None


def _check_vllm(cfg: Config) -> None:
    """vLLM is installed when it is the engine (a ConfigError that says how to install it; a warning for a
    version outside the tested range)."""
    if cfg.rollout.engine != "vllm":
        return
    from hybridflow.rollout.vllm_backend import import_vllm

    import_vllm()


# trainer.loggers that need a library of their own: (module, pip install line).
LOGGER_LIBRARIES = {
    "wandb": ("wandb", "pip install 'hybridflow[wandb]' (or: pip install wandb)"),
    "mlflow": ("mlflow", "pip install 'hybridflow[mlflow]' (or: pip install mlflow-skinny)"),
}


def check_logger_library(name: str) -> None:
    """A ConfigError naming trainer.loggers and the pip command when logger `name`'s library is missing.

    Asked of the import system without importing (wandb's import alone takes a good part of a second)."""
    if name not in LOGGER_LIBRARIES:
        return
    module, install = LOGGER_LIBRARIES[name]
    if importlib.util.find_spec(module) is None:
        raise ConfigError("trainer.loggers", f"{name!r} needs the {module} package, which is not installed: "
                          f"{install}; or drop {name!r} from trainer.loggers")


def check_runnable(cfg: Config, plan: RunPlan, model: "DecoderConfig",
                   critic_model: Optional["DecoderConfig"] = None) -> None:
    """ConfigError for what the config, its run plan and the models' own config.json / the machine cannot
    run together.

    critic_model: the config.json at critic.model_path, when one is given (else the actor's model).
    """
    check_plan(cfg, plan, model, critic_model)
    _check_vllm(cfg)
    for name in cfg.trainer.loggers:
        check_logger_library(name)
    _check_output_dir(plan.run_dir)
    _check_ray_address(cfg)
    _check_previous_run(cfg, plan.run_dir)
    _check_env_function(cfg)
    if cfg.reward.model_path is not None and not Path(cfg.reward.model_path).exists():
        raise ConfigError("reward.model_path", f"reward model path does not exist: {cfg.reward.model_path}")
    if cfg.reward.model_path is not None and not (Path(cfg.reward.model_path) / "config.json").is_file():
        raise ConfigError("reward.model_path", f"no config.json in {cfg.reward.model_path}: not a Hugging Face "
                          "model directory")
    if cfg.critic.model_path is not None and not Path(cfg.critic.model_path).exists():
        raise ConfigError("critic.model_path", f"critic model path does not exist: {cfg.critic.model_path}")
    # In-process and torchrun workers run here; Ray workers may sit on other nodes (their pools check).
    if cfg.trainer.device == "cuda" and not plan.uses_ray:
        import torch

        if not torch.cuda.is_available():
            why = "torch was built without CUDA" if torch.version.cuda is None else "no CUDA device is visible"
            raise ConfigError("trainer.device", f"'cuda' but {why} (torch {torch.__version__}); use cpu")
