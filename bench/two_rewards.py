"""A second reward beside examples/rewards.py:digit_share, of a much wider spread: how GDPO
(advantage.estimator = "gdpo") and GRPO weigh two rewards of different scales (RESULTS.md)."""


def vowels(responses: list[str]) -> list[float]:
    """The number of vowels in a response (0 to ~40 in 16 tokens of the tiny preset)."""
    return [float(sum(c in "aeiouAEIOU" for c in r)) for r in responses]
