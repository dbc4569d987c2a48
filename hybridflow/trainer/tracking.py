"""Per-step metrics to the console, `metrics.jsonl`, TensorBoard, Weights & Biases and MLflow.

    tracker = Tracker(run_dir, ["console", "jsonl"], total_steps=100)
    tracker.log(step, {"reward/mean": 0.4, "actor/kl": 1e-3})
    tracker.close()

The single controller owns the one Tracker of a run; workers return metrics
to it rather than logging themselves. `metrics.jsonl` is the run's record
(`hybridflow plot` reads it): one `{"step": s, ...}` object per line, flushed
each step, NaN written as `null` and infinities as `"inf"`/`"-inf"` so the file
stays strict JSON. The wandb and mlflow loggers (`tracking_services.py`, each
an optional extra imported only when named) also take the run's config and,
through `add_artifact`, the run's plot and exported model. A new backend is
one class with `log` and `close` (and `add_artifact` where files go) added to
LOGGERS.
"""
from __future__ import annotations

import contextlib
import json
import logging
import math
import sys
import time
from pathlib import Path
import typing
from typing import Callable, Optional, Protocol, TextIO

from hybridflow.config.schema import LoggerName
from hybridflow.common import atomic_write, nearest_name

log = logging.getLogger(__name__)

METRICS_FILE = "metrics.jsonl"

# (metric, short label) shown by the console logger, in this order.
CONSOLE_METRICS = (
    ("reward/mean", "reward"),
    ("val/accuracy", "val_acc"),
    ("actor/kl", "kl"),
    ("actor/entropy", "entropy"),
    ("response/length_mean", "len"),
    ("perf/tokens_per_s", "tok/s"),
)


class _Logger(Protocol):
    def log(self, step: int, metrics: dict[str, float]) -> None: ...

    def close(self, failed: bool = False) -> None: ...  # failed: the run ended in an error


class _FileLogger(_Logger, Protocol):
    """A logger that also keeps files (plots, models) with the run: wandb, mlflow."""

    def add_artifact(self, path: Path, kind: str) -> None: ...


# --- metrics.jsonl ------------------------------------------------------------

def _to_number(key: str, value) -> float | int:
    """A metric as a plain int or float; 0-d tensors and numpy scalars are accepted."""
    if isinstance(value, bool):
        return int(value)
    if isinstance(value, int):
        return value
    try:
        return float(value)
    except (TypeError, ValueError, RuntimeError) as exc:  # RuntimeError: multi-element tensor
        raise TypeError(f"metric {key!r} must be a number, got {type(value).__name__}") from exc


def _encode(value: float | int):
    if isinstance(value, float) and not math.isfinite(value):
        return None if math.isnan(value) else ("inf" if value > 0 else "-inf")
    return value


def _decode(value):
    if value is None:
        return math.nan
    if isinstance(value, str) and value.lower() in ("nan", "inf", "-inf", "+inf"):
        return float(value)
    return value


def read_metrics(path: Path | str) -> list[dict]:
    """The records of a metrics.jsonl (a run dir is also accepted), in file order.

    NaN comes back as float('nan'), "inf"/"-inf" as floats. A last line cut
    off by a crash mid-write is skipped; a corrupt line elsewhere raises
    ValueError naming the file and line.
    """
    path = Path(path)
    if path.is_dir():
        path = path / METRICS_FILE
    if not path.is_file():
        raise FileNotFoundError(f"no metrics file {path}")
    raw = path.read_bytes()
    try:
        lines = raw.decode("utf-8").splitlines()
    except UnicodeDecodeError as exc:
        lineno = raw[:exc.start].count(b"\n") + 1
        raise ValueError(f"{path}:{lineno}: not UTF-8 text (byte {raw[exc.start]:#04x})") from None
    records = []
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            raw = json.loads(line)
        except json.JSONDecodeError as exc:
            if i == len(lines) - 1:
                break
            raise ValueError(f"{path}:{i + 1}: not a JSON object ({exc})") from exc
        records.append({k: _decode(v) for k, v in raw.items()})
    return records


