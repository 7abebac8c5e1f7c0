"""rlctl: reinforcement-learning post-training of language models as stage commands over
Arrow shards (rollout → score → advantage → update → reshard), run alone, piped, from a
Makefile, or under one controller with `rlctl pipeline`."""

from __future__ import annotations

__version__ = "0.1.0"

__all__ = ["Pipeline", "__version__"]


def __getattr__(name: str):
    if name == "Pipeline":  # imported lazily: `import rlctl` stays light for the CLI
        from rlctl.pipeline import Pipeline

        return Pipeline
    raise AttributeError(f"module 'rlctl' has no attribute {name!r}")
