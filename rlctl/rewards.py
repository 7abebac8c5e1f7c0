"""Reward functions: built-ins, user functions, reward models and endpoints, behind one calling rule.

`--reward SPEC` is `path/to/file.py:function`, `module:function`, `builtin:NAME`,
`rm:MODEL_URI` (a reward model), `judge:MODEL_URI` (a causal LM asked yes or no: rlctl.judge) or an
`http(s)://` endpoint. Code rewards run in a child process
(`rlctl.reward_process`); how a function is called (rlctl's keywords, one positional list,
verl's `compute_score`, TRL's `completions`) is decided from its signature (`reward_styles`).
`score.rewards` combines several, weighted (`RewardSet`): the total is the `reward` column,
each component and each extra value a function reports has a `reward/...` column of its own.

A function that raises, returns the wrong count, returns NaN/inf, or runs past the timeout is
a `RewardError` naming the first bad sample's index (found by re-calling per sample).
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import json
import math
import operator
import re
import signal
import string
import sys
import threading
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rlctl.algos.registry import Registry
from rlctl.errors import InputError, RewardError
from rlctl.math_answers import last_boxed, same_answer
from rlctl.reward_http import HttpOptions, HttpReward
from rlctl.reward_styles import ADAPTER_INPUTS, batch_adapter, calling_style

FLOAT32_MAX = 3.4028234663852886e38


@dataclass(frozen=True)
class RewardSamples:
    """What a reward function may look at, one entry per sample."""

    prompts: list[str]
    responses: list[str]
    ground_truths: list[str | None]
    data_sources: list[str | None]
    extras: list[dict[str, Any]] = field(default_factory=list)
    messages: list[list[dict] | None] = field(default_factory=list)  # chat prompts; empty: none are chats

    def __len__(self) -> int:
        return len(self.responses)

    def column(self, name: str) -> list:
        values = getattr(self, name)
        return list(values) if values or name != "messages" else [None] * len(self)

    def select(self, indices: Sequence[int], *, responses: Sequence[str]) -> RewardSamples:
        """The samples at `indices`, with `responses` in place of theirs (a tool sees the
        response so far)."""
        def pick(values: list) -> list:
            return [values[i] for i in indices] if values else []

        return RewardSamples(
            pick(self.prompts), list(responses), pick(self.ground_truths), pick(self.data_sources), pick(self.extras), pick(self.messages)
        )

    def subset(self, index: int) -> RewardSamples:
        pick = slice(index, index + 1)
        return RewardSamples(
            self.prompts[pick], self.responses[pick], self.ground_truths[pick], self.data_sources[pick], self.extras[pick], self.messages[pick]
        )


BUILTINS: Registry[Callable] = Registry("builtin reward")


def overlong_penalty(lengths: Sequence[int], *, max_new_tokens: int, buffer: int, penalty: float) -> list[float]:
    """DAPO's soft overlong punishment, added to each reward: 0 up to max_new_tokens - buffer
    tokens, then falling linearly to -penalty at max_new_tokens (verl's overlong_buffer)."""
    expected = max_new_tokens - buffer
    return [min(-(n - expected) / buffer * penalty, 0.0) if buffer > 0 else 0.0 for n in lengths]


SHAPING_COLUMNS = ("reward/overlong_penalty", "reward/length_penalty")  # score's shaping terms, in `reward` besides what the reward gave


def given_rewards(scores) -> list[float]:
    """Each sample's reward as the reward function(s) gave it: the `reward` column less score's
    shaping terms (what "correct" or "passed" is judged on), to 6 decimals where there are any:
    the column is float32, so 1.0 − 1/6 less −1/6 would come back a hair under 1."""
    total = scores.column("reward").to_pylist()
    shaped = [name for name in SHAPING_COLUMNS if name in scores.column_names]
    for name in shaped:
        total = [t - s for t, s in zip(total, scores.column(name).to_pylist())]
    return [round(t, 6) for t in total] if shaped else total


def length_penalty(ids: Sequence[str], lengths: Sequence[int], correct: Sequence[bool], *, weight: float) -> list[float]:
    """Kimi k1.5's length reward, added to each reward: among the samples of one prompt (`ids`),
    λ = 0.5 − (length − shortest) / (longest − shortest), from +0.5 for the shortest to −0.5 for
    the longest; a correct sample gets weight·λ, a wrong one weight·min(0, λ) (never a bonus for
    being short and wrong). A prompt whose samples are all one length gets 0."""
    shortest: dict[str, int] = {}
    longest: dict[str, int] = {}
    for key, n in zip(ids, lengths):
        shortest[key], longest[key] = min(n, shortest.get(key, n)), max(n, longest.get(key, n))
    shaping = []
    for key, n, ok in zip(ids, lengths, correct):
        spread = longest[key] - shortest[key]
        lam = 0.5 - (n - shortest[key]) / spread if spread else 0.0
        shaping.append(weight * (lam if ok else min(0.0, lam)))
    return shaping


# --- built-ins ----------------------------------------------------------------------------


@BUILTINS.register("length")
def length_reward(responses: list[str]) -> list[float]:
    """min(len(response) / 100, 1): the seed article's toy reward for longer answers."""
    return [min(len(r) / 100.0, 1.0) for r in responses]


_GSM8K_STRICT = re.compile(r"#### (\-?[0-9\.\,]+)")
_NUMBER = re.compile(r"\-?[0-9\.\,]+")
GSM8K_TAIL = 300  # both rules read only the last 300 characters, as verl's


def gsm8k_answer(response: str) -> str | None:
    """verl's strict rule: the last `#### <number>` in the final 300 characters, commas
    removed. `#### $18` has no answer and `#### 42.` answers "42." (not 42): the format is
    part of what is rewarded."""
    matches = _GSM8K_STRICT.findall(response[-GSM8K_TAIL:])
    return matches[-1].replace(",", "") if matches else None


def gsm8k_flexible_answer(response: str) -> str | None:
    """The last number in the final 300 characters, wherever it stands (`$`, `####` or none),
    commas and a trailing period removed."""
    numbers = [n.replace(",", "").rstrip(".") for n in _NUMBER.findall(response[-GSM8K_TAIL:])]
    numbers = [n for n in numbers if n not in ("", "-")]
    return numbers[-1] if numbers else None


def _exact_answer_reward(extract: Callable[[str], str | None], responses: list[str], ground_truths: list[str | None]) -> list[float]:
    scores = []
    for response, truth in zip(responses, ground_truths):
        answer = extract(response)
        expected = None if truth is None else str(truth).replace(",", "").replace("$", "").strip()
        scores.append(1.0 if answer is not None and answer == expected else 0.0)
    return scores


@BUILTINS.register("gsm8k")
def gsm8k_reward(*, responses: list[str], ground_truths: list[str | None]) -> list[float]:
    """1.0 when verl's strict rule (`gsm8k_answer`) extracts exactly the ground truth, else 0.0."""
    return _exact_answer_reward(gsm8k_answer, responses, ground_truths)


@BUILTINS.register("gsm8k_flexible")
def gsm8k_flexible_reward(*, responses: list[str], ground_truths: list[str | None]) -> list[float]:
    """1.0 when the last number of the response (`gsm8k_flexible_answer`) is the ground truth."""
    return _exact_answer_reward(gsm8k_flexible_answer, responses, ground_truths)


@BUILTINS.register("math")
def math_reward(*, responses: list[str], ground_truths: list[str | None]) -> list[float]:
    """1.0 when the response's last `\\boxed{...}` says what the ground truth says (verl's `math`
    reward: rlctl.math_answers, equal up to how LaTeX spells the value), else 0.0. A ground truth
    that is a whole solution (MATH's) gives its own last box."""
    scores = []
    for response, truth in zip(responses, ground_truths):
        answer = last_boxed(response)
        expected = None if truth is None else last_boxed(str(truth)) or str(truth)
        scores.append(1.0 if answer is not None and expected is not None and same_answer(answer, expected) else 0.0)
    return scores


_THINK_FORMAT = re.compile(r"^<think>(?!.*<think>)(.*?)</think>.*$", re.DOTALL | re.MULTILINE)


@BUILTINS.register("think_format")
def think_format_reward(responses: list[str]) -> list[float]:
    """1.0 when the response opens with `<think>`, closes it with `</think>` and opens no
    second one (whatever follows the close), else 0.0: TRL's think_format_reward, the format
    term of R1-style runs beside a correctness reward (`score.rewards`, a small weight)."""
    return [1.0 if _THINK_FORMAT.match(response) else 0.0 for response in responses]


_ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCTUATION = set(string.punctuation)


def normalize_answer(text: str) -> str:
    """SQuAD's normalization of a short answer: lower case, punctuation and the articles a, an,
    the removed, whitespace collapsed (what exact match and F1 compare in NQ, HotpotQA and
    Search-R1's rewards)."""
    text = "".join(c for c in text.lower() if c not in _PUNCTUATION)
    return " ".join(_ARTICLES.sub(" ", text).split())


def qa_answer(response: str) -> str:
    """The answer a QA response gives: its last `<answer>…</answer>`, else the whole response."""
    tagged = _ANSWER_TAG.findall(response)
    return tagged[-1] if tagged else response


def golden_answers(truth: str | None) -> list[str]:
    """A ground truth's accepted answers: a JSON array of strings (NQ's several aliases), else the string itself."""
    if truth is None:
        return []
    text = str(truth)
    if text.lstrip().startswith("["):
        try:
            answers = json.loads(text)
        except ValueError:
            return [text]
        if isinstance(answers, list) and all(isinstance(a, str) for a in answers):
            return answers
    return [text]


def token_f1(prediction: str, golden: str) -> float:
    """SQuAD's token F1 of two normalized answers: the harmonic mean of the shared tokens' share
    of each (a bag of words: a token counts as often as both have it)."""
    predicted, expected = normalize_answer(prediction).split(), normalize_answer(golden).split()
    common = sum((Counter(predicted) & Counter(expected)).values())
    if not common:
        return 0.0
    precision, recall = common / len(predicted), common / len(expected)
    return 2 * precision * recall / (precision + recall)


@BUILTINS.register("qa_em")
def qa_exact_match_reward(*, responses: list[str], ground_truths: list[str | None]) -> list[float]:
    """1.0 when the response's answer (`qa_answer`) equals one of the ground truth's answers once
    both are normalized (`normalize_answer`), else 0.0: verl's `search_r1_like_qa_em`, the
    exact match of NQ and HotpotQA."""
    return [
        1.0 if any(normalize_answer(qa_answer(response)) == normalize_answer(golden) for golden in golden_answers(truth)) else 0.0
        for response, truth in zip(responses, ground_truths)
    ]


@BUILTINS.register("qa_f1")
def qa_f1_reward(*, responses: list[str], ground_truths: list[str | None]) -> list[float]:
    """The best token F1 (`token_f1`) of the response's answer against the ground truth's
    answers: partial credit where exact match gives none (SQuAD's F1)."""
    return [max((token_f1(qa_answer(response), golden) for golden in golden_answers(truth)), default=0.0) for response, truth in zip(responses, ground_truths)]
_MCQ_BOXED = re.compile(r"\\boxed\{\s*(?:\\text\{\s*)?\(?([A-Za-z])\)?\s*\}?\s*\}")
_MCQ_STATED = re.compile(r"answer(?:\s+is)?\s*[:：]?\s*\(?\s*([A-Z])(?![A-Za-z])\)?", re.IGNORECASE)
_MCQ_TAGGED = re.compile(r"^\s*\(?([A-Za-z])\)?[.)]?\s*$")


def mcq_answer(response: str) -> str | None:
    """The option letter a multiple-choice response gives, upper case, or None: its last
    `\boxed{X}`, else its last "answer is (X)" / "Answer: X" (the letter standing alone: not
    the first letter of a word), else a last `<answer>X</answer>` holding only the letter. No
    guess from a letter elsewhere, so an unanswered response scores 0."""
    boxed = _MCQ_BOXED.findall(response)
    if boxed:
        return boxed[-1].upper()
    stated = [letter for letter in _MCQ_STATED.findall(response) if letter.isupper() or letter.lower() != "a"]
    if stated:
        return stated[-1].upper()
    tagged = _ANSWER_TAG.findall(response)
    if tagged and (alone := _MCQ_TAGGED.match(tagged[-1])):
        return alone.group(1).upper()
    return None


def option_letter(truth: str | None) -> str:
    """A multiple-choice ground truth's option letter: "B", "b", "(B)" or "B." (one letter)."""
    alone = _MCQ_TAGGED.match(truth or "")
    if alone is None:
        raise RewardError(f"mcq ground_truth must be one option letter such as B or (B), got {truth!r}")
    return alone.group(1).upper()


@BUILTINS.register("mcq")
def multiple_choice_reward(*, responses: list[str], ground_truths: list[str | None]) -> list[float]:
    """1.0 when the option letter the response gives (`mcq_answer`) is the ground truth's, else
    0.0 (MMLU, GPQA, ARC, MMLU-Pro as multiple choice)."""
    return [1.0 if mcq_answer(response) == option_letter(truth) else 0.0 for response, truth in zip(responses, ground_truths)]


_BINARY_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv}


