"""`--reward http://...`: a batch POSTed as JSON in requests of batch_size, a bounded number in
flight, retried when the service is busy or slow, and an error (never a guess) when it fails."""

import json
import threading
import time
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from rlctl.config import ScoreConfig
from rlctl.errors import RewardError
from rlctl.rewards import RewardSamples, load_rewards


def samples(responses, truths=None):
    n = len(responses)
    return RewardSamples(["p"] * n, list(responses), list(truths or ["x"] * n), ["src"] * n, [{"i": i} for i in range(n)])


class RewardService:
    """A local reward endpoint: len(response) per sample, with failures on demand."""

    def __init__(self, *, fail_first: int = 0, status: int = 503, delay: float = 0.0, answer=None) -> None:
        self.fail_first, self.status, self.delay, self.answer = fail_first, status, delay, answer
        self.requests: list[dict] = []
        self.in_flight = self.most_in_flight = 0
        self.lock = threading.Lock()

    def handle(self, handler: BaseHTTPRequestHandler) -> None:
        body = json.loads(handler.rfile.read(int(handler.headers["Content-Length"])))
        with self.lock:
            self.requests.append(body)
            failing = len(self.requests) <= self.fail_first
            self.in_flight += 1
            self.most_in_flight = max(self.most_in_flight, self.in_flight)
        try:
            time.sleep(self.delay)
            if failing:
                handler.send_error(self.status, "busy")
                return
            answer = self.answer if self.answer is not None else {"rewards": [float(len(r)) for r in body["responses"]]}
            data = json.dumps(answer).encode()
            handler.send_response(200)
            handler.send_header("Content-Length", str(len(data)))
            handler.end_headers()
            handler.wfile.write(data)
        finally:
            with self.lock:
                self.in_flight -= 1


@contextmanager
def serving(service: RewardService):
    class Handler(BaseHTTPRequestHandler):
        def do_POST(self):
            service.handle(self)

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/score"
    finally:
        server.shutdown()
        server.server_close()


def score(url, responses, **cfg):
    rewards = load_rewards(ScoreConfig(reward=url, **cfg))
    return rewards.score(samples(responses), timeout=cfg.get("reward_timeout", 10.0))


def test_the_batch_goes_in_requests_of_http_batch_size_at_most_concurrency_at_once():
    service = RewardService(delay=0.2)
    responses = ["x" * n for n in range(10)]
    with serving(service) as url:
        scores = score(url, responses, http_batch_size=2, http_concurrency=3, batch_size=64)  # forward passes' rows: not the requests'
    assert scores.total == [float(n) for n in range(10)]  # in the original order
    assert sorted(len(r["responses"]) for r in service.requests) == [2] * 5
    assert service.most_in_flight == 3
    assert set(service.requests[0]) == {"prompts", "responses", "ground_truths", "data_sources", "extras"}


def test_a_busy_service_is_retried_then_answers():
    service = RewardService(fail_first=2, status=503)
    with serving(service) as url:
        assert score(url, ["ab"], http_retries=2).total == [2.0]
    assert len(service.requests) == 3


def test_retries_end_in_an_error_that_says_what_the_service_said():
    service = RewardService(fail_first=99, status=503)
    with serving(service) as url, pytest.raises(RewardError, match="failed after 2 tries: HTTP 503"):
        score(url, ["ab"], http_retries=1)


def test_a_client_error_is_not_retried():
    service = RewardService(fail_first=99, status=400)
    with serving(service) as url, pytest.raises(RewardError, match="failed after 1 try: HTTP 400"):
        score(url, ["ab"], http_retries=3)
    assert len(service.requests) == 1


def test_a_slow_service_times_out_per_request():
    service = RewardService(delay=1.0)
    with serving(service) as url, pytest.raises(RewardError, match="failed after 1 try: timed out after 0.2s"):
        score(url, ["ab"], reward_timeout=0.2, http_retries=0)


def test_an_unreachable_service_and_a_wrong_answer_are_errors():
    with pytest.raises(RewardError, match="unreachable"):
        score("http://127.0.0.1:9/score", ["ab"], http_retries=0)
    with serving(RewardService(answer={"rewards": [1.0, 2.0]})) as url, pytest.raises(RewardError, match="answered 2 values for a request of 1 samples"):
        score(url, ["ab"])
    with serving(RewardService(answer={"scores": [1.0]})) as url, pytest.raises(RewardError, match='must answer {"rewards": \\[...\\]} or a list'):
        score(url, ["ab"])


def test_verl_dicts_and_none_come_back_as_from_a_function():
    answer = {"rewards": [{"score": 1.0, "judge": "yes"}, {"score": 0.0, "judge": "no"}]}
    with serving(RewardService(answer=answer)) as url:
        scores = score(url, ["a", "b"])
    assert scores.total == [1.0, 0.0] and scores.columns == {"reward/judge": ["yes", "no"]}
