"""#13 item 6: Ctrl-C and a killed controller. The first Ctrl-C finishes the step, saves it and stops with
one line; a second abandons the step but never a checkpoint write; nothing the run started outlives it,
and a controller killed with SIGKILL leaves no Ray process behind either."""
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from hybridflow.checkpoint import CheckpointManager
from hybridflow.trainer.interrupt import GracefulInterrupt

ROOT = Path(__file__).resolve().parents[2]


def test_first_sigint_is_noted_the_second_raises(capsys):
    # Python's default handler, or SIG_IGN where the test process was started in the background (nohup, `&`)
    before = signal.getsignal(signal.SIGINT)
    with GracefulInterrupt() as interrupt:
        os.kill(os.getpid(), signal.SIGINT)
        assert interrupt.requested
        assert capsys.readouterr().err.count("hybridflow: interrupted:") == 1
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(1)  # the handler runs between bytecodes; never reached
    assert signal.getsignal(signal.SIGINT) is before  # restored


def test_a_second_sigint_waits_for_the_critical_section():
    finished = []
    with GracefulInterrupt() as interrupt:
        os.kill(os.getpid(), signal.SIGINT)
        with pytest.raises(KeyboardInterrupt):
            with interrupt.critical():
                os.kill(os.getpid(), signal.SIGINT)
                for _ in range(1000):
                    pass
                finished.append(True)  # a checkpoint write would complete here
    assert finished == [True]


def _run(tmp_path: Path, devices: int = 2, steps: int = 3) -> tuple[subprocess.Popen, Path]:
    """A Ray run of tiny-grpo on `devices` worker processes, once it has logged `steps` steps."""
    out = tmp_path / "runs"
    cmd = [sys.executable, "-m", "hybridflow.cli", "train", "configs/tiny-grpo.yaml", f"trainer.output_dir={out}",
           "trainer.total_steps=100000", "trainer.save_every=1", "trainer.val_every=0",
           "trainer.val_before_train=false", f"trainer.n_devices={devices}", "trainer.launcher=ray"]
    # its own session, as a terminal's foreground job: Ctrl-C reaches every process of the group
    proc = subprocess.Popen(cmd, cwd=ROOT, start_new_session=True, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    metrics = out / "tiny-grpo" / "metrics.jsonl"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and proc.poll() is None:
        if metrics.is_file() and len(metrics.read_text().splitlines()) >= steps:
            return proc, out / "tiny-grpo"
        time.sleep(0.5)
    proc.kill()
    raise AssertionError(f"the run did not reach step {steps}: {proc.communicate()[1][-2000:]}")


def _tree(pid: int) -> list[psutil.Process]:
    return [psutil.Process(pid), *psutil.Process(pid).children(recursive=True)]


def _still_alive(procs: list[psutil.Process], within_s: float) -> list[str]:
    deadline = time.monotonic() + within_s
    while True:
        alive = []
        for p in procs:
            try:
                if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                    alive.append(p.name())
            except psutil.Error:
                pass
        if not alive or time.monotonic() > deadline:
            return alive
        time.sleep(0.2)


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_ctrl_c_stops_after_the_step_saves_it_and_leaves_nothing_running(tmp_path):
    proc, run_dir = _run(tmp_path)
    procs = _tree(proc.pid)
    assert any("raylet" in p.name() for p in procs)  # the local cluster is in the tree checked below
    os.killpg(proc.pid, signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err[-2000:]
    assert "Traceback" not in err and err.count("hybridflow: interrupted:") == 1
    steps = [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    ckpt = CheckpointManager(run_dir / "checkpoints", keep_last=2)
    assert ckpt.latest()[0] == steps[-1]  # the step it finished is saved, intact (manifest checked)
    assert len(ckpt.all_steps()) == 2 and not [p for p in ckpt.root.iterdir() if p.name.startswith(".")]
    assert _still_alive(procs, within_s=10) == []


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_a_killed_controller_leaves_no_ray_process_behind(tmp_path):
    """Before: the dashboard and runtime-env agents outlived a SIGKILLed controller by about a minute.
    One worker process and one step are enough: what must not outlive the controller is Ray's own."""
    proc, _ = _run(tmp_path, devices=1, steps=1)
    procs = _tree(proc.pid)
    names = {p.name() for p in procs}
    assert {"ray::DashboardAgent", "ray::RuntimeEnvAgent"} <= names
    assert any(name.startswith("ray::_Host") for name in names), names  # the worker's actor process
    proc.kill()
    proc.communicate(timeout=30)
    assert _still_alive(procs, within_s=10) == []
