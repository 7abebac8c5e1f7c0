"""`rlctl plot`: one run's panels, or several runs' lines on the same panels."""

import json

import pytest

from rlctl.errors import InputError
from rlctl.plot import chosen_panels, metrics_figure, plot_runs, run_labels


def make_run(folder, rewards, kl=None):
    folder.mkdir(parents=True)
    rows = [{"iteration": i + 1, "reward_mean": r, "reward_std": 0.1, "entropy": 2.0 - i, "kl": kl} for i, r in enumerate(rewards)]
    (folder / "metrics.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(folder)


def is_png(path) -> bool:
    with open(path, "rb") as f:
        return f.read(4) == b"\x89PNG"


def test_one_run_writes_its_metrics_png(tmp_path):
    run = make_run(tmp_path / "runs" / "grpo", [0.1, 0.5])
    assert plot_runs([run]) == f"{run}/metrics.png" and is_png(f"{run}/metrics.png")


def test_several_runs_share_the_panels_and_write_compare_png_beside_them(tmp_path):
    grpo = make_run(tmp_path / "runs" / "grpo", [0.1, 0.5, 0.7])
    dapo = make_run(tmp_path / "runs" / "dapo", [0.2, 0.6])
    written = plot_runs([grpo, dapo])
    assert written == str(tmp_path / "runs" / "compare.png") and is_png(written)
    assert is_png(plot_runs([grpo, dapo], str(tmp_path / "out" / "c.png")))


def test_each_run_is_a_labelled_line_on_every_panel_it_recorded():
    runs = {"grpo": [{"iteration": 1, "reward_mean": 0.1, "kl": None}, {"iteration": 2, "reward_mean": 0.4, "kl": None}],
            "ppo": [{"iteration": 1, "reward_mean": 0.2, "kl": 0.01}]}
    fig = metrics_figure(runs, "t")
    reward, kl = fig.axes[0], fig.axes[1]
    assert [line.get_label() for line in reward.get_lines()] == ["grpo", "ppo"]
    assert list(reward.get_lines()[0].get_ydata()) == [0.1, 0.4]
    assert [line.get_label() for line in kl.get_lines()] == ["ppo"]  # grpo recorded no KL
    assert [t.get_text() for t in reward.get_legend().get_texts()] == ["grpo", "ppo"]


def test_runs_sharing_a_folder_name_are_labelled_by_path():
    assert run_labels(["a/grpo", "b/ppo"]) == ["grpo", "ppo"]
    assert run_labels(["a/grpo", "b/grpo"]) == ["a/grpo", "b/grpo"]


def test_a_folder_that_is_not_a_run_or_named_twice_is_refused(tmp_path):
    run = make_run(tmp_path / "grpo", [0.1])
    (tmp_path / "empty").mkdir()
    with pytest.raises(InputError, match="empty: no metrics.jsonl"):
        plot_runs([run, str(tmp_path / "empty")])
    with pytest.raises(InputError, match="named twice"):
        plot_runs([run, str(tmp_path / "grpo") + "/"])
    assert not (tmp_path / "compare.png").exists()


def test_metrics_asked_for_replace_the_usual_panels(tmp_path):
    grpo = make_run(tmp_path / "runs" / "grpo", [0.1, 0.5], kl=0.02)
    runs = {"grpo": [{"iteration": 1, "groups/equal_rewards": 0.5, "entropy": 2.0}, {"iteration": 2, "groups/equal_rewards": 0.75, "entropy": 1.0}]}
    fig = metrics_figure(runs, "t", chosen_panels(["groups/equal_rewards", "entropy"], runs))
    assert [ax.get_title() for ax in fig.axes] == ["groups/equal_rewards", "entropy"]  # a usual panel keeps its title
    assert list(fig.axes[0].get_lines()[0].get_ydata()) == [0.5, 0.75]
    assert is_png(plot_runs([grpo], str(tmp_path / "one.png"), metrics=["kl"]))  # one panel
    with pytest.raises(InputError, match="no run recorded 'reward_man'; did you mean reward_mean"):
        plot_runs([grpo], str(tmp_path / "bad.png"), metrics=["reward_man"])
    assert not (tmp_path / "bad.png").exists()
