"""The trainer: the PPO/GRPO loop on the single controller and its plumbing.

- tracking.py: Tracker (console, metrics.jsonl, TensorBoard), read_metrics
- checkpointing.py: CheckpointManager (atomic step directories, `latest`
  marker, keep_last pruning), atomic_write_json, atomic_torch_save
- plot.py: plot_run, behind `hybridflow plot RUN_DIR`
- trainer.py / rl_steps.py: RLTrainer, the PPO/GRPO loop (import from
  `hybridflow.trainer.trainer`; kept out of this namespace so that the
  plumbing imports without megatron-core)
"""
from hybridflow.trainer.checkpointing import (CheckpointError, CheckpointManager,
                                              atomic_torch_save, atomic_write_json)
from hybridflow.trainer.plot import PLOT_METRICS, PlotError, plot_run
from hybridflow.trainer.tracking import LOGGERS, Tracker, read_metrics

__all__ = [
    "CheckpointError", "CheckpointManager", "atomic_torch_save", "atomic_write_json",
    "PLOT_METRICS", "PlotError", "plot_run",
    "LOGGERS", "Tracker", "read_metrics",
]
