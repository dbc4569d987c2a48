"""reward.kind http against a local server (127.0.0.1): OpenRLHF's request shape, batching, bounded in-flight
requests, retries with backoff, and one clear error naming the URL when the endpoint is dead."""
import json
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from hybridflow.config.schema import HttpRewardConfig, RewardConfig
from hybridflow.data import fields as F
from hybridflow.roles.scoring import RewardError, build_scorer, score_rule


class Endpoint:
    """A reward server: each query scores len(label); `fail_first` requests answer 500 first."""

    def __init__(self, fail_first=0, delay=0.0):
        self.requests, self.open, self.most_open, self.fail_first = [], 0, 0, fail_first
        lock, endpoint = threading.Lock(), self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                with lock:
                    endpoint.open += 1
                    endpoint.most_open = max(endpoint.most_open, endpoint.open)
                    endpoint.requests.append(body)
                    fail = endpoint.fail_first > 0
                    endpoint.fail_first -= fail
                time.sleep(delay)
                with lock:
                    endpoint.open -= 1
                answer = b"oops" if fail else json.dumps({"rewards": [len(x) for x in body["labels"]]}).encode()
                self.send_response(500 if fail else 200)
                self.send_header("Content-Length", str(len(answer)))
                self.end_headers()
                self.wfile.write(answer)

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/score"
        threading.Thread(target=self.server.serve_forever, args=(0.01,), daemon=True).start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()


def _batch(labels):
    n = len(labels)
    return {F.DATA_SOURCE: ["t"] * n, F.PROMPT_TEXT: [f"q{i} " for i in range(n)],
            F.RESPONSE_TEXT: [f"a{i}" for i in range(n)], F.GROUND_TRUTH: labels, F.EXTRA_INFO: [{}] * n}


def _reward(url, **http):
    return RewardConfig(kind="http", timeout_s=2.0, http=HttpRewardConfig(url=url, **{"backoff_s": 0.01, **http}))


def test_rows_go_in_batches_with_at_most_max_in_flight_open_and_scores_come_back_in_order():
    endpoint = Endpoint(delay=0.05)
    try:
        batch = score_rule(_batch(["a", "bb", "ccc", "dddd", "e", "ff", "g"]),
                           build_scorer(_reward(endpoint.url, batch_size=2, max_in_flight=2)), "http")
    finally:
        endpoint.close()
    assert batch[F.RULE_SCORES].tolist() == [1.0, 2.0, 3.0, 4.0, 1.0, 2.0, 1.0]
    assert sorted(len(r["query"]) for r in endpoint.requests) == [1, 2, 2, 2]
    assert endpoint.most_open == 2  # four requests, two at a time
    first = next(r for r in endpoint.requests if r["labels"] == ["a", "bb"])
    assert first == {"query": ["q0 a0", "q1 a1"], "prompts": ["q0 ", "q1 "], "labels": ["a", "bb"]}


def test_a_failing_request_is_tried_again():
    endpoint = Endpoint(fail_first=2)
    try:
        batch = score_rule(_batch(["a", "bb"]), build_scorer(_reward(endpoint.url, retries=2)), "http")
    finally:
        endpoint.close()
    assert batch[F.RULE_SCORES].tolist() == [1.0, 2.0] and len(endpoint.requests) == 3


def test_a_dead_or_failing_endpoint_is_one_error_naming_the_url_after_the_retries():
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{s.getsockname()[1]}/score"
    with pytest.raises(RewardError, match=rf"reward endpoint {dead} failed 3 tries of a request of 2 rows; "
                                          r"last: URLError"):
        score_rule(_batch(["a", "bb"]), build_scorer(_reward(dead, retries=2)), "http")
    endpoint = Endpoint(fail_first=10)
    try:
        with pytest.raises(RewardError, match=r"failed 2 tries.*HTTPError: HTTP Error 500"):
            score_rule(_batch(["a"]), build_scorer(_reward(endpoint.url, retries=1)), "http")
    finally:
        endpoint.close()
