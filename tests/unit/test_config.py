"""Typed config: TOML sections → frozen dataclasses, overrides, and errors that point at the key."""

import dataclasses

import pytest

from rlctl.config import Config, ConfigError, load_config, parse_toml_file, to_toml


def write(tmp_path, text):
    path = tmp_path / "c.toml"
    path.write_text(text)
    return path


def test_sections_map_to_typed_frozen_objects(tmp_path):
    cfg = load_config(write(tmp_path, "[update]\nlr = 1e-5\nepochs = 2\n[rollout]\nn = 4\n"))
    assert cfg.update.lr == 1e-5 and cfg.update.epochs == 2 and cfg.rollout.n == 4
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.update.lr = 1.0


def test_overrides_coerce_types():
    cfg = load_config(None, ["update.lr=3e-4", "rollout.n=8", "advantage.norm_by_std=false", "model.path=models/x"])
    assert (cfg.update.lr, cfg.rollout.n, cfg.advantage.norm_by_std, cfg.model.path) == (3e-4, 8, False, "models/x")


def test_int_is_accepted_for_float_but_not_the_reverse():
    assert load_config(None, ["update.lr=1"]).update.lr == 1.0
    with pytest.raises(ConfigError, match=r"rollout.n: expected int, got 1.5"):
        load_config(None, ["rollout.n=1.5"])


def test_unknown_key_suggests_the_nearest(tmp_path):
    with pytest.raises(ConfigError, match=r"unknown key update.epochz; did you mean update.epochs\?"):
        load_config(write(tmp_path, "[update]\nepochz = 2\n"))


@pytest.mark.parametrize("typed,meant", [
    ("update.lerning_rate", "update.lr"),  # verl/TRL's name, misspelt
    ("rollout.num_generations", "rollout.n"),  # TRL's name
    ("update.max_new_tokens", "rollout.max_new_tokens"),  # the right key in another section
    ("advantage.gama", "advantage.gamma"),
    ("update.epsilon_high", "update.clip_ratio_high"),  # TRL's GRPOConfig names
    ("update.delta", "update.clip_ratio_c"),
    ("update.off_policy_mask_threshold", "update.off_policy_mask"),
    ("update.use_bias_correction_kl", "update.kl_loss_unbiased"),
    ("update.use_adaptive_entropy", "update.entropy_target"),
])
def test_unknown_key_suggests_the_nearest_over_every_section_and_verl_and_trl_names(typed, meant):
    with pytest.raises(ConfigError, match=rf"did you mean {meant}\?"):
        load_config(None, [f"{typed}=1"])


def test_unknown_section_suggests_the_nearest(tmp_path):
    with pytest.raises(ConfigError, match=r"unknown section \[rollot\]; did you mean rollout\?"):
        load_config(write(tmp_path, "[rollot]\nn = 2\n"))


def test_type_error_names_key_type_and_value(tmp_path):
    with pytest.raises(ConfigError, match=r"update.lr: expected float, got 'fast'"):
        load_config(write(tmp_path, '[update]\nlr = "fast"\n'))


def test_toml_syntax_error_gives_the_line(tmp_path):
    with pytest.raises(ConfigError, match=r"TOML syntax error: .*line 3"):
        load_config(write(tmp_path, "[update]\nlr = 1e-5\nepochs = \n"))


def test_set_of_unknown_key_is_an_error():
    with pytest.raises(ConfigError, match=r"--set 'update.learning_rate=1': unknown key update.learning_rate"):
        load_config(None, ["update.learning_rate=1"])


def test_settings_that_depend_on_each_other_can_be_set_in_any_order():
    """Each section is checked once with all of its new values: a setting that another one
    allows, or a LoRA table given key by key, need not come in the order the checks read them."""
    cfg = load_config(None, ["dpo.loss=ipo", "dpo.label_smoothing=0.1", "dpo.loss=robust"])  # ipo takes no label smoothing; robust does
    assert (cfg.dpo.loss, cfg.dpo.label_smoothing) == ("robust", 0.1)
    cfg = load_config(None, ["dpo.ref_sync_alpha=0.5", "dpo.lora.r=4", "dpo.ref_sync_every=8", "dpo.lora.r=0", "dpo.lora.alpha=8"])
    assert (cfg.dpo.lora.r, cfg.dpo.lora.alpha, cfg.dpo.ref_sync_every) == (0, 8.0, 8)  # the last value of a key counts, a table's other keys kept
    with pytest.raises(ConfigError, match=r"^--set 'dpo.ref_sync_alpha=0.5', 'dpo.ref_sync_every=8', 'dpo.lora.r=4': dpo.ref_sync_alpha below 1"):  # the section's settings named
        load_config(None, ["dpo.ref_sync_alpha=0.5", "update.lr=1e-5", "dpo.ref_sync_every=8", "dpo.lora.r=4"])


