"""Fault injection for crash tests: `RLCTL_FAULT_KILL_AT=<text>` makes the process SIGKILL
itself at the first named point whose name contains <text>. Points are named where outputs
are written (`<uri>:part-N`, `<uri>:before-commit`) and between pipeline steps."""

from __future__ import annotations

import os
import signal

ENV = "RLCTL_FAULT_KILL_AT"


def point(name: str) -> None:
    target = os.environ.get(ENV)
    if target and target in name:
        os.kill(os.getpid(), signal.SIGKILL)
