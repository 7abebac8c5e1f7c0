"""`rlctl dpo` from the command line: a committed checkpoint that a pipeline starts from, rerun
skipped; bad input is one line and nothing written."""

import json
from pathlib import Path

import pytest

from rlctl.checkpoint import is_intact
from tests.conftest import assert_not_written, one_line_error

PAIRS = [{"id": f"p{i}", "prompt": f"Type a number: {i}", "chosen": f"{7 * i + 3}", "rejected": "no idea" if i % 2 else "maybe"} for i in range(8)]


@pytest.fixture
def pairs(tmp_path) -> Path:
    path = tmp_path / "pairs.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in PAIRS))
    return path


def test_dpo_writes_a_checkpoint_with_its_epochs_and_a_rerun_is_skipped(cli, tmp_path, tiny_model, pairs):
    args = ("dpo", "--data", pairs, "--val-data", pairs, "--model", tiny_model, "--out", tmp_path / "dpo", "--epochs", "2", "--lr", "1e-3", "--batch-size", "4", "--beta", "0.2")
    result = cli(*args)
    assert result.exit_code == 0, result.stderr
    lines = result.stderr.splitlines()
    assert lines[0].startswith("dpo: epoch 0  val_loss 0.6931") and lines[2].startswith("dpo: epoch 2  loss") and "dpo: wrote" in lines[-1]
    assert is_intact(str(tmp_path / "dpo")) is None and not (tmp_path / "dpo" / "trainer_state").exists()
    manifest = json.loads((tmp_path / "dpo" / "_manifest.json").read_text())
    assert manifest["stage"] == "dpo" and manifest["config"]["dpo"]["beta"] == 0.2 and manifest["state"]["optimizer_steps"] == 4
    assert manifest["metrics"]["val_loss"] < 0.6931
    assert "skipped" in cli(*args).stderr
    shown = cli("show", tmp_path / "dpo")
    assert shown.exit_code == 0 and "dpo" in shown.stdout


@pytest.mark.parametrize(
    ("rows", "args", "fragment"),
    [
        ([{"prompt": "a", "chosen": "b"}], [], "need 'chosen' and 'rejected' columns"),
        ([{"prompt": "a", "chosen": "b", "rejected": None}], [], "row 0 has no rejected response"),
        ([{"prompt": "a", "chosen": "b", "rejected": "c " * 40}], ["--set", "dpo.max_tokens=20"], "the rejected response of pair '0' has"),
        ([{"prompt": "a", "chosen": "b", "rejected": "c"}], ["--beta", "0"], "dpo.beta must be > 0"),
        ([{"prompt": "a", "chosen": "b", "rejected": "c"}], ["--set", "dpo.label_smoothing=0.5"], "dpo.label_smoothing must be at least 0 and below 0.5"),
        ([{"prompt": "a", "chosen": "", "rejected": "c"}], [], "the chosen response of pair '0' has an empty response"),
        ([{"prompt": "a", "chosen": "b", "rejected": "c"}], ["--loss", "kto"], "dpo.loss must be one of"),
        ([{"prompt": "a", "chosen": "b", "rejected": "c"}], ["--loss", "ipo", "--set", "dpo.label_smoothing=0.1"], "dpo.label_smoothing applies to the sigmoid and robust losses"),
    ],
)
def test_bad_input_is_one_line_and_nothing_written(cli, tmp_path, tiny_model, rows, args, fragment):
    data = tmp_path / "pairs.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    result = cli("dpo", "--data", data, "--model", tiny_model, "--out", tmp_path / "out", *args)
    assert result.exit_code == 2, result.stderr
    assert fragment in one_line_error(result)
    assert_not_written(tmp_path / "out")


def test_dpo_into_its_own_model_folder_is_refused(cli, tmp_path, tiny_model, pairs):
    result = cli("dpo", "--data", pairs, "--model", tiny_model, "--out", tiny_model)
    assert result.exit_code == 2 and "is the --model folder" in one_line_error(result)
