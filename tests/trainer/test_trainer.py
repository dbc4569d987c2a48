"""End to end: the PPO/GRPO trainer on the tiny configs in configs/, plus its bad-input errors."""
import json
import math
import re
from pathlib import Path

import pytest
import torch

from hybridflow.config.loader import load_config
from hybridflow.errors import ConfigError
from hybridflow.data.dataset import DatasetError
from hybridflow.checkpoint import CheckpointError, CheckpointManager
from hybridflow.trainer import read_metrics
from hybridflow.trainer.trainer import RLTrainer, TrainingError

pytestmark = pytest.mark.usefixtures("megatron_world")
ROOT = Path(__file__).resolve().parents[2]
DETERMINISTIC = ("reward/", "response/", "actor/", "critic/", "val/", "batch/", "data/")


@pytest.fixture(scope="module")
def megatron_world():
    from hybridflow.engine.distributed import init_process_group
    init_process_group("cpu")


def config(name: str, tmp_path: Path, *overrides: str):
    return load_config(ROOT / "configs" / name, [f"trainer.output_dir={tmp_path}", *overrides])


def in_repo(cfg):
    """Config paths are relative to the repo root. Runs end without the plot (`trainer.plot`: 0.4 s a run, about
    100 runs a suite); the tests of the plot turn it back on."""
    cfg.trainer.plot = False
    cfg.model.path = str(ROOT / cfg.model.path)
    cfg.data.train_files = [str(ROOT / f) for f in cfg.data.train_files]
    cfg.data.val_files = [str(ROOT / f) for f in cfg.data.val_files]
    return cfg


def learned(metrics: list[dict]) -> dict[int, dict]:
    return {m["step"]: {k: v for k, v in m.items() if k.startswith(DETERMINISTIC)} for m in metrics}


@pytest.mark.slow
def test_grpo_runs_saves_exports_and_resumes_identically(tmp_path):
    full = in_repo(config("tiny-grpo.yaml", tmp_path / "a"))
    full.trainer.plot = True
    summary = RLTrainer(full).fit()
    run = summary["run_dir"]
    records = read_metrics(run / "metrics.jsonl")
    assert [r["step"] for r in records] == [0, 1, 2, 3, 4]
    assert {"reward/mean", "actor/pg_loss", "actor/grad_norm", "actor/entropy", "actor/clip_frac",
            "timing/rollout_s", "perf/tokens_per_s"} <= records[1].keys()
    assert "val/accuracy" in records[0] and "val/accuracy" in records[2]
    assert sorted(p.name for p in (run / "checkpoints").iterdir() if p.name.startswith("step_")) == \
        ["step_000002", "step_000004"]
    assert (run / "plots" / "metrics.png").is_file()

    # The exported actor loads in transformers and gives the engine's logits.
    import transformers
    hf = transformers.AutoModelForCausalLM.from_pretrained(summary["hf_actor"])
    tok = transformers.AutoTokenizer.from_pretrained(summary["hf_actor"])
    ids = torch.tensor([tok("123+456=")["input_ids"]])
    from hybridflow.models.checkpoint import load_decoder
    ours = load_decoder(summary["hf_actor"])(ids)
    torch.testing.assert_close(hf(ids).logits, ours, atol=1e-4, rtol=1e-4)

    # Interrupted after step 2, resumed: the same metrics as the uninterrupted run.
    part = in_repo(config("tiny-grpo.yaml", tmp_path / "b"))
    RLTrainer(part).fit(stop_after=2)
    resumed = in_repo(config("tiny-grpo.yaml", tmp_path / "b", "trainer.resume=auto"))
    RLTrainer(resumed).fit()
    again = read_metrics(tmp_path / "b" / "tiny-grpo" / "metrics.jsonl")
    assert [r["step"] for r in again] == [0, 1, 2, 3, 4]
    assert not (tmp_path / "b" / "tiny-grpo" / "plots").exists()  # trainer.plot=false (in_repo) draws none
    want, got = learned(records), learned(again)
    for step in (3, 4):
        assert got[step].keys() == want[step].keys()
        for key, value in want[step].items():
            assert got[step][key] == pytest.approx(value, rel=1e-5, abs=1e-6), (step, key)


