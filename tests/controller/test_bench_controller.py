"""The controller benchmark's measurement runs (tiny sizes); its figures are not asserted."""
import importlib.util
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_controller.py"


def _bench():
    spec = importlib.util.spec_from_file_location("bench_controller_under_test", BENCH)
    bench = importlib.util.module_from_spec(spec)  # not in sys.modules: Ray ships its classes by value
    spec.loader.exec_module(bench)
    return bench


@pytest.mark.timeout(120)
def test_measure_dispatch_overhead_reports_every_variant(ray_cluster):
    bench = _bench()
    rows = bench.measure_dispatch_overhead(calls=2, rows=8, world=2)
    assert [(r["group"], r["call"].split()[0]) for r in rows][:3] == [("ray x2", "ONE_TO_ALL"),
                                                                      ("ray x2", "DP_SPLIT"), ("ray x2", "DP_SPLIT")]
    assert {r["group"] for r in rows} == {"ray x2", "ray x2 put-all", "ray x2 clone-send", "local x1"}
    assert all(r["wall_ms"] >= r["worker_ms"] >= 0 for r in rows)
    assert all(r["driver_peak_mib"] is not None and r["driver_peak_mib"] >= 0 for r in rows)


@pytest.mark.timeout(180)
@pytest.mark.parametrize("launcher", ["local", "ray"])
def test_async_long_tail_runs_with_stages_in_threads_and_in_processes(ray_cluster, launcher):
    import torch

    threads = torch.get_num_threads()
    try:  # the measurement itself checks that async and sync give identical outputs
        out = _bench().measure_async_long_tail(prompts=8, chunk=4, repeats=1, launcher=launcher)
    finally:
        torch.set_num_threads(threads)
    assert out["sync_s"] > 0 and out["async_s"] > 0 and len(out["lengths"]) == 8
