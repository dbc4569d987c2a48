"""Every file in configs/ validates against the schema."""
from pathlib import Path

import pytest

from hybridflow.cli import main
from hybridflow.config.loader import load_config

CONFIGS = sorted((Path(__file__).resolve().parents[2] / "configs").glob("*.yaml"))


def test_configs_exist():
    assert len(CONFIGS) >= 2


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_shipped_config_validates(path):
    cfg = load_config(path)
    assert cfg.model.path


def test_cli_prints_resolved_config_and_reports_errors(capsys):
    assert main(["config", str(CONFIGS[0]), "rollout.n=4"]) == 0
    assert "n: 4" in capsys.readouterr().out
    assert main(["config", str(CONFIGS[0]), "rollout.nn=4"]) == 2
    assert "rollout.nn: unknown key (did you mean 'n'?)" in capsys.readouterr().err


def test_cli_bench_names_unknown_benchmarks(capsys):
    assert main(["bench", "nope"]) == 2
    err = capsys.readouterr().err
    assert "bench_nope.py" in err and "'kernels'" in err and "'rollout'" in err
