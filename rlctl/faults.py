"""Fault injection for crash tests: `RLCTL_FAULT_KILL_AT=<text>` makes the process SIGKILL
itself at the first named point whose name contains <text>. Points are named where outputs
are written (`<uri>:part-N`, `<uri>:before-commit`) and between pipeline steps.
`RLCTL_FAULT_SKIP=<text>` makes `skipped(name)` true at points whose name contains <text>:
a step silently not done (a weight push), for the checks that must catch it."""

from __future__ import annotations

import os
import signal

ENV = "RLCTL_FAULT_KILL_AT"
SKIP_ENV = "RLCTL_FAULT_SKIP"


def point(name: str) -> None:
    target = os.environ.get(ENV)
    if target and target in name:
        os.kill(os.getpid(), signal.SIGKILL)


def skipped(name: str) -> bool:
    target = os.environ.get(SKIP_ENV)
    return bool(target) and target in name
