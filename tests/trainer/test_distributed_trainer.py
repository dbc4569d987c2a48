"""The trainer on Ray worker groups: colocated (hybrid) and split placement, 2-4 processes."""
import math
from pathlib import Path

import pytest
import torch

from hybridflow.config.loader import load_config
from hybridflow.errors import ConfigError
from hybridflow.trainer import read_metrics
from hybridflow.trainer.trainer import RLTrainer
from tests.trainer.test_trainer import in_repo

ROOT = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.usefixtures("ray_cluster"), pytest.mark.timeout(300)]


def run(name: str, tmp_path: Path, *overrides: str, before_fit=None):
    """Fit config `name`; `before_fit(trainer)` may check the built trainer first."""
    cfg = in_repo(load_config(ROOT / "configs" / name, [f"trainer.output_dir={tmp_path}", *overrides]))
    trainer = RLTrainer(cfg)
    try:
        if before_fit is not None:
            before_fit(trainer)
        summary = trainer.fit()
    finally:
        trainer.shutdown()
    return summary, read_metrics(summary["run_dir"] / "metrics.jsonl")


THREE_STEPS = ["trainer.total_steps=3", "trainer.save_every=0", "data.val_files=[]"]


def test_grpo_colocated_on_two_ray_workers_matches_the_single_process_run(tmp_path):
    """Actor, rollout (views), DP=2 training and the reward model share two Ray processes (the hybrid
    layout): the reward model, placed on the actor's devices, joins the actor's processes.

    Sampling is keyed by (step, prompt, sample), so both layouts roll out the
    same responses; the updates differ only in floating-point summation order
    (gradients reduced over two ranks), hence the tolerance. One mini-batch
    per step: with several, each rank cuts mini-batches from its own shard
    (as verl does), so different rows share a mini-batch than in one process.
    """
    from tests.trainer.test_trainer import learned

    rm = ROOT / "hybridflow/assets/tiny_reward_model"
    common = ["trainer.total_steps=2", "trainer.val_every=0", "trainer.save_every=0",
              "actor.ppo_mini_batch_size=8", f"reward.model_path={rm}", "reward.model_weight=0.5"]
    def shares_the_actors_processes(trainer):
        assert trainer.reward_model.group.pids() == trainer.actor.group.pids()  # no process of its own

    summary, records = run("tiny-grpo.yaml", tmp_path / "two", "trainer.n_devices=2", "trainer.launcher=ray",
                           *common, before_fit=shares_the_actors_processes)
    _, single = run("tiny-grpo.yaml", tmp_path / "one", *common)
    assert [r["step"] for r in records] == [r["step"] for r in single] == [0, 1, 2]
    two, one = learned(records), learned(single)
    assert two[0] == one[0]  # greedy validation before any update
    for step in (1, 2):
        assert two[step].keys() == one[step].keys()
        for key, value in one[step].items():
            assert two[step][key] == pytest.approx(value, rel=1e-4, abs=1e-5), (step, key)
    assert len(list((summary["checkpoint"] / "actor").glob("engine_*.pt"))) == 2  # one shard file per rank


def test_ppo_split_placement_critic_on_its_own_devices(tmp_path, single):
    """Actor+rollout+reference on devices 0-1, the critic on 2-3 (four Ray processes, both roles at
    TP1 x DP2): three steps of two epochs of two mini-batches equal one process's to 1e-5."""
    _, records = run("tiny-ppo.yaml", tmp_path / "split", "trainer.n_devices=4", "trainer.launcher=ray",
                     "placement.training=[0,1]", "placement.rollout=[0,1]", "placement.reference=[0,1]",
                     "placement.critic=[2,3]", *THREE_STEPS)
    for key in ("critic/vf_loss", "actor/pg_loss", "actor/kl", "actor/kl_loss"):
        assert math.isfinite(records[3][key]), key
    _assert_same_metrics({"one": single("tiny-ppo.yaml")[1], "split": records}, (1, 2, 3), rel=1e-5, abs_=1e-6)


