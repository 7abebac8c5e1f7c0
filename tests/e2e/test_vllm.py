"""The vLLM rollout engine (CPU build in CI): the rollouts schema with the HF engine's meaning of
`rollout_logprobs`, seeded rows, weights pushed in place and checked every step, replay.
Skipped where vLLM is not installed (`make vllm`); .ci/run installs it."""

import json
import math

import numpy as np
import pytest
import torch

from rlctl import shards
from rlctl.backends.base import SamplingParams
from rlctl.backends.vllm_engine import logprobs_mode
from rlctl.errors import InputError
from tests.conftest import assert_not_written, one_line_error


def test_the_logprob_mode_is_the_one_that_means_what_the_hf_engine_means():
    assert logprobs_mode(SamplingParams(8, temperature=1.0, top_p=0.9, top_k=50)) == "raw_logprobs"  # T = 1: raw is log softmax(logits)
    assert logprobs_mode(SamplingParams(8, temperature=0.7)) == "processed_logprobs"  # nothing truncates: processed is log softmax(logits / T)
    with pytest.raises(InputError, match="top_p = 1, top_k = 0, min_p = 0 and repetition_penalty = 1"):
        logprobs_mode(SamplingParams(8, temperature=0.7, top_p=0.9))
    with pytest.raises(InputError, match="repetition_penalty=1.3"):  # vLLM's processed log-probs are after its penalties
        logprobs_mode(SamplingParams(8, temperature=0.7, repetition_penalty=1.3))
    assert logprobs_mode(SamplingParams(8, temperature=1.0, repetition_penalty=1.3)) == "raw_logprobs"  # raw: before them
    with pytest.raises(InputError, match="min_p=0.1"):  # min-p truncates too
        logprobs_mode(SamplingParams(8, temperature=0.7, min_p=0.1))
    assert logprobs_mode(SamplingParams(8, temperature=1.0, min_p=0.1)) == "raw_logprobs"


def test_asking_for_vllm_where_it_is_not_installed_names_the_install_step(cli, tmp_path, tiny_model, prompts_file, monkeypatch):
    monkeypatch.setattr("rlctl.backends.vllm_engine.vllm_available", lambda: False)
    result = cli("rollout", "--prompts", prompts_file, "--model", tiny_model, "--out", tmp_path / "r", "--backend", "vllm")
    assert result.exit_code == 2
    assert "make vllm" in one_line_error(result)
    assert_not_written(tmp_path / "r")


vllm = pytest.importorskip("vllm")


