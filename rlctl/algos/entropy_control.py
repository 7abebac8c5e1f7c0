"""Adaptive entropy control (Skywork-OR1, He et al. 2025; TRL's `use_adaptive_entropy`).

An entropy bonus with a fixed coefficient either does too little to stop the policy's entropy
collapsing or, once strong enough, makes it explode. The controller instead steers the mean
token entropy towards a target: the bonus applies only while the last optimizer step measured
an entropy at or below the target, and its coefficient rises by a step after every such
measurement and falls by one after every other, within bounds. Pure state: the trainer keeps
an `EntropyControl`, saves it in its checkpoint and moves it once per optimizer step.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class EntropyControl:
    coef: float  # the controller's coefficient (update.entropy_coef at the start)
    last_entropy: float | None = None  # the mean token entropy of the last optimizer step; None before the first

    def applied(self, target: float) -> float:
        """The coefficient the coming step's loss takes: the controller's where the last step's
        entropy was at or below `target`, else 0 — and 0 before any step has measured one."""
        if self.last_entropy is None or self.last_entropy > target:
            return 0.0
        return self.coef

    def after_step(self, entropy: float, *, target: float, delta: float, low: float, high: float) -> EntropyControl:
        """The state after a step that measured `entropy`: the coefficient up by `delta` where it
        is at or below `target`, down by `delta` where above, held within [low, high]."""
        coef = min(self.coef + delta, high) if entropy <= target else max(self.coef - delta, low)
        return EntropyControl(coef, float(entropy))

    def to_json(self) -> dict:
        return {"coef": self.coef, "last_entropy": self.last_entropy}

    @classmethod
    def from_json(cls, value: object, *, where: str) -> EntropyControl:
        """A saved state, checked: a finite coefficient, and a finite entropy or null."""
        import math

        from rlctl.errors import InputError

        ok = isinstance(value, dict) and set(value) == {"coef", "last_entropy"}
        numbers = [value.get("coef"), value.get("last_entropy")] if ok else []
        if not ok or not all(v is None or (isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)) for v in numbers) or numbers[0] is None:
            raise InputError(f"{where}: entropy_control must be {{\"coef\": number, \"last_entropy\": number or null}}, got {value!r}")
        return cls(float(value["coef"]), None if value["last_entropy"] is None else float(value["last_entropy"]))
