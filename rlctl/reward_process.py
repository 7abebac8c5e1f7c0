"""User reward code (`file.py:fn`, `module:fn`) runs in a child process, never in rlctl's own.

Why: a reward is somebody's Python. In our process a `sys.exit(0)` inside it would end the
command with exit 0, `os._exit` would skip every cleanup, a `print` would land in the middle of
an `--out -` Arrow stream, and a `try/except Exception` around a slow loop would swallow our
timeout. In a child, the child's stdout is our stderr, a hard timeout is a SIGKILL, and every
way the child can end is reported as a failure of the reward, never as success.

The two processes speak JSON lines over a private pipe pair (not stdin/stdout):

    → {"init": {"spec": ..., "sys_path": [...]}}      ← {"ready": {"keywords": [...] | null}} | {"error": "..."}
    → {"call": {"args": [...], "kwargs": {...}}}      ← {"result": [...]} | {"failure": "..."}

    python -m rlctl.reward_process READ_FD WRITE_FD   (started by RewardProcess, not by hand)
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import select
import signal
import subprocess
import sys
import time
from typing import Any

from rlctl.errors import InputError

START_TIMEOUT = 120.0  # importing a reward module (it may import torch) must not hang forever


class RewardCallFailed(Exception):
    """The call did not return values: the reward raised, exited, or ran past its time."""


class RewardProcess:
    """A child process holding one user reward function; callable like the function."""

    def __init__(self, spec: str, flag: str = "--reward") -> None:
        self.spec, self.flag = spec, flag  # `flag`: what the user set it with, for messages (rollout.tool for a tool)
        self.keywords: tuple[str, ...] | None = None
        self._child: subprocess.Popen | None = None
        self._to_child = self._from_child = -1
        self._buffer = b""
        self.start()
        atexit.register(self.close)

    # -- lifecycle -----------------------------------------------------------------------

    def start(self) -> None:
        """Start the child and load the reward in it; a bad spec is an InputError (exit 2)."""
        parent_read, child_write = os.pipe()
        child_read, parent_write = os.pipe()
        self._child = subprocess.Popen(
            [sys.executable, "-m", "rlctl.reward_process", str(child_read), str(child_write)],
            stdin=subprocess.DEVNULL, stdout=_stderr_fd(),
            pass_fds=(child_read, child_write), start_new_session=True,
        )
        os.close(child_read)
        os.close(child_write)
        self._to_child, self._from_child, self._buffer = parent_write, parent_read, b""
        try:
            reply = self._exchange({"init": {"spec": self.spec, "sys_path": sys.path}}, START_TIMEOUT)
        except RewardCallFailed as exc:
            self.close()
            raise InputError(f"{self.flag} {self.spec!r}: loading it failed: {exc}") from None
        if "error" in reply:
            self.close()
            raise InputError(f"{self.flag} {self.spec!r}: {reply['error']}")
        keywords = reply["ready"]["keywords"]
        self.keywords = tuple(keywords) if keywords is not None else None

    def close(self) -> None:
        if self._child is not None:
            if self._child.poll() is None:
                self._child.kill()
            self._child.wait()
            self._child = None
        for fd in (self._to_child, self._from_child):
            if fd >= 0:
                with contextlib.suppress(OSError):  # already closed
                    os.close(fd)
        self._to_child = self._from_child = -1

    def __del__(self) -> None:
        self.close()

    # -- calls ---------------------------------------------------------------------------

    def call(self, args: list, kwargs: dict, timeout: float) -> Any:
        """The function's return value (as JSON carried it); RewardCallFailed otherwise."""
        if self._child is None or self._child.poll() is not None:
            self.close()
            self.start()  # the previous call killed or ended it
        reply = self._exchange({"call": {"args": args, "kwargs": kwargs}}, timeout if timeout > 0 else None)
        if "failure" in reply:
            raise RewardCallFailed(reply["failure"])
        return from_jsonable(reply["result"])

    def _exchange(self, message: dict, timeout: float | None) -> dict:
        data = (json.dumps(message, default=str) + "\n").encode()
        try:
            _write_all(self._to_child, data)
            return json.loads(self._read_line(timeout))
        except _TimedOut:
            self.close()
            raise RewardCallFailed(f"ran past the {timeout:g}s timeout") from None
        except (BrokenPipeError, EOFError):
            code = self._child.wait() if self._child is not None else None
            self.close()
            raise RewardCallFailed(f"ended its process (exit code {code})") from None

    def _read_line(self, timeout: float | None) -> bytes:
        deadline = None if timeout is None else time.monotonic() + timeout
        while b"\n" not in self._buffer:
            wait = None if deadline is None else max(0.0, deadline - time.monotonic())
            ready, _, _ = select.select([self._from_child], [], [], wait)
            if not ready:
                raise _TimedOut()
            chunk = os.read(self._from_child, 1 << 16)
            if not chunk:
                raise EOFError()
            self._buffer += chunk
        line, _, self._buffer = self._buffer.partition(b"\n")
        return line


