"""MKL's Intel kernels on AMD CPUs with AVX2: wanted only there (or where asked), a one-line
library compiled once into the cache and loaded before torch, MKL's kernel choice changed by
it in a fresh process, the same GEMM results to fp32 rounding, and every way it cannot apply
(no compiler, a failing one, torch already loaded) leaving MKL's own choice."""

from __future__ import annotations

import ctypes
import json
import os
import subprocess
import sys

import pytest

from rlctl import mkl_kernels
from rlctl.dtypes import cpuinfo_text
from rlctl.errors import InputError
from rlctl.manifest import Manifest
from tests.unit.test_cpu_linear import AMD_ZEN3, AMD_ZEN5, GRAVITON3, INTEL_XEON

has_compiler = pytest.mark.skipif(mkl_kernels.find_compiler() is None, reason="no C compiler on this machine")
non_intel_x86 = pytest.mark.skipif(not mkl_kernels.is_non_intel_x86(cpuinfo_text()), reason="MKL runs its Intel kernels here already (or there is no MKL)")


def test_intel_kernels_are_wanted_by_default_on_non_intel_x86_cpus_with_avx2():
    assert mkl_kernels.wanted(AMD_ZEN3, "auto")  # measured: GEMMs 15–35% faster, an iteration 10–17% less
    assert mkl_kernels.wanted(AMD_ZEN5, "auto")  # measured: its AVX-512 kernels, an fp32 iteration ~26% less than oneDNN's
    assert not mkl_kernels.wanted(AMD_ZEN3.replace(" avx2", ""), "auto")  # no AVX2: nothing measured
    assert not mkl_kernels.wanted(INTEL_XEON, "auto")  # MKL's own kernels there already
    assert not mkl_kernels.wanted(GRAVITON3, "auto") and not mkl_kernels.wanted("", "auto")


def test_the_override_asks_for_them_on_any_non_intel_x86_cpu_or_never():
    assert mkl_kernels.wanted(AMD_ZEN5, "intel")
    assert not mkl_kernels.wanted(GRAVITON3, "intel") and not mkl_kernels.wanted(INTEL_XEON, "intel")
    assert not mkl_kernels.wanted(AMD_ZEN3, "default")


def test_mkl_runs_its_intel_kernels_on_intel_cpus_or_where_the_library_is_loaded(monkeypatch):
    assert mkl_kernels.runs_intel_kernels(INTEL_XEON)
    monkeypatch.setattr(mkl_kernels, "_state", mkl_kernels.DEFAULT)
    assert not mkl_kernels.runs_intel_kernels(AMD_ZEN3) and not mkl_kernels.runs_intel_kernels(GRAVITON3)
    monkeypatch.setattr(mkl_kernels, "_state", mkl_kernels.INTEL)
    assert mkl_kernels.runs_intel_kernels(AMD_ZEN3)


def test_a_bad_override_is_refused_with_the_choices():
    assert mkl_kernels.requested_mode({}) == "auto"
    assert mkl_kernels.requested_mode({"RLCTL_MKL_KERNELS": " Intel "}) == "intel"
    with pytest.raises(InputError, match="RLCTL_MKL_KERNELS='fast': use one of auto, intel, default"):
        mkl_kernels.requested_mode({"RLCTL_MKL_KERNELS": "fast"})


@has_compiler
def test_the_library_is_compiled_once_into_the_cache(tmp_path):
    library = mkl_kernels.build(tmp_path, mkl_kernels.find_compiler())
    assert library == mkl_kernels.library_path(tmp_path) and library.is_file()
    built = library.stat().st_mtime_ns
    assert mkl_kernels.build(tmp_path, "/nonexistent/cc") == library  # there already: no compiler needed
    assert library.stat().st_mtime_ns == built
    assert ctypes.CDLL(str(library)).mkl_serv_intel_cpu_true() == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == [library.name]  # no build folder left behind


def test_a_failing_compiler_leaves_nothing_and_mkl_its_own_choice(tmp_path, monkeypatch):
    assert mkl_kernels.build(tmp_path, "false") is None
    assert list(tmp_path.iterdir()) == []
    monkeypatch.setattr(mkl_kernels, "_state", None)
    monkeypatch.delitem(sys.modules, "torch")  # as before torch is imported; nothing is loaded here
    env = {"CC": "false", "XDG_CACHE_HOME": str(tmp_path)}
    assert mkl_kernels.enable(env, cpuinfo=AMD_ZEN3) == mkl_kernels.BUILD_FAILED
    assert not mkl_kernels.active() and mkl_kernels.recorded() == "default"


def test_no_compiler_leaves_mkl_its_own_choice(tmp_path, monkeypatch):
    monkeypatch.setattr(mkl_kernels, "_state", None)
    monkeypatch.setattr(mkl_kernels, "find_compiler", lambda environ=None: None)
    monkeypatch.delitem(sys.modules, "torch")
    assert mkl_kernels.enable({"XDG_CACHE_HOME": str(tmp_path)}, cpuinfo=AMD_ZEN3) == mkl_kernels.NO_COMPILER
    assert list(tmp_path.iterdir()) == []


