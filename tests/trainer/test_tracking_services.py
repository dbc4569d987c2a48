"""The wandb and mlflow loggers against the real libraries: W&B offline (its run file read back record by
record), MLflow on a local file store (read back with its client); a tiny training run and resume."""
import json
import math
import re
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from hybridflow.config.loader import to_dict
from hybridflow.errors import ConfigError
from hybridflow.trainer import Tracker, read_metrics
from hybridflow.trainer.tracking_services import flatten

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def offline(monkeypatch):
    """No network, whatever the developer's shell says: W&B offline, MLflow on the run's own file store."""
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)


# --- reading back what the services wrote -----------------------------------------------------------------

def wandb_records(run_dir: Path) -> list:
    """The protobuf records of a W&B offline run's `.wandb` file (wandb 0.31 has no Python reader of its own).

    The file is a LevelDB-style log, as wandb's `sdk/internal/datastore.py` wrote it: a 7-byte header
    (":W&B", magic, version), then 32 KiB blocks of chunks, each `crc32 (4) | length (2) | type (1) | data`
    with type 1 = a whole record, 2/3/4 = its first/middle/last part; a block's tail under 7 bytes is
    padding."""
    from wandb.proto import wandb_internal_pb2 as pb

    (path,) = run_dir.glob("run-*.wandb")
    data = path.read_bytes()
    assert data[:4] == b":W&B"
    records, pos, part = [], 7, b""
    while pos + 7 <= len(data):
        if 32768 - pos % 32768 < 7:
            pos += 32768 - pos % 32768
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if kind == 0:
            break
        part += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):
            record = pb.Record()
            record.ParseFromString(part)
            records.append(record)
            part = b""
    return records


def wandb_run(run_dir: Path) -> dict:
    """One offline run's id, config, history ({step: {key: value}}), artifacts and exit code."""
    out = {"config": {}, "history": {}, "artifacts": {}, "exit_code": None}
    for r in wandb_records(run_dir):
        kind = r.WhichOneof("record_type")
        if kind == "run":
            out["id"], out["project"], out["name"] = r.run.run_id, r.run.project, r.run.display_name
            out["config"].update({i.key: json.loads(i.value_json) for i in r.run.config.update})
        elif kind == "config":
            out["config"].update({i.key: json.loads(i.value_json) for i in r.config.update})
        elif kind == "history":
            items = {(i.key or "/".join(i.nested_key)): json.loads(i.value_json) for i in r.history.item}
            row = {k: v for k, v in items.items() if not k.startswith("_")}  # _step, _runtime, _timestamp
            out["history"].setdefault(r.history.step.num, {}).update(row)
        elif kind == "artifact":
            out["artifacts"][r.artifact.type] = sorted(m.path for m in r.artifact.manifest.contents)
        elif kind == "exit":
            out["exit_code"] = r.exit.exit_code
    return out


def mlflow_client(run_dir: Path):
    from mlflow.tracking import MlflowClient

    state = json.loads((run_dir / "mlflow_run.json").read_text())
    assert state["tracking_uri"] == (run_dir / "mlruns").absolute().as_uri()
    return MlflowClient(state["tracking_uri"]), state["run_id"]


def mlflow_history(client, run_id: str) -> dict[int, dict[str, float]]:
    out: dict[int, dict[str, float]] = {}
    for key in client.get_run(run_id).data.metrics:
        for m in client.get_metric_history(run_id, key):
            assert key not in out.get(m.step, {}), f"{key} logged twice at step {m.step}"
            out.setdefault(m.step, {})[key] = m.value
    return out


def mlflow_artifacts(client, run_id: str, path: str = "") -> list[str]:
    found = []
    for f in client.list_artifacts(run_id, path or None):
        found += mlflow_artifacts(client, run_id, f.path) if f.is_dir else [f.path]
    return sorted(found)


def same(a, b) -> bool:
    """One number logged to two places (NaN reads back as NaN)."""
    return (isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b)) or a == b


def jsonl_history(run_dir: Path) -> dict[int, dict]:
    return {r["step"]: {k: v for k, v in r.items() if k != "step"} for r in read_metrics(run_dir)}