def _truncate_after(path: Path, step: int) -> None:
    """Drop records with step > `step` (and a torn last line), atomically."""
    if not path.is_file():
        return
    kept = "".join(_dump(r) + "\n" for r in read_metrics(path) if r.get("step", 0) <= step)
    atomic_write(path, lambda f: f.write(kept.encode()))


def _dump(record: dict) -> str:
    return json.dumps({k: _encode(v) for k, v in record.items()}, allow_nan=False)


class JsonlLogger:
    """Appends one JSON object per step to `run_dir/metrics.jsonl`."""

    def __init__(self, run_dir: Path, resume_from_step: Optional[int]):
        self.path = run_dir / METRICS_FILE
        if resume_from_step is not None:
            _truncate_after(self.path, resume_from_step)
        self._file = open(self.path, "a")

    def log(self, step: int, metrics: dict[str, float]) -> None:
        with self._named_errors():
            self._file.write(_dump({"step": step, **metrics}) + "\n")
            self._file.flush()

    def close(self, failed: bool = False) -> None:
        with self._named_errors():
            self._file.close()

    @contextlib.contextmanager
    def _named_errors(self):
        """A failed write (a full disk) names this file: a buffered flush raises OSError without a filename."""
        try:
            yield
        except OSError as exc:
            if exc.filename is not None or exc.errno is None:
                raise
            raise OSError(exc.errno, exc.strerror, str(self.path)) from None


# --- console -----------------------------------------------------------------

def _duration(seconds: float) -> str:
    seconds = int(seconds)
    h, rest = divmod(seconds, 3600)
    m, s = divmod(rest, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m}:{s:02d}"


def _short(value: float | int) -> str:
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if abs(value) >= 1000:
        return f"{value:.0f}"
    return f"{value:.4g}"


class ConsoleLogger:
    """One plain line per step: progress bar, elapsed/ETA and the key metrics.

    Plain lines (no carriage returns or curses) so that redirected logs and
    Ray's log forwarding stay readable.
    """

    BAR = 20

    def __init__(self, total_steps: int, start_step: int,
                 stream: Optional[TextIO] = None, clock: Callable[[], float] = time.monotonic):
        self.total = max(total_steps, 1)
        self.start_step = start_step
        self.stream = stream
        self.clock = clock
        self.t0 = clock()

    def line(self, step: int, metrics: dict[str, float]) -> str:
        frac = min(max(step / self.total, 0.0), 1.0)
        filled = int(round(frac * self.BAR))
        bar = "#" * filled + "-" * (self.BAR - filled)
        elapsed = self.clock() - self.t0
        done = step - self.start_step
        eta = _duration(elapsed / done * max(self.total - step, 0)) if done > 0 else "?"
        width = len(str(self.total))
        parts = [f"step {step:>{width}}/{self.total} [{bar}] {frac:4.0%}",
                 f"{_duration(elapsed)} elapsed, eta {eta}"]
        shown = [f"{label} {_short(metrics[key])}" for key, label in CONSOLE_METRICS
                 if key in metrics]
        if shown:
            parts.append("  ".join(shown))
        return " | ".join(parts)

    def log(self, step: int, metrics: dict[str, float]) -> None:
        # sys.stdout is looked up per call so redirection after start is honoured.
        print(self.line(step, metrics), file=self.stream or sys.stdout, flush=True)

    def close(self, failed: bool = False) -> None:
        pass


# --- tensorboard -------------------------------------------------------------

class TensorboardLogger:
    """Scalars to `run_dir/tensorboard`; a no-op with one warning without tensorboard."""

    def __init__(self, run_dir: Path, resume_from_step: Optional[int]):
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as exc:
            log.warning("tensorboard logger skipped: the tensorboard package is not "
                        "importable (%s); `pip install tensorboard` to enable it", exc)
            self._writer = None
            return
        # purge_step hides events a crashed run wrote after the resume point.
        purge = None if resume_from_step is None else resume_from_step + 1
        self._writer = SummaryWriter(log_dir=str(run_dir / "tensorboard"), purge_step=purge)

    @property
    def enabled(self) -> bool:
        return self._writer is not None

    def log(self, step: int, metrics: dict[str, float]) -> None:
        if self._writer is None:
            return
        for key, value in metrics.items():
            self._writer.add_scalar(key, value, global_step=step)
        self._writer.flush()

    def close(self, failed: bool = False) -> None:
        if self._writer is not None:
            self._writer.close()