def evaluate_arithmetic(expression: str) -> tuple[float, list[int]]:
    """Evaluate + - * / over integer literals and parentheses; return (value, literals used).

    Parses to an AST and walks only the allowed node types: nothing else is ever executed.
    Raises ValueError for anything else (names, calls, powers, unary minus, floats).
    """
    if len(expression) > 200:
        raise ValueError("expression too long")
    tree = ast.parse(expression.strip(), mode="eval")
    literals: list[int] = []

    def walk(node: ast.AST) -> float:
        if isinstance(node, ast.Expression):
            return walk(node.body)
        if isinstance(node, ast.BinOp) and type(node.op) in _BINARY_OPS:
            left, right = walk(node.left), walk(node.right)
            if isinstance(node.op, ast.Div) and right == 0:
                raise ValueError("division by zero")
            return _BINARY_OPS[type(node.op)](left, right)
        if isinstance(node, ast.Constant) and type(node.value) is int:
            literals.append(node.value)
            return float(node.value)
        raise ValueError(f"not allowed in an answer: {type(node).__name__}")

    return walk(tree), literals


def parse_countdown_truth(truth: str | None) -> tuple[float, list[int]]:
    """Ground truth as JSON: {"target": 24, "numbers": [3, 5, 8, 1]}."""
    try:
        raw = json.loads(truth or "")
        return float(raw["target"]), [int(n) for n in raw["numbers"]]
    except (ValueError, KeyError, TypeError) as exc:
        raise RewardError(f"countdown ground_truth must be JSON with target and numbers, got {truth!r}") from exc