# --- a tiny training run ------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def megatron_world():
    from hybridflow.engine.distributed import init_process_group
    init_process_group("cpu")


@pytest.mark.slow
@pytest.mark.usefixtures("megatron_world")
def test_a_resumed_tiny_run_is_recorded_in_wandb_and_mlflow_as_in_metrics_jsonl(tmp_path):
    from hybridflow.config.loader import load_config
    from hybridflow.trainer.trainer import RLTrainer

    def run(*extra: str, stop_after=None):
        cfg = load_config(ROOT / "configs" / "tiny-grpo.yaml", [
            f"trainer.output_dir={tmp_path}", f"model.path={ROOT / 'hybridflow/assets/demo_model'}",
            f"data.train_files=[{ROOT / 'hybridflow/assets/arithmetic/train.parquet'}]",
            f"data.val_files=[{ROOT / 'hybridflow/assets/arithmetic/test.parquet'}]", "data.val_max_samples=16",
            "trainer.total_steps=2", "trainer.save_every=1", "trainer.val_every=0",
            "trainer.loggers=[jsonl,wandb,mlflow]", *extra])
        return cfg, RLTrainer(cfg).fit(stop_after=stop_after)

    run(stop_after=1)  # stopped after step 1 (its checkpoint saved), then resumed to the end
    cfg, summary = run("trainer.resume=auto")
    run_dir = summary["run_dir"]
    want = jsonl_history(run_dir)
    assert sorted(want) == [0, 1, 2]
    params = {k: str(v) for k, v in flatten(to_dict(cfg)).items()}

    client, run_id = mlflow_client(run_dir)
    got = client.get_run(run_id)
    assert got.info.status == "FINISHED" and got.info.run_name == "tiny-grpo"
    assert client.get_experiment(got.info.experiment_id).name == "hybridflow"
    assert got.data.params == params  # the resumed run's config, flattened
    history = mlflow_history(client, run_id)  # steps 0 and 1 taken over from the first run, 2 logged here
    assert history.keys() == want.keys()
    for step, row in want.items():
        assert history[step].keys() == row.keys()
        assert all(same(history[step][k], float(v)) for k, v in row.items()), step
    artifacts = mlflow_artifacts(client, run_id)
    assert "plots/metrics.png" in artifacts
    assert {"hf_actor/config.json", "hf_actor/model.safetensors"} <= set(artifacts)

    first, second = sorted((run_dir / "wandb").glob("offline-run-*"))
    before, after = wandb_run(first), wandb_run(second)
    assert before["id"] == after["id"] == (run_dir / "wandb" / "run_id").read_text()
    assert (before["project"], before["name"]) == ("hybridflow", "tiny-grpo")
    assert before["exit_code"] == after["exit_code"] == 0
    assert after["config"]["_wandb"]["branch_point"] == {"run_id": before["id"], "step": 1}  # rewound to 1
    assert {k: after["config"][k] for k in params} == json.loads(json.dumps(flatten(to_dict(cfg))))
    assert sorted(before["history"]) == [0, 1] and sorted(after["history"]) == [2]
    for step, row in {**before["history"], **after["history"]}.items():
        assert row.keys() == want[step].keys()
        assert all(same(float(row[k]), float(v)) for k, v in want[step].items()), step
    assert after["artifacts"]["plots"] == ["metrics.png"]
    assert {"config.json", "model.safetensors"} <= set(after["artifacts"]["hf_actor"])
    # What `wandb sync` would upload (a dry run names the run files and touches no network).
    sync = subprocess.run([str(Path(sys.executable).parent / "wandb"), "sync", "--dry-run", str(second)],
                          capture_output=True, text=True, timeout=60)
    assert sync.returncode == 0 and f"run-{after['id']}.wandb" in sync.stdout + sync.stderr


# --- resume and errors, on the Tracker alone ------------------------------------------------------------------

