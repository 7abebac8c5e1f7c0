"""The seed article's reward function: longer answers score higher, capped at 1."""


def reward_fn(samples: list[str]) -> list[float]:
    return [min(len(s) / 100.0, 1.0) for s in samples]
