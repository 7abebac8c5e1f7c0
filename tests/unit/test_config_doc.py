"""The config explains itself: every key has a type, default and description taken from the
dataclasses, `rlctl config show` prints them with a file's values, docs/config.md is current."""

import json
from pathlib import Path

import pytest

from rlctl.config import SECTIONS, ConfigError, load_config
from rlctl.config_doc import config_of, differences, key_docs, markdown, show

ROOT = Path(__file__).resolve().parents[2]


def test_every_key_of_every_section_has_a_description():
    docs = key_docs()
    assert {d.section for d in docs} == set(SECTIONS)
    assert [d.name for d in docs if not d.description] == []
    lr = next(d for d in docs if d.name == "update.lr")
    assert (lr.type, lr.default, lr.description) == ("float", 1e-6, "policy learning rate (AdamW)")


def test_docs_config_md_is_what_the_code_generates():
    assert (ROOT / "docs" / "config.md").read_text() == markdown(), "stale: run python -m rlctl.config_doc docs/config.md"


def test_show_gives_each_value_its_type_default_and_meaning(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text('[update]\nlr = 3e-5\n[score]\nrewards = [{fn = "builtin:gsm8k", weight = 2.0}]\n')
    text = show(load_config(path))
    lines = text.splitlines()
    assert "[update]  # The policy (and critic) update: PPO-style losses, batching, optimizer." in lines
    assert next(line for line in lines if line.startswith("lr = ")).split("#", 1)[1].strip() == "float; default 1e-06: policy learning rate (AdamW)"
    assert next(line for line in lines if line.startswith("epochs = 1")).split("#", 1)[1].strip() == "int: passes over the batch per update (PPO epochs)"
    assert 'rewards = [{fn = "builtin:gsm8k", weight = 2.0, name = "", sources = []}]' in text


def test_config_show_command_prints_text_and_json(cli, tmp_path):
    path = tmp_path / "c.toml"
    path.write_text("[rollout]\nn = 8\n")
    as_text = cli("config", "show", path)
    assert as_text.exit_code == 0 and "n = 8" in as_text.stdout and "default 1: samples per prompt" in as_text.stdout
    rows = json.loads(cli("config", "show", path, "--json", "--set", "update.lr=1e-4").stdout)
    assert {"key": "rollout.n", "type": "int", "default": 1, "value": 8, "description": "samples per prompt (the group size of GRPO/RLOO)"} in rows
    assert next(r for r in rows if r["key"] == "update.lr")["value"] == 1e-4
    bad = cli("config", "show", path, "--set", "update.lerning_rate=1")
    assert bad.exit_code == 2 and "did you mean update.learning_rate" not in bad.stderr and "update.lr" in bad.stderr


def test_differences_are_the_keys_two_configs_disagree_on_defaults_filled_in(tmp_path):
    grpo = load_config(overrides=['advantage.estimator="grpo"', "update.lr=3e-3"])
    drgrpo = load_config(overrides=['advantage.estimator="grpo"', "update.lr=3e-3", "advantage.norm_by_std=false", "update.lora.r=8"])
    assert differences(grpo, drgrpo) == [("advantage.norm_by_std", True, False), ("update.lora.r", 0, 8)]
    assert differences(grpo, grpo) == []


def test_a_run_folder_compares_by_the_config_it_ran_with(tmp_path):
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "config.resolved.toml").write_text("[rollout]\nn = 8\n")
    (tmp_path / "other.toml").write_text("[rollout]\nn = 4\n")
    assert differences(config_of(tmp_path / "run"), config_of(tmp_path / "other.toml")) == [("rollout.n", 8, 4)]
    with pytest.raises(ConfigError, match="a folder without config.resolved.toml"):
        config_of(tmp_path)


def test_config_diff_prints_each_differing_key_with_both_values(cli, tmp_path):
    (tmp_path / "a.toml").write_text('[advantage]\nestimator = "grpo"\n[rollout]\nn = 8\n')
    (tmp_path / "b.toml").write_text('[advantage]\nestimator = "rloo"\n[rollout]\nn = 8\n')
    result = cli("config", "diff", tmp_path / "a.toml", tmp_path / "b.toml")
    assert result.exit_code == 0 and result.stdout.startswith("1 keys differ")
    assert [[cell.strip() for cell in line.split("│")[1:4]] for line in result.stdout.splitlines() if "estimator" in line] == [["advantage.estimator", '"grpo"', '"rloo"']]
    listed = cli("config", "diff", tmp_path / "a.toml", tmp_path / "b.toml", "--json")
    assert json.loads(listed.stdout) == [{"key": "advantage.estimator", "first": "grpo", "second": "rloo"}]
    assert cli("config", "diff", tmp_path / "a.toml", tmp_path / "a.toml").stdout.endswith(": the same config\n")