def _assert_synced_by_plan(records, steps):
    """Every sync moved exactly the plan's bytes, which are the formula's (a rollout rank's generation shard)."""
    for step in steps:
        r = records[step]
        assert r["sync/bytes_received"] == r["sync/plan_bytes_received"] == r["sync/formula_bytes_received"] > 0, step
        assert r["sync/bytes_sent"] == r["sync/plan_bytes_sent"] > 0, step
        assert r["sync/collectives"] > 0 and r["sync/collectives_off_plan"] == 0, step


@pytest.mark.timeout(600)
@pytest.mark.parametrize("layout", [
    pytest.param(["trainer.n_devices=3", "placement.rollout=[2]", "actor.parallel.tp=2"], id="t2-to-tg1"),
    pytest.param(["trainer.n_devices=4", "placement.rollout=[2,3]", "rollout.tg=2"], id="d2-to-tg2"),
    pytest.param(["trainer.n_devices=3", "placement.rollout=[2]", "actor.parallel.pp=2", "actor.parallel.virtual_pp=2"],
                 id="p2v2-to-tg1"),
    pytest.param(["trainer.n_devices=3", "placement.rollout=[2]", "actor.parallel.cp=2"], id="c2-to-tg1")])
def test_grpo_rollout_apart_from_training_matches_the_single_process_run(tmp_path, single, layout):
    """Rollout on devices of its own: the actor at TP2 into one rollout process at tg = 1 (3 processes), at
    DP2 into a rollout group of two at tg = 2 (4 processes), at PP2 x virtual_pp 2 (each stage sends the
    layers of both its model chunks) or at CP2 (CP rank 0 of each stage sends: CP ranks hold the same
    weights) into one rollout process (3 processes). Before the first rollout and after each
    update the actor's ranks broadcast the slices of their training shards each rollout rank's generation
    shard needs, over a process group spanning both groups: the responses and metrics are those of one
    process (keyed sampling; summation order as above), each sync moves the plan's bytes, no weight passes
    the driver, and after a sync the rollout's weights are the actor's, bit for bit (without it, they are
    one update behind: checked)."""
    from hybridflow.models.checkpoint import load_hf_state_dict
    from tests.trainer.test_trainer import learned

    common = ["actor.ppo_mini_batch_size=8"]
    layout = [*layout, "trainer.launcher=ray", "placement.training=[0,1]", "placement.reference=[0,1]"]
    cfg = in_repo(load_config(ROOT / "configs" / "tiny-grpo.yaml", [
        f"trainer.output_dir={tmp_path / 'apart'}", *layout, *common, *THREE_STEPS, "trainer.save_every=1"]))
    trainer = RLTrainer(cfg)
    try:
        summary = trainer.fit()
        assert trainer.weights.stale  # the last update has not reached the rollout group yet
        behind = trainer.separate_rollout.hf_weights()
        shipped = trainer.shipped_bytes()
        again = trainer.weights.sync.push()
        assert trainer.shipped_bytes() == shipped  # the driver passed no tensor to either group
        assert again["sync/bytes_received"] == again["sync/formula_bytes_received"]
        synced = trainer.separate_rollout.hf_weights()
    finally:
        trainer.shutdown()
    actor = load_hf_state_dict(summary["hf_actor"])
    assert synced.keys() == actor.keys() and all(torch.equal(synced[k], actor[k]) for k in actor)
    assert not all(torch.equal(behind[k], actor[k]) for k in actor)  # the invariant can fail: a stale copy
    records = read_metrics(summary["run_dir"] / "metrics.jsonl")
    _assert_synced_by_plan(records, (1, 2, 3))
    apart, one = learned(records), learned(single("tiny-grpo.yaml", *common)[1])
    for step in (1, 2, 3):  # steps 2 and 3 roll out with weights updated once and twice
        assert apart[step].keys() == one[step].keys()
        for key, value in one[step].items():
            assert apart[step][key] == pytest.approx(value, rel=1e-4, abs=1e-5), (step, key)
    if "actor.parallel.tp=2" not in layout:  # resuming is checked once; it does not depend on the layout
        return

    # Resumed from the same run's step-2 checkpoint (the later one moved away, as the resume error advises):
    # the restored actor's weights must reach the rollout group before step 3.
    import shutil

    shutil.copytree(tmp_path / "apart", tmp_path / "resumed")
    shutil.rmtree(tmp_path / "resumed" / "tiny-grpo" / "checkpoints" / "step_000003")
    _, again = run("tiny-grpo.yaml", tmp_path / "resumed", *layout, *common, *THREE_STEPS, "trainer.resume=auto")
    assert [r["step"] for r in again] == [r["step"] for r in records]  # steps after 2 were replaced, once
    for key, value in apart[3].items():
        assert learned(again)[3][key] == pytest.approx(value, rel=1e-5, abs=1e-6), key