class _TimedOut(Exception):
    """The child did not answer within the call's timeout."""


def _stderr_fd() -> int:
    """Where the child's stdout goes: our stderr (fd 2 when sys.stderr is not a real file)."""
    try:
        return sys.stderr.fileno()
    except (AttributeError, OSError, ValueError):
        return 2


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


# --- the child -------------------------------------------------------------------------------


def _serve(read_fd: int, write_fd: int) -> None:
    """Load the reward, then answer calls until the parent closes the pipe."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent decides when we stop
    incoming = os.fdopen(read_fd, "rb")
    outgoing = os.fdopen(write_fd, "wb")

    def send(message: dict) -> None:
        outgoing.write((json.dumps(message, default=str) + "\n").encode())
        outgoing.flush()

    fn = None
    for raw in incoming:
        message = json.loads(raw)
        if "init" in message:
            sys.path[:] = message["init"]["sys_path"]
            try:
                from rlctl.rewards import load_code_reward

                reward = load_code_reward(message["init"]["spec"])
            except InputError as exc:
                send({"error": str(exc).split(": ", 1)[-1]})
                continue
            except BaseException as exc:  # noqa: BLE001 — user code at import time: report anything
                send({"error": f"importing it failed: {type(exc).__name__}: {exc}"})
                continue
            fn = reward.fn
            send({"ready": {"keywords": list(reward.keywords) if reward.keywords is not None else None}})
        elif "call" in message:
            send(_run(fn, message["call"]["args"], message["call"]["kwargs"]))


def _run(fn, args: list, kwargs: dict) -> dict:
    try:
        value = fn(*args, **kwargs)
    except SystemExit as exc:
        return {"failure": f"called sys.exit({exc.code!r})"}
    except BaseException as exc:  # noqa: BLE001 — any exception of user code is a failed reward
        return {"failure": f"raised {type(exc).__name__}: {exc}"}
    return {"result": _jsonable(value)}


def _jsonable(value: Any) -> Any:
    """Tensors and arrays to lists; anything JSON cannot carry becomes a typed marker, so the
    parent can say what the reward returned."""
    if hasattr(value, "detach"):
        value = value.detach().cpu().reshape(-1).tolist()
    elif hasattr(value, "tolist"):
        value = value.tolist()
    if isinstance(value, (list, tuple)):
        return [_carried(v) for v in value]
    return _foreign(value)


def _carried(v: Any) -> Any:
    """One sample's value: a number, None (TRL: no reward applies), text (a tool's answer,
    rlctl.tool_turns), or verl's dict of a score and reported values (those that are not
    numbers or text travel as their repr)."""
    v = _scalar(v)
    if _plain_number(v) or v is None or isinstance(v, str):
        return v
    if isinstance(v, dict) and "__type__" not in v:
        return {str(k): x if _plain_number(x) or x is None or isinstance(x, str) else repr(x)[:60] for k, x in ((k, _scalar(x)) for k, x in v.items())}
    return _foreign(v)


def _scalar(v: Any) -> Any:
    """A one-element tensor or numpy scalar as the Python number it holds."""
    if hasattr(v, "item") and getattr(v, "ndim", None) == 0:
        return v.item()
    return v


def _foreign(v: Any) -> dict:
    return {"__type__": type(v).__name__, "repr": repr(v)[:60]}


def _plain_number(v: Any) -> bool:
    """What JSON carries as it is (NaN and ±inf included: the parent refuses them by name)."""
    return isinstance(v, (bool, int, float))


class ForeignValue:
    """A returned value JSON could not carry, as the parent sees it: its type name and repr."""

    def __init__(self, type_name: str, text: str) -> None:
        self.type_name, self.text = type_name, text

    def __repr__(self) -> str:
        return self.text


def from_jsonable(value: Any) -> Any:
    if isinstance(value, dict) and "__type__" in value:
        return ForeignValue(value["__type__"], value.get("repr", ""))
    if isinstance(value, list):
        return [from_jsonable(v) for v in value]
    return value


if __name__ == "__main__":
    _serve(int(sys.argv[1]), int(sys.argv[2]))
