"""pipeline.loggers: TensorBoard, wandb (offline) and MLflow get every metric of every
iteration that metrics.jsonl has, a resumed run goes on in the same tracker run, and a
missing package is exit 2 naming the extra."""

import json

import pytest

from rlctl.config import load_config
from rlctl.errors import ConfigError
from rlctl.loggers import check_loggers, mlflow_file_store_key, numeric
from rlctl.pipeline import Pipeline
from tests.e2e.test_pipeline import PROMPTS


def run(tmp_path, tiny_model, iterations: int) -> list[dict]:
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps(r) + "\n" for r in PROMPTS))
    cfg = {
        "model": {"path": tiny_model}, "data": {"prompts": str(prompts), "batch_size": 2}, "rollout": {"n": 2, "max_new_tokens": 4},
        "pipeline": {"iterations": iterations, "run_dir": str(tmp_path / "run"), "loggers": ["console", "jsonl", "tensorboard", "wandb", "mlflow"], "wandb_mode": "offline",
                     "log_completions": 3},
    }
    with Pipeline.from_config(cfg) as pipeline:
        pipeline.run()
    return [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def logged(tmp_path_factory, tiny_model):
    tmp_path = tmp_path_factory.mktemp("loggers")
    run(tmp_path, tiny_model, 1)
    rows = run(tmp_path, tiny_model, 2)  # resumed: iteration 2 goes to the same tracker runs
    return tmp_path / "run", rows


def test_tensorboard_holds_every_metric_of_every_iteration(logged):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run_dir, rows = logged
    events = EventAccumulator(str(run_dir / "tensorboard"))
    events.Reload()
    # a resumed run writes a second event file into the same folder; read both
    seen = {}
    for path in sorted((run_dir / "tensorboard").glob("events.out.tfevents.*")):
        one = EventAccumulator(str(path))
        one.Reload()
        for tag in one.Tags()["scalars"]:
            seen.update({(tag, e.step): e.value for e in one.Scalars(tag)})
    for row in rows:
        for key, value in numeric(row).items():
            assert seen[(key, row["iteration"])] == pytest.approx(value, rel=1e-6), key


def test_mlflow_has_one_run_with_every_iteration(logged, monkeypatch):
    import mlflow

    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    run_dir, rows = logged
    client = mlflow.MlflowClient(tracking_uri=(run_dir / "mlruns").resolve().as_uri())
    (experiment,) = [e for e in client.search_experiments() if e.name == "rlctl"]
    (tracked,) = client.search_runs([experiment.experiment_id])
    history = client.get_metric_history(tracked.info.run_id, "reward_mean")
    logged_points = sorted((m.step, m.value) for m in history)
    assert [step for step, _ in logged_points] == [r["iteration"] for r in rows]
    assert [value for _, value in logged_points] == pytest.approx([r["reward_mean"] for r in rows])
    assert tracked.data.params["update.lr"] == "1e-06"
    for key, value in numeric(rows[-1]).items():  # a metric and its group (response_length, response_length/max) both kept
        assert tracked.data.metrics[mlflow_file_store_key(key)] == pytest.approx(value, rel=1e-6), key
    assert {"response_length", "response_length.max", "seconds.total"} <= set(tracked.data.metrics)


def test_wandb_offline_writes_one_run_folder(logged):
    run_dir, _ = logged
    folders = list((run_dir / "wandb").glob("offline-run-*"))
    assert folders and len({f.name.rpartition("-")[2] for f in folders}) == 1  # the same run id after resuming
    assert all(list(f.glob("run-*.wandb")) for f in folders)


def test_each_iterations_drawn_samples_reach_every_tracker(logged, monkeypatch):
    """pipeline.log_completions: the rows drawn from (seed, iteration) of each iteration's batch,
    whole, in TensorBoard's text panel, an MLflow file per iteration and a wandb table."""
    import mlflow
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from rlctl import shards
    from rlctl.completion_log import drawn_completions, markdown_table

    run_dir, rows = logged
    expected = {r["iteration"]: markdown_table(drawn_completions(shards.read(str(run_dir / f"iter-{r['iteration']:04d}" / "advantage")).table, 3, seed=0, iteration=r["iteration"])) for r in rows}
    assert all(text.count("\n") == 4 for text in expected.values())  # a header, its rule, 3 samples
    texts = {}
    for path in sorted((run_dir / "tensorboard").glob("events.out.tfevents.*")):
        events = EventAccumulator(str(path), size_guidance={"tensors": 0})
        events.Reload()
        texts.update({e.step: e.tensor_proto.string_val[0].decode() for e in events.Tensors("completions/text_summary")})
    assert texts == expected
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    client = mlflow.MlflowClient(tracking_uri=(run_dir / "mlruns").resolve().as_uri())
    (tracked,) = client.search_runs([e.experiment_id for e in client.search_experiments() if e.name == "rlctl"])
    for iteration, text in expected.items():
        path = client.download_artifacts(tracked.info.run_id, f"completions/iter-{iteration:04d}.md", str(run_dir / "downloaded"))
        assert open(path).read() == text + "\n"
    assert list((run_dir / "wandb").glob("offline-run-*/files/media/table/completions_*.table.json"))


def test_unknown_or_missing_loggers_are_config_errors(monkeypatch):
    with pytest.raises(ConfigError, match="unknown logger 'tensorbord'; available: console, jsonl, tensorboard, wandb, mlflow"):
        load_config(None, ['pipeline.loggers=["tensorbord"]'])
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a))
    with pytest.raises(ConfigError, match="wandb needs the wandb package: pip install 'rlctl\\[wandb\\]'"):
        check_loggers(("console", "wandb"))
