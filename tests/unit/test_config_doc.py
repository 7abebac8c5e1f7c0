"""The config explains itself: every key has a type, default and description taken from the
dataclasses, `rlctl config show` prints them with a file's values, docs/config.md is current."""

import json
from pathlib import Path

from rlctl.config import SECTIONS, load_config
from rlctl.config_doc import key_docs, markdown, show

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
    assert 'rewards = [{fn = "builtin:gsm8k", weight = 2.0, name = ""}]' in text


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