@BUILTINS.register("countdown")
def countdown_reward(*, responses: list[str], ground_truths: list[str | None]) -> list[float]:
    """1.0 if the last <answer>expr</answer> uses exactly the given numbers and hits the
    target; 0.1 for a well-formed arithmetic answer that misses; 0.0 otherwise."""
    scores = []
    for response, truth in zip(responses, ground_truths):
        target, numbers = parse_countdown_truth(truth)
        tags = _ANSWER_TAG.findall(response)
        if not tags:
            scores.append(0.0)
            continue
        try:
            value, used = evaluate_arithmetic(tags[-1])
        except (ValueError, SyntaxError, ZeroDivisionError, OverflowError):
            scores.append(0.0)
            continue
        hit = Counter(used) == Counter(numbers) and abs(value - target) < 1e-5
        scores.append(1.0 if hit else 0.1)
    return scores


# --- loading a spec ------------------------------------------------------------------------


@dataclass(frozen=True)
class RewardFunction:
    """A resolved reward: the callable and how to call it."""

    spec: str
    fn: Callable
    keywords: tuple[str, ...] | None  # None: called as fn(responses)

    def arguments(self, samples: RewardSamples) -> tuple[list, dict[str, Any]]:
        """(args, kwargs) of a call on `samples`, by the calling rule of the function."""
        if self.keywords is None:
            return [list(samples.responses)], {}
        return [], {k: samples.column(k) for k in self.keywords}

    def __call__(self, samples: RewardSamples) -> Any:
        args, kwargs = self.arguments(samples)
        return self.fn(*args, **kwargs)