@pytest.mark.slow
def test_skipping_uniform_prompts_resumes_identically(tmp_path):
    """data.skip_uniform_passes=1 on 16 training prompts (two steps an epoch): steps 3 and 4 pass over
    the prompts whose group scored all the same in epoch 1. The sampler's walk is saved with step 2's
    checkpoint; resumed there, steps 3 and 4 draw the same prompts and learn the same as the whole run."""
    from hybridflow.data.dataset import read_rows, write_parquet

    rows = [row for _, row in read_rows(ROOT / "hybridflow/assets/arithmetic/train.parquet")][:16]
    train = str(write_parquet(rows, tmp_path / "train16.parquet"))
    common = [f"data.train_files=[{train}]", "data.skip_uniform_passes=1", "data.val_files=[]"]
    whole = in_repo(config("tiny-grpo.yaml", tmp_path / "a", *common))
    want = learned(read_metrics(RLTrainer(whole).fit()["run_dir"] / "metrics.jsonl"))
    skipped = {step: want[step]["data/skipped_fraction"] for step in (1, 2, 3, 4)}
    assert skipped[1] == skipped[2] == 0.0 and skipped[3] + skipped[4] > 0  # uniform groups in epoch 1
    state = json.loads((tmp_path / "a/tiny-grpo/checkpoints/step_000002/trainer.json").read_text())
    assert state["sampler"]["step"] == 2 and state["sampler"]["skips"]

    part = in_repo(config("tiny-grpo.yaml", tmp_path / "b", *common))
    RLTrainer(part).fit(stop_after=2)
    resumed = in_repo(config("tiny-grpo.yaml", tmp_path / "b", *common, "trainer.resume=auto"))
    RLTrainer(resumed).fit()
    got = learned(read_metrics(tmp_path / "b" / "tiny-grpo" / "metrics.jsonl"))
    for step in (3, 4):
        assert got[step].keys() == want[step].keys()
        for key, value in want[step].items():
            assert got[step][key] == pytest.approx(value, rel=1e-5, abs=1e-6), (step, key)

    # A sampler state that names a prompt this run does not have (as if saved with other data, its
    # manifest matching) is refused, naming the file.
    import hashlib

    from hybridflow.checkpoint import MANIFEST

    step_dir = tmp_path / "b/tiny-grpo/checkpoints/step_000004"
    path, manifest = step_dir / "trainer.json", json.loads((step_dir / MANIFEST).read_text())
    state = json.loads(path.read_text())
    state["sampler"]["skips"]["123456"] = 1
    path.write_text(json.dumps(state))
    manifest["files"]["trainer.json"] = path.stat().st_size
    manifest.setdefault("sha256", {})["trainer.json"] = hashlib.sha256(path.read_bytes()).hexdigest()
    (step_dir / MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(CheckpointError, match=r"step_000004/trainer.json: its sampler state does not fit .*"
                                              r"prompt index 123456 is not among the training prompts"):
        RLTrainer(in_repo(config("tiny-grpo.yaml", tmp_path / "b", *common, "trainer.resume=auto"))).fit()


@pytest.mark.slow
def test_ppo_with_critic_reference_and_kl_learns(tmp_path):
    """Three PPO steps (critic, GAE, reference with KL in the reward and as a loss), deterministic: sampling
    is keyed by (seed, step, row). Step 1 samples no right answer, so rewards, advantages and the critic's
    zero-initialised value head are all 0 and nothing moves; step 2's update is the first with signal.
    Checked to fail: with the advantages negated greedy accuracy falls (0.287 -> 0.198), with the returns
    negated the critic's predictions go negative."""
    # All 1000 held-out prompts (the config validates on 128): the figures below were measured on them.
    cfg = in_repo(config("tiny-ppo.yaml", tmp_path, "trainer.total_steps=3", "data.val_max_samples=0"))
    summary = RLTrainer(cfg).fit()
    steps = {r["step"]: r for r in read_metrics(summary["run_dir"] / "metrics.jsonl")}
    assert sorted(steps) == [0, 1, 2, 3]
    for key in ("critic/vf_loss", "critic/grad_norm", "actor/kl", "actor/kl_loss", "actor/kl_coef",
                "actor/kl_in_reward"):
        assert all(math.isfinite(steps[s][key]) for s in (1, 2, 3)), key
    # The actor learns: greedy accuracy on the 1000 held-out prompts, before step 1 and after step 3
    # (0.287 -> 0.409 when written).
    assert steps[3]["val/accuracy"] > steps[0]["val/accuracy"] + 0.05
    # The critic learns: its values are exactly 0 until its first update with signal (step 2), after which
    # they move toward the returns, which lie in [0, 1] less a small KL penalty.
    assert steps[2]["critic/vpred_mean"] == 0.0 and steps[2]["critic/grad_norm"] > 0
    assert 0.0 < steps[3]["critic/vpred_mean"] < 1.0
    # The actor is the reference until its first update; then the KL between them enters the reward.
    assert steps[2]["actor/kl"] == steps[2]["actor/kl_in_reward"] == 0.0
    # Two reductions of the same per-token KL: actor/kl is the token mean over the batch, actor/kl_in_reward
    # the mean of each response's token mean. They agree in exact arithmetic when every response has the same
    # length, as here (length_mean == length_max); in float32 their sums run in different orders, so they
    # agree to rounding (1e-9 apart on an AVX2 CPU, equal on an AVX-512 one), not bit for bit.
    assert steps[3]["response/length_mean"] == steps[3]["response/length_max"]
    assert steps[3]["actor/kl_in_reward"] == pytest.approx(steps[3]["actor/kl"], rel=1e-5)
    assert steps[3]["actor/kl"] != 0.0
    ckpt = summary["checkpoint"]
    assert (ckpt / "critic").is_dir() and (ckpt / "actor").is_dir()


def test_missing_model_path_is_named(tmp_path):
    cfg = in_repo(config("tiny-grpo.yaml", tmp_path))
    cfg.model.path = str(tmp_path / "no-such-model")
    with pytest.raises(ConfigError, match="model.path: model path does not exist: .*no-such-model"):
        RLTrainer(cfg)


def test_tokenizer_model_vocab_mismatch(tmp_path):
    from hybridflow.data.tokenizer import build_char_tokenizer
    tok_dir = build_char_tokenizer("0123456789+=abcdefghij", tmp_path / "tok")
    cfg = in_repo(config("tiny-grpo.yaml", tmp_path, f"model.tokenizer_path={tok_dir}"))
    with pytest.raises(ConfigError, match="has 26 tokens but the model .* has vocab_size 16"):
        RLTrainer(cfg)


def test_dataset_without_usable_prompts(tmp_path):
    cfg = in_repo(config("tiny-grpo.yaml", tmp_path, "data.max_prompt_length=3"))
    with pytest.raises(DatasetError, match="no usable prompts"):
        RLTrainer(cfg)


@pytest.mark.slow
def test_nan_loss_stops_with_step_and_metric_and_keeps_last_checkpoint(tmp_path, monkeypatch):
    cfg = in_repo(config("tiny-grpo.yaml", tmp_path, "trainer.save_every=1"))
    trainer = RLTrainer(cfg)
    actor = trainer.actor.group._worker.actor  # in-process group (trainer.launcher auto, 1 device)
    real = actor.policy_loss

    def poisoned(*args, **kwargs):
        out = real(*args, **kwargs)
        return out._replace(loss=out.loss * float("nan")) if trainer_step["now"] == 2 else out

    trainer_step = {"now": 0}
    original_step = trainer.train_step

    def tracked(step):
        trainer_step["now"] = step
        return original_step(step)

    monkeypatch.setattr(actor, "policy_loss", poisoned)
    monkeypatch.setattr(trainer, "train_step", tracked)
    with pytest.raises(TrainingError, match=r"step 2: actor/pg_loss is nan; .*step_000001"):
        trainer.fit()
    assert trainer.ckpt.latest()[0] == 1
    assert json.loads((trainer.ckpt.latest()[1] / "trainer.json").read_text())["step"] == 1


@pytest.mark.slow
def test_full_disk_when_saving_keeps_previous_checkpoint(tmp_path, monkeypatch):
    cfg = in_repo(config("tiny-grpo.yaml", tmp_path, "trainer.save_every=1", "trainer.total_steps=2"))
    trainer = RLTrainer(cfg)
    trainer.fit(stop_after=1)
    first = trainer.ckpt.latest()
    real_save = torch.save

    def full_disk(obj, f, *a, **k):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(torch, "save", full_disk)
    with pytest.raises(CheckpointError, match="step 2 .*No space left on device"):
        trainer.save_checkpoint(2)
    monkeypatch.setattr(torch, "save", real_save)
    assert trainer.ckpt.latest() == first
    assert trainer.ckpt.all_steps() == [1]


@pytest.mark.slow
def test_async_preparation_equals_sync_and_overlaps(tmp_path):
    """Chunks of dataflow.min_batch_for_reward responses: reward and log-probs start on chunk 0
    while chunk 1 generates; the run's metrics equal the sync run's with the same chunks."""
    runs = {}
    for mode in ("false", "true"):
        cfg = in_repo(config("tiny-grpo.yaml", tmp_path / mode, "dataflow.min_batch_for_reward=16",
                             f"dataflow.async_execution={mode}", "trainer.total_steps=2",
                             "trainer.val_every=0", "trainer.save_every=0"))
        RLTrainer(cfg).fit()
        runs[mode] = read_metrics(tmp_path / mode / "tiny-grpo" / "metrics.jsonl")
    sync, async_ = learned(runs["false"]), learned(runs["true"])
    assert sync.keys() == async_.keys() == {0, 1, 2}
    for step in (1, 2):
        assert sync[step] == pytest.approx(async_[step], rel=1e-6, abs=1e-7), step
    assert all(r["timing/overlap_s"] > 0 for r in runs["true"][1:])
    assert all(r["timing/overlap_s"] == 0 for r in runs["false"][1:])


def test_a_rollout_buffer_saved_before_the_rollout_scored_its_rows_is_scored_on_resume(tmp_path):
    """An off-policy checkpoint written before the rule reward moved into the rollout's worker holds batches
    without RULE_SCORES or RESPONSE_LENGTH; the trainer scores them as the rollout would have."""
    from hybridflow.data import fields as F

    trainer = RLTrainer(in_repo(config("tiny-grpo.yaml", tmp_path)))
    made = trainer.rollout(trainer.prompts(1), 0)
    old = {k: v for k, v in made.items() if k not in (F.RULE_SCORES, F.RESPONSE_LENGTH)}
    again = trainer._scored_here(old)
    assert torch.equal(again[F.RULE_SCORES], made[F.RULE_SCORES])
    assert torch.equal(again[F.RESPONSE_LENGTH], made[F.RESPONSE_LENGTH])


def test_reward_model_combined_with_rule_reward(tmp_path):
    """reward.model_path: SCORES = rule_weight * rule + model_weight * reward-model score."""
    from hybridflow.data import fields as F
    from hybridflow.roles.scoring import score
    from hybridflow.utils import load_hf_model

    rm_path = ROOT / "hybridflow/assets/tiny_reward_model"
    cfg = in_repo(config("tiny-grpo.yaml", tmp_path, f"reward.model_path={rm_path}", "reward.rule_weight=2.0",
                         "reward.model_weight=0.5"))
    trainer = RLTrainer(cfg)
    batch, _, _ = trainer.prepare(1)
    rule = score(batch, trainer.reward_fn)
    assert torch.equal(batch[F.RULE_SCORES], rule)  # scored by the rollout, where the batch is made
    model = load_hf_model(rm_path).score(list(zip(batch[F.PROMPT_TEXT], batch[F.RESPONSE_TEXT])))
    torch.testing.assert_close(batch[F.SCORES], 2.0 * rule + 0.5 * torch.tensor(model), atol=1e-5, rtol=1e-5)
    assert trainer.train_step(2)["actor/grad_norm"] > 0


def test_missing_reward_model_path_is_named(tmp_path):
    cfg = in_repo(config("tiny-grpo.yaml", tmp_path, f"reward.model_path={tmp_path / 'no-rm'}"))
    with pytest.raises(ConfigError, match="reward.model_path: reward model path does not exist"):
        RLTrainer(cfg)


def test_batch_size_per_device_splits_generation_without_changing_greedy_results(tmp_path):
    whole = RLTrainer(in_repo(config("tiny-grpo.yaml", tmp_path / "a"))).validate()
    parts = RLTrainer(in_repo(config("tiny-grpo.yaml", tmp_path / "b", "rollout.batch_size_per_device=24",
                                     "rollout.pad_to_max_length=true"))).validate()
    assert parts["val/accuracy"] == whole["val/accuracy"] and parts["val/n"] == whole["val/n"] == 128


@pytest.mark.slow
def test_a_rerun_in_an_old_run_directory_is_refused_unless_resumed_or_overwritten(tmp_path):
    """Starting afresh over a previous run used to truncate its metrics and prune its checkpoints."""
    one_step = ["trainer.total_steps=1", "trainer.val_every=0", "trainer.save_every=1"]
    RLTrainer(in_repo(config("tiny-grpo.yaml", tmp_path, *one_step))).fit()
    metrics = tmp_path / "tiny-grpo" / "metrics.jsonl"
    before = metrics.read_bytes()
    with pytest.raises(ConfigError, match=r"trainer.resume: .*tiny-grpo holds a previous run \(metrics.jsonl "
                                          r".*checkpoints step_000001..step_000001\); set trainer.resume=auto to "
                                          r"continue it, or trainer.overwrite=true"):
        RLTrainer(in_repo(config("tiny-grpo.yaml", tmp_path, *one_step)))
    assert metrics.read_bytes() == before  # nothing was touched
    # Overwriting starts over at once: stopped before its first save (a crash), it leaves no step of
    # the old run for a later resume=auto to pick up as if it were this run's.
    RLTrainer(in_repo(config("tiny-grpo.yaml", tmp_path, *one_step, "trainer.overwrite=true"))).fit(stop_after=0)
    old = CheckpointManager(tmp_path / "tiny-grpo" / "checkpoints", keep_last=0)
    assert old.latest() is None and old.all_steps() == []
    RLTrainer(in_repo(config("tiny-grpo.yaml", tmp_path, *one_step, "trainer.overwrite=true"))).fit()
    assert [r["step"] for r in read_metrics(metrics)] == [0, 1]  # started over: a new metrics file


def test_a_worker_failing_inside_a_flow_stage_surfaces_as_worker_error(tmp_path, monkeypatch):
    from hybridflow.controller import WorkerError
    from hybridflow.dataflow import NodeError

    trainer = RLTrainer(in_repo(config("tiny-grpo.yaml", tmp_path)))
    cause = WorkerError(1, "generate", "its worker process died")

    def failing_run(*args, **kwargs):
        raise NodeError("node 'rollout': forward_fn raised WorkerError") from cause

    monkeypatch.setattr(trainer.flow, "run", failing_run)
    with pytest.raises(WorkerError, match="rank 1 failed in generate") as info:
        trainer.train_step(1)
    assert info.value is cause


@pytest.mark.parametrize("override, message", [
    ("actor.parallel.pp=2 rollout.pg=2", "rollout.pg: 2: generation pipelining is not built yet"),
    ("trainer.n_devices=5 placement.training=[0,1] placement.reference=[0,1] placement.rollout=[2,3,4] "
     "rollout.tg=3", "rollout.tg: 3 does not divide the model's 4 attention heads"),
    ("trainer.n_devices=4 actor.parallel.tp=2 rollout.grouping=full",
     "rollout.grouping: 'full' (the DeepSpeed-Chat baseline) gathers within one training replica"),
    ("trainer.n_devices=4 actor.parallel.tp=4 rollout.tg=2 rollout.engine=vllm",
     "rollout.grouping: 'hybridflow' at tg=2 < actor.parallel.tp=4"),
])
def test_settings_not_built_yet_stop_before_any_worker_starts(tmp_path, override, message):
    cfg = in_repo(config("tiny-grpo.yaml", tmp_path, "trainer.n_devices=2", *override.split()))
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        RLTrainer(cfg)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error where no CUDA device exists")
def test_cuda_device_without_cuda_is_a_config_error(tmp_path):
    cfg = in_repo(config("tiny-grpo.yaml", tmp_path, "trainer.device=cuda"))
    with pytest.raises(ConfigError, match="trainer.device: 'cuda' but (torch was built without CUDA|no CUDA device)"):
        RLTrainer(cfg)


def test_gpu_scale_configs_against_their_model_shapes(tmp_path):
    from hybridflow.config.plan import RunPlan
    from hybridflow.config.preflight import check_runnable
    from hybridflow.models import DecoderConfig

    qwen_05b = DecoderConfig(model_type="qwen2", vocab_size=151936, hidden_size=896, intermediate_size=4864,
                             num_layers=24, num_heads=14, num_kv_heads=2, head_dim=64)
    cfg = load_config(ROOT / "configs" / "qwen2.5-0.5b-grpo-gsm8k.yaml", ["trainer.device=cpu",
                                                                        f"trainer.output_dir={tmp_path}"])
    check_runnable(cfg, RunPlan.from_config(cfg), qwen_05b)  # tp=2 over 8 devices: runnable now
    cfg.actor.parallel.tp = 4  # 14 heads do not split 4 ways
    with pytest.raises(ConfigError, match="actor.parallel.tp: 4 does not divide the model.s 14 attention heads"):
        check_runnable(cfg, RunPlan.from_config(cfg), qwen_05b)
    qwen_7b = DecoderConfig(model_type="qwen2", vocab_size=152064, hidden_size=3584, intermediate_size=18944,
                            num_layers=28, num_heads=28, num_kv_heads=4, head_dim=128)
    cfg = load_config(ROOT / "configs" / "qwen2.5-7b-ppo-gsm8k.yaml", ["trainer.device=cpu",
                                                                     f"trainer.output_dir={tmp_path}"])
    check_runnable(cfg, RunPlan.from_config(cfg), qwen_7b)  # tp=4 -> tg=2: runnable now
    cfg.rollout.pg = 2
    with pytest.raises(ConfigError, match="rollout.pg: 2: generation pipelining is not built yet"):
        check_runnable(cfg, RunPlan.from_config(cfg), qwen_7b)


def test_validation_can_be_capped_skipped_and_reports_progress(tmp_path, caplog):
    caplog.set_level("INFO", logger="hybridflow.trainer.trainer")
    cfg = in_repo(config("tiny-grpo.yaml", tmp_path, "trainer.total_steps=1", "trainer.val_before_train=false",
                         "data.val_max_samples=5", "data.val_batch_size=2", "trainer.save_every=0"))
    trainer = RLTrainer(cfg)
    summary = trainer.fit()
    records = read_metrics(summary["run_dir"] / "metrics.jsonl")
    assert [r["step"] for r in records] == [1] and records[0]["val/n"] == 5  # no step-0 validation
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("validation:")]
    total = len(trainer.val_set)
    assert lines[0] == f"validation: the first 5 of {total} prompts, up to 6 new tokens each, 3 batches of <= 2"
    assert [line.split(",")[0] for line in lines[1:]] == ["validation: 2/5 prompts", "validation: 4/5 prompts",
                                                          "validation: 5/5 prompts"]
    assert all("s elapsed, ETA" in line for line in lines[1:])
    assert caplog.records[0].levelname == "INFO"

    # A validation that would generate many tokens says so before it starts, with the keys that shorten it.
    caplog.clear()
    trainer.val_count, trainer.cfg.data.max_response_length = total, 100_000
    trainer._announce_validation()
    assert caplog.records[-1].levelname == "WARNING"
    assert f"all {total} prompts" in caplog.text and "data.val_max_samples" in caplog.text
    assert "trainer.val_before_train=false" in caplog.text
    trainer.shutdown()
    with pytest.raises(ConfigError, match="data.val_max_samples: must be >= 0"):
        config("tiny-grpo.yaml", tmp_path, "data.val_max_samples=-1")


