"""The CPU decode attention computes what SDPA computes, and the HF engine generates with it."""

import numpy as np
import pytest
import torch
from torch.nn.functional import scaled_dot_product_attention

from rlctl.backends import decode_attention
from rlctl.backends.base import SamplingParams
from rlctl.backends.decode_attention import decode_step_attention
from rlctl.backends.hf import HFPolicy

ROWS, HEADS, KV_HEADS, LENGTH, DIM = 5, 8, 2, 11, 16


def padded_mask() -> torch.Tensor:
    """[B, 1, 1, L], True attends; row r is left-padded by r positions."""
    mask = torch.ones(ROWS, 1, 1, LENGTH, dtype=torch.bool)
    for r in range(ROWS):
        mask[r, ..., :r] = False
    return mask


def sdpa(query, key, value, mask):
    return scaled_dot_product_attention(query, key, value, attn_mask=mask, enable_gqa=True).transpose(1, 2)


@pytest.mark.parametrize("dtype, tolerance", [(torch.float32, 1e-6), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("mask_kind", ["none", "bool", "additive", "per-head"])
def test_one_token_attention_equals_sdpa_with_grouped_heads_and_padding(dtype, tolerance, mask_kind):
    torch.manual_seed(0)
    query = torch.randn(ROWS, HEADS, 1, DIM, dtype=dtype)
    key, value = (torch.randn(ROWS, KV_HEADS, LENGTH, DIM, dtype=dtype) for _ in range(2))
    mask = {
        "none": None,
        "bool": padded_mask(),
        "additive": torch.zeros(ROWS, 1, 1, LENGTH).masked_fill(~padded_mask(), float("-inf")),
        "per-head": padded_mask().expand(ROWS, HEADS, 1, LENGTH).clone(),
    }[mask_kind]
    expected = sdpa(query.float(), key.float(), value.float(), mask)
    got = decode_step_attention(query, key, value, mask, scaling=None)
    assert got.shape == (ROWS, 1, HEADS, DIM) and got.dtype == dtype
    torch.testing.assert_close(got.float(), expected, atol=tolerance, rtol=tolerance)


def test_prompts_and_training_forwards_go_to_sdpa():
    torch.manual_seed(0)
    module = torch.nn.Module()
    module.num_key_value_groups, module.is_causal = HEADS // KV_HEADS, True
    query = torch.randn(ROWS, HEADS, 3, DIM)
    key, value = (torch.randn(ROWS, KV_HEADS, 3, DIM) for _ in range(2))
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    module.eval()
    torch.testing.assert_close(decode_attention.cpu_decode_attention(module, query, key, value, None)[0], sdpa_attention_forward(module, query, key, value, None)[0])
    one = query[:, :, :1]
    module.train()
    assert torch.equal(decode_attention.cpu_decode_attention(module, one, key, value, None)[0], sdpa_attention_forward(module, one, key, value, None)[0])


@pytest.mark.parametrize("dtype, tolerance", [("fp32", 1e-5), ("bf16", 0.1)])
def test_generation_with_it_samples_what_sdpa_samples(tiny_model, monkeypatch, dtype, tolerance):
    policy = HFPolicy.load(tiny_model, "cpu")
    texts = ["hello there", "12 + 3 =", "a", "The answer is"]
    batch = [policy.tokenizer(t)["input_ids"] for t in texts] * 2  # prompts of different lengths: padded rows
    params = SamplingParams(max_new_tokens=10, temperature=1.0, seed=5)
    calls = []
    monkeypatch.setattr(decode_attention, "decode_step_attention", lambda *a: calls.append(1) or decode_step_attention(*a))
    ours = policy.generate(batch, params, compute_dtype=dtype)
    layers = policy.model.config.num_hidden_layers
    assert len(calls) == 9 * layers  # every step after the prompt's, in every layer
    monkeypatch.setenv("RLCTL_DECODE_ATTENTION", "sdpa")
    theirs = policy.generate(batch, params, compute_dtype=dtype)
    assert len(calls) == 9 * layers
    same = sum(a.response_ids == b.response_ids for a, b in zip(ours, theirs))
    assert same >= (len(batch) if dtype == "fp32" else len(batch) // 2)  # bf16 rounding may flip a sample
    for a, b in zip(ours, theirs):
        if a.response_ids == b.response_ids:
            np.testing.assert_allclose(a.logprobs, b.logprobs, atol=tolerance)
    assert policy.model.config._attn_implementation != decode_attention.NAME  # the model's own again
