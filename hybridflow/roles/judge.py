"""`reward.kind: judge`: a generative model's verdict on each response is its reward.

The judge (`reward.judge.model_path`, any local HF causal LM) is loaded with
the built-in engine in the process that scores the rows (the rollout's
worker) and answers `template` greedily, so the same rows always score the
same. `parse_verdict` reads the verdict from its answer: for "yes_no" the last
"yes" or "no" word (any case), for "number" the last number divided by
`scale` and clipped to [0, 1]. An answer with no verdict scores 0 and is a
failed row, counted and subject to reward.max_failure_fraction like any
reward's failures (`roles.scoring`).

Simplified on purpose: the judge runs where the rows are scored, not on its
own placement or beside the reference, and its time is bounded by
`max_new_tokens` rather than reward.timeout_s.
"""
from __future__ import annotations

import re
from typing import Any, Optional, Sequence

from hybridflow.config.schema import JudgeConfig
from hybridflow.rewards.guard import Outcome

__all__ = ["JudgeReward", "parse_verdict"]

_WORD = re.compile(r"\b(yes|no)\b", re.IGNORECASE)
_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


def parse_verdict(answer: str, verdict: str = "yes_no", scale: float = 1.0) -> Optional[float]:
    """The score in the judge's `answer`, or None when it holds no verdict."""
    if verdict == "yes_no":
        words = _WORD.findall(answer)
        return None if not words else float(words[-1].lower() == "yes")
    numbers = _NUMBER.findall(answer)
    return None if not numbers else min(1.0, max(0.0, float(numbers[-1]) / scale))


class JudgeReward:
    """Scores rows with the judge model's verdicts (see the module docstring)."""

    def __init__(self, cfg: JudgeConfig, max_failure_fraction: float = 0.1, model: Any = None):
        self.cfg, self.max_failure_fraction = cfg, max_failure_fraction
        self.name = f"judge {cfg.model_path}"
        self._model = model

    @property
    def model(self) -> Any:
        if self._model is None:  # loaded on first use, in the scoring process
            from hybridflow.rollout.hf import load_hf_model

            self._model = load_hf_model(self.cfg.model_path)
        return self._model

    def questions(self, rows: Sequence[tuple], prompts: Sequence[str]) -> list[str]:
        prompts = list(prompts) or [""] * len(rows)
        return [self.cfg.template.format(prompt=p, response=row[1], ground_truth=row[2])
                for p, row in zip(prompts, rows)]

    def answers(self, questions: list[str]) -> list[str]:
        """The judge's greedy answer to each question, `batch_size` at a time, as plain text (no chat turn)."""
        out: list[str] = []
        for start in range(0, len(questions), self.cfg.batch_size):
            part = questions[start:start + self.cfg.batch_size]
            pairs = self.model.generate(part, max_new_tokens=self.cfg.max_new_tokens, chat=False,
                                        stop=tuple(self.cfg.stop))
            out += [text for _, text in pairs]
        return out

    def score_batch(self, rows: Sequence[tuple], prompts: Sequence[str] = ()) -> list[Outcome]:
        outcomes = []
        for answer in self.answers(self.questions(rows, prompts)):
            value = parse_verdict(answer, self.cfg.verdict, self.cfg.scale)
            outcomes.append(Outcome(value) if value is not None else
                            Outcome(0.0, "error", f"reward judge {self.cfg.model_path} gave no {self.cfg.verdict} "
                                                  f"verdict: {answer[:100]!r}"))
        return outcomes

    def close(self) -> None:
        self._model = None