GAP = ("offpolicy/is_weight_mean", "offpolicy/is_weight_max", "offpolicy/is_clipped_frac", "offpolicy/k3_kl")


@pytest.mark.slow
@pytest.mark.parametrize("correction", ["none", "decoupled"])
def test_skipping_old_log_probs_gives_the_same_update(tmp_path, correction):
    """One epoch over one mini-batch: the old log-probs are the current policy's, so the update takes
    its own (detached) instead of a forward pass of their own. Same steps either way, with a sampler-
    trainer correction too (the proximal policy is the same weights), and the sampler-trainer gap the
    update reports from its own pass is the one the driver measured from the recomputed log-probs."""
    one_step = ["actor.ppo_mini_batch_size=8", "trainer.total_steps=3", "trainer.val_every=3", "trainer.save_every=0",
                "trainer.experiment=skip", f"actor.off_policy_correction={correction}"]
    runs = {}
    for skip in (True, False):
        cfg = in_repo(config("tiny-grpo.yaml", tmp_path / str(skip), *one_step, f"actor.skip_old_log_probs={skip}",
                             "data.val_max_samples=0"))  # all 1000 held-out prompts: the bound below counts them
        trainer = RLTrainer(cfg)
        assert trainer.needs_old is not skip
        runs[skip] = read_metrics(trainer.fit()["run_dir"] / "metrics.jsonl")
        trainer.shutdown()
    assert "timing/log_probs_s" not in runs[True][1] and "timing/log_probs_s" in runs[False][1]
    assert runs[True][1]["actor/clip_frac"] == 0.0
    want, got = learned(runs[False]), learned(runs[True])
    assert got.keys() == want.keys() == {0, 1, 2, 3}
    gap = {skip: {r["step"]: r for r in runs[skip]} for skip in runs}
    for step in (1, 2, 3):
        for key in ("reward/mean", "actor/pg_loss", "actor/grad_norm", "actor/entropy", "response/length_mean"):
            assert got[step][key] == pytest.approx(want[step][key], rel=1e-4, abs=1e-6), (step, key)
    # The gap of equal weights (only the engines' computation orders differ): both ~0, from either pass.
    for step in (1, 2, 3):
        for key in GAP:
            assert gap[True][step][key] == pytest.approx(gap[False][step][key], rel=1e-4, abs=1e-6), (step, key)
    # The two runs' weights agree to rounding, not bit for bit (the old log-probs come from different passes),
    # so a greedy answer on a near-tie may flip: at most 2 of the 1000 held-out prompts.
    assert got[3]["val/accuracy"] == pytest.approx(want[3]["val/accuracy"], abs=0.002)
    # Anything that reads the old log-probs before the update keeps their pass.
    for extra in (["actor.ppo_epochs=2"], ["actor.ppo_mini_batch_size=4"], ["algorithm.use_kl_in_reward=true", "reference.enabled=true"]):
        from hybridflow.config.plan import RunPlan
        assert RunPlan.from_config(config("tiny-grpo.yaml", tmp_path, "actor.ppo_mini_batch_size=8", *extra)
                                   ).needs_old_log_probs


