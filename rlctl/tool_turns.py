"""Multi-turn rollouts with a tool (`rollout.tool`): a response that stops at a stop string
(`rollout.stop`, e.g. `</calc>`) is handed to the tool, whose text is appended and generation
goes on from there, until the model ends without a call, the tool answers None, the calls
reach `rollout.max_tool_calls` or the tokens reach `max_new_tokens`.

The tool's tokens belong to the response (rewards read the whole exchange; the trainer's
forward sees them as context) but the policy did not sample them: `loss_mask` is False there,
their log-probs 0, and the advantage and the loss skip them. Each row's turns draw from their
own stream (`turn_seed`, the row's global index), so a row's exchange does not depend on which
other rows continue with it, nor on how rows are split over workers."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from rlctl.algos.logprobs import row_seed
from rlctl.backends.base import Generation
from rlctl.calculator import calculator
from rlctl.config import ConfigError
from rlctl.errors import RewardError
from rlctl.rewards import (
    RewardFunction,
    RewardSamples,
    call_within,
    from_callable,
    is_code_reward,
    load_reward,
)

TOOL_TURN_SEEDS = 0x7001  # mixed into a turn's seed: turn 2's stream is not turn 1's continued


@dataclass
class Transcript:
    """One row's response over its turns: every token, whose they are, and how it ended."""

    response_ids: list[int]
    logprobs: list[float]
    loss_mask: list[bool]
    finish_reason: str
    tool_calls: int = 0
    waiting: bool = False  # ended its last turn at a stop string: the tool has the next word

    def append_model(self, generation: Generation, room: int, at_stop_string: bool) -> None:
        """A turn's tokens, cut to the `room` left under max_new_tokens."""
        tokens, logprobs = generation.response_ids[:room], generation.logprobs[:room]
        cut = len(generation.response_ids) > room
        self.response_ids += tokens
        self.logprobs += logprobs
        self.loss_mask += [True] * len(tokens)
        self.finish_reason = "length" if cut else generation.finish_reason
        self.waiting = at_stop_string and not cut

    def append_tool(self, tokens: list[int], room: int) -> None:
        """The tool's tokens (not the policy's), cut to the `room` left; cut means the end."""
        kept = tokens[:room]
        self.response_ids += kept
        self.logprobs += [0.0] * len(kept)
        self.loss_mask += [False] * len(kept)
        self.tool_calls += 1
        if len(tokens) >= room:
            self.finish_reason, self.waiting = "length", False


TOOLS = {"calculator": calculator}  # builtin:NAME


def check_tool(spec: str, stop: Sequence[str]) -> None:
    """A tool is code or a builtin, and is called where a response stops at a stop string:
    one line, exit 2."""
    if not spec:
        return
    kind, _, name = spec.partition(":")
    if kind == "builtin" and name not in TOOLS:
        raise ConfigError(f"rollout.tool {spec!r}: no such builtin tool; the builtin tools: {', '.join(TOOLS)}")
    if ":" not in spec or (kind != "builtin" and not is_code_reward(spec)):
        raise ConfigError(f"rollout.tool {spec!r}: expected file.py:function, module:function or builtin:NAME ({', '.join(TOOLS)})")
    if not stop:
        raise ConfigError("rollout.tool is called where a response stops at a stop string: set rollout.stop (its call's closing tag, e.g. --stop '</calc>')")


class Tool:
    """The user's tool: code (file.py:fn, module:fn) run in a child process like a code reward,
    or a builtin (builtin:calculator: rlctl.calculator), called with the same keywords (`responses`: each response so far; `prompts`,
    `ground_truths`, `data_sources`, `extras`), answering one text or None per response."""

    def __init__(self, fn: RewardFunction, timeout: float) -> None:
        self.fn, self.timeout = fn, timeout

    @classmethod
    def load(cls, spec: str, *, timeout: float) -> Tool:
        kind, _, name = spec.partition(":")
        if kind == "builtin":  # rlctl's own, in this process
            return cls(from_callable(TOOLS[name], spec), timeout)
        return cls(load_reward(spec, flag="rollout.tool"), timeout)

    def __call__(self, samples: RewardSamples) -> list[str | None]:
        answers = call_within(self.fn, samples, timeout=self.timeout, what="tool")
        if not isinstance(answers, (list, tuple)) or len(answers) != len(samples):
            got = f"{len(answers)} values" if isinstance(answers, (list, tuple)) else type(answers).__name__
            raise RewardError(f"tool {self.fn.spec} returned {got} for {len(samples)} responses: expected a list of texts (None: no call)")
        bad = next((i for i, answer in enumerate(answers) if answer is not None and not isinstance(answer, str)), None)
        if bad is not None:
            raise RewardError(f"tool {self.fn.spec} returned {type(answers[bad]).__name__} for response {bad}: expected a text or None")
        return list(answers)

    def __enter__(self) -> Tool:
        return self

    def __exit__(self, *exc) -> None:
        if hasattr(self.fn.fn, "close"):
            self.fn.fn.close()


