"""Greedy held-out evaluation of HF models on a prompt dataset: `hybridflow eval`.

    hybridflow eval data/addition-chat/test.parquet --model BEFORE --model AFTER \
        --reward arithmetic_chat --reward arithmetic_chat_lenient --examples 4 [--engine vllm]

Each model answers every prompt greedily (prompts rendered as training
renders them: :class:`PromptDataset` with the chat template), and each named
reward scores the answers. Several rewards read the same answers differently,
e.g. a strict and a lenient reading, to tell a real gain from a formatting
one. With two models, the report ends with prompts whose answers changed.

`engine` is the rollout engine that generates: "builtin" (the default) or
"vllm", both built by the rollout factory (`rollout/factory.py`, through
`load_hf_model`) as the trainer builds them, so a model trained with vLLM
rollouts is evaluated on the engine that generated its training samples.
The scorer is the same for both. vLLM missing is an error naming the pip
command, never a silent fall back to the built-in engine.

Each reward scores through the reward guard as in training
(`roles.scoring.build_scorer`: a per-row time limit `timeout_s`, `math` and
`code` in worker processes, `code` in its sandbox): a row whose reward
raises, hangs or returns no number scores 0 and is counted
(`Evaluation.failures`, `timeouts`, the first error's text in the report);
an evaluation never stops for it.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

import torch

from hybridflow.config.schema import ENGINES, DataConfig, RewardConfig
from hybridflow.errors import ConfigError
from hybridflow.data.dataset import PromptDataset
from hybridflow.roles.scoring import build_scorer

__all__ = ["Evaluation", "evaluate", "report"]


@dataclass
class Evaluation:
    model: str
    prompts: list[str]  # the user's question (last message)
    responses: list[str]
    scores: dict[str, list[float]]  # reward name -> one score per prompt
    engine: str = "builtin"  # the engine that generated the responses
    failures: dict[str, int] = field(default_factory=dict)  # reward name -> rows that scored 0 for an error
    timeouts: dict[str, int] = field(default_factory=dict)  # ... of which past the time limit
    first_error: dict[str, str] = field(default_factory=dict)  # reward name -> the first failing row's text

    def accuracy(self, reward: str) -> float:
        values = self.scores[reward]
        return sum(v >= 1.0 for v in values) / len(values)


def _load(model_dir: str | Path, engine: str):
    """The model at `model_dir` generating on `engine`; ConfigError naming --engine when it cannot."""
    from hybridflow.rollout.hf import load_hf_model

    if engine not in ENGINES:
        raise ConfigError("--engine", f"{engine!r} is not one of {list(ENGINES)}")
    if engine == "vllm":
        from hybridflow.rollout.vllm_backend import VLLMUnavailable, import_vllm

        try:
            import_vllm()
        except VLLMUnavailable as exc:  # its message names rollout.engine, the trainer's key
            raise ConfigError("--engine", str(exc).removeprefix(f"{exc.path}: ")) from exc
    model = load_hf_model(model_dir, engine=engine)
    if model.engine != engine:  # load_hf_model falls back to the built-in engine; an evaluation must not
        raise ConfigError("--engine", f"{engine!r} could not be built for {model_dir} (got {model.engine!r})")
    return model


@torch.no_grad()
def evaluate(model_dir: str | Path, data_files: Sequence[str | Path], rewards: Sequence[str] = ("default",),
             limit: int = 0, max_new_tokens: int = 64, batch_size: int = 64, engine: str = "builtin",
             timeout_s: float = 30.0) -> Evaluation:
    """`model_dir`'s greedy answers to the first `limit` prompts (0: all) of `data_files`, scored by each of
    `rewards` (registry names or "file.py:function") with a time limit of `timeout_s` seconds per row."""
    model = _load(model_dir, engine)
    data = PromptDataset(DataConfig(max_prompt_length=1 << 20, apply_chat_template=True), model.tokenizer,
                         list(data_files))
    count = min(len(data), limit or len(data))
    params = model.sampling_params(max_new_tokens)  # greedy, EOS stops
    scorers = {name: build_scorer(RewardConfig(function=name, timeout_s=timeout_s)) for name in rewards}
    result = Evaluation(str(model_dir), [], [], {name: [] for name in rewards}, engine,
                        {name: 0 for name in rewards}, {name: 0 for name in rewards})
    try:
        for start in range(0, count, batch_size):
            items = [data[i] for i in range(start, min(start + batch_size, count))]
            batch = data.collate(items)
            texts = model.complete(batch["input_ids"], batch["attention_mask"], params)
            result.prompts += [str(item.messages[-1]["content"]) for item in items]
            result.responses += texts
            rows = [(item.data_source, text, item.ground_truth, item.extra_info) for item, text in zip(items, texts)]
            for name, scorer in scorers.items():
                _record(result, name, scorer.score_batch(rows, result.prompts[start:]))
    finally:
        for scorer in scorers.values():
            scorer.close()
    return result


def _record(result: Evaluation, name: str, outcomes: list) -> None:
    """One batch's outcomes of reward `name`: their scores (0 where a row failed) and the failure counts."""
    result.scores[name] += [o.score for o in outcomes]
    result.failures[name] += sum(o.failed for o in outcomes)
    result.timeouts[name] += sum(o.kind == "timeout" for o in outcomes)
    first = next((o.text for o in outcomes if o.failed), None)
    if first is not None:
        result.first_error.setdefault(name, first)


def report(results: Sequence[Evaluation], examples: int = 4) -> str:
    names = list(results[0].scores)
    engines = ", ".join(dict.fromkeys(r.engine for r in results))
    lines = [f"{len(results[0].prompts)} held-out prompts, greedy ({engines} engine)"]
    for r in results:
        lines.append(f"  {r.model}: " + ", ".join(f"{n} {r.accuracy(n):.1%}" for n in names))
        for n in names:
            if r.failures.get(n):
                lines.append(f"    {n}: {r.failures[n]} rows scored 0 for a failure ({r.timeouts[n]} past the time "
                             f"limit); the first: {r.first_error[n]}")
    if len(results) == 2 and examples:
        before, after = results
        first = names[0]
        changed = [i for i, (a, b) in enumerate(zip(before.scores[first], after.scores[first])) if a != b]
        fixed = [i for i in changed if after.scores[first][i] > before.scores[first][i]]
        lines.append(f"answers changed on {first}: {len(fixed)} fixed, {len(changed) - len(fixed)} broken; "
                     f"for example:")
        for i in (fixed + changed)[:examples]:
            lines.append(f"  {before.prompts[i]!r}\n      before: {before.responses[i]!r}\n"
                         f"      after:  {after.responses[i]!r}")
    return "\n".join(lines)
