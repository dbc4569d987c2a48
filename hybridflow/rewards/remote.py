"""`reward.kind: http`: a remote reward model, called the way OpenRLHF calls one (`--remote_rm_url`).

Each batch goes out in requests of `batch_size` rows, POSTed as JSON
{"query": [prompt + response, ...], "prompts": [...], "labels": [ground truth, ...]}
and answered {"rewards": [one number per query]} (or "scores"). At most
`max_in_flight` requests are open at once; each has `timeout_s` and is tried
again `retries` times after a failure (a connection error, a timeout, an HTTP
error status, an answer that is not one number per query), waiting
`backoff_s * 2**k` before retry k. A request that fails every try stops the
run with one line naming the URL and the last error (`RewardError` via
`roles.scoring`): an endpoint that is down or wrong is not a few bad rows.
"""
from __future__ import annotations

import json
import math
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Sequence

from hybridflow.config.schema import HttpRewardConfig
from hybridflow.rewards.guard import Outcome

__all__ = ["HttpReward", "EndpointError"]


class EndpointError(RuntimeError):
    """The endpoint failed every try of a request; the message names its URL and the last error."""


class HttpReward:
    """Scores rows by POSTing them to `cfg.url` (see the module docstring)."""

    def __init__(self, cfg: HttpRewardConfig, timeout_s: float = 30.0, max_failure_fraction: float = 0.1):
        self.cfg, self.timeout_s, self.max_failure_fraction = cfg, timeout_s, max_failure_fraction
        self.name = f"http {cfg.url}"

    def _post(self, body: dict[str, Any], n: int) -> list[float]:
        request = urllib.request.Request(self.cfg.url, data=json.dumps(body).encode(), method="POST",
                                         headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=self.timeout_s) as answer:
            data = json.loads(answer.read())
        values = data.get("rewards", data.get("scores")) if isinstance(data, dict) else data
        if not isinstance(values, list) or len(values) != n:
            raise ValueError(f"expected {{\"rewards\": [{n} numbers]}}, got {str(data)[:200]}")
        scores = [float(v) for v in values]
        if not all(math.isfinite(v) for v in scores):
            raise ValueError(f"the rewards include a value that is not finite: {scores}")
        return scores

    def _request(self, body: dict[str, Any], n: int) -> list[float]:
        """One request, with its retries; EndpointError after the last."""
        last: BaseException | None = None
        for attempt in range(self.cfg.retries + 1):
            if attempt:
                time.sleep(self.cfg.backoff_s * 2 ** (attempt - 1))
            try:
                return self._post(body, n)
            except (OSError, ValueError, urllib.error.URLError) as exc:  # HTTPError and timeouts are OSErrors
                last = exc
        raise EndpointError(f"reward endpoint {self.cfg.url} failed {self.cfg.retries + 1} tries of a request "
                            f"of {n} rows; last: {type(last).__name__}: {last}")

    def score_batch(self, rows: Sequence[tuple], prompts: Sequence[str] = ()) -> list[Outcome]:
        prompts = list(prompts) or [""] * len(rows)
        size = self.cfg.batch_size
        bodies = []
        for start in range(0, len(rows), size):
            part = range(start, min(start + size, len(rows)))
            bodies.append(({"query": [prompts[i] + rows[i][1] for i in part], "prompts": [prompts[i] for i in part],
                            "labels": [_label(rows[i][2]) for i in part]}, len(part)))
        with ThreadPoolExecutor(max_workers=self.cfg.max_in_flight, thread_name_prefix="reward-http") as pool:
            answers = list(pool.map(lambda item: self._request(*item), bodies))
        return [Outcome(score) for scores in answers for score in scores]

    def close(self) -> None:
        pass


def _label(value: Any) -> Any:
    """A ground truth as JSON can carry it (numpy values and other objects as text)."""
    try:
        json.dumps(value)
        return value
    except (TypeError, ValueError):
        return str(value)