LOGGERS = typing.get_args(LoggerName)


class Tracker:
    """Sends each step's metrics to the named loggers (console, jsonl, tensorboard, wandb, mlflow).

    `resume_from_step=k` continues a run that is resuming from the checkpoint
    of step k: metrics.jsonl records with step > k (written after that
    checkpoint, before the crash) are dropped so no step appears twice, and
    the console ETA counts only steps done since k; TensorBoard, W&B and
    MLflow drop them their own ways (`tracking_services.py`). Without it, an
    existing metrics.jsonl is appended to; pass 0 to start it afresh.

    `config` (nested plain data, `config.loader.to_dict`), `project` and
    `name` (default: the run directory's name) describe the run to W&B and
    MLflow; the other loggers ignore them.
    """

    def __init__(self, run_dir: Path | str, loggers: list[str], total_steps: int, *,
                 resume_from_step: Optional[int] = None, stream: Optional[TextIO] = None,
                 config: Optional[dict] = None, project: str = "hybridflow", name: Optional[str] = None):
        for logger_name in loggers:
            if logger_name not in LOGGERS:
                close = nearest_name(logger_name, LOGGERS)
                hint = f"did you mean {close!r}? " if close else ""
                raise ValueError(f"unknown logger {logger_name!r}: {hint}valid loggers: {', '.join(LOGGERS)}")
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.total_steps = total_steps
        self.loggers: dict[str, _Logger] = {}  # a name given twice logs once
        self._closed = False
        try:
            for logger_name in loggers:
                if logger_name not in self.loggers:
                    self.loggers[logger_name] = self._build(logger_name, resume_from_step, stream, config or {},
                                                            project, name or self.run_dir.name)
        except BaseException:
            self.close(failed=True)  # the loggers already started (a W&B run) end, not linger
            raise

    def _build(self, logger_name: str, resume_from_step: Optional[int], stream: Optional[TextIO],
               config: dict, project: str, name: str) -> _Logger:
        if logger_name == "console":
            return ConsoleLogger(self.total_steps, resume_from_step or 0, stream)
        if logger_name == "jsonl":
            return JsonlLogger(self.run_dir, resume_from_step)
        if logger_name == "tensorboard":
            return TensorboardLogger(self.run_dir, resume_from_step)
        from hybridflow.trainer import tracking_services

        cls = tracking_services.WandbLogger if logger_name == "wandb" else tracking_services.MlflowLogger
        return cls(self.run_dir, resume_from_step, tracking_services.flatten(config), project, name)

    def log(self, step: int, metrics: dict[str, float]) -> None:
        """Record `metrics` for `step` in every logger."""
        if self._closed:
            raise RuntimeError("Tracker.log after close()")
        if "step" in metrics:
            raise ValueError("'step' is reserved for the step number; rename that metric")
        clean = {k: _to_number(k, v) for k, v in metrics.items()}
        for logger in self.loggers.values():
            logger.log(int(step), clean)

    def add_artifact(self, path: Path | str, kind: str) -> None:
        """Keep the file or directory `path` with the run, under `kind` ("plots", "hf_actor"), in every
        logger that keeps files (wandb, mlflow); the others have it in the run directory already."""
        if self._closed:
            raise RuntimeError("Tracker.add_artifact after close()")
        path = Path(path)
        if not path.exists():
            raise FileNotFoundError(f"artifact {path} does not exist")
        for logger in self.loggers.values():
            if hasattr(logger, "add_artifact"):
                typing.cast(_FileLogger, logger).add_artifact(path, kind)

    def close(self, failed: bool = False) -> None:
        """Flush and close every logger (`failed`: W&B and MLflow mark the run failed); calling it twice is
        harmless."""
        if self._closed:
            return
        self._closed = True
        for logger in self.loggers.values():
            logger.close(failed=failed)

    def __enter__(self) -> "Tracker":
        return self

    def __exit__(self, exc_type, *exc) -> None:
        self.close(failed=exc_type is not None)
