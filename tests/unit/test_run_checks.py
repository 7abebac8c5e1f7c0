"""What a run's metrics suggest changing: each rule fires on its sign, says what to change, and
stays quiet where the run's config already deals with it."""

import pytest

from rlctl.choices import RUN_CHECKS
from rlctl.config import load_config
from rlctl.errors import ConfigError
from rlctl.run_checks import resolved_config, run_findings


def rows(count: int, **metrics) -> list[dict]:
    return [{"iteration": i, "reward_mean": 0.5, **metrics} for i in range(1, count + 1)]


def checks(found) -> list[str]:
    return [f.check for f in found]


def test_a_healthy_run_has_no_findings():
    healthy = rows(5, **{"response_length/clip_ratio": 0.05, "groups/equal_rewards": 0.25, "rollout_is/frac_beyond_threshold": 0.0})
    assert run_findings(healthy) == []
    assert run_findings([]) == []


def test_responses_cut_at_the_length_limit_say_to_raise_max_new_tokens():
    found = run_findings(rows(3, **{"response_length/clip_ratio": 0.62, "response_length/max": 24.0}))
    assert checks(found) == ["truncated"] and found[0].iterations == (3,)
    assert "iteration 3: 62% of the responses ended at the length limit (24 tokens)" in found[0].message
    assert "raise rollout.max_new_tokens" in found[0].message and "score.overlong_buffer" in found[0].message


def test_only_the_last_iteration_counts_for_truncation():
    history = rows(3, **{"response_length/clip_ratio": 0.9})
    history[-1]["response_length/clip_ratio"] = 0.1  # the policy learned to stop
    assert run_findings(history) == []


def test_a_run_is_not_told_to_add_what_it_has():
    cfg = load_config(overrides=["score.overlong_buffer=4"])
    (found,) = run_findings(rows(1, **{"response_length/clip_ratio": 0.5}), cfg)
    assert "raise rollout.max_new_tokens" in found.message and "overlong_buffer" not in found.message
    cfg = load_config(overrides=["update.mask_truncated=true"])
    found = run_findings(rows(1, **{"response_length/clip_ratio": 0.5}), cfg)[0]
    assert "overlong_buffer" in found.message and "mask_truncated" not in found.message


def test_groups_of_equal_rewards_over_the_last_three_iterations_say_the_prompts_carry_no_signal():
    history = rows(4, **{"groups/equal_rewards": 0.95})
    history[-1]["groups/equal_rewards"] = 1.0
    found = run_findings(history, load_config(overrides=['advantage.estimator="rloo"']))
    assert checks(found) == ["equal_rewards"] and found[0].iterations == (2, 3, 4)
    assert "iterations 2-4: 95% or more of the prompt groups gave every sample the same reward" in found[0].message
    assert "RLOO gives those groups no advantage" in found[0].message and "pipeline.dynamic_sampling" in found[0].message


def test_equal_rewards_need_three_iterations_in_a_row():
    history = rows(3, **{"groups/equal_rewards": 1.0})
    history[1]["groups/equal_rewards"] = 0.5
    assert run_findings(history) == []
    assert run_findings(rows(2, **{"groups/equal_rewards": 1.0})) == []
    assert run_findings(rows(3, **{"groups/equal_rewards": None})) == []  # rollout.n = 1


def test_equal_rewards_are_no_finding_where_an_advantage_does_not_compare_within_the_group():
    equal = rows(3, **{"groups/equal_rewards": 1.0})
    assert checks(run_findings(equal)) == ["equal_rewards"]  # no config: the rule assumes a group-relative estimator
    assert run_findings(equal, load_config(overrides=['advantage.estimator="gae"'])) == []  # a critic's values
    assert run_findings(equal, load_config(overrides=["pipeline.dynamic_sampling=true"])) == []  # those groups are dropped


def test_tokens_the_engine_and_trainer_disagree_on_point_to_rollout_is():
    mismatched = rows(2, **{"rollout_is/frac_beyond_threshold": 0.03})
    (found,) = run_findings(mismatched, load_config(overrides=["pipeline.rollout_is_threshold=1.5"]))
    assert found.check == "engine_mismatch"
    assert "iteration 2: 3.0% of the tokens have a trainer/engine probability ratio beyond pipeline.rollout_is_threshold 1.5" in found.message
    assert 'update.rollout_is = "token"' in found.message
    assert run_findings(mismatched, load_config(overrides=['update.rollout_is="token"'])) == []  # already corrected


def test_a_rollout_correction_that_rejects_most_responses_three_iterations_running_says_why():
    history = rows(4, **{"rollout_rs/seq_masked_fraction": 0.8, "logprob_mismatch": 0.012})
    history[0]["rollout_rs/seq_masked_fraction"] = 0.1  # before the window
    history[2]["rollout_rs/seq_masked_fraction"] = 0.55
    (found,) = run_findings(history)
    assert found.check == "rejected" and found.iterations == (2, 3, 4)
    assert found.message.startswith("iterations 2-4: update.rollout_rs rejected 55%-80% of the responses") and "logprob_mismatch 0.012" in found.message
    assert "update.rollout_rs_threshold" in found.message
    history[3]["rollout_rs/seq_masked_fraction"] = 0.3
    assert run_findings(history) == []  # one iteration under half breaks the run of three


