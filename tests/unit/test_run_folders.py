"""Iteration and checkpoint folders sort by number, not by text: iter-10000 follows iter-9999."""

from rlctl.manifest import MANIFEST_NAME
from rlctl.pipeline import committed_checkpoints
from rlctl.runinfo import iteration_folders


def test_iteration_folders_sort_numerically_past_four_digits(tmp_path):
    for name in ("iter-9999", "iter-10000", "iter-0002", "iter-123456", "notes", "iter-x"):
        (tmp_path / name).mkdir()
    assert [p.name for p in iteration_folders(tmp_path)] == ["iter-0002", "iter-9999", "iter-10000", "iter-123456"]


def test_the_newest_committed_checkpoint_is_the_highest_iteration(tmp_path):
    root = tmp_path / "checkpoints"
    for name in ("iter-9998", "iter-9999", "iter-10000", "iter-10001"):
        (root / name).mkdir(parents=True)
        if name != "iter-10001":  # uncommitted
            (root / name / MANIFEST_NAME).write_text("{}")
    assert [p.name for p in committed_checkpoints(tmp_path)] == ["iter-9998", "iter-9999", "iter-10000"]
