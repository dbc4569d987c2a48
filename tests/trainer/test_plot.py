"""plot_run and `hybridflow plot`: PNG from a synthetic metrics.jsonl, errors naming the path."""
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from hybridflow.cli import main
from hybridflow.trainer import PlotError, Tracker, plot_run
from hybridflow.trainer.plot import _series

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _run(tmp_path) -> Path:
    run = tmp_path / "run"
    with Tracker(run, ["jsonl"], total_steps=20) as tracker:
        for step in range(1, 21):
            metrics = {"reward/mean": step / 20, "actor/kl": 0.01 * math.sin(step),
                       "critic/vf_loss": float("nan"),  # all-NaN: skipped
                       "response/length_mean": 100 + step}
            if step % 5 == 0:
                metrics["val/accuracy"] = step / 40
            tracker.log(step, metrics)
    return run


def test_plot_run_writes_a_png(tmp_path):
    run = _run(tmp_path)
    paths = plot_run(run)
    assert paths == [run / "plots" / "metrics.png"]
    assert paths[0].read_bytes().startswith(PNG_MAGIC)


def test_series_skips_nan_and_keeps_the_last_value_of_a_repeated_step():
    records = [{"step": 2, "x": 1.0}, {"step": 1, "x": float("nan")}, {"step": 2, "x": 3.0},
               {"step": 3}, {"step": 4, "x": 5}]
    assert _series(records, "x") == ([2, 4], [3.0, 5.0])


def test_nothing_to_plot_is_a_plot_error_listing_what_is_there(tmp_path):
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "reward/mean": null, "other": 1}\n')
    with pytest.raises(PlotError, match="other"):
        plot_run(tmp_path)


def test_cli_plot_prints_the_paths(tmp_path, capsys):
    run = _run(tmp_path)
    assert main(["plot", str(run)]) == 0
    assert capsys.readouterr().out.strip() == str(run / "plots" / "metrics.png")


@pytest.mark.parametrize("make, named", [
    (lambda tmp: tmp / "missing", "missing"),
    (lambda tmp: tmp, "metrics.jsonl"),
])
def test_cli_plot_missing_run_dir_or_metrics_exits_2(tmp_path, capsys, make, named):
    target = make(tmp_path)
    assert main(["plot", str(target)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("hybridflow: error:") and named in err and str(tmp_path) in err


def test_cli_plot_as_a_subprocess_uses_no_display(tmp_path):
    run = _run(tmp_path)
    env = {**os.environ, "MPLBACKEND": "TkAgg", "DISPLAY": ""}  # Agg is used regardless
    proc = subprocess.run([sys.executable, "-m", "hybridflow.cli", "plot", str(run)],
                          capture_output=True, text=True, env=env, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert (run / "plots" / "metrics.png").is_file()
