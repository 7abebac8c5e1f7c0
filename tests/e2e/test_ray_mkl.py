"""Ray worker processes choose MKL's kernels (rlctl.mkl_kernels) before they load torch, as
the CLI does: the job's setup hook runs in every worker process of a Ray rlctl starts."""

import os

import pytest

from rlctl import mkl_kernels
from rlctl.config import WorkersConfig

pytest.importorskip("ray")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")


def test_every_worker_process_chooses_mkl_kernels_before_torch_loads():
    import ray

    from rlctl.workers.ray import start_ray

    if ray.is_initialized():
        ray.shutdown()
    assert start_ray(WorkersConfig(backend="ray", num_workers=1))
    try:

        @ray.remote
        def chosen() -> tuple[str | None, bool]:
            from rlctl import mkl_kernels as in_worker

            return in_worker.state(), in_worker.wanted(in_worker.cpuinfo_text(), in_worker.requested_mode()) and in_worker.find_compiler() is not None

        state, can = ray.get(chosen.remote())
    finally:
        ray.shutdown()
    assert state not in (None, mkl_kernels.TOO_LATE)  # the hook ran, before torch
    assert (state == mkl_kernels.INTEL) == can
