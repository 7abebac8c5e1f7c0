"""`rlctl show` of a shard: a table while its columns stay readable, records otherwise."""

import json

import pyarrow as pa
import pytest

from rlctl import shards
from rlctl.errors import InputError
from rlctl.manifest import MANIFEST_NAME, FileEntry, Manifest
from rlctl.show import show

RESPONSE = "The sum of 17 and 25 is 42, because 17 + 25 = 42."
ROLLOUTS = {
    "id": ["q1", "q1"],
    "prompt": ["What is 17 + 25? Answer with the number.", "What is 17 + 25? Answer with the number."],
    "sample": pa.array([0, 1], pa.int32()),
    "prompt_ids": pa.array([[1, 2], [1, 2]], pa.list_(pa.int32())),
    "response_ids": pa.array([[3, 4], [5]], pa.list_(pa.int32())),
    "response": [RESPONSE, "42"],
    "rollout_logprobs": pa.array([[-1.0, -2.0], [-0.5]], pa.list_(pa.float32())),
    "finish_reason": ["stop", "stop"],
    "policy_version": pa.array([0, 0], pa.int64()),
}


@pytest.fixture
def rollouts(tmp_path):
    uri = str(tmp_path / "rollouts")
    shards.write(pa.table(ROLLOUTS), uri, Manifest(stage="rollout"), schema="rollouts")
    return uri


def shown(capsys, monkeypatch, columns: int, uri: str, **options) -> str:
    monkeypatch.setenv("COLUMNS", str(columns))
    show(uri, **options)
    return capsys.readouterr().out


def test_a_narrow_terminal_shows_each_row_as_records_with_its_text_whole(rollouts, capsys, monkeypatch):
    out = shown(capsys, monkeypatch, 80, rollouts)
    assert RESPONSE in out and ROLLOUTS["prompt"][0] in out
    assert "│ row " in out and "│ finish_reason " in out  # a line per column
    assert all(len(line) <= 80 for line in out.splitlines())
    assert "prompt_ids" not in out  # token ids stay for --columns and --json


def test_a_wide_terminal_keeps_the_table(rollouts, capsys, monkeypatch):
    out = shown(capsys, monkeypatch, 200, rollouts)
    header = next(line for line in out.splitlines() if "finish_reason" in line)
    assert "response" in header and "sample" in header  # the columns side by side
    assert "│ row " not in out


def test_the_layout_can_be_chosen(rollouts, capsys, monkeypatch):
    assert "│ finish_reason " in shown(capsys, monkeypatch, 200, rollouts, layout="records")
    table = shown(capsys, monkeypatch, 80, rollouts, layout="table")
    assert RESPONSE not in table and "│ row " not in table
    with pytest.raises(InputError, match="unknown layout 'wide'"):
        show(rollouts, layout="wide")


def test_width_caps_the_records_cells(rollouts, capsys, monkeypatch):
    out = shown(capsys, monkeypatch, 80, rollouts, layout="records", width=12)
    assert RESPONSE[:11] + "…" in out and RESPONSE not in out


def test_no_rows_shows_the_columns(rollouts, capsys, monkeypatch):
    out = shown(capsys, monkeypatch, 80, rollouts, rows=0)
    assert "2 rows" in out and "│ row " not in out and "id" in out


def test_json_is_the_same_whatever_the_layout(rollouts, capsys, monkeypatch):
    outputs = {json.dumps(json.loads(shown(capsys, monkeypatch, 80, rollouts, as_json=True, layout=layout))) for layout in ("table", "records")}
    (single,) = outputs
    assert json.loads(single)["head"][0]["response"] == RESPONSE


def test_sort_orders_the_rows_by_a_column_or_a_list_columns_mean(tmp_path, capsys):
    table = pa.table({
        "id": ["a", "b", "c"],
        "reward": pa.array([0.5, None, 0.9], pa.float32()),
        "advantages": pa.array([[1.0, -3.0], [0.5], []], pa.list_(pa.float32())),
    })
    uri = str(tmp_path / "batch")
    shards.write(table, uri, Manifest(stage="advantage"))

    def ids(sort: str) -> list[str]:
        show(uri, as_json=True, sort=sort)
        return [row["id"] for row in json.loads(capsys.readouterr().out)["head"]]

    assert ids("reward") == ["a", "c", "b"]  # nulls last either way
    assert ids("-reward") == ["c", "a", "b"]
    assert ids("-advantages") == ["b", "a", "c"]  # means 0.5, -1.0; no tokens last
    with pytest.raises(InputError, match="no column 'rewards' to sort by; columns: id, reward, advantages"):
        show(uri, sort="rewards")