@pytest.fixture(scope="module")
def six_prompts(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("prompts") / "six.jsonl"
    path.write_text("".join(json.dumps({"id": f"q{i}", "prompt": f"Question {i}: what is {i} plus {i}?"}) + "\n" for i in range(6)))
    return str(path)


def test_vllm_rollout_writes_seeded_rows_whose_logprobs_the_trainer_recomputes(cli, tmp_path, tiny_model, six_prompts):
    for out in ("a", "b"):
        result = cli("rollout", "--prompts", six_prompts, "--model", tiny_model, "--out", tmp_path / out, "--n", "4", "--max-new-tokens", "12", "--backend", "vllm", "--seed", "7")
        assert result.exit_code == 0, result.stderr
    a, b = (shards.read(str(tmp_path / out), "rollouts").table for out in ("a", "b"))
    assert a.num_rows == 24
    assert a.column("response_ids").to_pylist() == b.column("response_ids").to_pylist()  # same seed, same tokens
    assert len({tuple(r) for r in a.column("response_ids").to_pylist()}) > 20  # and the samples of a prompt differ
    result = cli("score", "--rollouts", tmp_path / "a", "--out", tmp_path / "s", "--reward", "builtin:length", "--policy", tiny_model)
    assert result.exit_code == 0, result.stderr
    scores = shards.read(str(tmp_path / "s"), "scores").table
    engine = np.concatenate([np.asarray(x) for x in scores.column("rollout_logprobs").to_pylist()])
    trainer = np.concatenate([np.asarray(x) for x in scores.column("old_logprobs").to_pylist()])
    assert np.abs(engine - trainer).max() < 1e-3  # fp32; measured ≈ 2e-6 on the small preset


def test_vllm_rollout_at_another_temperature_keeps_the_hf_meaning(cli, tmp_path, tiny_model, six_prompts):
    result = cli("rollout", "--prompts", six_prompts, "--model", tiny_model, "--out", tmp_path / "r", "--n", "2", "--max-new-tokens", "8", "--backend", "vllm", "--temperature", "0.7")
    assert result.exit_code == 0, result.stderr
    result = cli("score", "--rollouts", tmp_path / "r", "--out", tmp_path / "s", "--reward", "builtin:length", "--policy", tiny_model)
    assert result.exit_code == 0, result.stderr
    scores = shards.read(str(tmp_path / "s"), "scores").table
    engine = np.concatenate([np.asarray(x) for x in scores.column("rollout_logprobs").to_pylist()])
    trainer = np.concatenate([np.asarray(x) for x in scores.column("old_logprobs").to_pylist()])  # log softmax(logits / 0.7)
    assert np.abs(engine - trainer).max() < 1e-3


def test_vllm_with_min_p_draws_only_tokens_at_least_that_share_as_likely_as_the_likeliest(cli, tmp_path, tiny_model, six_prompts):
    """rollout.min_p reaches vLLM's sampler: every drawn token's probability (one forward of the
    model, T = 1) is at least min_p × its position's largest; without it some are not."""
    from rlctl.backends.hf import HFPolicy, pack

    policy = HFPolicy.load(tiny_model, "cpu")
    shortfall = {}
    for name, extra in (("min-p", ("--min-p", "0.6")), ("plain", ())):
        args = ("--n", "4", "--max-new-tokens", "8", "--backend", "vllm", "--seed", "3", *extra)
        result = cli("rollout", "--prompts", six_prompts, "--model", tiny_model, "--out", tmp_path / name, *args)
        assert result.exit_code == 0, result.stderr
        rows = shards.read(str(tmp_path / name), "rollouts").table
        prompts, responses = rows.column("prompt_ids").to_pylist(), rows.column("response_ids").to_pylist()
        packed = pack(prompts, responses, policy.pad_id, "cpu")
        with torch.no_grad():
            logits = policy.model(input_ids=packed.input_ids, attention_mask=packed.attention_mask, position_ids=packed.position_ids).logits
        logp = torch.log_softmax(logits.gather(1, packed.logit_index.unsqueeze(-1).expand(-1, -1, logits.shape[-1])).float(), -1)
        drawn = logp.gather(-1, packed.response_ids.unsqueeze(-1)).squeeze(-1)
        shortfall[name] = float(torch.where(packed.response_mask.bool(), logp.max(-1).values + math.log(0.6) - drawn, -math.inf).max())
    assert shortfall["min-p"] < 1e-3 and shortfall["plain"] > 0.1


@pytest.mark.slow
def test_vllm_with_a_repetition_penalty_repeats_less_and_returns_the_policys_logprobs(cli, tmp_path, tiny_model, six_prompts):
    """rollout.repetition_penalty reaches vLLM's sampler (greedy: fewer tokens the prompt or the
    response held already), and at T = 1 its raw log-probs are the policy's, before the penalty."""
    from rlctl.backends.hf import HFPolicy

    def rollout(name, *extra):
        result = cli("rollout", "--prompts", six_prompts, "--model", tiny_model, "--out", tmp_path / name, "--max-new-tokens", "16", "--backend", "vllm", *extra)
        assert result.exit_code == 0, result.stderr
        return shards.read(str(tmp_path / name), "rollouts").table

    def repeats(table):
        rows = zip(table.column("prompt_ids").to_pylist(), table.column("response_ids").to_pylist())
        return sum(token in set(prompt) | set(response[:t]) for prompt, response in rows for t, token in enumerate(response))

    plain, strong = rollout("plain", "--temperature", "0"), rollout("strong", "--temperature", "0", "--repetition-penalty", "1e4")
    assert repeats(plain) > 0 and repeats(strong) == 0
    sampled = rollout("sampled", "--n", "2", "--seed", "2", "--repetition-penalty", "1.5")
    policy = HFPolicy.load(tiny_model, "cpu")
    prompts, responses = sampled.column("prompt_ids").to_pylist(), sampled.column("response_ids").to_pylist()
    engine = sampled.column("rollout_logprobs").to_pylist()
    trainer = policy.logprobs(prompts, responses, temperature=1.0)
    assert max(abs(a - b) for e, t in zip(engine, trainer) for a, b in zip(e, t)) < 1e-3


def test_vllm_stops_at_a_stop_string_where_the_hf_rule_cuts(cli, tmp_path, tiny_model, six_prompts):
    """vLLM finds stop strings in its own detokenized text; its rows are the unstopped rows cut
    by rlctl's rule (rlctl.backends.stop_strings), and the string stays in the response."""
    common = ["--prompts", six_prompts, "--model", tiny_model, "--n", "2", "--max-new-tokens", "24", "--backend", "vllm", "--seed", "5"]
    assert cli("rollout", *common, "--out", tmp_path / "free").exit_code == 0
    free = shards.read(str(tmp_path / "free"), "rollouts").table
    responses = free.column("response").to_pylist()
    stop = max(("a", "e", "s", "t"), key=lambda s: sum(s in r[len(r) // 4:] for r in responses))
    result = cli("rollout", *common, "--out", tmp_path / "stopped", "--stop", stop)
    assert result.exit_code == 0, result.stderr
    stopped = shards.read(str(tmp_path / "stopped"), "rollouts").table
    from transformers import AutoTokenizer

    from rlctl.backends.base import Generation
    from rlctl.backends.stop_strings import StopStrings

    stops = StopStrings(AutoTokenizer.from_pretrained(tiny_model), [stop])
    expected = [stops.cut(Generation(ids, [0.0] * len(ids), reason)) for ids, reason in zip(free.column("response_ids").to_pylist(), free.column("finish_reason").to_pylist())]
    assert sum(g.finish_reason == "stop" for g in expected) >= 4
    assert stopped.column("response_ids").to_pylist() == [g.response_ids for g in expected]
    assert stopped.column("finish_reason").to_pylist() == [g.finish_reason for g in expected]


def test_vllm_takes_tool_turns_as_the_hf_engine_does(cli, tmp_path, tiny_model, six_prompts):
    """Greedy, fp32: the same exchanges with a tool from either engine (rlctl.tool_turns)."""
    (tmp_path / "tools.py").write_text("def echo(responses):\n    return [f'<r>{len(r)}</r>' for r in responses]\n")
    common = ["--prompts", six_prompts, "--model", tiny_model, "--max-new-tokens", "24", "--temperature", "0", "--set", "rollout.dtype=fp32"]
    assert cli("rollout", *common, "--out", tmp_path / "free").exit_code == 0
    responses = shards.read(str(tmp_path / "free"), "rollouts").table.column("response").to_pylist()
    stop = max(("a", "e", "s", "t", "o", "i", "n"), key=lambda s: sum(s in r[: len(r) // 2] for r in responses))
    tool = ["--stop", stop, "--set", f"rollout.tool={tmp_path / 'tools.py'}:echo", "--set", "rollout.max_tool_calls=2"]
    for backend in ("hf", "vllm"):
        result = cli("rollout", *common, *tool, "--out", tmp_path / backend, "--backend", backend)
        assert result.exit_code == 0, result.stderr
    hf, ours = (shards.read(str(tmp_path / b), "rollouts").table for b in ("hf", "vllm"))
    masks = hf.column("loss_mask").to_pylist()
    assert sum(hf.column("tool_calls").to_pylist()) >= 2 and any(False in m and m[-1] for m in masks)  # a turn after the tool's text
    for column in ("response_ids", "loss_mask", "tool_calls", "finish_reason"):
        assert ours.column(column).to_pylist() == hf.column(column).to_pylist(), column


def test_vllm_refuses_a_temperature_with_truncation_before_starting(cli, tmp_path, tiny_model, six_prompts):
    result = cli("rollout", "--prompts", six_prompts, "--model", tiny_model, "--out", tmp_path / "r", "--backend", "vllm", "--temperature", "0.7", "--top-p", "0.9")
    assert result.exit_code == 2
    assert "top_p = 1, top_k = 0, min_p = 0 and repetition_penalty = 1" in one_line_error(result)
    assert_not_written(tmp_path / "r")


def grpo_run(tmp_path, *extra: str) -> list[str]:
    return [
        "pipeline", "examples/grpo.toml", "--run-dir", str(tmp_path / "run"), "--iterations", "3", "--quiet",
        "--set", "rollout.backend=vllm", *extra,
    ]


def test_a_vllm_pipeline_checks_the_pushed_weights_every_iteration_and_replays_identically(cli, tmp_path):
    result = cli(*grpo_run(tmp_path, "--set", "pipeline.keep_checkpoints=0"))
    assert result.exit_code == 0, result.stderr
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["weights_in_sync"] for r in rows] == [True, True, True]
    assert all(r["weight_sync_seconds"] > 0 for r in rows)
    assert all(r["logprob_mismatch"] < 1e-4 and r["rollout_is/frac_beyond_threshold"] == 0 for r in rows)
    update = json.loads((tmp_path / "run" / "iter-0002" / "update" / "_manifest.json").read_text())
    assert update["state"]["handover"]["mode"] == "in-place push into the vLLM engine"
    assert update["state"]["handover"]["weights_in_sync"] is True
    replayed = cli("replay", tmp_path / "run" / "iter-0002" / "rollout", "--check")
    assert replayed.exit_code == 0, replayed.stderr
    assert "identical" in replayed.stdout


def test_a_skipped_weight_push_is_caught_before_the_next_rollout(cli, tmp_path, monkeypatch):
    monkeypatch.setenv("RLCTL_FAULT_SKIP", "push-weights-")
    result = cli(*grpo_run(tmp_path))
    assert result.exit_code == 1
    line = one_line_error(result)
    assert "not generating with the trainer's weights" in line and "norm/embedding tensors differ" in line
    assert not (tmp_path / "run" / "iter-0001" / "update" / "_manifest.json").exists()  # the update is not committed
    assert not (tmp_path / "run" / "checkpoints").exists()


@pytest.mark.slow
def test_the_grpo_example_learns_with_the_vllm_engine(cli, tmp_path):
    from tests.e2e.test_examples import learning_margin

    result = cli("pipeline", "examples/grpo.toml", "--run-dir", str(tmp_path / "run"), "--quiet", "--set", "rollout.backend=vllm")
    assert result.exit_code == 0, result.stderr
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 30 and all(r["weights_in_sync"] for r in rows)
    assert learning_margin(rows) >= 0.5  # the margin stated in examples/grpo.toml


@pytest.mark.slow
def test_vllm_engines_on_two_ray_workers_write_the_rows_of_one_and_stay_in_sync(ray_session, cli, tmp_path, tiny_model, six_prompts):
    common = ["--prompts", six_prompts, "--model", tiny_model, "--n", "2", "--max-new-tokens", "8", "--backend", "vllm"]
    assert cli("rollout", *common, "--out", tmp_path / "local").exit_code == 0
    result = cli("rollout", *common, "--out", tmp_path / "ray", "--workers-backend", "ray", "--workers", "2")
    assert result.exit_code == 0, result.stderr
    local, ray = (shards.read(str(tmp_path / out), "rollouts").table for out in ("local", "ray"))
    assert ray.column("response_ids").to_pylist() == local.column("response_ids").to_pylist()  # each row its own seeded request
    result = cli(*grpo_run(tmp_path, "--iterations", "2", "--workers-backend", "ray", "--workers", "2"))
    assert result.exit_code == 0, result.stderr
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["weights_in_sync"] for r in rows] == [True, True]
    handover = json.loads((tmp_path / "run" / "iter-0002" / "update" / "_manifest.json").read_text())["state"]["handover"]
    assert handover["workers"] == 2 and "each rank's vLLM engine" in handover["mode"]


def test_a_resharded_folder_loads_in_vllm_and_generates_what_transformers_does(cli, tmp_path, tiny_model):
    import torch
    from transformers import AutoModelForCausalLM

    from rlctl.backends.vllm_engine import VLLMEngine

    result = cli("reshard", "--checkpoint", tiny_model, "--out", tmp_path / "w", "--dtype", "bf16", "--check")
    assert result.exit_code == 0, result.stderr
    engine = VLLMEngine.load(str(tmp_path / "w"), "cpu")  # bf16 weights, fp32 compute
    try:
        model = AutoModelForCausalLM.from_pretrained(tmp_path / "w", dtype=torch.float32)
        check = engine.check_against(model)
        assert check.in_sync and check.tokens_equal and check.max_logprob_diff < 1e-3
    finally:
        engine.close()


def test_a_lora_run_pushes_merged_weights_into_vllm_every_iteration(cli, tmp_path):
    lora = 'update.lora={r=8, alpha=16, target_modules=["q_proj", "v_proj", "down_proj"]}'
    result = cli(*grpo_run(tmp_path, "--set", lora, "--set", "update.lr=1e-2"))
    assert result.exit_code == 0, result.stderr
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["weights_in_sync"] for r in rows] == [True, True, True]
    assert all(r["logprob_mismatch"] < 1e-4 for r in rows)
    tied = cli(*grpo_run(tmp_path / "tied", "--set", 'update.lora={r=8, target_modules=["lm_head"]}'))
    assert tied.exit_code == 2 and "vLLM ties them again" in one_line_error(tied)


def test_a_merged_lora_checkpoint_loads_in_vllm_and_generates_what_the_adapter_does(cli, tmp_path):
    from rlctl.backends.hf import HFPolicy
    from rlctl.backends.vllm_engine import VLLMEngine

    lora = 'update.lora={r=8, alpha=16, target_modules=["q_proj", "v_proj", "down_proj"]}'
    run = cli("pipeline", "examples/grpo.toml", "--run-dir", str(tmp_path / "run"), "--iterations", "2", "--quiet", "--set", lora, "--set", "update.lr=1e-2")
    assert run.exit_code == 0, run.stderr
    checkpoint = tmp_path / "run" / "checkpoints" / "iter-0002"
    merged = cli("reshard", "--checkpoint", checkpoint, "--out", tmp_path / "merged", "--merge-lora", "--check")
    assert merged.exit_code == 0, merged.stderr
    engine = VLLMEngine.load(str(tmp_path / "merged"), "cpu")
    try:
        check = engine.check_against(HFPolicy.load(str(checkpoint), "cpu").model)  # the adapter model itself
        assert check.in_sync and check.tokens_equal and check.max_logprob_diff < 1e-3
    finally:
        engine.close()