def test_a_kl_target_that_stops_every_update_at_its_first_step_three_iterations_running_says_what_to_change():
    history = rows(4, kl_stopped_early=1.0, optimizer_steps=1, approx_kl=0.04)
    history[0]["optimizer_steps"] = 3  # before the window
    (found,) = run_findings(history)
    assert found.check == "kl_stopped" and found.iterations == (2, 3, 4)
    assert found.message.startswith("iterations 2-4: update.target_kl stopped every update after its first optimizer step (approx_kl 0.04 at iteration 4)")
    assert "raise update.target_kl, lower update.lr" in found.message
    history[2]["optimizer_steps"] = 2
    assert run_findings(history) == []  # an update that made two steps breaks the run of three
    assert run_findings(rows(4)) == []  # no target_kl: nothing to say


def test_gpg_groups_of_equal_rewards_carry_no_signal_either():
    equal = rows(3, **{"groups/equal_rewards": 1.0})
    assert checks(run_findings(equal, load_config(overrides=['advantage.estimator="gpg"']))) == ["equal_rewards"]


def test_skipped_optimizer_steps_are_counted_over_the_whole_run():
    history = rows(5)
    history[1]["skipped_steps"] = 2
    history[3]["vf_skipped_steps"] = 1
    (found,) = run_findings(history)
    assert found.check == "skipped_steps" and found.iterations == (2, 4)
    assert found.message.startswith("iterations 2, 4: 3 optimizer steps skipped for a non-finite gradient")


def test_responses_that_collapsed_to_an_end_token_are_a_finding_where_they_were_longer_at_the_start():
    history = rows(5, response_length=1.0, reward_mean=0.95)
    history[0]["response_length"] = 15.3
    (found,) = run_findings(history, run_dir="runs/judge")
    assert found.check == "collapsed" and found.iterations == (3, 4, 5)
    assert found.message.startswith("iterations 3-5: responses average 1 tokens or fewer (iteration 1: 15.3), with mean reward 0.95: the policy learned to stop at once")
    assert "rlctl show runs/judge/iter-0005/score --columns response,reward" in found.message
    history[3]["response_length"] = 2.1  # shortened on purpose (score.length_penalty), not empty
    assert run_findings(history) == []
    assert run_findings(rows(5, response_length=1.0)) == []  # as short from the start: the task's answers are


def test_an_iteration_stopped_by_until_is_not_judged():
    history = rows(2, **{"response_length/clip_ratio": 0.0})
    history.append({"iteration": 3, "stopped_early": True})
    assert run_findings(history) == []


def test_a_run_folder_without_a_readable_config_is_judged_without_one(tmp_path):
    assert resolved_config(tmp_path) is None
    (tmp_path / "config.resolved.toml").write_text("[nosuchsection]\n")
    assert resolved_config(tmp_path) is None
    (tmp_path / "config.resolved.toml").write_text('[advantage]\nestimator = "gae"\n')
    assert resolved_config(tmp_path).advantage.estimator == "gae"


def test_a_run_can_leave_out_the_checks_it_expects_to_fire():
    cut = rows(1, **{"response_length/clip_ratio": 1.0})
    assert run_findings(cut, load_config(overrides=['pipeline.ignore_checks=["truncated"]'])) == []
    with pytest.raises(ConfigError, match="pipeline.ignore_checks: unknown check 'truncation'; the checks: truncated, constant_reward, equal_rewards"):
        load_config(overrides=['pipeline.ignore_checks=["truncation"]'])


def test_a_reward_that_gives_every_sample_one_value_is_one_finding_whatever_the_estimator():
    flat = rows(4, **{"reward_max": 0.0, "reward_min": 0.0, "groups/equal_rewards": 1.0})
    found = run_findings(flat, load_config(overrides=['advantage.estimator="gae"']), "runs/x")
    assert checks(found) == ["constant_reward"] and found[0].iterations == (2, 3, 4)  # not equal_rewards as well
    assert found[0].message.startswith("iterations 2-4: the reward gave every sample of each iteration the same value (0), so no advantage has anything to learn from")
    assert "rlctl show runs/x/iter-0004/score --columns response,reward" in found[0].message
    flat[-1]["reward_max"] = 0.1  # one sample scored: a signal, if a weak one
    assert checks(run_findings(flat)) == ["equal_rewards"]


def test_a_run_whose_every_sample_earns_its_best_reward_is_told_the_task_looks_learned():
    learning = rows(5, reward_max=1.0, reward_min=0.0) + [{"iteration": i, "reward_max": 1.0, "reward_min": 1.0} for i in (6, 7, 8)]
    (found,) = run_findings(learning)
    assert found.check == "constant_reward" and found.message.startswith("iterations 6-8: every sample scored 1, the best reward of the run: the task looks learned")
    never = [{"iteration": i, "reward_max": 0.0, "reward_min": 0.0} for i in range(1, 9)]
    assert "look at what it scored" in run_findings(never)[0].message  # it never varied: a reward that cannot parse the responses
    fell = rows(5, reward_max=1.0, reward_min=0.0) + [{"iteration": i, "reward_max": 0.0, "reward_min": 0.0} for i in (6, 7, 8)]
    assert "look at what it scored" in run_findings(fell)[0].message  # collapsed to the worst: not learned


def test_every_check_is_named_in_the_choices():
    every = rows(3, **{"response_length/clip_ratio": 1.0, "groups/equal_rewards": 1.0, "rollout_is/frac_beyond_threshold": 0.5, "skipped_steps": 1, "rollout_rs/seq_masked_fraction": 0.9, "kl_stopped_early": 1.0, "optimizer_steps": 1})
    flat = rows(3, reward_max=1.0, reward_min=1.0)
    emptied = rows(4, response_length=1.0)
    emptied[0]["response_length"] = 20.0
    assert sorted({*checks(run_findings(every)), *checks(run_findings(flat)), *checks(run_findings(emptied))}) == sorted(RUN_CHECKS)
