"""`judge:MODEL_URI`: a causal LM's probability of saying yes rather than no, after a question
built from each sample, is its reward — the same number batched and padded as alone."""

import pyarrow as pa
import pytest
import torch

from rlctl import shards
from rlctl.config import ScoreConfig
from rlctl.errors import ConfigError, InputError
from rlctl.judge import DEFAULT_TEMPLATE, JudgeReward, JudgeSettings, check_template
from rlctl.rewards import load_rewards
from tests.conftest import one_line_error
from tests.unit.test_shards import ROLLOUT_VALUES

PROMPTS = ["What is 2 + 2?", "Name a prime number.", "Spell cat backwards, please, carefully."]
RESPONSES = ["4", "Nine, which is odd and certainly a prime number by any account", "tac"]
TRUTHS = ["4", None, "tac"]


def alone(judge: JudgeReward, prompt, response, truth) -> float:
    """The verdict share of one sample from its own unpadded forward pass."""
    ids = torch.tensor([judge.question_ids(prompt, response, truth)])
    with torch.no_grad():
        logp = torch.log_softmax(judge.model(input_ids=ids).logits[0, -1].double(), -1)
    yes, no = logp[judge.yes].exp(), logp[judge.no].exp()
    return float(yes / (yes + no))


def test_the_reward_is_the_judges_yes_share_the_same_batched_as_alone(tiny_model):
    judge = JudgeReward(tiny_model, batch_size=3)
    rewards = judge(prompts=PROMPTS, responses=RESPONSES, ground_truths=TRUTHS)
    assert rewards == pytest.approx([alone(judge, *sample) for sample in zip(PROMPTS, RESPONSES, TRUTHS)], abs=1e-5)
    assert all(0 < r < 1 for r in rewards) and len(set(rewards)) == 3  # lengths differ: the batch is left-padded
    assert judge(prompts=PROMPTS[:1], responses=RESPONSES[:1], ground_truths=TRUTHS[:1]) == pytest.approx(rewards[:1], abs=1e-6)


def test_the_question_is_the_template_filled_in_as_the_judges_chat_turn(tiny_model):
    judge = JudgeReward(tiny_model, settings=JudgeSettings("Q: {prompt}\nA: {response}\nTruth: {ground_truth}\nRight?", "Yes", "No"))
    text = judge.tokenizer.decode(judge.question_ids("2 + 2?", "4", None))
    assert text == "<|im_start|>user\nQ: 2 + 2?\nA: 4\nTruth: \nRight?<|im_end|>\n<|im_start|>assistant\n"  # the assistant's turn opened
    assert (judge.yes, judge.no) == tuple(judge.tokenizer(w, add_special_tokens=False)["input_ids"][0] for w in ("Yes", "No"))
    judge.tokenizer.chat_template, judge.chat = None, False  # a base model: the question ends with "Answer:"
    assert judge.tokenizer.decode(judge.question_ids("2 + 2?", "4", "4")).endswith("Truth: 4\nRight?\nAnswer:")


def test_a_score_config_names_a_judge_that_the_score_stage_records_as_an_input(cli, tmp_path, tiny_model, prompts_file):
    cfg = ScoreConfig(reward=f"judge:{tiny_model}", judge_template="Is '{response}' a good answer to '{prompt}'?", judge_yes="yes", judge_no="no")
    reward = load_rewards(cfg)
    assert reward.spec == f"judge:{tiny_model}" and reward.terms[0].name == "judge"
    assert cli("rollout", "--prompts", prompts_file, "--model", tiny_model, "--out", tmp_path / "r", "--n", "2", "--max-new-tokens", "4").exit_code == 0
    config = tmp_path / "judge.toml"
    config.write_text(f'[score]\nreward = "judge:{tiny_model}"\njudge_template = "Is \'{{response}}\' a good answer to \'{{prompt}}\'?"\njudge_yes = "yes"\njudge_no = "no"\n')
    result = cli("score", "--rollouts", tmp_path / "r", "--out", tmp_path / "s", "--config", config)
    assert result.exit_code == 0, result.stderr
    scored = shards.read(str(tmp_path / "s"))
    direct = JudgeReward(tiny_model, settings=JudgeSettings("Is '{response}' a good answer to '{prompt}'?", "yes", "no"))
    table = scored.table
    prompts = [p if p is not None else m[-1]["content"] for p, m in zip(table.column("prompt").to_pylist(), table.column("messages").to_pylist())]
    expected = direct(prompts=prompts, responses=table.column("response").to_pylist(), ground_truths=table.column("ground_truth").to_pylist())
    assert table.column("reward").to_pylist() == pytest.approx(expected, abs=1e-5)
    assert tiny_model in [ref.uri for ref in scored.manifest.inputs]  # a new judge makes a new score


@pytest.mark.parametrize(("template", "message"), [
    ("{question}: {response}", "score.judge_template names {question}; it may use {prompt}, {response} and {ground_truth}"),
    ("Is it right?", "score.judge_template must say where the response goes with {response}"),
    ("{response", "score.judge_template is not a template"),
])
def test_a_template_the_judge_cannot_fill_is_refused(template, message):
    with pytest.raises(ConfigError, match=message.replace("{", "\\{").replace("}", "\\}").replace("(", "\\(").replace(")", "\\)")):
        ScoreConfig(judge_template=template)
    check_template(DEFAULT_TEMPLATE)


def test_verdicts_the_judge_cannot_tell_apart_are_refused(cli, tmp_path, tiny_model):
    with pytest.raises(ConfigError, match="two different words"):
        ScoreConfig(judge_yes="Yes", judge_no="Yes")
    with pytest.raises(InputError, match="start with the same token"):
        JudgeReward(tiny_model, settings=JudgeSettings(DEFAULT_TEMPLATE, "Yesterday", "Yesteryear"))
    rollouts = tmp_path / "r"
    shards.write(pa.table(ROLLOUT_VALUES), str(rollouts), shards.Manifest(stage="rollout"))
    result = cli("score", "--rollouts", rollouts, "--out", tmp_path / "s", "--reward", f"judge:{tmp_path / 'nowhere'}")
    assert result.exit_code == 2 and "does not exist" in one_line_error(result)


def test_a_pipeline_scored_by_a_judge_replays_its_score_identical(cli, tmp_path, tiny_model, prompts_file):
    (tmp_path / "judge.toml").write_text(
        f'[model]\npath = "{tiny_model}"\n[data]\nprompts = "{prompts_file}"\nbatch_size = 3\n'
        '[rollout]\nn = 2\nmax_new_tokens = 4\n'
        f'[score]\nreward = "judge:{tiny_model}"\njudge_template = "Q: {{prompt}} A: {{response}} Good?"\n'
        '[update]\nlr = 1e-3\nmicro_batch_size = 6\n[pipeline]\niterations = 2\n'
    )
    run = tmp_path / "run"
    result = cli("pipeline", tmp_path / "judge.toml", "--run-dir", run, "--quiet")
    assert result.exit_code == 0, result.stderr
    rewards = shards.read(str(run / "iter-0002" / "score")).table.column("reward").to_pylist()
    assert all(0 < r < 1 for r in rewards)
    replayed = cli("replay", run / "iter-0002" / "score", "--check")
    assert replayed.exit_code == 0 and "identical" in replayed.stdout, (replayed.stdout, replayed.stderr)
