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
    assert names == {"rollout", "score", "advantage", "update", "reshard", "pipeline", "replay", "show", "plot", "model init", "config show", "config diff", "eval", "sft", "reward-model", "dpo", "kto", "verify"}


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


def bash_complete(*words: str) -> list[str]:
    """What the bash script offers when the command line is `rlctl WORDS` (the last word being typed)."""
    import shlex
    import subprocess

    line = " ".join(shlex.quote(w) for w in ("rlctl", *words))
    script = f'source {ROOT / "completions" / "rlctl.bash"}; COMP_WORDS=({line}); COMP_CWORD={len(words)}; _rlctl; printf "%s\\n" "${{COMPREPLY[@]}}"'
    return subprocess.run(["bash", "-c", script], capture_output=True, text=True, check=True).stdout.split()


def test_completion_offers_the_values_of_choice_flags():
    assert bash_complete("advantage", "--estimator", "") == ["gae", "gdpo", "gpg", "grpo", "grpo_passk", "online_dpo", "opo", "optimal_token_baseline", "reinforce_pp", "reinforce_pp_baseline", "remax", "rloo"]
    assert bash_complete("advantage", "--pf-ppo", "max") == ["max_min", "max_random"]
    assert bash_complete("model", "init", "--preset", "s") == ["small"]
    assert bash_complete("rollout", "--backend", "") == ["hf", "vllm"]
    assert bash_complete("rollout", "--max-new") == ["--max-new-tokens"]


def test_help_shows_config_defaults_and_choices(cli):
    text = cli("rollout", "--help").stdout
    assert "--dtype [auto|fp32|bf16]" in text and "[default: auto]" in text
    assert "[default: 64]" in text  # --max-new-tokens: rollout.max_new_tokens's default


def test_choice_lists_are_the_registries():
    from rlctl import choices
    from rlctl.algos.advantages import ESTIMATORS
    from rlctl.algos.kl import KL_ESTIMATORS
    from rlctl.algos.losses import LOSS_AGG_MODES, POLICY_LOSSES
    from rlctl.modelinit import PRESETS
    from rlctl.pipeline import STAGES
    from rlctl.rewards import BUILTINS

    assert choices.ESTIMATORS == tuple(ESTIMATORS.names())
    assert choices.KL_ESTIMATORS == tuple(KL_ESTIMATORS.names())
    assert choices.LOSS_AGG_MODES == tuple(LOSS_AGG_MODES)
    assert choices.POLICY_LOSSES == tuple(POLICY_LOSSES)
    assert choices.PRESETS == tuple(PRESETS)
    assert choices.PIPELINE_STAGES == tuple(STAGES)
    assert choices.BUILTIN_REWARDS == tuple(BUILTINS.names())
