"""rlctl: reinforcement-learning post-training of language models as stage commands over
Arrow shards (rollout → score → advantage → update → reshard), run alone, piped, from a
Makefile, or under one controller with `rlctl pipeline`."""

from __future__ import annotations

__version__ = "0.1.0"

__all__ = ["__version__"]