def test_set_needs_section_dot_key():
    with pytest.raises(ConfigError, match="expected section.key=value"):
        load_config(None, ["lr=1"])


def test_resolved_config_renders_back_to_equal_toml(tmp_path):
    cfg = load_config(None, ["update.lr=2e-5", "model.path=a \"b\"", 'rollout.stop=["\\n\\nQuestion:", "</answer>", "é\\t"]'])
    again = load_config(write(tmp_path, to_toml(cfg)))
    assert again == cfg
    assert parse_toml_file(tmp_path / "c.toml")["update"]["lr"] == 2e-5
    assert again.rollout.stop == ("\n\nQuestion:", "</answer>", "é\t")  # control characters escaped, one line each


def test_defaults_are_a_complete_config():
    assert isinstance(load_config(), Config)


def test_micro_batch_tokens_is_auto_or_a_count_of_tokens(tmp_path):
    assert load_config().update.micro_batch_tokens == "auto"
    assert load_config(write(tmp_path, "[update]\nmicro_batch_tokens = 2048\n")).update.micro_batch_tokens == "2048"
    assert load_config(None, ["update.micro_batch_tokens=0"]).update.micro_batch_tokens == "0"
    from rlctl.config import UpdateConfig

    assert UpdateConfig(micro_batch_tokens=4096).micro_batch_tokens == "4096"
    for bad in ("-1", "lots", "1e4"):
        with pytest.raises(ConfigError, match=r"update.micro_batch_tokens must be auto, 0 \(no cap\) or a number of tokens"):
            load_config(None, [f"update.micro_batch_tokens={bad}"])


def test_validation_samples_are_at_least_one():
    assert load_config(overrides=["pipeline.val_n=4", "pipeline.val_temperature=0.6"]).pipeline.val_n == 4
    with pytest.raises(ConfigError, match="pipeline.val_n must be ≥ 1"):
        load_config(overrides=["pipeline.val_n=0"])


def test_a_text_key_set_to_what_toml_reads_as_a_number_keeps_what_was_typed():
    """`--set update.rollout_rs_threshold=1_2` is the ratio range 1 to 2, not TOML's integer 12."""
    cfg = load_config(overrides=["update.rollout_rs=token_k1", "update.rollout_rs_threshold=1_2"])
    assert cfg.update.rollout_rs_threshold == "1_2"
    assert load_config(overrides=["update.micro_batch_tokens=4096"]).update.micro_batch_tokens == "4096"
    assert load_config(overrides=["update.lr=1_0e-6"]).update.lr == 1e-5  # a number key reads TOML's number as before


def test_the_optimal_token_baseline_reads_the_updates_importance_weights_and_turns_sum_pi_squared_on():
    """advantage.otb_rollout_is = auto becomes update.rollout_is with its threshold, and
    score.sum_pi_squared true, for that estimator only; an explicit setting stays."""
    from rlctl.config import resolve_estimator_inputs

    cfg = resolve_estimator_inputs(load_config(overrides=["advantage.estimator=optimal_token_baseline", "update.rollout_is=token", "update.rollout_is_threshold=3.0"]))
    assert (cfg.advantage.otb_rollout_is, cfg.advantage.otb_rollout_is_threshold, cfg.score.sum_pi_squared) == ("token", 3.0, True)
    pinned = resolve_estimator_inputs(load_config(overrides=["advantage.estimator=optimal_token_baseline", "advantage.otb_rollout_is=off", "update.rollout_is=token"]))
    assert pinned.advantage.otb_rollout_is == "off"
    other = load_config(overrides=["update.rollout_is=token"])
    assert resolve_estimator_inputs(other) == other


def test_chat_template_kwargs_are_a_table_of_plain_values_that_survive_the_resolved_config(tmp_path):
    from rlctl.config import to_toml

    cfg = load_config(write(tmp_path, '[data]\nchat_template_kwargs = {enable_thinking = false, "odd key" = "x", depth = 2}\n'))
    assert cfg.data.chat_template_kwargs == {"enable_thinking": False, "odd key": "x", "depth": 2}
    again = tmp_path / "again.toml"
    again.write_text(to_toml(cfg))
    assert load_config(again).data == cfg.data
    assert load_config(None, ["data.chat_template_kwargs={enable_thinking = true}"]).data.chat_template_kwargs == {"enable_thinking": True}
    with pytest.raises(ConfigError, match=r"data.chat_template_kwargs: expected a table like \{name = value\}, got 'yes'"):
        load_config(None, ["data.chat_template_kwargs=yes"])
    with pytest.raises(ConfigError, match=r"data.chat_template_kwargs: 'tools' must be a name with a boolean, number or text value, got \[1\]"):
        load_config(None, ["data.chat_template_kwargs={tools = [1]}"])