def test_resume_drops_the_steps_after_the_checkpoint_from_mlflow_and_rewinds_wandb(tmp_path):
    config = {"actor": {"optim": {"lr": 1e-3}}, "data": {"files": ["a.parquet"]}, "critic": {"model_path": None}}
    with Tracker(tmp_path, ["mlflow", "wandb"], 10, config=config, project="p", name="crash") as tracker:
        for step in range(1, 8):
            tracker.log(step, {"x": float(step), "y": step})
        old_mlflow = tracker.loggers["mlflow"].run_id
    # The checkpoint was at step 5; 6 and 7 are redone with other values.
    with Tracker(tmp_path, ["mlflow", "wandb"], 10, config=config, project="p", name="crash",
                 resume_from_step=5) as tracker:
        for step in range(6, 9):
            tracker.log(step, {"x": 10.0 * step, "y": step})
    client, run_id = mlflow_client(tmp_path)
    assert run_id != old_mlflow and client.get_run(old_mlflow).info.lifecycle_stage == "deleted"
    want = {s: {"x": float(s) if s <= 5 else 10.0 * s, "y": float(s)} for s in range(1, 9)}
    assert mlflow_history(client, run_id) == want
    assert client.get_run(run_id).data.params == {"actor.optim.lr": "0.001", "data.files": "['a.parquet']",
                                                  "critic.model_path": "None"}
    assert [r.info.run_id for r in client.search_runs([client.get_run(run_id).info.experiment_id])] == [run_id]

    first, second = sorted((tmp_path / "wandb").glob("offline-run-*"))
    before, after = wandb_run(first), wandb_run(second)
    assert sorted(before["history"]) == list(range(1, 8)) and sorted(after["history"]) == [6, 7, 8]
    assert after["config"]["_wandb"]["branch_point"] == {"run_id": before["id"], "step": 5}
    assert after["history"][6] == {"x": 60.0, "y": 6}
    assert before["config"]["actor.optim.lr"] == 1e-3 and before["config"]["data.files"] == ["a.parquet"]

    # Without resume_from_step (an appended metrics.jsonl), both continue the stored run.
    with Tracker(tmp_path, ["mlflow", "wandb"], 10, config=config, project="p", name="crash") as tracker:
        tracker.log(9, {"x": 9.0})
        assert tracker.loggers["mlflow"].run_id == run_id
        assert tracker.loggers["wandb"].run_id == before["id"]
    assert mlflow_history(client, run_id)[9] == {"x": 9.0}
    # A fresh start (the trainer passes -1) is a new run.
    with Tracker(tmp_path, ["mlflow"], 10, config=config, project="p", resume_from_step=-1) as tracker:
        assert tracker.loggers["mlflow"].run_id != run_id


def test_an_error_in_the_run_marks_it_failed(tmp_path):
    with pytest.raises(RuntimeError, match="boom"):
        with Tracker(tmp_path, ["mlflow", "wandb"], 2, project="p") as tracker:
            tracker.log(1, {"x": 1.0})
            raise RuntimeError("boom")
    client, run_id = mlflow_client(tmp_path)
    assert client.get_run(run_id).info.status == "FAILED"
    (run,) = (tmp_path / "wandb").glob("offline-run-*")
    assert wandb_run(run)["exit_code"] == 1


@pytest.mark.parametrize("name, pip", [("wandb", "pip install 'hybridflow[wandb]' (or: pip install wandb)"),
                                       ("mlflow", "pip install 'hybridflow[mlflow]' (or: pip install mlflow-skinny)")])
def test_a_logger_whose_library_is_missing_names_trainer_loggers_and_the_pip_command(tmp_path, monkeypatch,
                                                                                       name, pip):
    monkeypatch.setitem(sys.modules, name, None)  # the library does not import
    with pytest.raises(ConfigError) as err:
        Tracker(tmp_path, ["jsonl", name], 1)
    assert str(err.value).startswith(f"trainer.loggers: {name!r} needs the {name} package")
    assert pip in str(err.value)

    # The trainer's preflight says so before any worker starts.
    from hybridflow.config.loader import load_config
    from hybridflow.trainer.trainer import RLTrainer

    cfg = load_config(ROOT / "configs" / "tiny-grpo.yaml", [
        f"trainer.output_dir={tmp_path}", f"model.path={ROOT / 'hybridflow/assets/demo_model'}",
        f"trainer.loggers=[console,{name}]"])
    with pytest.raises(ConfigError, match=rf"trainer.loggers: '{name}' needs .*{re.escape(pip)}"):
        RLTrainer(cfg)