LAYOUTS = {
    "packed": ["actor.use_dynamic_bsz=true", "actor.ppo_max_token_len_per_gpu=40",
               "actor.log_prob_use_dynamic_bsz=true", "actor.log_prob_max_token_len_per_gpu=64",
               "reference.log_prob_use_dynamic_bsz=true", "reference.log_prob_max_token_len_per_gpu=64"],
    "shared-prompt": ["actor.share_prompts=true", "actor.log_prob_share_prompts=true",
                      "reference.log_prob_share_prompts=true"],
}


PACKING_COMMON = ["trainer.total_steps=2", "trainer.val_every=0", "trainer.save_every=0", "trainer.experiment=pack",
                  "actor.ppo_mini_batch_size=4", "actor.use_kl_loss=true", "reference.enabled=true"]


def _metrics_of_run(run_dir: Path, *overrides: str) -> list[dict]:
    trainer = RLTrainer(in_repo(config("tiny-grpo.yaml", run_dir, *PACKING_COMMON, *overrides)))
    try:
        return read_metrics(trainer.fit()["run_dir"] / "metrics.jsonl")
    finally:
        trainer.shutdown()


@pytest.fixture(scope="module")
def padded_run(tmp_path_factory):
    """The padded run both packing layouts are compared with, run once."""
    return _metrics_of_run(tmp_path_factory.mktemp("padded"))


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_packed_micro_batches_train_as_the_padded_ones(tmp_path, layout, padded_run):
    """#14 item 5: with verl's dynamic batch size on for the actor, its old log-probs and the reference,
    every training forward packs token-budgeted micro-batches (no padding computed), and the steps equal
    the padded run's. The same for shared-prompt rows (each prompt computed once, its samples' responses
    after it). (The critic's packed and shared values are checked against the padded ones in
    tests/engine/test_megatron_engine.py.)"""
    packing = LAYOUTS[layout]
    want, got = learned(padded_run), learned(_metrics_of_run(tmp_path, *packing))
    assert want[1]["actor/grad_norm"] > 0 and want[1]["actor/approx_kl"] > 0  # updates happened, old log-probs used
    for step in (1, 2):
        for key in ("reward/mean", "actor/pg_loss", "actor/kl_loss", "actor/grad_norm", "actor/entropy",
                    "actor/approx_kl", "response/length_mean"):
            assert got[step][key] == pytest.approx(want[step][key], rel=1e-3, abs=1e-6), (step, key)
    key = packing[0].split("=")[0]
    with pytest.raises(ConfigError, match=f"{key}: .* need pipeline size 1, the layout has"):
        RLTrainer(in_repo(config("tiny-grpo.yaml", tmp_path / "pp", packing[0],
                                 "actor.parallel.pp=2", "trainer.n_devices=2", "trainer.launcher=ray")))
    if layout == "shared-prompt":
        with pytest.raises(ConfigError, match="actor.share_prompts: shared-prompt rows and packed micro-batches "
                                              r"\(actor.use_dynamic_bsz\) are two layouts"):
            RLTrainer(in_repo(config("tiny-grpo.yaml", tmp_path / "both", *packing, "actor.use_dynamic_bsz=true")))


