"""DataFlow graphs: validation errors name the culprit, plans, filters, sync and async runs."""
import time

import pytest

from hybridflow import DataFlow, Node
from hybridflow.dataflow import DataFlowError, NodeError


def node(name, fn=lambda model, items: list(items), **kwargs):
    return Node(name=name, forward_fn=fn, **kwargs)


def chain(*names):
    nodes = [node(n) for n in names]
    return DataFlow(nodes=nodes, edges=list(zip(nodes, nodes[1:])))


# -- validation -------------------------------------------------------------
def test_unknown_node_in_an_edge_is_named():
    a, b = node("rollout"), node("reward")
    with pytest.raises(DataFlowError, match=r"unknown node 'reward'.*add_node"):
        DataFlow(nodes=[a], edges=[(a, b)])
    flow = DataFlow(nodes=[a, b])
    with pytest.raises(DataFlowError, match=r"unknown node 'rewrd' \(did you mean 'reward'\?"):
        flow.add_edge("rollout", "rewrd")


def test_duplicate_names_and_edges_are_rejected():
    with pytest.raises(DataFlowError, match="duplicate node name 'reward'"):
        DataFlow(nodes=[node("reward"), node("reward")])
    flow = chain("a", "b")
    with pytest.raises(DataFlowError, match="a -> b is already in the flow"):
        flow.add_edge("a", "b")
    with pytest.raises(DataFlowError, match="a different node named 'b'"):
        flow.add_edge("a", node("b"))


def test_a_cycle_is_spelled_out_and_not_added():
    flow = chain("a", "b", "c")
    with pytest.raises(DataFlowError, match=r"c -> a would close a cycle: a -> b -> c -> a"):
        flow.add_edge("c", "a")
    with pytest.raises(DataFlowError, match=r"cycle: b -> b"):
        flow.add_edge("b", "b")
    assert flow.edges == [("a", "b"), ("b", "c")]


def test_exactly_one_source():
    flow = DataFlow(nodes=[node("rollout"), node("safety"), node("reward")], edges=[("rollout", "reward")])
    with pytest.raises(DataFlowError, match=r"exactly one source.*found 2: 'rollout', 'safety'"):
        flow.run(["p"])


def test_bad_arguments():
    with pytest.raises(TypeError, match="forward_fn"):
        Node(name="x")
    with pytest.raises(ValueError, match="batch_size"):
        node("x", batch_size=0)
    with pytest.raises(ValueError, match="engine='vllm' applies to a generating model"):
        node("x", engine="vllm")
    with pytest.raises(TypeError, match="list of input items"):
        chain("a").run("a prompt")


# -- plans ------------------------------------------------------------------
def test_topological_order_keeps_insertion_order_for_ties():
    nodes = [node(n) for n in ("reward", "ref", "rollout", "adv")]
    flow = DataFlow(nodes=nodes, edges=[("rollout", "ref"), ("rollout", "reward"),
                                        ("ref", "adv"), ("reward", "adv")])
    plan = flow.plan()
    assert plan.order == ("rollout", "reward", "ref", "adv")
    assert (plan.source, plan.sinks) == ("rollout", ("adv",))
    assert plan.inputs["adv"] == ("ref", "reward")  # declaration order: the zip order


@pytest.mark.parametrize("order", ["api", "reversed"])
def test_a_filter_inserted_between_connected_nodes_keeps_every_declared_edge(order):
    rollout, safety, reward = node("rollout"), node("safety"), node("reward")
    edges = [(rollout, reward), (rollout, safety), (safety, reward)]
    flow = DataFlow(nodes=[rollout, reward])
    flow.add_node(safety)
    for edge in (edges if order == "api" else edges[::-1]):
        flow.add_edge(*edge)
    plan = flow.plan()
    assert plan.order == ("rollout", "safety", "reward")
    assert set(plan.inputs["reward"]) == {"rollout", "safety"} and plan.outputs["rollout"] == ("reward", "safety")
    assert len(flow.edges) == 3


# -- running ----------------------------------------------------------------
def generate(model, prompts):
    return [(p, p.upper()) for p in prompts]


def score(model, batch):
    return [float(len(r)) for _, r in batch]


def is_short(model, batch):
    return [len(p) < 4 for p, _ in batch]


