"""Reward functions used by the examples. Each takes what it needs by keyword (or the list of
response strings) and returns one float per sample."""


def length_reward(samples: list[str]) -> list[float]:
    """The seed article's toy reward: longer answers score higher, capped at 100 characters."""
    return [min(len(s) / 100.0, 1.0) for s in samples]


def digit_share(responses: list[str]) -> list[float]:
    """The share of a response's characters that are digits (0 for an empty response): a
    rule a program can verify exactly, used by examples/grpo.toml."""
    return [sum(c.isdigit() for c in r) / len(r) if r else 0.0 for r in responses]


def states_the_answer(responses: list[str], ground_truths: list[str]) -> list[float]:
    """1 when the response holds the ground truth as a whole number, else 0 (examples/tool_use.toml)."""
    import re

    return [float(truth in re.findall(r"\d+", response)) for response, truth in zip(responses, ground_truths)]


def repeats_the_number(responses: list[str], ground_truths: list[str]) -> list[float]:
    """1 when the response is exactly the number the prompt asks to repeat (examples/sft_grpo.toml)."""
    return [float(response.strip() == truth) for response, truth in zip(responses, ground_truths)]