def from_callable(fn: Callable, spec: str = "<callable>") -> RewardFunction:
    """`fn` with the calling rule its signature asks for (`reward_styles.calling_style`)."""
    style = calling_style(fn, spec)
    if style.name in ("verl", "trl"):
        return RewardFunction(spec, batch_adapter(fn, style), ADAPTER_INPUTS)
    return RewardFunction(spec, fn, style.keywords if style.name == "rlctl" else None)


def load_reward(
    spec: str, *, device: str = "cpu", batch_size: int = 16, http: HttpOptions | None = None, flag: str = "--reward", dtype: str = "fp32",
    reward_models: Callable[[str], Callable] | None = None, judge=None,
) -> RewardFunction:
    """A reward from its spec. Code (file.py:fn, module:fn) is loaded in a child process.
    `flag` names the setting in messages (a tool is loaded the same way); `dtype`: a reward
    model's compute dtype (score.dtype); `reward_models(uri)`: an `rm:` folder's scorer where a
    worker group holds it (else it is loaded here); `judge`: a `judge:` model's question and
    verdicts (rlctl.judge.JudgeSettings)."""
    kind, sep, rest = spec.partition(":")
    if not sep or not rest:
        raise InputError(f"{flag} {spec!r}: expected file.py:function, module:function, builtin:NAME, rm:MODEL_URI, judge:MODEL_URI or an http(s):// URL")
    if kind in ("http", "https"):
        if not rest.startswith("//") or len(rest) <= 2:
            raise InputError(f"{flag} {spec!r}: expected {kind}://HOST[:PORT]/PATH")
        endpoint = HttpReward(spec, http or HttpOptions(batch_size=batch_size))
        return RewardFunction(spec, endpoint, endpoint.keywords)
    if kind == "builtin":
        return from_callable(BUILTINS.get(rest), spec)
    if kind == "rm":
        scorer = reward_models(rest) if reward_models is not None else RewardModel(rest, device=device, batch_size=batch_size, dtype=dtype)
        return RewardFunction(spec, scorer, ("prompts", "responses", "messages"))
    if kind == "judge":
        from rlctl.judge import JudgeReward

        return RewardFunction(spec, JudgeReward(rest, device=device, batch_size=batch_size, dtype=dtype, settings=judge), ("prompts", "responses", "ground_truths"))
    target = spec.rpartition(":")[0]
    if target.endswith(".py") and not Path(target).is_file():
        raise InputError(f"{flag} {spec!r}: file {target} does not exist")
    from rlctl.reward_process import RewardProcess

    process = RewardProcess(spec, flag)
    return RewardFunction(spec, process, process.keywords)


