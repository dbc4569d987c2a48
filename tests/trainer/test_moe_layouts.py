"""Mixture of experts through the trainer (issue 59, item 4): GRPO and PPO on a tiny Qwen3-MoE at TP2, PP2 and
DP2 on Ray, each against one process, and the HF export that `transformers` loads with the same logits."""
import json
import shutil

import pytest
import torch

from tests.trainer.test_cp_layouts import critic_at_the_actors_layout, critic_too
from tests.trainer.test_distributed_trainer import ROOT, compare_with_one_process, run

pytestmark = [pytest.mark.usefixtures("ray_cluster"), pytest.mark.timeout(400)]


def qwen3_moe_shaped_model(path):
    """The demo model's shapes as a Qwen3-MoE at `path`: QK-norm, 4 heads over 2 KV heads, every layer's MLP
    4 experts of 96 features with 2 chosen per token (weights renormalised), random weights (router std 0.2:
    no near ties), the demo model's tokenizer."""
    from hybridflow.models.bridge import get_bridge
    from hybridflow.models.checkpoint import save_hf_checkpoint
    from hybridflow.models.config import DecoderConfig
    from hybridflow.models.decoder import Decoder

    demo = ROOT / "hybridflow/assets/demo_model"
    hf = {**json.loads((demo / "config.json").read_text()), "model_type": "qwen3_moe",
          "architectures": ["Qwen3MoeForCausalLM"], "num_key_value_heads": 2, "num_experts": 4,
          "num_experts_per_tok": 2, "moe_intermediate_size": 96, "norm_topk_prob": True}
    cfg = DecoderConfig.from_hf_dict(hf)
    assert cfg.is_moe and cfg.qk_norm
    decoder = Decoder(cfg).init_weights(std=0.2, seed=3)
    save_hf_checkpoint(get_bridge(cfg).generation_to_hf(dict(decoder.state_dict())), cfg.to_hf_dict(), path)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(demo / name, path / name)
    return path


def _steps(path) -> list[str]:
    """Three steps, one mini-batch each. The random model answers no prompt right, so the tiny reward model
    scores the responses too: without it every reward is 0, GRPO's advantages are 0 and nothing trains, and
    PPO's whitened advantages are made of the last bits of the KL (experts see other token batches in the
    update's micro-batches than in the log-prob pass, so their matmuls round differently)."""
    rm = ROOT / "hybridflow/assets/tiny_reward_model"
    return [f"model.path={path}", "trainer.total_steps=3", "trainer.val_every=0", "trainer.save_every=0",
            "actor.ppo_mini_batch_size=8", f"reward.model_path={rm}", "reward.model_weight=0.5"]


# The router's losses, or routing replay (the rollout's routes replayed in the old pass and the update).
ROUTER_LOSSES = {"aux+z": ["actor.moe.aux_loss_coeff=0.01", "actor.moe.z_loss_coeff=0.001"],
                 "aux": ["actor.moe.aux_loss_coeff=0.01"], "": [], "replay": ["actor.moe.routing_replay=rollout"]}


@pytest.fixture(scope="module")
def qwen3_moe(tmp_path_factory):
    """The model's path, and each config's three steps on one process, with or without the router losses
    (run once each)."""
    path, runs = qwen3_moe_shaped_model(tmp_path_factory.mktemp("qwen3moe")), {}

    def one_process(name: str, router_losses: str = ""):
        if (name, router_losses) not in runs:
            runs[name, router_losses] = run(name, tmp_path_factory.mktemp("one"), *_steps(path),
                                            *ROUTER_LOSSES[router_losses])
        return runs[name, router_losses]

    return path, one_process


# megatron-core trains an MoE layer at tp > 1 only with sequence parallelism (the config check asks for it).
LAYOUTS = {"tp2sp": ["trainer.n_devices=2", "actor.parallel.tp=2", "actor.parallel.sequence_parallel=true"],
           "pp2": ["trainer.n_devices=2", "actor.parallel.pp=2"],
           "dp2": ["trainer.n_devices=2"],
           "dp2ep2": ["trainer.n_devices=2", "actor.parallel.ep=2"],
           "tp2sp_ep2": ["trainer.n_devices=4", "actor.parallel.tp=2", "actor.parallel.sequence_parallel=true",
                         "actor.parallel.ep=2", "rollout.tg=2"],
           "pp2_ep2": ["trainer.n_devices=4", "actor.parallel.pp=2", "actor.parallel.ep=2"],
           "cp2_ep2": ["trainer.n_devices=2", "actor.parallel.cp=2", "actor.parallel.ep=2"],
           "dp2ep2_apart": ["trainer.n_devices=3", "actor.parallel.ep=2", "placement.training=[0,1]",
                            "placement.reference=[0,1]", "placement.rollout=[2]"]}


