"""The shipped examples run as a user would run them."""

import os
import subprocess
from pathlib import Path

import pytest

from rlctl import shards

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_stages_script_runs_two_iterations_and_the_pipe(tmp_path):
    env = {**os.environ, "WORK": str(tmp_path / "work")}
    result = subprocess.run(["bash", "examples/stages.sh"], cwd=ROOT, env=env, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-2000:]
    work = tmp_path / "work"
    for it in (1, 2):
        for stage in ("rollout", "score", "advantage", "update", "weights"):
            assert (work / f"iter-{it}" / stage / "_manifest.json").exists()
    assert shards.read(str(work / "iter-2" / "rollout")).table.column("policy_version").to_pylist()[0] == 1
    assert shards.read(str(work / "piped" / "advantage"), "batch").table.num_rows == 48
