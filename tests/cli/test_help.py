"""Every command has help text, its --help is a reviewed snapshot, and the shell completion
scripts in completions/ are what the CLI generates today."""

from pathlib import Path

import pytest

from rlctl import __version__
from rlctl.completion import command_specs, scripts

COMMANDS = [spec.path for spec in command_specs()]
ROOT = Path(__file__).resolve().parents[2]


def test_the_architecture_commands_are_all_registered():
    names = {" ".join(p) for p in COMMANDS}
    assert names == {"rollout", "score", "advantage", "update", "reshard", "pipeline", "replay", "show", "plot", "model init"}


@pytest.mark.parametrize("path", COMMANDS, ids=lambda p: "-".join(p))
def test_every_command_and_option_has_help(path):
    import typer.main

    from rlctl.cli import app

    command = typer.main.get_command(app)
    for name in path:
        command = command.commands[name]
    assert command.help and command.help.strip()
    for param in command.params:
        if param.param_type_name == "option":
            assert param.help, f"{' '.join(path)} {param.opts[0]} has no help"


@pytest.mark.parametrize("path", [(), *COMMANDS], ids=lambda p: "-".join(p) or "rlctl")
def test_help_snapshot(cli, snapshot, path):
    result = cli(*path, "--help")
    assert result.exit_code == 0
    assert result.stdout == snapshot


def test_version(cli):
    result = cli("--version")
    assert result.exit_code == 0 and result.stdout.strip() == f"rlctl {__version__}"


def test_completion_scripts_are_current():
    for name, text in scripts().items():
        committed = (ROOT / "completions" / name).read_text()
        assert committed == text, f"completions/{name} is stale: run `make completions`"


def test_bash_completion_script_parses():
    import subprocess

    subprocess.run(["bash", "-n", str(ROOT / "completions" / "rlctl.bash")], check=True)
