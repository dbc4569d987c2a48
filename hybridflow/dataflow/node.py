"""`Node`: one stage of a DataFlow — a model and the plain code that runs it on a batch.

    Node(name="reward", model=rm, forward_fn=lambda model, batch: [model(p, r).item() for p, r in batch])

`forward_fn(model, items)` receives a list of items and returns a list. It is
plain PyTorch/HF code: no ranks, process groups or communication. One `bool`
per item from a node with downstream edges makes it a filter (only the items
marked True go on); any other list, and a last node's bools, are its
outputs (`hybridflow.dataflow.execute`).
"""
from __future__ import annotations

from typing import Any, Callable, Optional, Sequence

__all__ = ["Node", "NodeError"]


class NodeError(RuntimeError):
    """A node's forward_fn failed or returned something a DataFlow cannot use."""


def _as_list(out: Any, name: str) -> list:
    if isinstance(out, list):
        return out
    if isinstance(out, tuple):
        return list(out)
    if hasattr(out, "tolist") and callable(out.tolist):  # a torch / numpy vector of scores
        out = out.tolist()
        if isinstance(out, list):
            return out
    raise NodeError(f"node {name!r}: forward_fn must return a list (one item per input item, or "
                    f"one bool per item for a filter), got {type(out).__name__}")


class Node:
    """A named stage: `forward_fn(model, items) -> list`.

    - `model`: anything `forward_fn` uses (`load_hf_model(...)` output, a
      reward function, None).
    - `engine`: "builtin" or "vllm" for a generating model; applied with
      `model.use_engine(engine)` (which falls back to "builtin" with a
      warning when vLLM is absent). None leaves the model as loaded.
    - `placement`: device indices for the controller (e.g. `[0, 1]`); the
      in-process executor runs every node where its model already is.
    - `batch_size`: at most this many items per `forward_fn` call (None: all
      the items the node receives at once).
    - `env`: an environment factory (`hybridflow.envs`, e.g. `make_calculator_env`)
      for a rollout node without a forward_fn: the node then runs the multi-turn
      agent loop (`rollout.agent.agent_forward`), turning each prompt item into
      (item, Episode) pairs. For limits or sampling of your own, pass
      `forward_fn=agent_forward(make_env, limits, ...)` instead.
    """

    def __init__(self, name: str, model: Any = None,
                 forward_fn: Optional[Callable[[Any, list], Sequence]] = None,
                 engine: Optional[str] = None, placement: Optional[Sequence[int]] = None,
                 batch_size: Optional[int] = None, env: Optional[Callable[[], Any]] = None):
        if not isinstance(name, str) or not name:
            raise ValueError(f"Node name must be a non-empty string, got {name!r}")
        if env is not None:
            if forward_fn is not None:
                raise ValueError(f"node {name!r}: give env (the agent loop runs the model) or forward_fn, not both")
            if not callable(env):
                raise TypeError(f"node {name!r}: env must be a factory env() -> Environment, got {env!r}")
            from hybridflow.rollout.agent import agent_forward  # torch: only for nodes that use it

            forward_fn = agent_forward(env)
        if not callable(forward_fn):
            raise TypeError(f"node {name!r}: forward_fn must be a callable "
                            f"forward_fn(model, items) -> list, got {forward_fn!r}")
        if batch_size is not None and (not isinstance(batch_size, int) or batch_size < 1):
            raise ValueError(f"node {name!r}: batch_size must be None or an int >= 1, got {batch_size!r}")
        if engine is not None:
            # The one list of engine names; imported here because `import hybridflow` stays free of torch.
            from hybridflow.config.schema import ENGINES

            if engine not in ENGINES:
                raise ValueError(f"node {name!r}: engine must be one of {ENGINES} or None, got {engine!r}")
            if not callable(getattr(model, "use_engine", None)):
                raise ValueError(f"node {name!r}: engine={engine!r} applies to a generating model "
                                 f"from load_hf_model(...), not to {type(model).__name__}")
            model.use_engine(engine)
        self.name = name
        self.model = model
        self.forward_fn = forward_fn
        self.engine = getattr(model, "engine", engine) if engine is not None else None
        self.placement = list(placement) if placement is not None else None
        self.batch_size = batch_size

    def __call__(self, items: list) -> list:
        """`forward_fn` over `items`, `batch_size` at a time; the outputs concatenated."""
        step = self.batch_size or max(len(items), 1)
        outputs: list = []
        for start in range(0, len(items), step):
            outputs.extend(_as_list(self.forward_fn(self.model, items[start:start + step]), self.name))
        return outputs

    def __repr__(self) -> str:
        extras = "".join(f", {k}={v!r}" for k, v in (("engine", self.engine), ("placement", self.placement),
                                                      ("batch_size", self.batch_size)) if v is not None)
        return f"Node({self.name!r}{extras})"