def test_reward_values_a_user_function_may_return():
    """One finite number per response, in any of the forms users return it; anything else named."""
    import numpy as np

    from hybridflow.data import fields as F
    from hybridflow.roles import scoring

    batch = {F.DATA_SOURCE: ["a"] * 5, F.RESPONSE_TEXT: ["x"] * 5, F.GROUND_TRUTH: ["1"] * 5,
             F.EXTRA_INFO: [{}] * 5}
    values = iter([True, 2, np.float32(0.5), torch.tensor(-1.5), {"score": 0.25, "acc": True}])
    assert scoring.score(batch, lambda *a: next(values)).tolist() == [1.0, 2.0, 0.5, -1.5, 0.25]
    for bad, shown in ((float("inf"), "inf (not a finite number)"), (None, "None (a NoneType, not a number)"),
                       (torch.ones(2), "(a Tensor, not a number)"), ("1", "'1' (a str, not a number)")):
        with pytest.raises(scoring.RewardValueError, match=re.escape(shown)):
            scoring.score(batch, lambda *a, bad=bad: bad)


def test_the_rule_rewards_seconds_ride_with_the_rows_it_scored_and_are_reported_apart(tmp_path):
    """The rollout scores its rows (RULE_SCORES) and says how long that took, spread evenly over the rows
    (RULE_REWARD_SECONDS): the driver reports the sum as timing/rule_reward_s and drops the field. Before,
    a slow reward function's time showed only inside timing/rollout_s, and timing/reward_s read ~0."""
    import time

    from hybridflow.data import fields as F
    from hybridflow.rewards import register_reward
    from hybridflow.roles import scoring

    def slow(data_source, solution_str, ground_truth, extra_info=None):
        time.sleep(0.002)
        return 1.0

    batch = {F.DATA_SOURCE: ["a"] * 4, F.RESPONSE_TEXT: ["x"] * 4, F.GROUND_TRUTH: ["1"] * 4,
             F.EXTRA_INFO: [{}] * 4}
    scoring.score_rule(batch, slow, "slow")
    seconds = batch[F.RULE_REWARD_SECONDS]
    assert batch[F.RULE_SCORES].tolist() == [1.0] * 4 and seconds.shape == (4,)
    assert torch.all(seconds == seconds[0]) and seconds.sum().item() >= 4 * 0.002  # four sleeps at least

    name = "test_trainer_slow_reward"
    register_reward(name)(slow)
    trainer = RLTrainer(in_repo(config("tiny-grpo.yaml", tmp_path, f"reward.function={name}",
                                       "trainer.val_every=0", "trainer.save_every=0")))
    try:
        batch, metrics, _ = trainer.prepare(1)
    finally:
        trainer.shutdown()
    rows = len(batch[F.UID])  # 8 prompts x 4 samples, each scored once (sleeping 2 ms)
    assert rows * 0.002 <= metrics["timing/rule_reward_s"] and F.RULE_REWARD_SECONDS not in batch