# The expert-parallel runs that save their step-3 checkpoint, with the `hybridflow reshard` options of their layout.
EP_CHECKPOINTS = {"dp2ep2": ["--dp", "2", "--ep", "2"], "cp2_ep2": ["--cp", "2", "--ep", "2"]}


def ep_checkpoint_round_trips(summary, path, tmp_path, layout: list[str]) -> None:
    """The run's step-3 checkpoint (each rank's shard holds its expert-parallel rank's experts, a CP rank's its
    own file) converts to the HF model the run exported, bit for bit; and that HF model resharded to the run's
    layout gives the run's own shard files, every tensor equal (the tool writes what the engine writes)."""
    from hybridflow.cli import main
    from hybridflow.models.checkpoint import load_hf_state_dict

    step = summary["run_dir"] / "checkpoints" / "step_000003"
    assert main(["reshard", str(step), str(tmp_path / "hf"), "--to", "hf", "--config", str(path),
                 "--no-progress"]) == 0
    converted, exported = load_hf_state_dict(tmp_path / "hf"), load_hf_state_dict(summary["hf_actor"])
    assert sorted(converted) == sorted(exported) and all(torch.equal(converted[k], exported[k]) for k in exported)
    assert main(["reshard", str(summary["hf_actor"]), str(tmp_path / "again"), "--to", "hybridflow", *layout,
                 "--make-vocab-size-divisible-by", "16", "--no-progress"]) == 0  # the tiny configs' padding
    (written,) = (tmp_path / "again").glob("step_*")
    files = sorted(p.name for p in (step / "actor").glob("engine_*.pt"))
    assert files == sorted(p.name for p in (written / "actor").glob("engine_*.pt")) and len(files) == 2, files
    for file in files:
        mine = torch.load(written / "actor" / file, weights_only=True)["model"]
        run_s = torch.load(step / "actor" / file, weights_only=True)["model"]
        assert mine.keys() == run_s.keys(), (file, sorted(mine.keys() ^ run_s.keys()))
        assert all(torch.equal(mine[k], run_s[k]) for k in mine), (file, [(k, (mine[k] - run_s[k]).abs().max()) for k in mine if not torch.equal(mine[k], run_s[k])])
    a, b = (torch.load(step / "actor" / f, weights_only=True)["model"] for f in files)
    assert any(not torch.equal(a[k], b[k]) for k in a if ".local_experts." in k)  # each file its own experts


@pytest.mark.parametrize("name,layout,router_losses", [
    ("tiny-grpo.yaml", "tp2sp", "aux"), ("tiny-grpo.yaml", "pp2", "aux+z"), ("tiny-grpo.yaml", "dp2", ""),
    ("tiny-grpo.yaml", "tp2sp_ep2", ""), ("tiny-grpo.yaml", "pp2_ep2", ""), ("tiny-grpo.yaml", "cp2_ep2", "aux"),
    ("tiny-grpo.yaml", "dp2ep2_apart", ""),
    *(("tiny-ppo.yaml", k, "replay") for k in ("tp2sp", "pp2", "dp2ep2"))])