def compare_with_one_process(label: str, records: list[dict], single: list[dict], steps=(1, 2),
                             rel: float = 1e-4, abs_: float = 1e-5) -> None:
    """`steps` of a multi-rank run against the one-process run: the same steps, the learned metrics
    equal (`_assert_same_metrics`); prints the worst relative difference for the layout table."""
    from tests.trainer.test_trainer import learned

    assert [r["step"] for r in records] == [r["step"] for r in single]
    many, one = learned(records), learned(single)
    worst, step, key = max((abs(many[step][key] - value) / abs(value), step, key)
                           for step in steps for key, value in one[step].items()
                           if abs(value) > 1e-5 and key in many[step])
    print(f"{label} against one process: worst relative difference {worst:.3g} ({key} at step {step})")
    _assert_same_metrics({"one": single, label: records}, steps, rel, abs_)


def test_reference_apart_from_training_is_rejected_when_the_config_loads(tmp_path):
    with pytest.raises(ConfigError, match="placement.reference: must equal placement.training"):
        load_config(ROOT / "configs/tiny-grpo.yaml", [
            f"trainer.output_dir={tmp_path}", "trainer.n_devices=2", "trainer.launcher=ray",
            "placement.training=[0]", "placement.rollout=[0]", "placement.reference=[1]"])


def test_torchrun_local_mode_ppo_at_tp2_matches_the_single_process_run(tmp_path, single):
    """`torchrun -m hybridflow.cli train`: every rank drives its LocalWorkerGroup share, the critic in the
    actor's processes. Actor and critic train at TP2 (without Ray the critic shares the actor's layout);
    the actor generates at tg = 1 (t = 2 -> tg = 1: each rank gathers the whole model after an update).
    Three PPO steps (critic, GAE, reference, KL in reward and loss, two mini-batches per epoch, two
    epochs) equal one process's to 1e-5."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k not in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE")}
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
         "-m", "hybridflow.cli", "train", "configs/tiny-ppo.yaml", f"trainer.output_dir={tmp_path / 'trun'}",
         "actor.parallel.tp=2", "critic.parallel.tp=2", *THREE_STEPS, "trainer.save_every=3"], cwd=ROOT, env=env,
        capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    run_dir = tmp_path / "trun" / "tiny-ppo"
    for role in ("actor", "critic"):
        assert len(list((run_dir / "checkpoints" / "step_000003" / role).glob("engine_*.pt"))) == 2, role
    torchrun = read_metrics(run_dir / "metrics.jsonl")
    assert [r["step"] for r in torchrun] == [0, 1, 2, 3]
    assert torchrun[1]["reshard/bytes_received"] > 0
    _assert_same_metrics({"one": single("tiny-ppo.yaml")[1], "torchrun": torchrun}, (1, 2, 3), rel=1e-5)


def test_ppo_with_the_actor_at_dp2_and_the_critic_at_tp2_matches_the_single_process_run(tmp_path, single):
    """Layout invariance (docs/architecture.md): the actor at TP1 x DP2 and the critic at TP2 x DP1 on the
    same two Ray processes take the one-process optimizer steps. The mini-batches are drawn once for the
    whole batch from the step's key, each replica trains on its share of each, and the loss is normalised
    over the global mini-batch; before that, each replica shuffled its own rows and PPO with the critic
    at DP2 differed by 2.5% in critic/vf_loss at step 2. Three steps of two epochs of two mini-batches
    each equal one process's to 1e-5."""
    _, records = run("tiny-ppo.yaml", tmp_path / "dp2", "trainer.n_devices=2", "trainer.launcher=ray",
                     "critic.parallel.tp=2", *THREE_STEPS)
    assert records[1]["controller/shipped_bytes"] > 0
    _assert_same_metrics({"one": single("tiny-ppo.yaml")[1], "dp2": records}, (1, 2, 3), rel=1e-5)


