"""MKL's Intel kernels on x86 CPUs of other vendors (AMD Zen 2 to Zen 5).

torch's x86 build does its fp32 GEMMs in MKL, and MKL picks its kernels by CPU vendor: on a
CPU that is not Intel it runs a slower generic path (AVX2 at most). Measured on a 2-core Zen 3
(AVX2 + FMA, no AVX-512, no native bf16: rlctl trains in fp32 there): with MKL's Intel AVX2
kernels a 2048³ GEMM runs at ~128 instead of ~98 GFLOP/s, the small preset's 64-row GEMMs
15–35% faster, and the work of one GRPO iteration takes 10–17% less. On a 2-core Zen 5
(AVX-512) MKL then runs its AVX-512 kernels (2048³: ~430 instead of ~200 GFLOP/s), and an fp32
iteration of the TRL harness's work takes ~26% less than with oneDNN computing the products,
which rlctl did there before (update −37%); bf16 runs in oneDNN either way (bench/RESULTS.md,
"MKL's Intel kernels", "MKL's AVX-512 kernels on an AMD CPU with AVX-512").

MKL asks one exported function, `mkl_serv_intel_cpu_true`, whether the CPU is an Intel one.
A one-line library that defines it to answer yes, loaded with RTLD_GLOBAL before torch is,
comes first in the dynamic linker's search, and MKL then chooses its kernels from the CPU's
feature flags as it does on Intel CPUs (the CPU has every instruction they use).
The library is compiled from `SOURCE` with the system's C compiler once, into rlctl's cache;
without a compiler MKL keeps its own choice (and rlctl.cpu_linear moves fp32 products to
oneDNN where the CPU has AVX-512), and everything still works.

Where: the CLI (`rlctl.cli.main`) and rlctl's Ray workers call `enable()` before they import
torch (`rlctl.process_setup`); a Python program using rlctl as a library may call it first
thing. On Intel CPUs, on x86 CPUs without AVX2, off x86 and on GPUs nothing changes.
`RLCTL_MKL_KERNELS=auto|intel|default` overrides: `intel` on any non-Intel x86 CPU, `default`
never. Results are fp32 either way (other kernels: other summation orders, within ~1e-6), and
a pipeline records the choice in each stage's manifest (`mkl_kernels`).
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from rlctl.dtypes import cpu_flags, cpuinfo_text
from rlctl.errors import InputError

OVERRIDE_ENV = "RLCTL_MKL_KERNELS"
MODES = ("auto", "intel", "default")
SOURCE = "/* rlctl: MKL asks this whether the CPU is an Intel one; answering yes selects its kernels by feature flags. */\nint mkl_serv_intel_cpu_true(void) { return 1; }\n"
COMPILE_SECONDS = 60

# what enable() decided in this process: None (not asked yet) or one of these
INTEL = "intel"  # the library is loaded: MKL runs its Intel kernels
DEFAULT = "default"  # not wanted on this CPU (or RLCTL_MKL_KERNELS=default): MKL's own choice
NO_COMPILER = "no-compiler"  # wanted, but no C compiler to build the library
BUILD_FAILED = "build-failed"  # wanted, but the compiler or the load failed
TOO_LATE = "too-late"  # wanted, but torch was imported first (MKL's choice is made by then)
_state: str | None = None


def is_non_intel_x86(cpuinfo: str) -> bool:
    """An x86 CPU (its /proc/cpuinfo names a vendor) of another vendor than Intel."""
    vendors = _vendors(cpuinfo)
    return bool(vendors) and "GenuineIntel" not in vendors


def is_intel(cpuinfo: str) -> bool:
    """An Intel CPU (its /proc/cpuinfo names the vendor GenuineIntel)."""
    return "GenuineIntel" in _vendors(cpuinfo)


def _vendors(cpuinfo: str) -> set[str]:
    return {value.strip() for name, _, value in (line.partition(":") for line in cpuinfo.splitlines()) if name.strip() == "vendor_id"}


def is_avx2_only(cpuinfo: str) -> bool:
    """A non-Intel x86 CPU with AVX2 and without AVX-512 (Zen 2, Zen 3)."""
    flags = cpu_flags(cpuinfo)
    return is_non_intel_x86(cpuinfo) and "avx2" in flags and "avx512f" not in flags


def requested_mode(environ: dict | None = None) -> str:
    """RLCTL_MKL_KERNELS, checked: one of MODES ("auto" when unset)."""
    env = os.environ if environ is None else environ
    mode = env.get(OVERRIDE_ENV, "auto").strip().lower() or "auto"
    if mode not in MODES:
        raise InputError(f"{OVERRIDE_ENV}={env[OVERRIDE_ENV]!r}: use one of {', '.join(MODES)}")
    return mode


def is_non_intel_with_avx2(cpuinfo: str) -> bool:
    """A non-Intel x86 CPU with AVX2 (with or without AVX-512: Zen 2 to Zen 5)."""
    return is_non_intel_x86(cpuinfo) and "avx2" in cpu_flags(cpuinfo)


def wanted(cpuinfo: str, mode: str) -> bool:
    """Whether MKL should run its Intel kernels on this CPU: measured faster on AMD CPUs with
    AVX2 only (Zen 3) and with AVX-512 (Zen 5) ("auto"); on any non-Intel x86 CPU when asked
    ("intel")."""
    if mode == "default":
        return False
    return is_non_intel_x86(cpuinfo) if mode == "intel" else is_non_intel_with_avx2(cpuinfo)


def cache_dir(environ: dict | None = None) -> Path:
    """Where the compiled library is kept: $XDG_CACHE_HOME/rlctl (~/.cache/rlctl)."""
    env = os.environ if environ is None else environ
    return Path(env.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "rlctl"


def library_path(directory: Path) -> Path:
    """The library's file, named by its source's digest (a changed source builds anew)."""
    return directory / f"mkl-intel-cpu-{hashlib.sha256(SOURCE.encode()).hexdigest()[:16]}.so"


def find_compiler(environ: dict | None = None) -> str | None:
    """$CC where set and found, else cc, gcc or clang on the PATH."""
    env = os.environ if environ is None else environ
    for name in ([env["CC"]] if env.get("CC") else []) + ["cc", "gcc", "clang"]:
        found = shutil.which(name)
        if found:
            return found
    return None


def build(directory: Path, compiler: str | None) -> Path | None:
    """The library in `directory`, compiled now unless it is there already; None when the
    compiler fails (or there is none and no library yet). Written under a temporary name and
    renamed: processes building it at the same moment (Ray workers) never load a half-written
    file."""
    target = library_path(directory)
    if target.is_file():
        return target
    if compiler is None:
        return None
    try:
        directory.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=directory, prefix=".build-") as tmp:
            source, output = Path(tmp) / "mkl_intel_cpu.c", Path(tmp) / "out.so"
            source.write_text(SOURCE)
            done = subprocess.run([compiler, "-shared", "-fPIC", "-O2", "-o", str(output), str(source)], capture_output=True, timeout=COMPILE_SECONDS, check=False)
            if done.returncode != 0 or not output.is_file():
                return None
            os.replace(output, target)
    except (OSError, subprocess.TimeoutExpired):  # an unwritable cache, a compiler that hangs: MKL keeps its choice
        return None
    return target


def enable(environ: dict | None = None, cpuinfo: str | None = None) -> str:
    """Load the library where this CPU (`cpuinfo`: /proc/cpuinfo's text) wants MKL's Intel
    kernels (see the module's docstring); must run before torch is imported. Returns what was
    decided (INTEL, DEFAULT, NO_COMPILER, BUILD_FAILED or TOO_LATE), also kept for `state()`;
    a second call returns the first's."""
    global _state
    if _state is not None:
        return _state
    env = os.environ if environ is None else environ
    if not wanted(cpuinfo_text() if cpuinfo is None else cpuinfo, requested_mode(env)):
        _state = DEFAULT
    elif "torch" in sys.modules:
        _state = TOO_LATE
    else:
        compiler = find_compiler(env)
        library = build(cache_dir(env), compiler)  # a library built before needs no compiler
        if library is None:
            _state = NO_COMPILER if compiler is None else BUILD_FAILED
        else:
            _state = INTEL if _load(library) else BUILD_FAILED
    return _state


def _load(library: Path) -> bool:
    try:
        ctypes.CDLL(str(library), mode=os.RTLD_GLOBAL | os.RTLD_NOW)
    except OSError:
        return False
    return True


def state() -> str | None:
    """What `enable()` decided in this process; None if it was not called."""
    return _state


def active() -> bool:
    """Whether MKL runs its Intel kernels in this process (the library was loaded before torch)."""
    return _state == INTEL


def runs_intel_kernels(cpuinfo: str) -> bool:
    """Whether MKL computes with its Intel kernels in this process: on an Intel CPU by its own
    choice, on another vendor's x86 CPU where the library was loaded (`active`)."""
    return active() or is_intel(cpuinfo)


def recorded() -> str:
    """The word a manifest records: "intel" when MKL runs its Intel kernels, else "default"."""
    return INTEL if active() else DEFAULT