CHAT_SENTINEL = "\u2063RLCTL-ASSISTANT-TURN\u2063"  # stands for the assistant's turn while the template renders the tool's


def chat_turn_text(tokenizer, answer: str, role: str, template_kwargs: dict | None = None) -> str:
    """The text the tokenizer's chat template puts after an assistant's turn when a `role`
    message `answer` follows and the assistant speaks next: the assistant's turn closed, the
    tool's message, the next assistant turn opened (rollout.tool_format = "chat")."""
    messages = [{"role": "user", "content": "?"}, {"role": "assistant", "content": CHAT_SENTINEL}, {"role": role, "content": answer}]
    try:
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **(template_kwargs or {}))
    except Exception as exc:  # noqa: BLE001 — a template's own refusal (raise_exception), any kind
        raise ConfigError(
            f"rollout.tool_format = \"chat\": the tokenizer's chat template cannot render a {role!r} message after the assistant's ({exc}); "
            "set rollout.tool_role (e.g. \"user\") or tool_format = \"text\""
        ) from None
    if text.count(CHAT_SENTINEL) != 1:
        raise ConfigError("rollout.tool_format = \"chat\": the tokenizer's chat template does not keep the assistant's words as they are")
    return text.split(CHAT_SENTINEL, 1)[1]


def turn_seed(seed: int, turn: int) -> int:
    """The sampling seed of turn `turn` (0: the first, whose seed is the rollout's)."""
    return seed if turn == 0 else row_seed(seed ^ TOOL_TURN_SEEDS, turn)


def first_turn(generations: Sequence[Generation], at_stop_string: Sequence[bool], max_new_tokens: int) -> list[Transcript]:
    transcripts = []
    for generation, hit in zip(generations, at_stop_string):
        transcript = Transcript([], [], [], generation.finish_reason)
        transcript.append_model(generation, max_new_tokens, hit)
        transcripts.append(transcript)
    return transcripts


def take_turns(
    transcripts: list[Transcript], prompt_ids: Sequence[Sequence[int]], rows: Sequence[int], *,
    call_tool: Callable[[list[int], list[Transcript]], list[str | None]],
    tokenize: Callable[[str], list[int]],
    generate: Callable[[list[list[int]], int, list[int], int], tuple[list[Generation], list[bool]]],
    max_new_tokens: int, max_tool_calls: int,
) -> list[Transcript]:
    """Go on with every transcript that waits on the tool: `call_tool(indices, transcripts)`
    answers each (text, or None: the response ends there), `generate(prompts, limit, row_ids,
    turn)` samples the next turn ((generations cut at stop strings, whether each hit one)).
    `rows` are the transcripts' global row indices, which name their random streams."""
    turn = 0
    while True:
        asking = [i for i, t in enumerate(transcripts) if t.waiting and t.tool_calls < max_tool_calls and len(t.response_ids) < max_new_tokens]
        for t in transcripts:
            t.waiting = t.waiting and t.tool_calls < max_tool_calls and len(t.response_ids) < max_new_tokens  # else it ends at its stop string
        if not asking:
            return transcripts
        answers = call_tool(asking, [transcripts[i] for i in asking])
        going_on = []
        for i, answer in zip(asking, answers):
            transcript = transcripts[i]
            transcript.waiting = False
            if answer is None:
                continue
            transcript.append_tool(tokenize(answer), max_new_tokens - len(transcript.response_ids))
            if transcript.finish_reason != "length":  # the tool's text left room for the model
                going_on.append(i)
        if not going_on:
            return transcripts
        turn += 1
        rooms = [max_new_tokens - len(transcripts[i].response_ids) for i in going_on]
        prompts = [list(prompt_ids[i]) + transcripts[i].response_ids for i in going_on]
        generations, hits = generate(prompts, max(rooms), [rows[i] for i in going_on], turn)
        for i, room, generation, hit in zip(going_on, rooms, generations, hits):
            transcripts[i].append_model(generation, room, hit)