def test_no_token_tensor_or_text_of_a_ray_step_passes_the_driver(tmp_path):
    """The data plane: under Ray every token tensor ([B, R] and wider) and text of a PPO step stays in the
    object store: the rollout's, the old and reference log-probs, the values, and the token rewards and
    advantages the actor's rank 0 makes from them (KL in the reward included). The driver holds references
    and one number a row: what it received while preparing the step is RESPONSE_LENGTH, RULE_SCORES,
    RULE_REWARD_SECONDS, TRUNCATED, REWARD_FAILED and REWARD_TIMED_OUT (25 bytes a row) and the row index of
    each answer whose fields stayed in the store
    (4 bytes a row, shared by the answer's fields: the rollout's, the log-prob pass's, the values', the token
    stage's).
    Fetched back, the advantages are what the token stage gives on those rows in this process (the same
    function on the same rows; another process with its own thread count, hence assert_close).

    The rule reward scores where the rows are made. Here it is a function registered by name in this
    process only (a local function the workers cannot import), which reaches them with the spec and scores
    exactly as it does here; made to raise (it reads a flag file) on every row, more than
    reward.max_failure_fraction of a rank's rows fail, and the next step stops with the driver-side line: the
    function's name, the error and its line, the first failing row, no traceback."""
    import inspect
    import os

    from hybridflow.controller.transfer import fetch_remote_rows
    from hybridflow.data.batch import RowsElsewhere
    from hybridflow.data import fields as F
    from hybridflow.rewards import register_reward
    from hybridflow.roles.preparation import prepare_tokens
    from hybridflow.trainer.trainer import TrainingError

    flag = tmp_path / "fail"

    def reward(data_source, solution_str, ground_truth, extra_info=None):
        if os.path.exists(flag):
            return len(solution_str) / 0.0
        return float(sum(map(ord, solution_str)) % 7)

    name = "test_distributed_reward_of_this_process"
    register_reward(name)(reward)
    cfg = in_repo(load_config(ROOT / "configs" / "tiny-ppo.yaml", [
        f"trainer.output_dir={tmp_path}", "trainer.n_devices=2", "trainer.launcher=ray", "data.val_files=[]",
        f"reward.function={name}"]))
    trainer = RLTrainer(cfg)
    try:
        coef, received = trainer.kl_ctrl.value, trainer.received_bytes()
        batch, metrics, _ = trainer.prepare(1)
        rows = len(batch[F.UID])
        assert trainer.received_bytes() - received == (8 + 4 + 4 + 1 + 4 + 4) * rows + 4 * (4 * rows)
        assert metrics["timing/rule_reward_s"] > 0 and F.RULE_REWARD_SECONDS not in batch
        left = {name for name, value in batch.items() if isinstance(value, RowsElsewhere)}
        assert {F.INPUT_IDS, F.RESPONSES, F.RESPONSE_MASK, F.OLD_LOG_PROBS, F.REF_LOG_PROBS, F.VALUES,
                F.TOKEN_REWARDS, F.ADVANTAGES, F.RETURNS, F.RESPONSE_TEXT, F.PROMPT_TEXT, F.GROUND_TRUTH} <= left
        assert all(value.dim() == 1 for value in batch.values() if torch.is_tensor(value))
        fetched = fetch_remote_rows(batch)
        texts = fetched[F.RESPONSE_TEXT]
        assert torch.equal(batch[F.RULE_SCORES], torch.tensor([float(sum(map(ord, t)) % 7) for t in texts]))
        assert len(set(batch[F.RULE_SCORES].tolist())) > 1  # scores that tell rows apart
        want, figures = prepare_tokens(fetched, trainer.token_stage, coef)
        for field in (F.TOKEN_REWARDS, F.ADVANTAGES, F.RETURNS):
            torch.testing.assert_close(fetched[field], want[field])
        assert metrics["actor/kl_in_reward"] == pytest.approx(figures["actor/kl_in_reward"], rel=1e-5, abs=1e-7)
        assert metrics["batch/tokens"] == figures["batch/tokens"]

        flag.touch()
        with pytest.raises(TrainingError) as caught:
            trainer.train_step(2)
    finally:
        trainer.shutdown()
    line = inspect.getsourcelines(reward)[1] + 2
    assert str(caught.value) == (f"reward.function {name!r} raised ZeroDivisionError: float division by zero "
                                 f"(at {__file__}:{line}); on row 0 (data_source 'arithmetic'), the first of 8 "
                                 "failing rows of 8, more than reward.max_failure_fraction=0.1 of the batch")


