"""Checkpoints and run folders can be received from someone else: nothing in them runs code,
every file is verified on load, and no update is committed from a step that went wrong."""

import json
import os
import pickle
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pyarrow as pa
import pytest

from rlctl import shards
from rlctl.manifest import MANIFEST_NAME, Manifest
from tests.conftest import assert_not_written, one_line_error
from tests.e2e.test_pipeline import write_config


class Payload:
    """Unpickling this creates MARKER: the proof that a pickle ran code."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


@pytest.fixture
def batch(tmp_path, tiny_model, cli, prompts_file) -> str:
    out = tmp_path / "batch"
    for args in (
        ["rollout", "--prompts", prompts_file, "--model", tiny_model, "--out", tmp_path / "r", "--n", "2", "--max-new-tokens", "4"],
        ["score", "--rollouts", tmp_path / "r", "--out", tmp_path / "s", "--reward", "builtin:length"],
        ["advantage", "--scores", tmp_path / "s", "--out", out, "--estimator", "grpo"],
    ):
        result = cli(*args)
        assert result.exit_code == 0, result.stderr
    return str(out)


@pytest.fixture
def checkpoint(tmp_path, tiny_model, cli, batch) -> Path:
    result = cli("update", "--batch", batch, "--model", tiny_model, "--out", tmp_path / "ckpt", "--lr", "1e-3")
    assert result.exit_code == 0, result.stderr
    return tmp_path / "ckpt"


def test_a_checkpoint_lists_every_file_and_its_trainer_state_has_no_pickle(checkpoint):
    manifest = json.loads((checkpoint / MANIFEST_NAME).read_text())
    listed = {f["path"] for f in manifest["files"]}
    on_disk = {str(p.relative_to(checkpoint)) for p in checkpoint.rglob("*") if p.is_file() and p.name != MANIFEST_NAME}
    assert listed == on_disk
    assert {"model.safetensors", "config.json", "trainer_state/state.json", "trainer_state/optimizer.safetensors", "trainer_state/rng.safetensors"} <= listed
    assert not list(checkpoint.rglob("*.pt")) and not list(checkpoint.rglob("*.bin"))


def test_a_pickle_in_trainer_state_never_runs(tmp_path, tiny_model, cli, batch):
    marker = tmp_path / "pwned"
    model = tmp_path / "received"
    shutil.copytree(tiny_model, model)  # a plain model folder someone sent, with a crafted trainer state
    (model / "trainer_state").mkdir()
    (model / "trainer_state" / "state.json").write_text(json.dumps({"format": "rlctl-trainer-state", "version": 1, "step": 3, "optimizers": {}}))
    (model / "trainer_state" / "optimizer.pt").write_bytes(pickle.dumps(Payload(marker)))
    result = cli("update", "--batch", batch, "--model", model, "--out", tmp_path / "out")
    assert result.exit_code == 2
    assert "a pickle file; rlctl never loads pickle" in one_line_error(result)
    assert not marker.exists()
    assert_not_written(tmp_path / "out")


def test_a_file_planted_in_a_committed_checkpoint_is_refused(tmp_path, cli, batch, checkpoint):
    marker = tmp_path / "pwned"
    (checkpoint / "trainer_state" / "optimizer.pt").write_bytes(pickle.dumps(Payload(marker)))
    result = cli("update", "--batch", batch, "--model", checkpoint, "--out", tmp_path / "next")
    assert result.exit_code == 2 and "'trainer_state/optimizer.pt', which its manifest does not list" in one_line_error(result)
    assert not marker.exists()


@pytest.mark.parametrize("victim", ["model.safetensors", "trainer_state/optimizer.safetensors", "config.json"])
def test_a_changed_checkpoint_file_is_refused_by_every_loader(tmp_path, cli, prompts_file, batch, checkpoint, victim):
    path = checkpoint / victim
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))
    for args in (
        ["rollout", "--prompts", prompts_file, "--model", checkpoint, "--out", tmp_path / "r2"],
        ["update", "--batch", batch, "--model", checkpoint, "--out", tmp_path / "u2"],
        ["reshard", "--checkpoint", checkpoint, "--out", tmp_path / "w2"],
        ["score", "--rollouts", tmp_path / "r", "--out", tmp_path / "s2", "--reward", "builtin:length", "--ref", checkpoint],
    ):
        result = cli(*args)
        assert result.exit_code == 2, (args[0], result.stderr)
        assert f"{victim} does not match its manifest" in one_line_error(result)


def test_update_in_place_is_refused(tmp_path, cli, batch, checkpoint):
    before = (checkpoint / MANIFEST_NAME).read_bytes()
    result = cli("update", "--batch", batch, "--model", checkpoint, "--out", checkpoint)
    assert result.exit_code == 2 and "is the --model folder" in one_line_error(result)
    assert (checkpoint / MANIFEST_NAME).read_bytes() == before


def test_update_into_a_folder_rlctl_did_not_make_is_refused(tmp_path, cli, batch, tiny_model):
    target = tmp_path / "home"
    target.mkdir()
    (target / "thesis.tex").write_text("\\documentclass{article}")
    result = cli("update", "--batch", batch, "--model", tiny_model, "--out", target)
    assert result.exit_code == 2 and "not an rlctl output folder: it holds 'thesis.tex'" in one_line_error(result)
    assert sorted(p.name for p in target.iterdir()) == ["thesis.tex"]


def test_a_step_with_a_non_finite_gradient_is_never_committed_silently(tmp_path, cli, batch, tiny_model):
    table = shards.read(batch).table
    huge = pa.array([[3.0e38] * len(r) for r in table.column("response_ids").to_pylist()], pa.list_(pa.float32()))
    exploding = str(tmp_path / "exploding")
    shards.write(table.set_column(table.column_names.index("advantages"), "advantages", huge), exploding, Manifest(stage="advantage"), schema="batch")
    result = cli("update", "--batch", exploding, "--model", tiny_model, "--out", tmp_path / "out")
    assert result.exit_code == 1 and "non-finite gradient norm and were skipped; nothing is committed" in one_line_error(result)
    assert_not_written(tmp_path / "out")
    allowed = cli("update", "--batch", exploding, "--model", tiny_model, "--out", tmp_path / "out", "--set", "update.allow_skipped_steps=true", "--json")
    assert allowed.exit_code == 0, allowed.stderr
    assert json.loads(allowed.stdout)["metrics"]["skipped_steps"] == 1


def test_an_up_to_date_output_that_was_damaged_is_recomputed(tmp_path, cli, batch):
    scores = str(tmp_path / "s")
    part = tmp_path / "batch" / json.loads((tmp_path / "batch" / MANIFEST_NAME).read_text())["files"][0]["path"]
    part.write_bytes(part.read_bytes()[:-16] + b"\0" * 16)
    again = cli("advantage", "--scores", scores, "--out", tmp_path / "batch", "--estimator", "grpo")
    assert again.exit_code == 0 and "up to date but damaged" in again.stderr
    assert shards.read(str(tmp_path / "batch")).table.num_rows == 6


HOLD = """
import sys, time
from rlctl.locks import FolderLock
from rlctl.shards import filesystem
fs, path = filesystem(sys.argv[1])
lock = FolderLock.acquire(fs, path, what="pipeline run")
print("held", flush=True)
time.sleep(60)
"""


def test_two_pipelines_on_one_run_folder_do_not_both_run(tmp_path, tiny_model, cli):
    run = tmp_path / "run"
    run.mkdir()
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(run)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        result = cli("pipeline", write_config(tmp_path, tiny_model, pipeline={"iterations": 1}), "--run-dir", run, "--quiet")
        assert result.exit_code == 2
        assert f"pipeline run is being written by pid {holder.pid}" in one_line_error(result)
        assert not (run / "iter-0001").exists()
    finally:
        holder.kill()
        holder.wait()
    result = cli("pipeline", write_config(tmp_path, tiny_model, pipeline={"iterations": 1, "val_every": 0}), "--run-dir", run, "--quiet")
    assert result.exit_code == 0, result.stderr  # the holder died: its lock is stale
    assert (run / "iter-0001" / "update" / MANIFEST_NAME).exists() and not (run / "_lock.json").exists()


REWARD = """
from pathlib import Path
Path(__file__).with_name("reward-was-imported").touch()

def reward(responses):
    return [len(r) / 10 for r in responses]
"""


def test_replay_asks_before_running_reward_code_from_a_run_folder(tmp_path, tiny_model, cli):
    reward = tmp_path / "their_reward.py"
    reward.write_text(textwrap.dedent(REWARD))
    config = write_config(tmp_path, tiny_model, score={"reward": f"{reward}:reward"}, pipeline={"iterations": 1, "val_every": 0})
    assert cli("pipeline", config, "--run-dir", tmp_path / "run", "--quiet").exit_code == 0
    imported = tmp_path / "reward-was-imported"
    imported.unlink()
    stage = tmp_path / "run" / "iter-0001" / "score"

    refused = cli("replay", stage, "--check")
    assert refused.exit_code == 2 and "--trust-run-code" in one_line_error(refused) and str(reward) in refused.stderr
    assert not imported.exists()
    chosen = cli("replay", stage, "--reward", "builtin:length", "--out", tmp_path / "what-if")
    assert chosen.exit_code == 0, chosen.stderr
    assert not imported.exists()
    trusted = cli("replay", stage, "--check", "--trust-run-code")
    assert trusted.exit_code == 0 and trusted.stdout.strip() == "identical", trusted.stderr
    assert imported.exists()