def test_an_iteration_folder_shows_its_stages_in_the_loops_order_and_the_runs_metrics(tmp_path, capsys, monkeypatch):
    run = tmp_path / "run"
    iteration = run / "iter-0003"
    shards.write(pa.table(ROLLOUTS), str(iteration / "rollout"), Manifest(stage="rollout"), schema="rollouts")
    scored = pa.table({**ROLLOUTS, "reward": pa.array([1.0, 0.0], pa.float32())})
    shards.write(scored, str(iteration / "advantage"), Manifest(stage="advantage", metrics={"reward_mean": 0.5, "kl": 0.01}))
    shards.write(pa.table({"id": ["q1"], "prompt": ["p"]}), str(iteration / "prompts"), Manifest(stage="prompts"))
    (iteration / "update").mkdir()  # a stage that had not committed when the run stopped
    (iteration / "weights").mkdir()  # a checkpoint-like output: files without rows
    weights = Manifest(stage="reshard", files=[FileEntry("model.safetensors", 0, 10, "0" * 64)])
    (iteration / "weights" / MANIFEST_NAME).write_text(weights.to_json())
    (run / "metrics.jsonl").write_text(json.dumps({"iteration": 2, "reward_mean": 0.1}) + "\n" + json.dumps({"iteration": 3, "reward_mean": 0.5}) + "\n")

    show(str(iteration), as_json=True)
    summary = json.loads(capsys.readouterr().out)
    assert [s["folder"] for s in summary["stages"]] == ["prompts", "rollout", "advantage", "weights"]
    assert [s["rows"] for s in summary["stages"]] == [1, 2, 2, None] and summary["stages"][1]["seconds"] > 0
    assert summary["uncommitted"] == ["update"] and summary["metrics"] == {"iteration": 3, "reward_mean": 0.5}

    out = shown(capsys, monkeypatch, 100, str(iteration))
    assert out.startswith(f"iteration 3: {iteration}")
    assert "reward_mean 0.5  kl 0.01" in out and "not committed" in out
    assert out.index("│ prompts") < out.index("│ rollout") < out.index("│ advantage") < out.index("│ update")


def test_a_run_shows_its_metrics_then_what_they_suggest_changing(tmp_path, capsys, monkeypatch):
    run = tmp_path / "run"
    run.mkdir()
    rows = [{"iteration": i, "reward_mean": 0.1 * i, "response_length": 24.0, "response_length/max": 24.0, "response_length/clip_ratio": 0.75} for i in (1, 2)]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (run / "config.resolved.toml").write_text("[score]\noverlong_buffer = 8\n")

    show(str(run), as_json=True)
    summary = json.loads(capsys.readouterr().out)
    assert [c["check"] for c in summary["checks"]] == ["truncated"] and summary["checks"][0]["iterations"] == [2]
    assert "overlong_buffer" not in summary["checks"][0]["message"]  # the run's config already has one

    out = shown(capsys, monkeypatch, 200, str(run))
    header = next(line for line in out.splitlines() if "iter" in line and "reward" in line)
    assert [c.strip() for c in header.strip("┃ ").split("┃")] == ["iter", "reward", "len", "cut"]  # the columns the run has
    words = " ".join(out.split())  # the finding wraps at the terminal's width
    assert words.endswith("! iteration 2: 75% of the responses ended at the length limit (24 tokens), not at a stop token or string, so a reward "
                          "that wants a finished answer judged cut-off text: raise rollout.max_new_tokens if the answers need more room; "
                          "update.mask_truncated leaves cut-off responses out of the loss")


def test_a_run_shows_the_metrics_asked_for_over_its_last_iterations(tmp_path, capsys, monkeypatch):
    run = tmp_path / "run"
    run.mkdir()
    rows = [{"iteration": i, "reward_mean": 0.1 * i, "groups/equal_rewards": 0.25, "seconds/total": 1.0} for i in range(1, 6)]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))

    show(str(run), as_json=True, columns=["groups/equal_rewards"], rows=2)
    summary = json.loads(capsys.readouterr().out)
    assert summary["columns"] == ["iteration", "groups/equal_rewards"] and summary["iterations_done"] == 5
    assert summary["rows"] == [{"iteration": 4, "groups/equal_rewards": 0.25}, {"iteration": 5, "groups/equal_rewards": 0.25}]

    show(str(run), as_json=True)  # no --rows: every iteration
    assert [r["iteration"] for r in json.loads(capsys.readouterr().out)["rows"]] == [1, 2, 3, 4, 5]

    monkeypatch.setenv("COLUMNS", "100")
    show(str(run), columns=["groups/equal_rewards"], rows=1)
    out = capsys.readouterr().out
    assert "groups/equal_rewards" in out and "│    5 │" in out and "│    4 │" not in out
    with pytest.raises(InputError, match="no metric 'reward_man'; did you mean reward_mean"):
        show(str(run), columns=["reward_man"])


def test_where_shows_the_rows_a_condition_holds_for_and_how_many(rollouts, capsys, monkeypatch):
    show(rollouts, as_json=True, where=["response = 42"])
    data = json.loads(capsys.readouterr().out)
    assert (data["rows"], data["matched"]) == (2, 1) and [r["sample"] for r in data["head"]] == [1]
    out = shown(capsys, monkeypatch, 200, rollouts, where=["sample >= 1"], layout="table")
    assert out.startswith(f"{rollouts}: 2 rows, rollouts") and "; 1 where sample >= 1" in out.splitlines()[0]


def test_where_and_sort_on_something_without_rows_are_refused_not_ignored(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text(json.dumps({"iteration": 1, "reward_mean": 0.5}) + "\n")
    with pytest.raises(InputError, match="--where and --sort pick a shard's rows; a run has none"):
        show(str(run), where=["reward_mean < 1"])
    with pytest.raises(InputError, match="a run has none"):
        show(str(run), sort="reward_mean")


def test_the_best_iteration_is_the_first_to_reach_the_best_value_either_way():
    from rlctl.runinfo import best_iteration

    rows = [{"iteration": 1, "val/score": 0.2}, {"iteration": 2}, {"iteration": 3, "val/score": 0.9}, {"iteration": 4, "val/score": 0.9}, {"iteration": 5, "val/score": 0.1}]
    assert best_iteration(rows, "val/score") == 3  # the first of equals: the one saved when it bettered the rest
    assert best_iteration(rows, "val/score", "min") == 5
    assert best_iteration(rows, "kl") is None
    assert best_iteration([{"iteration": 0, "val/score": 1.0}, *rows], "val/score") == 3  # 0: the initial weights, no checkpoint of the run
