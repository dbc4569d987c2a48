"""The declarative DataFlow API: nodes (a model + plain forward code) joined by edges.

    rollout = Node(name="rollout", model=load_hf_model(actor_path), engine="vllm",
                   forward_fn=lambda model, prompts: model.generate(prompts, max_new_tokens=128))
    reward = Node(name="reward", model=load_hf_model(rm_path),
                  forward_fn=lambda model, batch: [model(p, r).item() for p, r in batch])
    flow = DataFlow(nodes=[rollout, reward], edges=[(rollout, reward)])
    result = flow.run(prompts)            # or run(prompts, async_execution=True, min_batch=32)
    print(result.report())                # [Rollout] Generated 2 responses in 1.8s ...

Items are per sample. The source node (the one without an input edge)
receives the run's inputs; every other node receives what its upstream
passed on: a node's output list (usually one item per input item; a rollout
with `n` samples per prompt returns `n`), or, for a filter (a node with
downstream edges that returns one `bool` per item), the input items it marked
True. Items marked False are recorded in `FlowResult.rejected`, not lost, and
the report names each filter ("[Safety] Passed 1 of 2 samples"). A last
node's bools are results. Every declared edge runs: a node with several
inputs receives the samples all of them passed on (`execute.py`).

`DataFlow.run_steps(batches, update, off_policy=...)` trains on a flow, one
run per step, in lock step or with the next runs overlapping the update
(`off_policy.py`, the trainer's modes).

`DataFlow.run` runs a flow in this process, or with `launcher="ray"` each
node in its own Ray worker on its `placement` device (`remote.py`).
"""
from hybridflow.dataflow.execute import FlowResult, NodeStats
from hybridflow.dataflow.flow import DataFlow, StepResult
from hybridflow.dataflow.plan import DataFlowError, Plan
from hybridflow.dataflow.node import Node, NodeError

__all__ = ["DataFlow", "DataFlowError", "FlowResult", "Node", "NodeError", "NodeStats", "Plan", "StepResult"]
