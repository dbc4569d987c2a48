"""The trainer: the PPO/GRPO loop on the single controller and its plumbing.

- tracking.py: Tracker (console, metrics.jsonl, TensorBoard), read_metrics;
  tracking_services.py: its wandb and mlflow loggers (optional extras)
- checkpointing.py: a run's save and resume (every group's shards and
  trainer.json, torchrun's broadcasts), on `hybridflow.checkpoint`
- plot.py: plot_run, behind `hybridflow plot RUN_DIR`
- dapo.py: DAPO's driver-side pieces (dynamic sampling with refill, overlong shaping and filtering),
  chosen when RLTrainer is built
- trainer.py / rl_steps.py: RLTrainer, the PPO/GRPO loop (import from
  `hybridflow.trainer.trainer`; kept out of this namespace so that the
  plumbing imports without megatron-core)
"""
from hybridflow.trainer.plot import PLOT_METRICS, PlotError, plot_run
from hybridflow.trainer.tracking import LOGGERS, Tracker, read_metrics

__all__ = [
    "PLOT_METRICS", "PlotError", "plot_run",
    "LOGGERS", "Tracker", "read_metrics",
]