def is_code_reward(spec: str) -> bool:
    """Whether loading this reward spec would import Python code (a file or a module)."""
    kind = spec.partition(":")[0]
    return kind not in ("builtin", "rm", "judge", "http", "https")


def load_code_reward(spec: str) -> RewardFunction:
    """file.py:fn or module:fn imported into this process (the reward child's side)."""
    target, _, name = spec.rpartition(":")
    module = _load_module(target, spec)
    fn = getattr(module, name, None)
    if not callable(fn):
        raise InputError(f"--reward {spec!r}: {target} has no function {name!r}")
    return from_callable(fn, spec)


def _load_module(target: str, spec: str):
    if target.endswith(".py"):
        path = Path(target)
        if not path.exists():
            raise InputError(f"--reward {spec!r}: file {target} does not exist")
        folder = str(path.resolve().parent)
        if folder not in sys.path:  # the reward file imports its sibling modules, as a script would
            sys.path.insert(0, folder)
        module_spec = importlib.util.spec_from_file_location(f"rlctl_user_reward_{path.stem}", path)
        module = importlib.util.module_from_spec(module_spec)
        try:
            module_spec.loader.exec_module(module)
        except Exception as exc:
            raise InputError(f"--reward {spec!r}: importing {target} failed: {type(exc).__name__}: {exc}") from exc
        return module
    try:
        return importlib.import_module(target)
    except ImportError as exc:
        raise InputError(f"--reward {spec!r}: cannot import module {target!r}: {exc}") from exc


class RewardModel:
    """`rm:URI`: a sequence-classification model with one output (`rlctl reward-model` trains
    one); the reward is its logit at the last token of what it reads: the sample as it read its
    training pairs (`reward_model.scored_ids`), a sequence over the model's context keeping its
    end. Batches of similar lengths; `dtype` as score.dtype (bf16: under autocast)."""

    def __init__(self, uri: str, *, device: str = "cpu", batch_size: int = 16, dtype: str = "fp32") -> None:
        from rlctl.backends.hf import context_length_of, resolve_device
        from rlctl.dtypes import compute_dtype
        from rlctl.reward_model import load_scorer

        self.device = resolve_device(device)
        self.model, self.tokenizer = load_scorer(uri, self.device)
        self.context = context_length_of(self.model)
        self.batch_size = batch_size
        self.bf16 = compute_dtype(dtype, self.device.type) == "bf16"

    def __call__(self, *, prompts: list[str], responses: list[str], messages: list[list[dict] | None] | None = None) -> list[float]:
        import torch

        from rlctl.reward_model import rewards_of, scored_ids

        chats = messages or [None] * len(responses)
        sequences = [scored_ids(self.tokenizer, p if m is None else None, m, r) for p, r, m in zip(prompts, responses, chats)]
        if self.context:
            sequences = [s[-self.context :] for s in sequences]
        order = sorted(range(len(sequences)), key=lambda i: len(sequences[i]))  # a batch pads to a similar length
        scores: list[float] = [0.0] * len(sequences)
        with torch.no_grad(), torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.bf16):
            for start in range(0, len(order), self.batch_size):
                batch = order[start : start + self.batch_size]
                values = rewards_of(self.model, [sequences[i] for i in batch], self.tokenizer.pad_token_id, self.device).cpu().tolist()
                for i, value in zip(batch, values):
                    scores[i] = value
        return scores