def test_grpo_and_ppo_on_a_tiny_qwen3_moe_at_each_layout_match_one_process(tmp_path, qwen3_moe, name, layout,
                                                                           router_losses: str):
    """Experts replicated on every rank, split over TP like an MLP (with sequence
    parallelism, the tokens gathered over TP before the dispatch), each layer's router and experts in the
    stage that holds the layer at PP2, megatron-core's allgather dispatcher over gloo; the 3D-HybridEngine
    gathers the experts into the generation layout. dp2ep2 (PPO): each rank trains half of every layer's
    experts (expert parallelism; the critic and the reference too), the dispatcher gathering both ranks'
    tokens to them; each rank generates with all experts, the other rank's gathered after every update.
    tp2sp_ep2 (GRPO, 4 processes): experts TP-split and split over the two DP ranks; generation at tg = 2
    gathers the other rank's experts' TP shards, then regroups as for a dense model. pp2_ep2 (GRPO, 4 processes):
    each stage's layers' experts split over its two DP ranks, gathered per stage before the grouped gather over
    the pipeline. cp2_ep2 (GRPO, 2 processes, dp 1): megatron-core carves the expert-parallel group from the CP
    ranks, so each CP rank holds half the experts and the dispatcher gathers both ranks' sequence chunks to them;
    with the load-balancing loss on (the routers told which chunk columns are padding), its loss and loads are
    one process's. dp2ep2_apart (GRPO, 3 processes): the rollout on a process of its own receives every expert
    from the training rank that trains it (`hybrid_engine/apart.py`). Three steps' learned metrics equal one
    process's within
    1e-5 relative (1e-6 absolute for small values). GRPO with router losses: megatron-core counts the
    load-balancing loss's tokens over TP (and CP) and the engine marks the padding columns, so at tp2+SP it,
    and at pp2 it and the z-loss, are one process's, as are the reported `moe/...` figures. Not at tp2+SP for
    the z-loss: megatron-core adds each TP rank's own mean over its real tokens (coefficient / tp), which is
    not the micro-batch's mean when padding is split unevenly over the ranks (measured: step 1's grad_norm
    4e-6 relative apart, then sampling diverges). At dp2 a rank's micro-batch holds other rows than one
    process's, and a loss over a micro-batch's loads differs by definition: that run has them off. PPO's
    critic is the same MoE decoder with a value head, at the actor's layout. PPO at tp2+SP: the KL metrics
    within 3e-6 absolute (9e-5 relative, measured): each is a mean difference of two log-probs near -2, so
    the last-bit differences of the experts' TP-split matmuls (each rank's rows of a different token batch)
    show 100 times larger relative to it; the router's weights after three steps agree to 6e-8. PPO replays the
    rollout's routes (engine/routes.py): each layout finds each token's batch position through its own
    packing, SP slices and pipeline stages, and routes it as one process does; the route mismatch it measures
    (the router's own choice against the rollout's) is one process's too (not the log-prob gaps on matched and
    mismatched tokens: those are differences of a few 1e-6 between the sampler's and the trainer's log-probs,
    rounding's, which each layout rounds otherwise)."""
    path, one_process = qwen3_moe
    save = ["trainer.save_every=1"] if layout in EP_CHECKPOINTS else []  # after _steps' save_every=0
    overrides = ["trainer.launcher=ray", *critic_too(LAYOUTS[layout]), *_steps(path), *ROUTER_LOSSES[router_losses]]
    summary, records = run(name, tmp_path / "layout", *overrides, *save, before_fit=critic_at_the_actors_layout)
    single = one_process(name, router_losses)[1]
    if layout == "dp2ep2":  # each rank receives the other's experts, half of all: (ep - 1) / ep of them
        from hybridflow.models.checkpoint import load_hf_state_dict

        experts = sum(t.numel() * t.element_size() for k, t in load_hf_state_dict(path).items() if ".experts." in k)
        assert [r["reshard/bytes_received"] for r in records if r.get("step")] == [experts / 2] * 3
    if layout == "dp2ep2_apart":  # each expert slice sent by a rank that trains it, the plan's bytes moved
        from tests.trainer.test_distributed_trainer import _assert_synced_by_plan

        _assert_synced_by_plan(records, (1, 2, 3))
    if layout in EP_CHECKPOINTS:
        ep_checkpoint_round_trips(summary, path, tmp_path, EP_CHECKPOINTS[layout])
    if layout == "dp2ep2":  # resumed from step 2 (each rank its experts' weights and Adam state), step 3 again
        from tests.trainer.test_trainer import learned

        shutil.copytree(tmp_path / "layout", tmp_path / "resumed")
        shutil.rmtree(summary["run_dir"].parent.parent / "resumed" / summary["run_dir"].name / "checkpoints" /
                      "step_000003")
        _, again = run(name, tmp_path / "resumed", *overrides, "trainer.resume=auto",
                       before_fit=critic_at_the_actors_layout)
        assert [r["step"] for r in again] == [r["step"] for r in records]
        for key, value in learned(records)[3].items():
            assert learned(again)[3][key] == pytest.approx(value, rel=1e-6, abs=1e-7), key
    compare_with_one_process(f"{name} on the tiny qwen3-moe at {layout}", records, single, steps=(1, 2, 3),
                             rel=1e-5, abs_=3e-6 if name == "tiny-ppo.yaml" and layout == "tp2sp" else 1e-6)
    for many, one in zip(records[1:], single[1:]):
        for key in ("moe/layer0/max_load", "moe/layer3/min_load", *(f"moe/{k}_loss" for k in ("aux", "z")
                                                                    if f"moe/{k}_loss" in one),
                    *(k for k in one if k.endswith(("route_mismatch", "route_mismatch_tokens")))):
            # The route mismatch counts the router's own near-ties, which the layouts' last bits can tip: a
            # share of a few hundred (token, layer) pairs (measured at pp2 and tp2+SP: 0.01279 vs 0.01267).
            close = dict(abs=5e-3) if "route_m" in key else dict(rel=1e-5)
            assert many[key] == pytest.approx(one[key], **close), key


