"""`--reward https://host/path`: a reward computed by a service (a judge model, a sandbox).

The batch is cut into requests of `batch_size` samples, sent `concurrency` at a time. Each is
a JSON POST of rlctl's reward inputs:

    {"prompts": [...], "responses": [...], "ground_truths": [...], "data_sources": [...], "extras": [...]}

and the answer is `{"rewards": [...]}` (or the bare list): one float per sample, `null` where no
reward applies, or verl's `{"score": ..., other values}`. A request that fails to connect,
times out, or answers 429/5xx is retried (`retries` more times, backing off 0.5 s, 1 s, 2 s ...);
any other answer is an error at once, with the start of what the server said.

No code from the server runs here: only JSON is read.
"""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from rlctl.errors import RewardError
from rlctl.reward_styles import RLCTL_KEYWORDS

RETRIED_STATUS = {429, 500, 502, 503, 504}
BACKOFF_SECONDS = 0.5


@dataclass(frozen=True)
class HttpOptions:
    batch_size: int = 16  # samples per request
    concurrency: int = 4  # requests in flight at once
    retries: int = 2  # more tries of a request that failed in a way worth retrying
    timeout: float = 60.0  # seconds per request


class HttpReward:
    """Callable with rlctl's reward keywords; times each request itself (`call`)."""

    keywords = RLCTL_KEYWORDS

    def __init__(self, url: str, options: HttpOptions = HttpOptions()) -> None:
        self.url, self.options = url, options

    def __call__(self, **inputs: list) -> list:
        return self.call([], inputs, self.options.timeout)

    def call(self, args: list, kwargs: dict[str, list], timeout: float) -> list:
        n = len(kwargs["responses"])
        size = self.options.batch_size
        chunks = [{k: v[start : start + size] for k, v in kwargs.items()} for start in range(0, n, size)]
        per_request = timeout if timeout > 0 else self.options.timeout
        with ThreadPoolExecutor(max_workers=min(self.options.concurrency, max(len(chunks), 1))) as pool:
            answers = list(pool.map(lambda chunk: self._post(chunk, per_request), chunks))
        values: list = []
        for chunk, answer in zip(chunks, answers):
            if len(answer) != len(chunk["responses"]):
                raise RewardError(f"reward {self.url} answered {len(answer)} values for a request of {len(chunk['responses'])} samples")
            values.extend(answer)
        return values

    def _post(self, payload: dict[str, list], timeout: float) -> list:
        body = json.dumps(payload, default=str).encode()
        failure = ""
        for attempt in range(self.options.retries + 1):
            if attempt:
                time.sleep(BACKOFF_SECONDS * 2 ** (attempt - 1))
            request = urllib.request.Request(self.url, data=body, headers={"Content-Type": "application/json"}, method="POST")
            try:
                with urllib.request.urlopen(request, timeout=timeout) as response:
                    return _rewards_of(response.read(), self.url)
            except urllib.error.HTTPError as exc:
                said = exc.read()[:200].decode("utf-8", "replace").strip()
                failure = f"HTTP {exc.code}" + (f": {said}" if said else "")
                if exc.code not in RETRIED_STATUS:
                    break
            except (urllib.error.URLError, TimeoutError, ConnectionError) as exc:
                reason = getattr(exc, "reason", exc)
                failure = f"timed out after {timeout:g}s" if isinstance(reason, TimeoutError) or "timed out" in str(reason) else f"unreachable ({reason})"
        tries = attempt + 1
        raise RewardError(f"reward {self.url} failed after {tries} tr{'y' if tries == 1 else 'ies'}: {failure}")


def _rewards_of(raw: bytes, url: str) -> list[Any]:
    try:
        answer = json.loads(raw)
    except ValueError:
        raise RewardError(f"reward {url} answered something that is not JSON: {raw[:80]!r}") from None
    if isinstance(answer, dict):
        answer = answer.get("rewards")
    if not isinstance(answer, list):
        raise RewardError(f"reward {url} must answer {{\"rewards\": [...]}} or a list, got {raw[:80]!r}")
    return answer