# --- several rewards, weighted ---------------------------------------------------------------


@dataclass(frozen=True)
class WeightedReward:
    name: str  # its column: reward/NAME
    reward: RewardFunction
    weight: float
    sources: tuple[str, ...] = ()  # the data_sources it scores; (): every sample

    def scores(self, samples: RewardSamples, *, timeout: float) -> RewardValues:
        """Its values for every sample: None (not applicable) outside its data_sources, whose
        samples alone it is called on."""
        if not self.sources:
            return evaluate_reward(self.reward, samples, timeout=timeout)
        mine = [i for i, source in enumerate(samples.data_sources) if source in self.sources]
        values = RewardValues([None] * len(samples), {})
        if not mine:
            return values
        part = evaluate_reward(self.reward, samples.select(mine, responses=[samples.responses[i] for i in mine]), timeout=timeout)
        for i, score in zip(mine, part.scores):
            values.scores[i] = score
        for key, column in part.info.items():
            spread = values.info.setdefault(key, [None] * len(samples))
            for i, value in zip(mine, column):
                spread[i] = value
        return values


@dataclass(frozen=True)
class RewardScores:
    """The `reward` column (the weighted total) and the `reward/...` columns beside it."""

    total: list[float]
    columns: dict[str, list[Any]]
    components: dict[str, float] = field(default_factory=dict)  # several rewards: each component's column → its weight in the total (what GDPO normalizes one by one)


class RewardSet:
    """The rewards of a score stage. One reward of weight 1 is the plain case: its score is the
    total and only its reported values get columns (`reward/KEY`). Several: each component is
    `reward/NAME` and its reported values `reward/NAME/KEY`; a sample's total is the weighted sum
    of the components that apply to it (TRL's None: not applicable)."""

    def __init__(self, terms: Sequence[WeightedReward]) -> None:
        self.terms = list(terms)

    @classmethod
    def of(cls, reward: RewardFunction) -> RewardSet:
        return cls([WeightedReward(term_name(reward.spec), reward, 1.0)])

    @property
    def single(self) -> bool:
        return len(self.terms) == 1 and self.terms[0].weight == 1.0 and not self.terms[0].sources

    @property
    def spec(self) -> str:
        """What manifests and the run header record."""
        return spec_text([(t.reward.spec, t.weight, t.sources) for t in self.terms])

    def score(self, samples: RewardSamples, *, timeout: float) -> RewardScores:
        columns: dict[str, list[Any]] = {}
        components = []
        for term in self.terms:
            values = term.scores(samples, timeout=timeout)
            prefix = "reward/" if self.single else f"reward/{term.name}"
            if not self.single:
                columns[prefix] = values.scores
            columns.update({f"{prefix.rstrip('/')}/{key}": column for key, column in values.info.items()})
            components.append((term, values.scores))
        total = []
        for i in range(len(samples)):
            applied = [(t.weight, scores[i]) for t, scores in components if scores[i] is not None]
            if not applied:
                names = ", ".join(t.reward.spec for t in self.terms)
                source = samples.data_sources[i] if samples.data_sources else None
                raise RewardError(f"no reward applies to sample {i} (data_source {source!r}): {names} returned None for it or do not score its data_source")
            total.append(math.fsum(w * v for w, v in applied))
        components = {} if self.single else {f"reward/{term.name}": term.weight for term in self.terms}
        return RewardScores(total, columns, components)


def spec_text(terms: Sequence[tuple[str, float, Sequence[str]]]) -> str:
    """Rewards as manifests record them: one of weight 1 on every sample by its spec, several as
    their weighted sum."""
    if len(terms) == 1 and terms[0][1] == 1.0 and not terms[0][2]:
        return terms[0][0]
    return " + ".join(f"{weight:g}*{spec}" + (f" on {'|'.join(sources)}" if sources else "") for spec, weight, sources in terms)


def reward_model_folders(cfg: Any) -> list[str]:
    """The `rm:` folders a ScoreConfig scores with: inputs of the score stage, so that a
    retrained reward model makes a new score rather than a skipped one."""
    specs = [t.fn for t in cfg.rewards] if cfg.rewards else [cfg.reward]
    return [spec.partition(":")[2] for spec in specs if spec.partition(":")[0] == "rm"]


