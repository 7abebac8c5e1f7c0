"""Joining a Ray cluster started with `ray start --head` (the multi-machine path, on one machine)."""

import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from tests.e2e.test_pipeline import rlctl, write_config

pytest.importorskip("ray")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_a_pipeline_joins_an_existing_cluster_by_address(tmp_path, tiny_model):
    ray_cli = shutil.which("ray", path=str(Path(sys.executable).parent)) or "ray"
    env = {**os.environ, "RAY_AUTH_MODE": "disabled"}
    port = free_port()
    started = subprocess.run(
        [ray_cli, "start", "--head", f"--port={port}", "--node-ip-address=127.0.0.1", "--num-cpus=2", "--include-dashboard=false", "--disable-usage-stats"],
        capture_output=True, text=True, env=env, timeout=120,
    )
    assert started.returncode == 0, started.stderr[-2000:]
    try:
        config = write_config(tmp_path, tiny_model, pipeline={"iterations": 2, "val_every": 0})
        rlctl("pipeline", config, "--run-dir", tmp_path / "run", "--quiet", "--workers-backend", "ray", "--workers", "2", "--address", f"127.0.0.1:{port}", env=env)
        rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
        assert [r["iteration"] for r in rows] == [1, 2]
        handover = json.loads((tmp_path / "run" / "iter-0002" / "update" / "_manifest.json").read_text())["state"]["handover"]
        assert handover["workers"] == 2
        status = subprocess.run([ray_cli, "status", f"--address=127.0.0.1:{port}"], capture_output=True, text=True, env=env, timeout=60)
        assert status.returncode == 0  # the cluster outlives the command that joined it
    finally:
        subprocess.run([ray_cli, "stop", "--force"], capture_output=True, env=env, timeout=120)