def safety_flow(**reward_kwargs):
    rollout, reward = node("rollout", generate), node("reward", score, **reward_kwargs)
    flow = DataFlow(nodes=[rollout, reward], edges=[(rollout, reward)])
    safety = flow.add_node(node("safety", is_short))
    flow.add_edge(rollout, safety)
    flow.add_edge(safety, reward)
    return flow


@pytest.mark.parametrize("async_execution", [False, True])
def test_filters_pass_input_items_and_record_rejections(async_execution):
    prompts = ["ab", "abcdef", "abc", "abcde"]
    result = safety_flow().run(prompts, async_execution=async_execution, min_batch=1)
    assert result.outputs["safety"] == [True, False, True, False]
    assert result.rejected == [("safety", ("abcdef", "ABCDEF")), ("safety", ("abcde", "ABCDE"))]
    assert result.outputs["reward"] == result.final == [2.0, 3.0]
    assert result.filtered == ("safety",)
    assert result.report().splitlines()[1:] == [
        f"[Safety] Passed 2 of 4 samples in {result.timings['safety']:.1f}s",
        f"[Reward] Scored 2 samples in {result.timings['reward']:.1f}s"]
    assert result.report().startswith("[Rollout] Generated 4 responses in ")


@pytest.mark.parametrize("async_execution", [False, True])
@pytest.mark.parametrize("order", ["api", "reversed"])
def test_the_shortcut_beside_a_filter_gives_each_passed_sample_once(order, async_execution):
    """rollout -> reward stays in the plan: the rollout's pairs and the pairs safety passed are the same
    items, so reward receives each sample safety passed, once, whichever edge was declared first."""
    seen = []
    rollout, safety = node("rollout", generate), node("safety", is_short)
    reward = node("reward", lambda m, batch: seen.extend(batch) or score(m, batch))
    edges = [(rollout, reward), (rollout, safety), (safety, reward)]
    flow = DataFlow(nodes=[rollout, safety, reward], edges=edges if order == "api" else edges[::-1])
    result = flow.run(["ab", "abcdef", "abc"], async_execution=async_execution, min_batch=1)
    assert seen == [("ab", "AB"), ("abc", "ABC")] and result.final == [2.0, 3.0]


def test_a_shortcut_beside_a_map_gives_the_node_both_items():
    """rollout -> critic -> reward beside rollout -> reward: reward sees each response with its value."""
    rollout, critic = node("rollout", generate), node("critic", lambda m, batch: [len(p) / 10 for p, _ in batch])
    reward = node("reward", lambda m, batch: [f"{r}:{v}" for (_, r), v in batch])
    flow = DataFlow(nodes=[rollout, critic, reward], edges=[(rollout, critic), (rollout, reward), (critic, reward)])
    assert flow.run(["ab", "abc"]).final == ["AB:0.2", "ABC:0.3"]


@pytest.mark.parametrize("async_execution", [False, True])
def test_a_last_node_that_returns_bools_gives_results_not_a_filter(async_execution):
    rollout, correct = node("rollout", generate), node("is_correct", is_short)
    result = DataFlow(nodes=[rollout, correct], edges=[(rollout, correct)]).run(
        ["ab", "abcdef"], async_execution=async_execution, min_batch=1)
    assert result.final == result.outputs["is_correct"] == [True, False]
    assert result.rejected == [] and result.filtered == ()
    assert result.report().splitlines()[-1].startswith("[Is_correct] Scored 2 samples in ")


def test_a_node_after_a_filter_that_rejects_everything_is_not_called():
    calls = []
    flow = safety_flow()
    flow.nodes["reward"].forward_fn = lambda model, batch: calls.append(batch) or []
    result = flow.run(["abcd", "abcde"])
    assert calls == [] and result.final == [] and len(result.rejected) == 2
    assert result.report().splitlines()[-1] == "[Reward] Scored 0 samples in 0.0s"


def test_fan_out_n_samples_batch_size_and_zipped_fan_in():
    seen = []
    rollout = node("rollout", lambda m, ps: [(p, f"{p}{i}") for p in ps for i in range(2)])
    rm = node("rm", lambda m, b: seen.append(len(b)) or [1.0] * len(b), batch_size=3)
    rule = node("rule", lambda m, b: [0.5] * len(b))
    total = node("total", lambda m, b: [x + y for x, y in b])
    flow = DataFlow(nodes=[rollout, rm, rule, total],
                    edges=[(rollout, rm), (rollout, rule), (rm, total), (rule, total)])
    result = flow.run(["a", "b"])
    assert result.outputs["rollout"] == [("a", "a0"), ("a", "a1"), ("b", "b0"), ("b", "b1")]
    assert seen == [3, 1] and result.final == [1.5] * 4
    assert result.report().splitlines()[-1].startswith("[Total] Scored 4 samples")