def scoring_model_folders(cfg: Any) -> list[str]:
    """Every model folder a ScoreConfig's rewards read (`rm:` and `judge:`): inputs of the score
    stage, so that another model makes a new score rather than a skipped one."""
    specs = [t.fn for t in cfg.rewards] if cfg.rewards else [cfg.reward]
    return [spec.partition(":")[2] for spec in specs if spec.partition(":")[0] in ("rm", "judge")]


def judge_settings(cfg: Any):
    """A ScoreConfig's `judge_*` keys as rlctl.judge.JudgeSettings."""
    from rlctl.judge import DEFAULT_TEMPLATE, JudgeSettings

    return JudgeSettings(cfg.judge_template or DEFAULT_TEMPLATE, cfg.judge_yes, cfg.judge_no)


def describe_rewards(cfg: Any) -> str:
    """A ScoreConfig's rewards as `RewardSet.spec` will record them, without loading any."""
    return spec_text([(t.fn, t.weight, t.sources) for t in cfg.rewards] if cfg.rewards else [(cfg.reward, 1.0, ())])


def term_name(spec: str) -> str:
    """A reward's short name: the function's (file.py:fn → fn), the builtin's, `rm`, the host."""
    kind, _, rest = spec.partition(":")
    if kind in ("http", "https"):
        return rest.lstrip("/").split("/")[0].split(":")[0] or kind
    if kind in ("rm", "judge"):
        return kind
    return spec.rpartition(":")[2] or spec


def load_rewards(cfg: Any, *, device: str = "cpu", reward_fn: Callable | None = None, reward_models: Callable[[str], Callable] | None = None) -> RewardSet:
    """The RewardSet a ScoreConfig names (`score.rewards`, else `score.reward`); a Python
    callable given to the Pipeline stands in for `score.reward`; `reward_models(uri)` gives the
    `rm:` scorers a worker group holds."""
    http = HttpOptions(batch_size=cfg.http_batch_size, concurrency=cfg.http_concurrency, retries=cfg.http_retries, timeout=cfg.reward_timeout or HttpOptions.timeout)
    if reward_fn is not None:
        return RewardSet.of(from_callable(reward_fn, f"callable:{getattr(reward_fn, '__name__', 'reward')}"))
    judge = judge_settings(cfg)
    if not cfg.rewards:
        return RewardSet.of(load_reward(cfg.reward, device=device, batch_size=cfg.batch_size, http=http, dtype=cfg.dtype, reward_models=reward_models, judge=judge))
    terms, seen = [], Counter()
    for term in cfg.rewards:
        name = term.name or term_name(term.fn)
        seen[name] += 1
        reward = load_reward(term.fn, device=device, batch_size=cfg.batch_size, http=http, dtype=cfg.dtype, reward_models=reward_models, judge=judge)
        terms.append(WeightedReward(name if seen[name] == 1 else f"{name}_{seen[name]}", reward, term.weight, tuple(term.sources)))
    return RewardSet(terms)


# --- calling safely ------------------------------------------------------------------------


@dataclass(frozen=True)
class RewardValues:
    """What one reward function said about a batch: a score per sample (None where it does not
    apply, TRL's convention) and the extra values it reported (verl's dict returns), by key."""

    scores: list[float | None]
    info: dict[str, list[Any]]


def compute_rewards(reward: RewardFunction, samples: RewardSamples, *, timeout: float) -> list[float]:
    """One float per sample; any failure is a `RewardError` naming the sample index."""
    values = evaluate_reward(reward, samples, timeout=timeout)
    if None in values.scores:
        raise RewardError(f"reward {reward.spec} returned None at sample {values.scores.index(None)}: no reward applies to it")
    return values.scores


def evaluate_reward(reward: RewardFunction, samples: RewardSamples, *, timeout: float) -> RewardValues:
    """The function's scores and reported values; a failure names the first bad sample."""
    try:
        return _checked(_call_with_timeout(reward, samples, timeout), len(samples), reward.spec)
    except _Failure as failure:
        index = _first_failing_sample(reward, samples, timeout)
        where = f" at sample {index}" if index is not None else " on the whole batch (no single sample fails alone)"
        raise RewardError(f"reward {reward.spec} {failure.what}{where}") from None


class _Failure(Exception):
    def __init__(self, what: str) -> None:
        super().__init__(what)
        self.what = what


def _first_failing_sample(reward: RewardFunction, samples: RewardSamples, timeout: float) -> int | None:
    if len(samples) == 1:
        return 0
    for index in range(len(samples)):
        try:
            _checked(_call_with_timeout(reward, samples.subset(index), timeout), 1, reward.spec)
        except _Failure:
            return index
    return None