def test_the_moe_export_loads_in_transformers_with_the_trained_logits(qwen3_moe):
    """The one-process GRPO run's HF export: per-expert tensors on disk, as `transformers` writes them; its
    Qwen3MoeForCausalLM (which fuses the experts when it loads) gives the plain decoder's logits."""
    import transformers

    from hybridflow.models.checkpoint import load_decoder, load_hf_state_dict

    summary, _ = qwen3_moe[1]("tiny-grpo.yaml")
    export = summary["hf_actor"]
    names = load_hf_state_dict(export).keys()
    assert "model.layers.0.mlp.experts.3.down_proj.weight" in names and "model.layers.0.mlp.gate.weight" in names
    reference = transformers.AutoModelForCausalLM.from_pretrained(export).eval()
    ids = torch.randint(3, 16, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(load_decoder(export).eval()(ids), reference(input_ids=ids).logits,
                                   rtol=1e-5, atol=1e-5)


def test_a_moe_run_resumed_from_its_checkpoint_takes_the_same_third_step(tmp_path, qwen3_moe):
    """Three GRPO steps with both router losses, saved every step; resumed from step 2's checkpoint (the
    experts' and router's weights and Adam state), step 3 is the same step again: its learned metrics and
    router figures equal the uninterrupted run's (the same computation in the same process: rel 1e-6 allows
    for the resumed optimizer's state read back through its own file format only)."""
    import shutil

    from tests.trainer.test_trainer import learned

    path, _ = qwen3_moe
    common = [*_steps(path), "trainer.save_every=1", *ROUTER_LOSSES["aux+z"]]
    _, records = run("tiny-grpo.yaml", tmp_path / "full", *common)
    shutil.copytree(tmp_path / "full", tmp_path / "resumed")
    shutil.rmtree(tmp_path / "resumed" / "tiny-grpo" / "checkpoints" / "step_000003")
    _, again = run("tiny-grpo.yaml", tmp_path / "resumed", *common, "trainer.resume=auto")
    assert [r["step"] for r in again] == [r["step"] for r in records]
    for key, value in learned(records)[3].items():
        assert learned(again)[3][key] == pytest.approx(value, rel=1e-6, abs=1e-7), key
    for key in ("moe/aux_loss", "moe/z_loss", "moe/layer2/max_load"):
        assert again[-1][key] == pytest.approx(records[-1][key], rel=1e-6), key


def test_one_step_routes_differ_from_the_stale_sampler_and_replay_routes_by_the_samplers(tmp_path, qwen3_moe):
    """The rollout apart and one version behind (trainer.off_policy=one_step): from step 2 the sampler's weights
    are an update older than the trainer's, so the trainer's routers choose other experts for some tokens than
    the sampler did (moe/old_pass/route_mismatch > 0, where at step 1, the same weights, only the two codes'
    rounding can tip a near-tie), and the log-probs of the tokens predicted from such columns are further from
    the sampler's than the others'. Replaying the rollout's routes changes what trains: the same run with
    actor.moe.routing_replay=rollout takes other steps from step 2 on (step 1 routes as the sampler did anyway)."""
    from tests.trainer.test_off_policy import APART

    path, _ = qwen3_moe
    common = [*APART, *_steps(path), "trainer.off_policy=one_step", "actor.skip_old_log_probs=false"]
    _, off = run("tiny-grpo.yaml", tmp_path / "off", *common)
    _, replay = run("tiny-grpo.yaml", tmp_path / "replay", *common, "actor.moe.routing_replay=rollout")
    steps = {r["step"]: r for r in off if r.get("step")}
    assert steps[1]["moe/old_pass/route_mismatch"] < 0.01
    assert steps[2]["moe/old_pass/route_mismatch"] > steps[1]["moe/old_pass/route_mismatch"]
    assert steps[3]["moe/old_pass/route_mismatch"] > 0
    assert steps[3]["moe/route_mismatch_log_prob_gap"] > steps[3]["moe/route_match_log_prob_gap"]
    replayed = {r["step"]: r for r in replay if r.get("step")}
    assert replayed[1]["actor/grad_norm"] == pytest.approx(steps[1]["actor/grad_norm"], rel=1e-5)
    assert replayed[2]["actor/grad_norm"] != pytest.approx(steps[2]["actor/grad_norm"], rel=1e-3)
    # Replayed, the tokens predicted from a column the trainer's own router would route otherwise are no
    # further from the sampler than the rest: the gap came from the routes (measured: 0.58 vs 0.34 at step 2
    # without replay, 0.13 vs 0.14 with it).
    assert replayed[2]["moe/route_mismatch_log_prob_gap"] < 0.5 * steps[2]["moe/route_mismatch_log_prob_gap"]