def test_a_join_takes_the_samples_every_branch_passed():
    """Two filters on two branches rejecting different samples: the join gets the samples both passed, each
    with its own items (zipping by position would pair one sample's upper case with another's)."""
    rollout, upper = node("rollout"), node("upper", lambda m, b: [x.upper() for x in b])
    not_a = node("not_a", lambda m, b: [x != "a" for x in b])
    not_b = node("not_b", lambda m, b: [x != "B" for x in b])
    join = node("join", lambda m, b: [f"{x}{y}" for x, y in b])
    flow = DataFlow(nodes=[rollout, upper, not_a, not_b, join],
                    edges=[(rollout, upper), (upper, not_b), (rollout, not_a), (not_b, join), (not_a, join)])
    result = flow.run(["a", "b", "c"])
    assert result.final == ["Cc"] and result.filtered == ("not_a", "not_b")
    assert result.rejected == [("not_a", "a"), ("not_b", "B")]


def test_joining_new_samples_with_another_branch_is_an_error():
    rollout, keep = node("rollout"), node("keep")
    twice = node("twice", lambda m, b: [x for x in b for _ in range(2)])
    flow = DataFlow(nodes=[rollout, keep, twice, node("join")],
                    edges=[(rollout, keep), (rollout, twice), (keep, "join"), (twice, "join")])
    with pytest.raises(DataFlowError, match=r"node 'join' joins its inputs sample by sample, but 'keep' passes on "
                                            r"samples of the run, 'twice' passes on samples of 'twice': a node that"):
        flow.run(["x", "y"])


def test_several_sinks_give_a_dict():
    rollout = node("rollout")
    flow = DataFlow(nodes=[rollout, node("a", score), node("b", is_short)],
                    edges=[(rollout, "a"), (rollout, "b")])
    result = flow.run([("p", "rr"), ("pppp", "r")])
    assert result.final == {"a": [2.0, 1.0], "b": [True, False]}  # a last node's bools are results


def test_a_filter_must_return_one_bool_per_item():
    flow = DataFlow(nodes=[node("rollout"), node("f", lambda m, b: [True]), node("reward")],
                    edges=[("rollout", "f"), ("f", "reward")])
    with pytest.raises(NodeError, match="'f' returned 1 bools for 2 items: a node with downstream edges"):
        flow.run(["x", "y"])


@pytest.mark.parametrize("async_execution", [False, True])
@pytest.mark.parametrize("failing", ["rollout", "reward"])
def test_a_failing_forward_fn_is_raised_with_the_node_name(async_execution, failing):
    def boom(model, items):
        raise ZeroDivisionError("no")
    flow = safety_flow()
    flow.nodes[failing].forward_fn = boom
    with pytest.raises(NodeError, match=rf"node '{failing}': forward_fn raised ZeroDivisionError: no"):
        flow.run(["a", "b", "c"], async_execution=async_execution, min_batch=1)
    with pytest.raises(NodeError, match="forward_fn must return a list"):
        DataFlow(nodes=[node("x", lambda m, b: 3)]).run(["a"])


def test_async_overlaps_slow_stages_and_matches_sync():
    """Rollout and reward each sleep per item: async lets reward work on chunk k while rollout makes k+1."""
    def slow_generate(model, prompts):
        time.sleep(0.04 * len(prompts))
        return generate(model, prompts)

    def slow_score(model, batch):
        time.sleep(0.04 * len(batch))
        return score(model, batch)

    rollout, reward = node("rollout", slow_generate), node("reward", slow_score)
    flow = DataFlow(nodes=[rollout, reward], edges=[(rollout, reward)])
    prompts = [f"p{i}" * (i % 3 + 1) for i in range(8)]
    sync = flow.run(prompts)
    asyn = flow.run(prompts, async_execution=True, min_batch=2)
    assert asyn.outputs == sync.outputs and asyn.final == sync.final
    assert sync.overlap_s == 0.0 and asyn.overlap_s > 0.0
    assert asyn.wall_s < sync.wall_s  # sync >= 0.64 s of sleep; async ~0.4 s
    assert flow.run(prompts, async_execution=True, min_batch=0).overlap_s == 0.0  # 0: whole batch