def test_torchrun_over_two_nodes_on_loopback_matches_the_single_process_run(tmp_path, single):
    """Two torchrun launchers, one per "node" (`--nnodes 2 --node-rank 0|1`, static rendezvous on
    127.0.0.1), one rank each, as the multi-node command in docs/architecture.md: PPO with actor and
    critic at DP2 across the two nodes takes the one-process steps (three steps, to 1e-5)."""
    import os
    import socket
    import subprocess
    import sys

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {k: v for k, v in os.environ.items() if k not in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE")}
    nodes = [subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node-rank", str(rank),
         "--nproc-per-node", "1", "--master-addr", "127.0.0.1", "--master-port", str(port),
         "-m", "hybridflow.cli", "train", "configs/tiny-ppo.yaml", f"trainer.output_dir={tmp_path / 'nodes'}",
         *THREE_STEPS], cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        for rank in (0, 1)]
    errors = [node.communicate(timeout=240)[1] for node in nodes]
    assert [node.returncode for node in nodes] == [0, 0], "\n".join(e[-2000:] for e in errors)
    records = read_metrics(tmp_path / "nodes" / "tiny-ppo" / "metrics.jsonl")
    _assert_same_metrics({"one": single("tiny-ppo.yaml")[1], "two nodes": records}, (1, 2, 3), rel=1e-5)


def test_killed_worker_stops_the_step_with_its_rank_named(tmp_path):
    """SIGKILL an actor process mid-step: the controller raises WorkerError naming a rank, no hang.

    Which rank is reported first depends on timing: the killed one (its
    process died) or its peer (its gloo collective lost the connection).
    """
    import os
    import signal
    import threading

    from hybridflow.controller import WorkerError

    cfg = in_repo(load_config(ROOT / "configs/tiny-grpo.yaml", [
        f"trainer.output_dir={tmp_path}", "trainer.n_devices=2", "trainer.launcher=ray"]))
    trainer = RLTrainer(cfg)
    try:
        trainer.train_step(1)  # warm: the next step's timing is known to be > 0.2 s
        victim = trainer.actor.group.pids()[1]
        threading.Timer(0.2, os.kill, (victim, signal.SIGKILL)).start()  # rollout or update, whichever runs
        with pytest.raises(WorkerError, match=r"rank [01] failed in \w+"):
            for step in range(2, 20):
                trainer.train_step(step)
    finally:
        trainer.shutdown()