def _checked(result: Any, expected: int, spec: str) -> RewardValues:
    if hasattr(result, "detach"):
        result = result.detach().cpu().reshape(-1).tolist()
    elif hasattr(result, "tolist"):
        result = result.tolist()
    if not isinstance(result, Sequence) or isinstance(result, (str, bytes)):
        raise _Failure(f"returned {getattr(result, 'type_name', type(result).__name__)}, expected a list of floats")
    if len(result) != expected:
        raise _Failure(f"returned {len(result)} values for {expected} samples")
    scores: list[float | None] = []
    info: dict[str, list[Any]] = {}
    for i, v in enumerate(result):
        if isinstance(v, dict):  # verl: {"score": 1.0, "acc": True, "pred": "42"}
            if "score" not in v:
                raise RewardError(f"reward {spec} returned a dict without a 'score' key at sample {i} (keys: {', '.join(map(str, v))})")
            for key, extra in v.items():
                if key != "score":
                    info.setdefault(str(key), [None] * expected)[i] = _info_value(extra)
            v = v["score"]
        scores.append(None if v is None else _finite(v, i, spec))
    return RewardValues(scores, info)


def _finite(v: Any, i: int, spec: str) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        kind = getattr(v, "type_name", type(v).__name__)
        raise RewardError(f"reward {spec} returned {kind} {v!r} at sample {i}, expected a float")
    value = float(v) if abs(v) <= FLOAT32_MAX else math.inf
    if not math.isfinite(value):
        what = v if isinstance(v, float) and not math.isfinite(v) else f"{str(v)[:12]}…, outside the float32 range of the reward column"
        raise RewardError(f"reward {spec} returned {what} at sample {i}")
    return value


def _info_value(value: Any) -> float | str | None:
    """A reported value as a shard can hold it: numbers (bools as 0/1) or text."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, (bool, int, float)):
        return float(value)
    return repr(value)


def call_within(fn: RewardFunction, samples: RewardSamples, *, timeout: float, what: str) -> Any:
    """`fn`'s raw result on `samples` within `timeout` (a function that is not a reward: a
    tool); a failure is one RewardError: `what` `fn.spec` raised / ran past its time / ..."""
    try:
        return _call_with_timeout(fn, samples, timeout)
    except _Failure as failure:
        raise RewardError(f"{what} {fn.spec} {failure.what}") from None


def _call_with_timeout(reward: RewardFunction, samples: RewardSamples, timeout: float) -> Any:
    from rlctl.reward_process import RewardCallFailed, RewardProcess

    if isinstance(reward.fn, HttpReward):  # times each request itself; failures are the whole batch's
        args, kwargs = reward.arguments(samples)
        return reward.fn.call(args, kwargs, timeout)
    if isinstance(reward.fn, RewardProcess):  # the child process enforces the timeout itself
        args, kwargs = reward.arguments(samples)
        try:
            return reward.fn.call(args, kwargs, timeout)
        except RewardCallFailed as exc:
            raise _Failure(str(exc)) from None
    if getattr(reward.fn, "runs_on_workers", False):  # a worker group's reward model: the group's own failure handling, no alarm in its Ray calls
        return reward(samples)
    if timeout <= 0:
        return _call(reward, samples)
    if threading.current_thread() is threading.main_thread() and hasattr(signal, "setitimer"):
        def on_alarm(signum, frame):
            raise _Timeout()

        previous = signal.signal(signal.SIGALRM, on_alarm)
        signal.setitimer(signal.ITIMER_REAL, timeout)
        try:
            return _call(reward, samples)
        except _Timeout:
            raise _Failure(f"ran past the {timeout:g}s timeout") from None
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, previous)
    box: dict[str, Any] = {}

    def target():
        try:
            box["value"] = _call(reward, samples)
        except BaseException as exc:  # carried to the caller's thread
            box["error"] = exc

    worker = threading.Thread(target=target, daemon=True)
    worker.start()
    worker.join(timeout)
    if worker.is_alive():
        raise _Failure(f"ran past the {timeout:g}s timeout")
    if "error" in box:
        raise box["error"]
    return box["value"]


class _Timeout(Exception):
    """Raised by the SIGALRM handler inside a reward call that ran past its time."""


def _call(reward: RewardFunction, samples: RewardSamples) -> Any:
    try:
        return reward(samples)
    except (_Timeout, RewardError):
        raise
    except Exception as exc:
        raise _Failure(f"raised {type(exc).__name__}: {exc}") from exc