def test_after_torch_is_loaded_it_is_too_late_and_says_so(monkeypatch, tmp_path):
    monkeypatch.setattr(mkl_kernels, "_state", None)
    assert "torch" in sys.modules  # this test process has it
    assert mkl_kernels.enable({"XDG_CACHE_HOME": str(tmp_path)}, cpuinfo=AMD_ZEN3) == mkl_kernels.TOO_LATE
    assert mkl_kernels.enable({}, cpuinfo=INTEL_XEON) == mkl_kernels.TOO_LATE  # decided once per process
    monkeypatch.setattr(mkl_kernels, "_state", None)
    assert mkl_kernels.enable({}, cpuinfo=INTEL_XEON) == mkl_kernels.DEFAULT


PROBE = """
import ctypes, json, os, sys
from rlctl import mkl_kernels
state = mkl_kernels.enable()
import torch
lib = ctypes.CDLL(os.path.join(os.path.dirname(torch.__file__), "lib", "libtorch_cpu.so"))
torch.manual_seed(0)
a, b = torch.randn(64, 512), torch.randn(1408, 512)
print(json.dumps({"state": state, "mkl_cpu_type": lib.mkl_serv_cpu_detect(), "product": torch.nn.functional.linear(a, b).tolist()}))
"""


def _probe(mode: str, cache) -> dict:
    env = {**os.environ, "RLCTL_MKL_KERNELS": mode, "XDG_CACHE_HOME": str(cache)}
    done = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, check=True)
    return json.loads(done.stdout)


@has_compiler
@non_intel_x86
def test_in_a_fresh_process_mkl_then_runs_its_intel_kernels_to_the_same_results(tmp_path):
    import torch

    stock, intel = _probe("default", tmp_path), _probe("intel", tmp_path)
    assert (stock["state"], intel["state"]) == ("default", "intel")
    assert intel["mkl_cpu_type"] != stock["mkl_cpu_type"]  # MKL's dispatch: another code path
    assert torch.allclose(torch.tensor(intel["product"]), torch.tensor(stock["product"]), rtol=1e-5, atol=1e-4)


def test_the_cli_refuses_a_bad_override_in_one_line():
    env = {**os.environ, "RLCTL_MKL_KERNELS": "fast"}
    done = subprocess.run([sys.executable, "-m", "rlctl", "--help"], env=env, capture_output=True, text=True)
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr.strip().splitlines() == ["rlctl: error: RLCTL_MKL_KERNELS='fast': use one of auto, intel, default"]


def test_replay_says_when_the_stage_ran_on_other_kernels():
    from rlctl.replay import _kernels_note

    now = mkl_kernels.recorded()
    other = "intel" if now == "default" else "default"
    assert _kernels_note(Manifest(stage="rollout", state={"mkl_kernels": now})) == ""
    assert _kernels_note(Manifest(stage="rollout", state={})) == ""  # recorded before rlctl chose kernels
    note = _kernels_note(Manifest(stage="rollout", state={"mkl_kernels": other}))
    assert f"recorded with MKL's {other} kernels" in note and f"RLCTL_MKL_KERNELS={other}" in note


def test_an_unwritable_cache_leaves_mkl_its_own_choice(tmp_path):
    blocked = tmp_path / "file"
    blocked.write_text("not a folder")
    assert mkl_kernels.build(blocked / "rlctl", "cc") is None


@non_intel_x86
def test_verbose_says_which_kernels_run_and_if_not_why(tmp_path):
    def said(**env) -> str:
        run_env = {**os.environ, "RLCTL_MKL_KERNELS": "intel", "XDG_CACHE_HOME": str(tmp_path), **env}
        done = subprocess.run([sys.executable, "-m", "rlctl", "--verbose", "config", "--help"], env=run_env, capture_output=True, text=True, check=True)
        return done.stderr

    assert said(CC="false") == "rlctl: MKL runs its generic kernels on this CPU, not its faster Intel ones: the C compiler could not build rlctl's library\n"
    assert said(RLCTL_MKL_KERNELS="default") == ""
    if mkl_kernels.find_compiler() is not None:
        assert said() == "rlctl: MKL runs its Intel kernels on this CPU (RLCTL_MKL_KERNELS=default: its own choice)\n"


@has_compiler
def test_a_library_built_before_is_loaded_without_a_compiler(tmp_path, monkeypatch):
    mkl_kernels.build(tmp_path / "rlctl", mkl_kernels.find_compiler())
    monkeypatch.setattr(mkl_kernels, "_state", None)
    monkeypatch.setattr(mkl_kernels, "find_compiler", lambda environ=None: None)
    monkeypatch.delitem(sys.modules, "torch")  # (loaded after torch here, so MKL's choice in this process stays as it was)
    assert mkl_kernels.enable({"XDG_CACHE_HOME": str(tmp_path)}, cpuinfo=AMD_ZEN3) == mkl_kernels.INTEL