def test_uniform_rows_are_the_groups_without_signal_and_above_a_floor():
    from hybridflow.data import fields as F
    from hybridflow.trainer import rl_steps

    # groups: a all right, b mixed, c all wrong, d a single sample
    batch = {F.SCORES: torch.tensor([1.0, 1.0, 1.0, 0.0, 0.0, 0.0, 0.5]), F.UID: list("aabbccd")}
    assert rl_steps.uniform_rows(batch).tolist() == [True, True, False, False, True, True, True]
    assert rl_steps.uniform_rows(batch, 1.0).tolist() == [True, True, False, False, False, False, False]
    assert rl_steps.uniform_rows(batch, 0.5).tolist() == [True, True, False, False, False, False, True]


def test_the_critic_joins_the_actors_processes_only_on_its_devices_and_layout(tmp_path):
    """Under Ray a critic on the actor's devices in the actor's megatron-core layout runs in the actor's
    processes (RayWorkerGroup.colocated); placed apart, or in another layout, it gets its own."""
    from hybridflow.config.plan import RunPlan

    ray4 = ["trainer.n_devices=4", "trainer.launcher=ray"]

    def colocated(*overrides):
        return RunPlan.from_config(config("tiny-ppo.yaml", tmp_path, *ray4, *overrides)).colocate_critic

    assert colocated()
    assert colocated("actor.parallel.tp=2", "critic.parallel.tp=2")
    assert not colocated("actor.parallel.tp=2")  # critic at tp = 1: another layout
    assert not colocated("placement.training=[0,1]", "placement.rollout=[0,1]", "placement.reference=[0,1]",
                         "placement.critic=[2,3]")


def test_the_reward_model_joins_the_actors_processes_only_on_its_devices(tmp_path):
    """Under Ray a reward model placed on the actor's devices (the default: every device) runs in the
    actor's processes; on a device set of its own it gets its own processes."""
    from hybridflow.config.plan import RunPlan

    rm = ["trainer.n_devices=4", "trainer.launcher=ray", f"reward.model_path={ROOT / 'hybridflow/assets/tiny_reward_model'}"]

    def colocated(*overrides):
        return RunPlan.from_config(config("tiny-grpo.yaml", tmp_path, *rm, *overrides)).colocate_reward_model

    assert colocated()
    assert colocated("actor.parallel.tp=2")  # an HF classifier: any megatron-core layout of the actor's
    assert not colocated("placement.rollout=[0,1]", "placement.reward=[2]", "placement.training=[0,1,2,3]")
