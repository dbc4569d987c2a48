"""Tracker: metrics.jsonl roundtrip, console lines, logger names, TensorBoard, resume."""
import json
import logging
import math
import sys

import pytest

from hybridflow.trainer import Tracker, read_metrics
from hybridflow.trainer.tracking import ConsoleLogger


def test_jsonl_roundtrip_keeps_ints_floats_nan_and_inf(tmp_path):
    with Tracker(tmp_path, ["jsonl"], total_steps=3) as tracker:
        tracker.log(1, {"reward/mean": 0.5, "response/length_mean": 12, "actor/kl": float("nan")})
        # Flushed each step: readable before close.
        assert read_metrics(tmp_path / "metrics.jsonl")[0]["step"] == 1
        tracker.log(2, {"reward/mean": float("inf"), "actor/kl": -float("inf")})
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    for line in lines:  # strict JSON, no bare NaN/Infinity
        json.loads(line, parse_constant=lambda c: pytest.fail(f"non-standard constant {c}"))
    first, second = read_metrics(tmp_path)
    assert first["step"] == 1 and first["reward/mean"] == 0.5
    assert first["response/length_mean"] == 12 and isinstance(first["response/length_mean"], int)
    assert math.isnan(first["actor/kl"])
    assert second["reward/mean"] == math.inf and second["actor/kl"] == -math.inf


def test_numpy_and_tensor_scalars_are_accepted(tmp_path):
    import numpy as np
    import torch

    with Tracker(tmp_path, ["jsonl"], total_steps=1) as tracker:
        tracker.log(1, {"a": np.float32(0.25), "b": torch.tensor(2.0)})
        with pytest.raises(TypeError, match="'c'"):
            tracker.log(2, {"c": "high"})
        with pytest.raises(ValueError, match="reserved"):
            tracker.log(2, {"step": 3})
    assert read_metrics(tmp_path) == [{"step": 1, "a": 0.25, "b": 2.0}]


def test_read_metrics_skips_a_torn_last_line_and_names_a_corrupt_one(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1, "x": 1.0}\n{"step": 2, "x"')
    assert read_metrics(path) == [{"step": 1, "x": 1.0}]
    path.write_text('{"step": 1}\ngarbage\n{"step": 3}\n')
    with pytest.raises(ValueError, match="metrics.jsonl:2"):
        read_metrics(path)
    with pytest.raises(FileNotFoundError, match="nope"):
        read_metrics(tmp_path / "nope")


def test_console_prints_one_line_per_step_with_progress_and_metrics(tmp_path, capsys):
    with Tracker(tmp_path, ["console"], total_steps=10) as tracker:
        tracker.log(5, {"reward/mean": 0.625, "actor/kl": 0.00123, "perf/tokens_per_s": 1234.5,
                        "other/metric": 7.0})
    out = capsys.readouterr().out
    assert out.count("\n") == 1 and "\r" not in out
    assert "step  5/10" in out and "50%" in out and "eta" in out
    assert "reward 0.625" in out and "kl 0.00123" in out and "tok/s 1234" in out
    assert "other/metric" not in out
    assert not (tmp_path / "metrics.jsonl").exists()


def test_console_eta_counts_steps_since_resume():
    now = [100.0]
    console = ConsoleLogger(total_steps=100, start_step=50, clock=lambda: now[0])
    now[0] += 60.0  # 10 steps in a minute -> 40 left take 4 minutes
    line = console.line(60, {"val/accuracy": float("nan")})
    assert "1:00 elapsed, eta 4:00" in line and "val_acc nan" in line
    assert "[############--------]" in line


def test_unknown_logger_names_it_the_valid_ones_and_a_suggestion(tmp_path):
    with pytest.raises(ValueError) as err:
        Tracker(tmp_path, ["console", "tensorbord"], total_steps=1)
    msg = str(err.value)
    assert "'tensorbord'" in msg and "did you mean 'tensorboard'" in msg
    assert "console, jsonl, tensorboard" in msg


def test_tensorboard_writes_an_events_file(tmp_path):
    # tensorboard is in the `dev` extra: a missing one is a broken install, not a reason to skip.
    with Tracker(tmp_path, ["tensorboard"], total_steps=2) as tracker:
        tracker.log(1, {"reward/mean": 0.5, "actor/kl": float("nan")})
    events = list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))
    assert events and events[0].stat().st_size > 0


def test_tensorboard_missing_warns_once_and_skips(tmp_path, monkeypatch, caplog):
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)  # import fails
    with caplog.at_level(logging.WARNING, logger="hybridflow.trainer.tracking"):
        with Tracker(tmp_path, ["tensorboard", "jsonl"], total_steps=2) as tracker:
            tracker.log(1, {"x": 1.0})
            tracker.log(2, {"x": 2.0})
    warnings = [r for r in caplog.records if "tensorboard" in r.getMessage()]
    assert len(warnings) == 1
    assert not (tmp_path / "tensorboard").exists()
    assert [r["step"] for r in read_metrics(tmp_path)] == [1, 2]


def test_resume_truncates_steps_after_the_checkpoint(tmp_path):
    with Tracker(tmp_path, ["jsonl"], total_steps=10) as tracker:
        for step in range(1, 8):
            tracker.log(step, {"x": float(step)})
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"step": 8, "x"')  # torn by the crash
    # The checkpoint was at step 5; steps 6-8 are redone.
    with Tracker(tmp_path, ["jsonl"], total_steps=10, resume_from_step=5) as tracker:
        assert [r["step"] for r in read_metrics(tmp_path)] == [1, 2, 3, 4, 5]
        for step in range(6, 9):
            tracker.log(step, {"x": 10.0 * step})
    records = read_metrics(tmp_path)
    assert [r["step"] for r in records] == list(range(1, 9))
    assert records[5]["x"] == 60.0


def test_close_is_idempotent_and_log_after_close_fails(tmp_path):
    tracker = Tracker(tmp_path, ["jsonl", "console"], total_steps=1)
    tracker.close()
    tracker.close()
    with pytest.raises(RuntimeError):
        tracker.log(1, {})
