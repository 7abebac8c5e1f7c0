"""Reward functions used by the examples. Each takes what it needs by keyword (or the list of
response strings) and returns one float per sample."""


def length_reward(samples: list[str]) -> list[float]:
    """The seed article's toy reward: longer answers score higher, capped at 100 characters."""
    return [min(len(s) / 100.0, 1.0) for s in samples]
