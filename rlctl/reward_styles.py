"""How a user's reward function is called, decided once from its signature.

People arrive with reward code written for another trainer; it must run unchanged. Accepted:

- **rlctl** keywords, lists over the batch: any of `prompts`, `responses`, `ground_truths`,
  `data_sources`, `extras` (`**kwargs` receives all five);
- **one positional** parameter: `fn(responses)`;
- **verl**: `compute_score(data_source, solution_str, ground_truth, extra_info=None)`, once per
  sample; returns a float, or a dict whose `score` is the reward and whose other values are
  reported beside it;
- **TRL**: `fn(prompts, completions, **kwargs)`, lists over the batch, every other prompt column
  (`ground_truth`, `data_source`, and the extra columns of the prompts) a keyword list; `None`
  for a sample the function does not apply to. Chat prompts arrive as message lists and
  completions as `[{"role": "assistant", "content": ...}]`, as TRL passes them.

A signature that mixes these forms, or requires a parameter none of them supplies, is refused
when the reward loads (exit 2), naming the forms.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from rlctl.errors import InputError, RewardError

RLCTL_KEYWORDS = ("prompts", "responses", "ground_truths", "data_sources", "extras")
VERL_KEYWORDS = ("data_source", "solution_str", "ground_truth", "extra_info")
TRL_KEYWORDS = ("prompts", "completions")
ADAPTER_INPUTS = (*RLCTL_KEYWORDS, "messages")  # what the verl and TRL adapters are called with

ACCEPTED_FORMS = (
    "fn(responses); fn(*, prompts, responses, ground_truths, data_sources, extras) with any of those names; "
    "verl's compute_score(data_source, solution_str, ground_truth, extra_info); TRL's fn(prompts, completions, **kwargs)"
)


@dataclass(frozen=True)
class CallingStyle:
    """`name`: rlctl | positional | verl | trl; `keywords`: the names the function declares
    among its style's inputs (all of them when it takes **kwargs)."""

    name: str
    keywords: tuple[str, ...]
    takes_any: bool = False  # **kwargs: TRL passes every column
    optional: tuple[str, ...] = ()  # declared with a default: passed only when the column exists


def calling_style(fn: Callable, spec: str) -> CallingStyle:
    """The one form `fn`'s signature fits; InputError when it fits none or several."""
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):  # a builtin without a signature: the plain list form
        return CallingStyle("positional", ())
    named = {name: p for name, p in params.items() if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)}
    takes_any = any(p.kind is p.VAR_KEYWORD for p in params.values())
    forms = {
        "verl": "solution_str" in named,
        "trl": "completions" in named,
        "rlctl": any(k in named for k in RLCTL_KEYWORDS if k != "prompts"),
    }
    chosen = [form for form, fits in forms.items() if fits]
    if len(chosen) > 1:
        raise InputError(f"--reward {spec!r}: its parameters mix the {' and '.join(chosen)} forms; accepted: {ACCEPTED_FORMS}")
    if not chosen:
        if "prompts" in named:
            chosen = ["rlctl"]
        elif not named:
            return CallingStyle("rlctl", RLCTL_KEYWORDS) if takes_any else CallingStyle("positional", ())
        else:
            first = next(iter(named.values()))
            rest = [p for p in list(named.values())[1:] if p.default is p.empty and p.kind is not p.KEYWORD_ONLY]
            required_kw = [p for p in named.values() if p.kind is p.KEYWORD_ONLY and p.default is p.empty]
            if first.kind is first.KEYWORD_ONLY or rest or required_kw:
                unknown = ", ".join(dict.fromkeys(p.name for p in ([first] if first.kind is first.KEYWORD_ONLY else []) + rest + required_kw))
                raise InputError(f"--reward {spec!r}: no form supplies its parameter(s) {unknown}; accepted: {ACCEPTED_FORMS}")
            return CallingStyle("positional", ())
    style = chosen[0]
    inputs = {"verl": VERL_KEYWORDS, "rlctl": RLCTL_KEYWORDS, "trl": None}[style]
    if inputs is not None:
        missing = [p.name for p in named.values() if p.name not in inputs and p.default is p.empty]
        if missing:
            raise InputError(f"--reward {spec!r}: the {style} form supplies no {', '.join(missing)}; accepted: {ACCEPTED_FORMS}")
        keywords = inputs if takes_any else tuple(k for k in inputs if k in named)
        return CallingStyle(style, keywords, takes_any)
    optional = tuple(name for name, p in named.items() if p.default is not p.empty)
    return CallingStyle("trl", tuple(named), takes_any, optional)


def batch_adapter(fn: Callable, style: CallingStyle) -> Callable[..., list]:
    """`fn` as a function of the rlctl inputs (`ADAPTER_INPUTS`, as keywords) returning one
    value per sample; used for the verl and TRL forms."""
    if style.name == "verl":
        return _VerlBatch(fn, style)
    if style.name == "trl":
        return _TrlBatch(fn, style)
    raise ValueError(f"no adapter for the {style.name} form")


class _VerlBatch:
    """compute_score once per sample, with verl's argument names."""

    def __init__(self, fn: Callable, style: CallingStyle) -> None:
        self.fn, self.style = fn, style

    def __call__(self, *, prompts, responses, ground_truths, data_sources, extras, messages) -> list:
        values = []
        for response, truth, source, extra in zip(responses, ground_truths, data_sources, extras):
            arguments = {"data_source": source, "solution_str": response, "ground_truth": truth, "extra_info": extra}
            values.append(self.fn(**{k: arguments[k] for k in self.style.keywords}))
        return values


class _TrlBatch:
    """The TRL reward-function call: prompts, completions and every prompt column as lists."""

    def __init__(self, fn: Callable, style: CallingStyle) -> None:
        self.fn, self.style = fn, style

    def __call__(self, *, prompts, responses, ground_truths, data_sources, extras, messages) -> list:
        columns: dict[str, list[Any]] = {  # a chat row's prompt and completion are messages
            "prompts": [p if m is None else m for p, m in zip(prompts, messages)],
            "completions": [r if m is None else [{"role": "assistant", "content": r}] for r, m in zip(responses, messages)],
            "ground_truth": list(ground_truths),
            "data_source": list(data_sources),
        }
        for name in sorted({k for extra in extras for k in extra}):
            columns.setdefault(name, [extra.get(name) for extra in extras])
        declared = [k for k in self.style.keywords if k in columns or k not in self.style.optional]
        wanted = list(dict.fromkeys([*columns, *declared])) if self.style.takes_any else declared
        missing = [k for k in wanted if k not in columns]
        if missing:
            raise RewardError(f"the reward asks for column(s) {', '.join(missing)}; the rollouts have {', '.join(columns)}")
        return self.fn(**{k: columns[k] for k in wanted})
