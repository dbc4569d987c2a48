"""The Weights & Biases and MLflow loggers of `Tracker` (`trainer.loggers: [wandb, mlflow]`).

Each is an optional extra (`pip install 'hybridflow[wandb]'`, `'hybridflow[mlflow]'`) and its library is
imported only when the logger is asked for (importing wandb takes a noticeable fraction of a second).
Both receive what the other loggers do, plus the run's config once and the run's files at the end:

- config: the typed config, flattened to dotted keys (`actor.optim.lr`), as W&B config / MLflow params;
- metrics: every step's dict, at that step number;
- artifacts: `Tracker.add_artifact(path, kind)`; the trainer adds the plot (`plots`) and the exported HF
  model (`hf_actor`) when the run ends.

W&B runs offline unless WANDB_MODE says otherwise: the run directory `<run dir>/wandb/offline-run-*` is what
`wandb sync` uploads, and nothing asks for a login or touches the network. MLflow logs to
MLFLOW_TRACKING_URI when it is set, else to a file store at `<run dir>/mlruns`.

Resume (`resume_from_step=k`) keeps each service's record equal to metrics.jsonl's, steps <= k then the
redone ones, without the steps a crashed run logged after its checkpoint:
- W&B: the same run id, rewound to step k (`resume_from="<id>?_step=k"`, applied by the server on sync);
- MLflow, whose metric history cannot be edited: a new run in the experiment that takes the old run's
  history up to step k, and the old run is deleted (MLflow's soft delete: it can be restored).
The run ids are kept in the run directory (`wandb/run_id`, `mlflow_run.json`). A fresh start
(`resume_from_step` <= 0) starts a new run; None continues the stored run, as metrics.jsonl is appended to.
"""
from __future__ import annotations

import json
import logging
import os
import re
import time
from pathlib import Path
from typing import Any, Optional

from hybridflow.config.preflight import check_logger_library

log = logging.getLogger(__name__)

# MLflow refuses a param value longer than this (mlflow.utils.validation.MAX_PARAM_VAL_LENGTH in 3.x).
_MLFLOW_PARAM_CHARS = 6000
_MLFLOW_BATCH = 1000  # metrics per log_batch call, MLflow's limit


