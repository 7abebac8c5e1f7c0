"""User reward code runs in a child process: however it ends, it cannot make a command succeed,
write into its stdout, or outlive its timeout."""

import textwrap

import pyarrow as pa
import pytest

from rlctl.errors import InputError, RewardError
from rlctl.rewards import RewardSamples, compute_rewards, load_reward
from tests.conftest import assert_not_written, one_line_error
from tests.unit.test_shards import ROLLOUT_VALUES


def samples(responses):
    n = len(responses)
    return RewardSamples(["p"] * n, list(responses), [None] * n, ["src"] * n, [{} for _ in range(n)])


def reward_file(tmp_path, body: str) -> str:
    path = tmp_path / "user_reward.py"
    path.write_text(textwrap.dedent(body))
    return f"{path}:reward"


# each: the reward's body, and what the error must say
MISBEHAVIOURS = {
    "sys_exit_0": ("import sys\ndef reward(samples):\n    sys.exit(0)\n", "called sys.exit(0)"),
    "os_exit_0": ("import os\ndef reward(samples):\n    os._exit(0)\n", "ended its process (exit code 0)"),
    "raises": ("def reward(samples):\n    raise ValueError('bad sample')\n", "raised ValueError: bad sample"),
    "swallows_the_timeout": (
        "import time\ndef reward(samples):\n    while True:\n        try:\n            time.sleep(0.05)\n        except Exception:\n            pass\n",
        "ran past the 0.5s timeout",
    ),
    "returns_strings": ("def reward(samples):\n    return ['1.0' for _ in samples]\n", "returned str '1.0' at sample 0"),
    "returns_nan": ("def reward(samples):\n    return [float('nan')] * len(samples)\n", "returned nan at sample 0"),
    "returns_out_of_float32_range": ("def reward(samples):\n    return [1e39] * len(samples)\n", "outside the float32 range"),
    "returns_a_dict": ("def reward(samples):\n    return {'a': 1}\n", "returned dict, expected a list of floats"),
}


@pytest.mark.parametrize("name", list(MISBEHAVIOURS))
def test_a_misbehaving_reward_is_a_reward_error_naming_what_it_did(tmp_path, name):
    body, message = MISBEHAVIOURS[name]
    reward = load_reward(reward_file(tmp_path, body))
    with pytest.raises(RewardError, match=message.replace("(", r"\(").replace(")", r"\)")):
        compute_rewards(reward, samples(["a"]), timeout=0.5)


def test_the_child_is_restarted_after_it_died(tmp_path):
    spec = reward_file(tmp_path, "import os\ndef reward(responses):\n    if 'die' in responses:\n        os._exit(3)\n    return [float(len(r)) for r in responses]\n")
    reward = load_reward(spec)
    with pytest.raises(RewardError, match="at sample 1"):  # found by re-calling per sample, in fresh children
        compute_rewards(reward, samples(["ok", "die"]), timeout=5)
    assert compute_rewards(reward, samples(["abc"]), timeout=5) == [3.0]


def test_prints_of_the_reward_go_to_stderr_not_stdout(tmp_path, capfd):
    reward = load_reward(reward_file(tmp_path, "def reward(samples):\n    print('hello from the reward')\n    return [1.0] * len(samples)\n"))
    assert compute_rewards(reward, samples(["a"]), timeout=5) == [1.0]
    out, err = capfd.readouterr()
    assert "hello from the reward" in err and "hello from the reward" not in out


def test_an_import_failure_is_bad_input(tmp_path):
    with pytest.raises(InputError, match="importing .* failed: ZeroDivisionError"):
        load_reward(reward_file(tmp_path, "1 / 0\n"))
    with pytest.raises(InputError, match="cannot import module 'no_such_module_here'"):
        load_reward("no_such_module_here:fn")


def committed_rollouts(tmp_path) -> str:
    from rlctl import shards
    from rlctl.manifest import Manifest

    uri = str(tmp_path / "rollouts")
    shards.write(pa.table(ROLLOUT_VALUES), uri, Manifest(stage="rollout"), schema="rollouts")
    return uri


@pytest.mark.parametrize("name", ["sys_exit_0", "os_exit_0"])
def test_score_to_stdout_fails_and_writes_no_stream(cli, tmp_path, name):
    body, message = MISBEHAVIOURS[name]
    result = cli("score", "--rollouts", committed_rollouts(tmp_path), "--out", "-", "--reward", reward_file(tmp_path, body))
    assert result.exit_code == 2 and message in one_line_error(result)
    assert result.stdout_bytes == b""


def test_score_to_stdout_with_a_printing_reward_is_a_clean_stream(cli, tmp_path):
    from rlctl import shards

    spec = reward_file(tmp_path, "def reward(samples):\n    print('noise')\n    return [0.5] * len(samples)\n")
    result = cli("score", "--rollouts", committed_rollouts(tmp_path), "--out", "-", "--reward", spec)
    assert result.exit_code == 0, result.stderr
    table = shards.read("-", "scores", stdin=pa.BufferReader(result.stdout_bytes)).table
    assert table.column("reward").to_pylist() == [0.5, 0.5, 0.5]


def test_score_into_a_folder_writes_nothing_when_the_reward_exits(cli, tmp_path):
    body, _ = MISBEHAVIOURS["sys_exit_0"]
    out = tmp_path / "scores"
    result = cli("score", "--rollouts", committed_rollouts(tmp_path), "--out", out, "--reward", reward_file(tmp_path, body))
    assert result.exit_code == 2
    assert_not_written(out)
