"""Suite-wide settings: GPU tests are skipped where no CUDA device exists; tests that start Ray or a
multi-process launch are `slow` and tests/benchmarks is `bench` (`make test-fast` leaves both out);
one Ray cluster per session."""
import os
from pathlib import Path

import pytest
import torch

# The suite compiles one inductor kernel on the CPU (tests/rollout/test_static_decode.py); inductor would
# first build a 150 MB precompiled header, which pays off only over many compiles (24 -> 17.5 s cold).
os.environ.setdefault("TORCHINDUCTOR_CPP_CACHE_PRECOMPILE_HEADERS", "0")

# A test that needs one of these pays for a Ray cluster or a torchrun launch (tens of seconds on 2 cores).
SLOW_FIXTURES = {"ray_cluster", "four_process_launch", "two_process_launch"}
BENCHMARKS = Path(__file__).parent / "benchmarks"


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects by these marks
def pytest_collection_modifyitems(config, items):
    skip_gpu = None if torch.cuda.is_available() else pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if SLOW_FIXTURES.intersection(item.fixturenames):
            item.add_marker(pytest.mark.slow)
        if BENCHMARKS in item.path.parents:
            item.add_marker(pytest.mark.bench)
        if skip_gpu and "gpu" in item.keywords:
            item.add_marker(skip_gpu)


@pytest.fixture(scope="session")
def ray_cluster():
    """One Ray cluster for the whole test session: `ray.init` costs 5-10 s on these machines. Its worker
    processes are kept warm between groups (`keep_processes_warm`): each Ray process costs ~6 s of imports
    before its worker does anything, and the suite starts groups one after another."""
    import ray

    from hybridflow.controller import init_ray, keep_processes_warm

    init_ray(num_cpus=8)
    keep_processes_warm(True)
    yield ray
    keep_processes_warm(False)
    ray.shutdown()


@pytest.fixture(scope="session")
def layouts_hf(tmp_path_factory):
    """The layout checks' HF checkpoint (`write_layout_model`), written once for both launches and the
    one-rank reference."""
    from tests.engine.conftest import write_layout_model

    return write_layout_model(tmp_path_factory.mktemp("layouts") / "hf")


@pytest.fixture(scope="session")
def four_process_launch(tmp_path_factory, layouts_hf):
    """One torchrun launch on 4 gloo processes for every 4-rank engine check: the engine at TP2xPP2, TP2xDP2
    and PP2xDP2 (tests/engine/layouts_check.py), the switch to generation in every grouping
    (tests/hybrid_engine/reshard_check.py), the reshard benchmark at its quick size and an MoE model at
    TP2xEP2 (tests/engine/ep_check.py). A launch costs
    about 20 s of start-up on 2 cores, paid once. Returns the paths the checks wrote."""
    from hybridflow.models.checkpoint import save_hf_checkpoint
    from tests.engine.conftest import tiny_model
    from tests.torchrun import torchrun_scripts

    tmp = tmp_path_factory.mktemp("four_processes")
    paths = {"layouts_hf": layouts_hf, "layouts": tmp / "layouts.pt",
             "reshard_hf": tmp / "reshard_hf", "reshard": tmp / "reshard.pt", "bench_reshard": tmp / "bench.txt",
             "experts_hf": tmp / "experts_hf", "experts": tmp / "experts.pt"}
    cfg, _, hf = tiny_model(num_key_value_heads=4, tie_word_embeddings=True)  # 4 KV heads: TP up to 4
    save_hf_checkpoint(hf, cfg.to_hf_dict(), paths["reshard_hf"])
    from tests.engine.test_megatron_engine import QWEN3_MOE

    cfg, _, hf = tiny_model(**QWEN3_MOE)  # 4 experts, top 2: tp2 x ep2
    save_hf_checkpoint(hf, cfg.to_hf_dict(), paths["experts_hf"])
    torchrun_scripts(4, [
        {"script": "tests/engine/layouts_check.py", "args": [paths["layouts"], paths["layouts_hf"]]},
        {"script": "tests/hybrid_engine/reshard_check.py", "args": [paths["reshard"], paths["reshard_hf"]]},
        {"script": "benchmarks/bench_reshard.py", "args": ["--quick", "--repeats", "1"],
         "stdout": paths["bench_reshard"]},
        {"script": "tests/engine/ep_check.py", "args": [paths["experts"], paths["experts_hf"]]},
    ], timeout=600)
    return paths


