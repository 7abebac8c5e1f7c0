"""One writer at a time per output folder (and per pipeline run folder): `_lock.json`.

The lock is a file created exclusively (`open(..., "xb")`: O_EXCL on a local disk, a
conditional PUT with `If-None-Match: *` on S3-compatible stores) that names its holder: host,
pid, the process's start time, the command and when it started. A second writer fails with
exit 2 and that name. A lock is stale, and is taken over, when its holder is gone: on the same
host, the pid is not running (or is a newer process that reused the pid); from another host,
it is older than `RLCTL_LOCK_STALE_SECONDS` (default 6 hours). Breaking a stale lock is
best-effort: two writers that both find the same stale lock at the same instant can race.

    with FolderLock.acquire(fs, "runs/x/iter-0001/rollout", what="output"):
        ...  # write, commit
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import sys
import time
from dataclasses import dataclass

import fsspec

from rlctl.errors import InputError
from rlctl.manifest import LOCK_NAME

STALE_ENV = "RLCTL_LOCK_STALE_SECONDS"
DEFAULT_STALE_SECONDS = 6 * 3600


class LockedError(InputError):
    """Another live process holds the folder's lock (exit code 2)."""


@dataclass
class FolderLock:
    fs: fsspec.AbstractFileSystem
    path: str  # the lock file
    owner: dict
    broke_stale: dict | None  # the holder of a stale lock this one replaced

    @classmethod
    def acquire(cls, fs: fsspec.AbstractFileSystem, folder: str, *, what: str, write_id: str = "") -> FolderLock:
        lock_path = folder.rstrip("/") + "/" + LOCK_NAME
        owner = _me(write_id)
        broke = None
        for _ in range(3):
            try:
                with fs.open(lock_path, "xb") as f:
                    f.write(json.dumps(owner, sort_keys=True).encode())
                return cls(fs, lock_path, owner, broke)
            except FileExistsError:
                holder = read_holder(fs, lock_path)
                if holder is None:
                    continue  # released between our create and our read
                if not is_stale(holder):
                    raise LockedError(f"{folder}: {what} is being written by {describe(holder)}; "
                                      f"wait for it, or remove {lock_path} if that process is gone") from None
                _remove(fs, lock_path)
                broke = holder
        raise LockedError(f"{folder}: could not take the {what} lock ({lock_path} keeps reappearing)")

    def release(self) -> None:
        holder = read_holder(self.fs, self.path)
        if holder is not None and holder.get("token") == self.owner["token"]:
            _remove(self.fs, self.path)

    def __enter__(self) -> FolderLock:
        return self

    def __exit__(self, *exc) -> None:
        self.release()


def is_stale(holder: dict) -> bool:
    if holder.get("host") == socket.gethostname():
        pid = holder.get("pid")
        if not isinstance(pid, int) or not _alive(pid):
            return True
        recorded, current = holder.get("started_process"), _process_start(pid)
        return recorded is not None and current is not None and current != recorded  # pid reused
    limit = float(os.environ.get(STALE_ENV, DEFAULT_STALE_SECONDS))
    try:
        return time.time() - float(holder.get("time", 0)) > limit
    except (TypeError, ValueError):
        return True


def describe(holder: dict) -> str:
    command = holder.get("command", "")
    return f"pid {holder.get('pid')} on {holder.get('host')} since {time.strftime('%H:%M:%S', time.localtime(float(holder.get('time', 0))))}" + (
        f" ({command})" if command else ""
    )


def _me(write_id: str) -> dict:
    pid = os.getpid()
    return {
        "host": socket.gethostname(),
        "pid": pid,
        "started_process": _process_start(pid),
        "time": time.time(),
        "command": " ".join(os.path.basename(a) if i == 0 else a for i, a in enumerate(sys.argv))[:200],
        "write_id": write_id,
        "token": os.urandom(8).hex(),
    }


def read_holder(fs: fsspec.AbstractFileSystem, lock_path: str) -> dict | None:
    """The lock file's holder (who, where, since when); None where there is no lock, {} where
    it cannot be read (no host, no time: stale)."""
    try:
        raw = fs.cat_file(lock_path)
    except FileNotFoundError:
        return None
    try:
        holder = json.loads(raw)
        return holder if isinstance(holder, dict) else {}
    except ValueError:
        return {}  # unreadable: no host, no time, so stale


def _remove(fs: fsspec.AbstractFileSystem, lock_path: str) -> None:
    with contextlib.suppress(FileNotFoundError):  # released meanwhile
        fs.rm(lock_path)
    fs.invalidate_cache(lock_path)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _process_start(pid: int) -> int | None:
    """The process's start time in clock ticks since boot (Linux), to tell a reused pid."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
        return int(fields[19])
    except (OSError, IndexError, ValueError):
        return None
