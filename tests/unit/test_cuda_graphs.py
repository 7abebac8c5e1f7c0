"""Decoding from a static batch (rlctl.backends.cuda_graphs): what a GPU captures into a CUDA
graph and replays. On the CPU the same operations run uncaptured, so their tokens, log-probs,
finish reasons and token counts are checked here against the step-by-step loop; the capture
itself is checked where a GPU is present."""

import numpy as np
import pytest
import torch

from rlctl.backends import cuda_graphs
from rlctl.backends.base import SamplingParams
from rlctl.backends.hf import HFPolicy
from rlctl.errors import InputError

needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.fixture
def policy(tiny_model, monkeypatch):
    monkeypatch.setenv("RLCTL_DECODE_PRODUCTS", "modules")  # both loops from the same products
    return HFPolicy.load(tiny_model, "cpu")


def prompts(policy):
    texts = ["hello there", "12 + 3 =", "a", "The answer is a longer prompt"]
    return [policy.tokenizer(t)["input_ids"] for t in texts] * 3


def generate(policy, params, *, static: bool, monkeypatch, dtype="fp32"):
    """`policy.generate`, its batches decoded from a static batch or step by step; with the
    counts `on_tokens` was given."""
    monkeypatch.setattr(cuda_graphs, "decode_mode", lambda model, device: "graph" if static else None)
    counts: list[int] = []
    out = policy.generate(prompts(policy), params, on_tokens=counts.append, compute_dtype=dtype, batch_size=8)
    return out, counts


@pytest.mark.parametrize("dtype,penalty", [("fp32", 1.0), ("bf16", 1.0), ("fp32", 1.3)])
def test_a_static_batch_samples_what_the_step_by_step_loop_samples(policy, monkeypatch, dtype, penalty):
    policy.stop_ids = list(range(0, 512, 13))  # 1 token in 13 stops: rows finish at different steps
    params = SamplingParams(max_new_tokens=20, temperature=1.0, seed=5, repetition_penalty=penalty)
    static, static_counts = generate(policy, params, static=True, monkeypatch=monkeypatch, dtype=dtype)
    stepwise, stepwise_counts = generate(policy, params, static=False, monkeypatch=monkeypatch, dtype=dtype)
    assert {g.finish_reason for g in static} == {"stop", "length"}  # the check covers both endings
    assert [g.response_ids for g in static] == [g.response_ids for g in stepwise]
    assert [g.finish_reason for g in static] == [g.finish_reason for g in stepwise]
    for a, b in zip(static, stepwise):
        np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-5 if dtype == "fp32" else 2e-2)
    # every kept token is reported, though a static batch reports them every CHECK_EVERY steps
    assert sum(static_counts) == sum(stepwise_counts) == sum(len(g.response_ids) for g in static)


def test_a_static_batch_stops_looking_once_every_row_has_stopped(policy, monkeypatch):
    policy.stop_ids = list(range(1, 512, 2))  # half the tokens stop: every row ends within a few steps
    params = SamplingParams(max_new_tokens=64, temperature=1.0, seed=1)
    steps = []
    original = cuda_graphs.StaticDecoder.__call__
    monkeypatch.setattr(cuda_graphs.StaticDecoder, "__call__", lambda self, *a: steps.append(a[-1]) or original(self, *a))
    out, _ = generate(policy, params, static=True, monkeypatch=monkeypatch)
    assert all(g.finish_reason == "stop" for g in out)
    longest = max(len(g.response_ids) for g in out)
    assert max(steps) < longest + cuda_graphs.CHECK_EVERY  # not the 64 steps the batch could take


def test_the_static_layer_writes_at_its_slot_and_returns_the_whole_buffer():
    keys, values = torch.zeros(2, 1, 6, 3), torch.zeros(2, 1, 6, 3)
    slot = torch.tensor([4])
    layer = cuda_graphs.StaticLayer(keys, values, slot)
    k, v = torch.ones(2, 1, 1, 3), torch.full((2, 1, 1, 3), 2.0)
    got_keys, got_values = layer.update(k, v)
    assert got_keys is keys and got_values is values
    assert keys[:, :, 4].eq(1).all() and values[:, :, 4].eq(2).all()
    assert keys[:, :, :4].eq(0).all() and keys[:, :, 5].eq(0).all()


def test_graphs_decode_on_a_gpu_only_and_can_be_turned_off(policy, monkeypatch):
    model = policy.model.eval()
    assert cuda_graphs.decode_mode(model, torch.device("cpu")) is None
    assert cuda_graphs.decode_mode(model, torch.device("cuda")) == "graph"  # the rule; no GPU is touched
    monkeypatch.setenv("RLCTL_CUDA_GRAPHS", "off")
    assert cuda_graphs.decode_mode(model, torch.device("cuda")) is None
    monkeypatch.setenv("RLCTL_CUDA_GRAPHS", "sometimes")
    with pytest.raises(InputError, match="RLCTL_CUDA_GRAPHS"):
        cuda_graphs.decode_mode(model, torch.device("cuda"))


def test_a_static_cache_is_sized_for_the_prompt_and_every_new_token(policy):
    from rlctl.backends.kv_cache import decoding_cache

    _, cache, mask, _ = policy._prompt_pass(policy.model, prompts(policy), decoding_cache(policy.model.config))
    config, head_dim = policy.model.config, policy.model.model.layers[0].self_attn.head_dim
    expected = 2 * config.num_hidden_layers * len(mask) * config.num_key_value_heads * (mask.shape[1] + 10) * head_dim * 4  # fp32
    assert cuda_graphs.cache_bytes(cache, len(mask), mask.shape[1] + 10) == expected


@needs_gpu
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_a_replayed_graph_gives_the_uncaptured_steps_logits_bit_for_bit(tiny_model, dtype):
    from rlctl.backends.kv_cache import decoding_cache

    policy = HFPolicy.load(tiny_model, "cuda")
    model = policy._bf16.of(policy.model) if dtype == "bf16" else policy.model.eval()
    batch = prompts(policy)
    logits = {}
    with torch.inference_mode():
        for graph in (True, False):
            first, cache, mask, positions = policy._prompt_pass(model, batch, decoding_cache(model.config))
            decoder = cuda_graphs.StaticDecoder(model, cache, mask, 6, graph=graph)
            tokens, steps = first.argmax(-1), []
            for step in range(6):
                out = decoder(tokens, positions[:, -1] + 1 + step, step).clone()
                steps.append(out)
                tokens = out.argmax(-1)
            logits[graph] = torch.stack(steps)
    assert torch.equal(logits[True], logits[False])


@needs_gpu
def test_graphed_generation_on_a_gpu_matches_the_step_by_step_loop(tiny_model, monkeypatch):
    policy = HFPolicy.load(tiny_model, "cuda")
    policy.stop_ids = list(range(0, 512, 13))
    params = SamplingParams(max_new_tokens=20, temperature=1.0, seed=5)
    graphed = policy.generate(prompts(policy), params, batch_size=8)
    monkeypatch.setenv("RLCTL_CUDA_GRAPHS", "off")
    stepwise = policy.generate(prompts(policy), params, batch_size=8)
    assert [g.response_ids for g in graphed] == [g.response_ids for g in stepwise]
    for a, b in zip(graphed, stepwise):
        np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-4)
