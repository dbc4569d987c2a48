"""The layouts of issue 41 through the trainer on Ray (item 5): CP with TP and with PP, TP with sequence
parallelism, each against one process."""
import pytest
import torch

from hybridflow.cli import main
from hybridflow.models.checkpoint import load_hf_state_dict
from tests.trainer.test_distributed_trainer import ROOT, compare_with_one_process, run

pytestmark = [pytest.mark.usefixtures("ray_cluster"), pytest.mark.timeout(400)]


def test_grpo_at_tp2_cp2_on_four_ray_workers_matches_the_single_process_run(tmp_path):
    """The actor at TP2 x CP2 on four Ray processes (one DP replica): each TP pair of a CP index gathers its
    generation weights itself (the 3D-HybridEngine's plan counts every CP rank as one more generation
    replica, so 4 replicas at tg = 1), each CP rank runs its load-balanced chunks through TP2 layers. Two
    steps' learned metrics equal one process's up to summation order. Its checkpoint (written by the CP
    rank 0 of each TP rank: CP ranks hold the same weights) converts with `hybridflow reshard` to the HF
    model the run exported, bit for bit."""
    common = ["trainer.total_steps=2", "trainer.val_every=0", "actor.ppo_mini_batch_size=8"]
    summary, records = run("tiny-grpo.yaml", tmp_path / "tp2cp2", "trainer.n_devices=4", "trainer.launcher=ray",
                           "actor.parallel.tp=2", "actor.parallel.cp=2", "trainer.save_every=2", *common)
    _, single = run("tiny-grpo.yaml", tmp_path / "one", "trainer.save_every=0", *common)
    compare_with_one_process("grpo at tp2 cp2", records, single)

    run_dir = summary["run_dir"]
    assert main(["reshard", str(run_dir / "checkpoints" / "step_000002"), str(tmp_path / "hf"), "--to", "hf",
                 "--config", str(ROOT / "hybridflow/assets/demo_model"), "--no-progress"]) == 0
    converted, exported = load_hf_state_dict(tmp_path / "hf"), load_hf_state_dict(run_dir / "hf_actor")
    assert sorted(converted) == sorted(exported)
    assert all(torch.equal(converted[k], exported[k]) for k in exported)


def test_grpo_at_pp2_cp2_on_four_ray_workers_matches_the_single_process_run(tmp_path):
    """The actor at PP2 x CP2: megatron-core's 1F1B schedule sends each CP rank's chunks' activations from
    the first stage to the second (the schedule sizes them width / cp), the last stage gathers the output
    over the CP group; the reshard plan gathers the stages per CP index. Two steps equal one process."""
    common = ["trainer.total_steps=2", "trainer.val_every=0", "trainer.save_every=0", "actor.ppo_mini_batch_size=8"]
    _, records = run("tiny-grpo.yaml", tmp_path / "pp2cp2", "trainer.n_devices=4", "trainer.launcher=ray",
                     "actor.parallel.pp=2", "actor.parallel.cp=2", *common)
    _, single = run("tiny-grpo.yaml", tmp_path / "one", *common)
    compare_with_one_process("grpo at pp2 cp2", records, single)


def test_grpo_at_tp2_with_sequence_parallelism_matches_the_single_process_run(tmp_path):
    """Sequence parallelism at TP2 on two Ray processes (issue 41, item 3, through the trainer): the
    activations between the TP regions are split over the sequence (reduce-scatter / all-gather pairs under
    gloo); the 3D-HybridEngine gathers the generation weights as at TP2. Two steps equal one process."""
    common = ["trainer.total_steps=2", "trainer.val_every=0", "trainer.save_every=0", "actor.ppo_mini_batch_size=8"]
    _, records = run("tiny-grpo.yaml", tmp_path / "sp", "trainer.n_devices=2", "trainer.launcher=ray",
                     "actor.parallel.tp=2", "actor.parallel.sequence_parallel=true", *common)
    _, single = run("tiny-grpo.yaml", tmp_path / "one", *common)
    compare_with_one_process("grpo at tp2 with sequence parallelism", records, single)
