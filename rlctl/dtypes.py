"""What "auto" means for a compute dtype: bf16 where the hardware runs it natively, else fp32.

bf16 pays only where the matmuls are native: on a Zen 5 (avx512_bf16) a bf16 matmul is about
4× an fp32 one, on an Intel Xeon without it about 8× slower (emulated), and on Ampere and later
GPUs it is the normal training dtype. So `rollout.dtype`, `score.dtype` and `update.bf16`
default to "auto" and this module decides, from the CPU flags or the GPU's capability, once
per process. `RLCTL_NATIVE_BF16=0|1` overrides the detection (benchmarks, tests, a CPU whose
flags are hidden by a hypervisor).
"""

from __future__ import annotations

import functools
import os
from pathlib import Path

AUTO = "auto"
# x86: AVX-512 BF16 (Zen 4+, Cooper Lake, Sapphire Rapids) or AMX; Arm: the BF16 extension
NATIVE_BF16_CPU_FLAGS = frozenset({"avx512_bf16", "amx_bf16", "bf16"})
OVERRIDE_ENV = "RLCTL_NATIVE_BF16"


def cpu_flags(cpuinfo: str) -> set[str]:
    """The feature flags of /proc/cpuinfo's text (x86 `flags`, Arm `Features`)."""
    flags: set[str] = set()
    for line in cpuinfo.splitlines():
        name, _, value = line.partition(":")
        if name.strip() in ("flags", "Features"):
            flags.update(value.split())
    return flags


@functools.cache
def cpuinfo_text() -> str:
    """/proc/cpuinfo, or "" where there is none."""
    try:
        return Path("/proc/cpuinfo").read_text(encoding="utf-8", errors="replace")
    except OSError:
        return ""


def _cpu_has_native_bf16() -> bool:
    return bool(cpu_flags(cpuinfo_text()) & NATIVE_BF16_CPU_FLAGS)


def native_bf16(device: str) -> bool:
    """Does `device` ("cpu", "cuda", "cuda:1") compute in bf16 natively? A CUDA device this
    process cannot see (Ray workers' GPUs seen from a CPU-only controller) counts as Ampere or
    later, the GPUs rlctl's distributed path is written for."""
    override = os.environ.get(OVERRIDE_ENV, "").strip()
    if override in ("0", "1"):
        return override == "1"
    if device.startswith("cuda"):
        import torch

        if not torch.cuda.is_available():
            return True
        return bool(torch.cuda.is_bf16_supported(including_emulation=False))
    return _cpu_has_native_bf16()


def compute_dtype(value: str, device: str) -> str:
    """A compute dtype setting ("auto", "fp32", "bf16") as the one used on `device`."""
    if value != AUTO:
        return value
    return "bf16" if native_bf16(device) else "fp32"


def autocast_bf16(value: str, device: str) -> bool:
    """`update.bf16` ("auto", "true", "false") as whether training runs under bf16 autocast."""
    if value == AUTO:
        return native_bf16(device)
    return value == "true"


def decided_bf16(value: str, device: str) -> str:
    """`update.bf16` with "auto" decided, as the config spells it ("true" | "false")."""
    return "true" if autocast_bf16(value, device) else "false"


def models_device(device: str, workers=None) -> str:
    """Where a command's models compute: the Ray workers' GPUs or CPUs when it has workers,
    else `device` ("auto": CUDA when this process sees a GPU)."""
    if workers is not None and workers.backend == "ray":
        return "cuda" if workers.gpus_per_worker else "cpu"
    if device == "auto":
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"
    return device


def resolve_dtypes(cfg, recorded=None):
    """`cfg` with every "auto" dtype decided: as the run first decided it (`recorded`, the
    config a resumed run saved) or for this machine's hardware. What is decided is what the
    run's config and every stage manifest record."""
    from dataclasses import replace

    device = models_device(cfg.model.device, cfg.workers)

    def decided(section: str, key: str, decide):
        value = getattr(getattr(cfg, section), key)
        if value != AUTO:
            return value
        before = getattr(getattr(recorded, section), key) if recorded is not None else AUTO
        return before if before != AUTO else decide(value, device)

    return replace(
        cfg,
        rollout=replace(cfg.rollout, dtype=decided("rollout", "dtype", compute_dtype)),
        score=replace(cfg.score, dtype=decided("score", "dtype", compute_dtype)),
        update=replace(cfg.update, bf16=decided("update", "bf16", decided_bf16)),
    )
