"""The KV cache generation decodes with: buffers grown a block at a time give the tokens and
log-probs of transformers' DynamicCache, whatever the prompts' padding, shared prompts, rows
finishing early, and however many blocks a response crosses."""

import numpy as np
import pytest
import torch

from rlctl.backends import kv_cache
from rlctl.backends.base import SamplingParams
from rlctl.backends.hf import HFPolicy
from rlctl.backends.kv_cache import BlockLayer, decoding_cache, padded_length
from rlctl.errors import InputError


@pytest.fixture
def policy(tiny_model):
    return HFPolicy.load(tiny_model, "cpu")


def generate_with(monkeypatch, policy, cache: str, batch, params, **kw):
    monkeypatch.setenv(kv_cache.OVERRIDE_ENV, cache)
    return policy.generate(batch, params, **kw)


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_blocks_generate_the_tokens_and_logprobs_of_the_dynamic_cache(monkeypatch, policy, dtype):
    monkeypatch.setattr(kv_cache, "BLOCK", 4)  # a 30-token response crosses ~8 blocks
    policy.stop_ids = list(range(0, 512, 29))  # rows finish at different steps and leave the batch
    texts = ["hello there", "12 + 3 =", "a", "The answer is, after a long think,"]
    batch = [policy.tokenizer(t)["input_ids"] for t in texts for _ in range(3)]  # prompts of 3 samples, left-padded
    params = SamplingParams(max_new_tokens=30, temperature=1.0, seed=4)
    dynamic = generate_with(monkeypatch, policy, "dynamic", batch, params, compute_dtype=dtype, batch_size=5)
    blocks = generate_with(monkeypatch, policy, "blocks", batch, params, compute_dtype=dtype, batch_size=5)
    assert {g.finish_reason for g in blocks} == {"stop", "length"}
    for d, b in zip(dynamic, blocks):
        assert b.response_ids == d.response_ids and b.finish_reason == d.finish_reason
        np.testing.assert_allclose(b.logprobs, d.logprobs, atol=1e-5)


def test_a_block_layer_returns_the_prompt_then_its_whole_buffer_with_unwritten_positions_zero(monkeypatch):
    monkeypatch.setattr(kv_cache, "BLOCK", 8)
    layer = BlockLayer()
    prompt_k, prompt_v = torch.randn(2, 3, 5, 4), torch.randn(2, 3, 5, 4)
    assert layer.get_mask_sizes(5) == (5, 0)
    keys, values = layer.update(prompt_k, prompt_v)
    assert torch.equal(keys, prompt_k) and torch.equal(values, prompt_v)  # the prompt attends over itself alone
    for step in range(6):  # positions 5..10: the buffer grows from 8 to 16 at position 8
        assert layer.get_mask_sizes(1) == (padded_length(6 + step), 0)
        k = torch.randn(2, 3, 1, 4)
        keys, _ = layer.update(k, torch.randn(2, 3, 1, 4))
        assert keys.shape[-2] == padded_length(6 + step) and torch.equal(keys[:, :, 5 + step], k[:, :, 0])
    assert layer.get_seq_length() == 11
    assert torch.equal(keys[:, :, :5], prompt_k) and not keys[:, :, 11:].any()
    layer.batch_select_indices(torch.tensor([1]))
    assert layer.keys.shape == (1, 3, 16, 4) and layer.get_seq_length() == 11
    layer.crop(-3)  # transformers' convention: drop the last 3 tokens
    assert layer.get_seq_length() == 8 and not layer.keys[:, :, 8:].any() and torch.equal(layer.keys[0, :, :5], prompt_k[1])


def test_the_generation_cache_replaces_only_full_attention_layers(tiny_model):
    from transformers import AutoConfig
    from transformers.cache_utils import DynamicSlidingWindowLayer

    config = AutoConfig.from_pretrained(tiny_model)
    assert all(isinstance(layer, BlockLayer) for layer in decoding_cache(config).layers)
    config.layer_types = ["sliding_attention", "full_attention"] * (config.num_hidden_layers // 2)
    config.sliding_window, config.use_sliding_window = 8, True
    layers = decoding_cache(config).layers
    assert [type(layer) for layer in layers[:2]] == [DynamicSlidingWindowLayer, BlockLayer]


def test_an_unknown_cache_choice_is_an_input_error(monkeypatch, tiny_model):
    from transformers import AutoConfig

    monkeypatch.setenv(kv_cache.OVERRIDE_ENV, "paged")
    with pytest.raises(InputError, match="RLCTL_KV_CACHE"):
        decoding_cache(AutoConfig.from_pretrained(tiny_model))
