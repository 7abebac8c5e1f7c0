"""`rlctl verify PATH`: an intact run verifies; a changed byte, a cut file, a file added to a
checkpoint, an output made from an input rewritten since are found and exit 1; half-written
writes and locks are named without failing; a path that is not there is exit 2."""

import json
import os
import shutil

import pytest

from rlctl import shards
from rlctl.pipeline import Pipeline
from tests.conftest import one_line_error, part_files
from tests.e2e.test_pipeline import write_config


@pytest.fixture(scope="module")
def run(tmp_path_factory, tiny_model):
    tmp = tmp_path_factory.mktemp("verified")
    config = write_config(tmp, tiny_model, model={"critic": ""}, advantage={"estimator": "grpo", "kl_coef": 0.0, "kl_controller": "fixed"},
                          pipeline={"iterations": 2, "val_every": 0})
    Pipeline.from_config(config, [f"pipeline.run_dir={tmp / 'run'}"]).run()
    return tmp / "run"


@pytest.fixture
def copy(run, tmp_path):
    target = tmp_path / "run"
    shutil.copytree(run, target)
    return target


def verdicts(cli, path, *flags) -> tuple[int, dict]:
    result = cli("verify", path, "--json", *flags)
    return result.exit_code, json.loads(result.stdout)


def test_an_intact_run_verifies_every_committed_folder(cli, run):
    code, report = verdicts(cli, run)
    assert code == 0
    folders = {f["folder"]: f for f in report["findings"]}
    expected = [f"iter-{i:04d}/{stage}" for i in (1, 2) for stage in ("prompts", "rollout", "score", "advantage", "update")] + ["checkpoints/iter-0002"]
    assert all(folders[name]["status"] == "ok" for name in expected)
    assert folders["checkpoints/iter-0002"]["stage"] == "checkpoint" and folders["checkpoints/iter-0002"]["files"] > 3
    assert report["counts"]["ok"] == sum(1 for f in report["findings"] if f["status"] == "ok") and report["digests"] is True
    said = cli("verify", run)
    assert said.exit_code == 0 and "damaged" not in said.stdout and f"{report['counts']['ok']} ok" in said.stdout


def test_a_changed_byte_is_damage_that_only_the_digests_see(cli, copy):
    part = part_files(copy / "iter-0002" / "score")[0]
    data = bytearray(part.read_bytes())
    data[len(data) // 2] ^= 0xFF
    part.write_bytes(bytes(data))
    code, report = verdicts(cli, copy)
    damaged = [f for f in report["findings"] if f["status"] == "damaged"]
    assert code == 1 and [f["folder"] for f in damaged] == ["iter-0002/score"]
    assert "does not match its manifest" in damaged[0]["detail"]
    said = cli("verify", copy)
    assert said.exit_code == 1 and "iter-0002/score" in said.stdout and "1 damaged" in said.stdout
    assert verdicts(cli, copy, "--sizes-only")[0] == 0  # the size is the same: only the sha256 tells


def test_a_cut_checkpoint_file_and_a_file_added_to_a_checkpoint_are_damage(cli, copy):
    weights = copy / "checkpoints" / "iter-0002" / "model.safetensors"
    with open(weights, "r+b") as f:
        f.truncate(weights.stat().st_size - 10)
    (copy / "checkpoints" / "iter-0001" / "notes.txt").write_text("added later")
    code, report = verdicts(cli, copy, "--sizes-only")
    damaged = {f["folder"]: f["detail"] for f in report["findings"] if f["status"] == "damaged"}
    assert code == 1 and set(damaged) == {"checkpoints/iter-0001", "checkpoints/iter-0002"}
    assert "model.safetensors has" in damaged["checkpoints/iter-0002"] and "(truncated or changed after commit)" in damaged["checkpoints/iter-0002"]
    assert "holds 'notes.txt', which its manifest does not list" in damaged["checkpoints/iter-0001"]


def test_a_file_added_to_a_shard_folder_is_named_but_no_reader_uses_it(cli, copy):
    (copy / "iter-0001" / "rollout" / "stray.arrow").write_bytes(b"x")
    code, report = verdicts(cli, copy)
    extra = [f for f in report["findings"] if f["status"] == "extra"]
    assert code == 0 and [f["folder"] for f in extra] == ["iter-0001/rollout"] and "'stray.arrow'" in extra[0]["detail"]


def test_an_output_made_from_an_input_rewritten_since_is_stale(cli, tmp_path, tiny_model, prompts_file):
    roll = ("rollout", "--prompts", prompts_file, "--model", tiny_model, "--out", tmp_path / "r", "--n", "2", "--max-new-tokens", "4")
    assert cli(*roll).exit_code == 0
    assert cli("score", "--rollouts", tmp_path / "r", "--out", tmp_path / "s", "--reward", "builtin:length").exit_code == 0
    assert verdicts(cli, tmp_path)[0] == 0
    assert cli(*roll, "--seed", "9").exit_code == 0  # the rollout rewritten under the score
    code, report = verdicts(cli, tmp_path)
    stale = [f for f in report["findings"] if f["status"] == "stale"]
    assert code == 1 and [f["folder"] for f in stale] == ["s"] and f"its input {tmp_path / 'r'} changed after it was made" in stale[0]["detail"]


def test_a_write_that_never_committed_and_a_lock_are_named_without_failing(cli, copy):
    half = copy / "iter-0003" / "rollout"
    half.mkdir(parents=True)
    (half / "part-abc-00000.arrow").write_bytes(b"partial")
    (copy / "_lock.json").write_text(json.dumps({"host": os.uname().nodename, "pid": 2**22 + 12345, "time": 0, "command": "rlctl pipeline"}))
    code, report = verdicts(cli, copy)
    by_status = {f["status"]: f for f in report["findings"] if f["status"] in ("uncommitted", "locked")}
    assert code == 0
    assert by_status["uncommitted"]["folder"] == "iter-0003/rollout" and "never committed" in by_status["uncommitted"]["detail"]
    assert by_status["locked"]["folder"] == "." and "a writer that is gone" in by_status["locked"]["detail"]
    assert shards.is_committed(str(copy / "iter-0002" / "score"))  # verify changes nothing


def test_a_path_that_is_not_there_is_bad_input(cli, tmp_path):
    result = cli("verify", tmp_path / "nowhere")
    assert result.exit_code == 2 and "does not exist" in one_line_error(result)
