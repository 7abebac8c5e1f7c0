"""Fault injection for crash tests: `RLCTL_FAULT_KILL_AT=<text>` makes the process SIGKILL
itself at the first named point whose name contains <text>; `RLCTL_FAULT_ABORT_AT=<text>`
makes it print one line and abort (SIGABRT, as a native library's failed check does). Points
are named where outputs are written (`<uri>:part-N`, `<uri>:before-commit`) and between
pipeline steps.
`RLCTL_FAULT_SKIP=<text>` makes `skipped(name)` true at points whose name contains <text>:
a step silently not done (a weight push), for the checks that must catch it."""

from __future__ import annotations

import os
import signal
import sys

ENV = "RLCTL_FAULT_KILL_AT"
ABORT_ENV = "RLCTL_FAULT_ABORT_AT"
SKIP_ENV = "RLCTL_FAULT_SKIP"


def point(name: str) -> None:
    target = os.environ.get(ENV)
    if target and target in name:
        os.kill(os.getpid(), signal.SIGKILL)
    target = os.environ.get(ABORT_ENV)
    if target and target in name:
        print(f"rlctl: fault injected: abort at {name}", file=sys.stderr, flush=True)
        os.abort()


def skipped(name: str) -> bool:
    target = os.environ.get(SKIP_ENV)
    return bool(target) and target in name
