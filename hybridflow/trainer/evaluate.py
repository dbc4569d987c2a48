"""Greedy held-out evaluation of HF models on a prompt dataset: `hybridflow eval`.

    hybridflow eval data/addition-chat/test.parquet --model BEFORE --model AFTER \
        --reward arithmetic_chat --reward arithmetic_chat_lenient --examples 4

Each model answers every prompt greedily on the built-in generator (prompts
rendered as training renders them: :class:`PromptDataset` with the chat
template), and each named reward scores the answers. Several rewards read the
same answers differently, e.g. a strict and a lenient reading, to tell a real
gain from a formatting one. With two models, the report ends with prompts
whose answers changed.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import torch

from hybridflow.config.schema import DataConfig
from hybridflow.data.dataset import PromptDataset
from hybridflow.rewards.registry import get_reward_fn

__all__ = ["Evaluation", "evaluate", "report"]


@dataclass
class Evaluation:
    model: str
    prompts: list[str]  # the user's question (last message)
    responses: list[str]
    scores: dict[str, list[float]]  # reward name -> one score per prompt

    def accuracy(self, reward: str) -> float:
        values = self.scores[reward]
        return sum(v >= 1.0 for v in values) / len(values)


@torch.no_grad()
def evaluate(model_dir: str | Path, data_files: Sequence[str | Path], rewards: Sequence[str] = ("default",),
             limit: int = 0, max_new_tokens: int = 64, batch_size: int = 64) -> Evaluation:
    from hybridflow.rollout.hf import load_hf_model

    model = load_hf_model(model_dir)
    data = PromptDataset(DataConfig(max_prompt_length=1 << 20, apply_chat_template=True), model.tokenizer,
                         list(data_files))
    count = min(len(data), limit or len(data))
    params = model.sampling_params(max_new_tokens)  # greedy, EOS stops
    fns = {name: get_reward_fn(name) for name in rewards}
    result = Evaluation(str(model_dir), [], [], {name: [] for name in rewards})
    for start in range(0, count, batch_size):
        items = [data[i] for i in range(start, min(start + batch_size, count))]
        batch = data.collate(items)
        texts = model.complete(batch["input_ids"], batch["attention_mask"], params)
        for item, text in zip(items, texts):
            result.prompts.append(str(item.messages[-1]["content"]))
            result.responses.append(text)
            for name, fn in fns.items():
                result.scores[name].append(float(fn(item.data_source, text, item.ground_truth, item.extra_info)))
    return result


def report(results: Sequence[Evaluation], examples: int = 4) -> str:
    names = list(results[0].scores)
    lines = [f"{len(results[0].prompts)} held-out prompts, greedy"]
    for r in results:
        lines.append(f"  {r.model}: " + ", ".join(f"{n} {r.accuracy(n):.1%}" for n in names))
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