def flatten(config: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """{"actor": {"optim": {"lr": 1e-3}}} -> {"actor.optim.lr": 1e-3}; lists and None stay values."""
    flat: dict[str, Any] = {}
    for key, value in config.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            flat.update(flatten(value, name + "."))
        else:
            flat[name] = value
    return flat


def _artifact_name(text: str) -> str:
    """W&B artifact names take letters, digits, '-', '_' and '.'."""
    return re.sub(r"[^A-Za-z0-9_.-]", "_", text)


class WandbLogger:
    """One W&B run per hybridflow run, offline by default; its id is kept in `run_dir/wandb/run_id`."""

    def __init__(self, run_dir: Path, resume_from_step: Optional[int], config: dict[str, Any],
                 project: str, name: str):
        check_logger_library("wandb")
        import wandb

        self.name = name
        root = run_dir / "wandb"
        root.mkdir(parents=True, exist_ok=True)
        self._id_file = root / "run_id"
        stored = self._id_file.read_text().strip() if self._id_file.is_file() else None
        resume: dict[str, Any] = {}
        if stored and resume_from_step is not None and resume_from_step > 0:
            resume = {"resume_from": f"{stored}?_step={resume_from_step}"}  # rewind: drops the steps after k
        elif stored and resume_from_step is None:
            resume = {"id": stored, "resume": "allow"}
        # A W&B service of the caller's own (a run of theirs is active) is left running at close.
        self._owns_service = wandb.run is None
        # console="off": the console logger prints the run's lines; wrapping stdout would also intercept
        # Ray's forwarded worker logs. reinit="create_new": a run of the caller's own stays untouched.
        self._run = wandb.init(project=project, name=name, dir=str(run_dir), config=config,
                               mode=os.environ.get("WANDB_MODE", "offline"), reinit="create_new",
                               settings=wandb.Settings(console="off"), **resume)
        self._id_file.write_text(self._run.id)
        self._wandb = wandb

    @property
    def run_id(self) -> str:
        return self._run.id

    def log(self, step: int, metrics: dict[str, float]) -> None:
        self._run.log(metrics, step=step)

    def add_artifact(self, path: Path, kind: str) -> None:
        # policy="immutable" references the file in the run directory instead of copying it to wandb's
        # staging area (the exported model is the run's largest file).
        artifact = self._wandb.Artifact(_artifact_name(f"{self.name}-{kind}"), type=kind)
        if path.is_dir():
            artifact.add_dir(str(path), policy="immutable")
        else:
            artifact.add_file(str(path), policy="immutable")
        self._run.log_artifact(artifact)

    def close(self, failed: bool = False) -> None:
        """Finish the run. `finish` returns before wandb's service has closed the run file; the teardown
        waits for that, so the offline run is complete (ready for `wandb sync`) when this returns and no
        service process outlives the run."""
        self._run.finish(exit_code=1 if failed else 0)
        if self._owns_service:
            self._wandb.teardown()


class MlflowLogger:
    """One MLflow run per hybridflow run (experiment: trainer.project, run name: trainer.experiment)."""

    def __init__(self, run_dir: Path, resume_from_step: Optional[int], config: dict[str, Any],
                 project: str, name: str):
        check_logger_library("mlflow")
        from mlflow.entities import Param
        from mlflow.tracking import MlflowClient

        uri = os.environ.get("MLFLOW_TRACKING_URI") or (run_dir / "mlruns").absolute().as_uri()
        if uri.startswith("file:") or "://" not in uri:
            # MLflow 3 keeps its file store in maintenance mode and refuses it unless this says it is wanted;
            # a local directory beside the run is what needs no server or database.
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        self.uri = uri
        self._client = MlflowClient(uri)
        self._state = run_dir / "mlflow_run.json"
        experiment = self._client.get_experiment_by_name(project)
        experiment_id = experiment.experiment_id if experiment else self._client.create_experiment(project)
        previous = self._previous_run()
        if previous is not None and resume_from_step is None:
            self.run_id = previous
            self._client.update_run(previous, status="RUNNING")
        else:
            self.run_id = self._client.create_run(experiment_id, run_name=name,
                                                  tags={"hybridflow.run_dir": str(run_dir)}).info.run_id
            params = [Param(k, str(v)[:_MLFLOW_PARAM_CHARS]) for k, v in config.items()]
            for i in range(0, len(params), 100):  # MLflow takes at most 100 params per batch
                self._client.log_batch(self.run_id, params=params[i:i + 100])
            if previous is not None and resume_from_step is not None and resume_from_step > 0:
                self._take_history(previous, resume_from_step)
        self._state.write_text(json.dumps({"tracking_uri": uri, "run_id": self.run_id}))

    def _previous_run(self) -> Optional[str]:
        """The run id this run directory logged to before, when it was this tracking URI's and still exists."""
        if not self._state.is_file():
            return None
        state = json.loads(self._state.read_text())
        if state.get("tracking_uri") != self.uri:
            return None
        from mlflow.exceptions import MlflowException

        try:
            run = self._client.get_run(state["run_id"])
        except MlflowException:  # purged, or not this store's: start a new run
            return None
        return run.info.run_id if run.info.lifecycle_stage == "active" else None

    def _take_history(self, old: str, step: int) -> None:
        """The old run's metric history up to `step` into this run; then the old run is (soft) deleted."""
        from mlflow.entities import Metric

        kept = []
        for key in self._client.get_run(old).data.metrics:
            kept += [Metric(m.key, m.value, m.timestamp, m.step)
                     for m in self._client.get_metric_history(old, key) if m.step <= step]
        kept.sort(key=lambda m: (m.step, m.timestamp))
        for i in range(0, len(kept), _MLFLOW_BATCH):
            self._client.log_batch(self.run_id, metrics=kept[i:i + _MLFLOW_BATCH])
        self._client.set_tag(self.run_id, "hybridflow.resumed_from", f"{old} at step {step}")
        self._client.set_terminated(old, status="KILLED")
        self._client.delete_run(old)

    def log(self, step: int, metrics: dict[str, float]) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        batch = [Metric(_mlflow_name(k), float(v), now, step) for k, v in metrics.items()]
        for i in range(0, len(batch), _MLFLOW_BATCH):
            self._client.log_batch(self.run_id, metrics=batch[i:i + _MLFLOW_BATCH])

    def add_artifact(self, path: Path, kind: str) -> None:
        if path.is_dir():
            self._client.log_artifacts(self.run_id, str(path), artifact_path=kind)
        else:
            self._client.log_artifact(self.run_id, str(path), artifact_path=kind)

    def close(self, failed: bool = False) -> None:
        self._client.set_terminated(self.run_id, status="FAILED" if failed else "FINISHED")


def _mlflow_name(name: str) -> str:
    """A metric name as MLflow stores it: it refuses characters other than letters, digits and _ - . space : /
    (the whole batch fails), so any other becomes "_"."""
    return "".join(c if c.isalnum() or c in "_-. :/" else "_" for c in name)