@pytest.fixture(scope="session")
def two_process_launch(tmp_path_factory, layouts_hf):
    """One torchrun launch on 2 gloo processes for the 2-rank checks: the built-in generator at tg = 2
    (tests/hybrid_engine/tp_generate_check.py), an update at DP = 2 (tests/engine/dp_step.py), the FSDP2
    engine's roles at 2 ranks (tests/engine/fsdp_check.py), a reward model sharded by FSDP2
    (tests/engine/fsdp_frozen_check.py), the engine at TP2 with and without sequence parallelism
    (tests/engine/layouts_check.py), FSDP checkpoints for the reshard tool, one of them its own output
    loaded back (tests/reshard/fsdp_save_check.py), the engine at pp 2 with virtual_pp 2
    (tests/engine/vpp_check.py), the static decode path at tg = 2 (tests/rollout/static_tp_check.py), CP
    attention and the engine at cp = 2 (tests/engine/cp_check.py, cp_engine_check.py), megatron-core loading
    the reshard tool's dist checkpoint at TP2 (tests/reshard/dist_load_check.py) and FSDP's in-place
    all-gather (tests/engine/test_fsdp_comm.py). Each launch costs ~6 s of start-up on 2 cores (torchrun's
    agent and two processes importing torch and megatron-core); these ran as five launches before."""
    from tests.reshard.conftest import write_model
    from tests.reshard.fsdp_save_check import write_from_hf
    from tests.reshard.test_reshard_dist import tool
    from tests.torchrun import torchrun_scripts

    tmp = tmp_path_factory.mktemp("two_processes")
    paths = {"tp_generate": tmp / "tp_generate.pt", "dp_step": tmp / "dp2.pt", "sp_layouts": tmp / "sp.pt",
             "fsdp": tmp / "fsdp.pt", "fsdp_reshard": tmp / "fsdp_reshard", "fsdp_frozen": tmp / "fsdp_frozen.pt",
             "vpp": tmp / "vpp.pt", "vpp_dir": tmp / "vpp", "static_tp": tmp / "static_tp.pt", "cp": tmp / "cp.json",
             "cp_engine": tmp / "cp_engine.pt", "fsdp_comm": tmp / "fsdp_comm.pt", "dist_hf": tmp / "dist_hf",
             "dist": tmp / "dist", "dist_logits": tmp / "dist_logits.pt", "dist_resaved": tmp / "megatron_tp2"}
    write_from_hf(paths["fsdp_reshard"])  # the tool's HF -> fsdp output, which the launch loads at 2 ranks
    write_model(paths["dist_hf"], "qwen2")  # QKV bias, tied embeddings, GQA (2 KV heads, one per TP rank)
    tool(paths["dist_hf"], paths["dist"], "--to", "dist", "--tp", 2)  # what dist_load_check.py loads
    torchrun_scripts(2, [{"script": "tests/hybrid_engine/tp_generate_check.py", "args": [paths["tp_generate"]]},
                         {"script": "tests/engine/dp_step.py", "args": [paths["dp_step"]]},
                         {"script": "tests/engine/fsdp_check.py", "args": [paths["fsdp"]]},
                         {"script": "tests/engine/fsdp_frozen_check.py", "args": [paths["fsdp_frozen"]]},
                         {"script": "tests/reshard/fsdp_save_check.py", "args": [paths["fsdp_reshard"]]},
                         {"script": "tests/engine/layouts_check.py",
                          "args": [paths["sp_layouts"], layouts_hf, "tp2_pp1_sp,tp2_pp1"]},
                         {"script": "tests/engine/vpp_check.py", "args": [paths["vpp"], paths["vpp_dir"]]},
                         {"script": "tests/rollout/static_tp_check.py", "args": [paths["static_tp"]]},
                         {"script": "tests/engine/cp_check.py", "args": [paths["cp"]]},
                         {"script": "tests/engine/cp_engine_check.py", "args": [paths["cp_engine"], layouts_hf]},
                         {"script": "tests/reshard/dist_load_check.py",
                          "args": [paths["dist"], paths["dist_hf"], paths["dist_logits"], paths["dist_resaved"]]},
                         {"script": "tests/engine/test_fsdp_comm.py", "args": [paths["fsdp_comm"]]}],
                     timeout=600)
    return paths