def test_api_md_placement_runs_as_written(tmp_path):
    """docs/api.md's placement: rollout [0, 1], reward [2], training [0, 1, 2, 3] (seven Ray
    processes: actor DP=4, a rollout group of two on part of its devices, the reward model on its
    own). Same metrics as one process with the same reward model, up to summation order."""
    from tests.trainer.test_trainer import learned

    rm = ROOT / "hybridflow/assets/tiny_reward_model"
    common = ["trainer.total_steps=2", "trainer.val_every=0", "trainer.save_every=0",
              "actor.ppo_mini_batch_size=8", f"reward.model_path={rm}", "reward.model_weight=0.5"]
    _, records = run("tiny-grpo.yaml", tmp_path / "api", "trainer.n_devices=4", "trainer.launcher=ray",
                     "placement.rollout=[0,1]", "placement.reward=[2]", "placement.training=[0,1,2,3]", *common)
    _, single = run("tiny-grpo.yaml", tmp_path / "one", *common)
    api, one = learned(records), learned(single)
    for step in (1, 2):
        assert api[step].keys() == one[step].keys()
        for key, value in one[step].items():
            assert api[step][key] == pytest.approx(value, rel=1e-4, abs=1e-5), (step, key)


def _assert_same_metrics(runs: dict, steps, rel=1e-4, abs_=1e-5):
    from tests.trainer.test_trainer import learned

    one = learned(runs.pop("one"))
    for name, records in runs.items():
        got = learned(records)
        for step in steps:
            assert got[step].keys() == one[step].keys(), (name, step)
            for key, value in one[step].items():
                assert got[step][key] == pytest.approx(value, rel=rel, abs=abs_), (name, step, key)


def _assert_same_export(summary: dict, one_summary: dict) -> None:
    """The HF export (streamed stage by stage from a pipelined actor) holds the one-process weights."""
    from hybridflow.models.checkpoint import load_hf_state_dict

    exported, want = load_hf_state_dict(summary["hf_actor"]), load_hf_state_dict(one_summary["hf_actor"])
    assert exported.keys() == want.keys()
    for name, value in want.items():
        diff = (exported[name] - value).abs()
        # Adam moves a weight whose gradient is ~0 by up to lr (3e-4) either way: a few elements may
        # differ by a fraction of lr after summation-order noise; the rest agree to float precision.
        assert diff.max() < 0.2 * 3e-4 and diff.mean() < 1e-7, (name, diff.max(), diff.mean())


def test_ppo_generating_at_tg2_on_four_processes_matches_the_single_process_run(tmp_path, single):
    """PPO at t = 4 -> tg = 2 (the paper's grouping: each rank receives a quarter of the model from its
    micro-DP partner) and at t = 2, p = 2 -> tg = 2 (the 3D-HybridEngine merges the two stages and
    regroups into two generation replicas of two TP ranks), on 4 Ray processes: three steps each equal
    one process (keyed sampling: the same responses). The critic takes the actor's layout. The TP2 x PP2
    run's HF export, streamed stage by stage, holds the one-process weights.

    The actor's side of GRPO is the same code at these layouts (GRPO differs in the controller's
    advantages only); GRPO itself runs multi-process in the DP, split-placement and torchrun tests.

    PPO runs without the KL loss (the reference still feeds the KL in the reward): at step 1 the actor
    equals the reference and the advantages vanish, so one process's gradient is exactly zero, while a
    4-way TP sum leaves a ~1e-9 KL gradient that Adam scales up to a full lr-sized step."""
    ppo = ["actor.use_kl_loss=false"]
    one_summary, one = single("tiny-ppo.yaml", *ppo)
    cases = {"ppo-t4": ["actor.parallel.tp=4", "critic.parallel.tp=4"],
             "ppo-t2p2": ["actor.parallel.tp=2", "actor.parallel.pp=2", "critic.parallel.tp=2", "critic.parallel.pp=2"]}
    for case, layout in cases.items():
        summary, parallel = run("tiny-ppo.yaml", tmp_path / case, "trainer.n_devices=4", "trainer.launcher=ray",
                                "rollout.tg=2", *layout, *ppo, *THREE_STEPS)
        transition = parallel[1]
        assert transition["reshard/bytes_received"] > 0 and transition["reshard/collectives"] > 0, case
        if case == "ppo-t4":
            assert transition["reshard/collectives"] == 1  # one bucketed all-gather per switch
        else:
            _assert_same_export(summary, one_summary)
        _assert_same_metrics({"one": one, case: parallel}, (1, 2, 3))
    assert one[1]["reshard/bytes_received"] == 0  # views at tp = pp = 1: nothing moves
