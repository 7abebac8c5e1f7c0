"""The work an update does is its trained tokens' and no more: torch's count of the products it
runs equals the model FLOPs that bench.update_peak divides by its time (no padded positions, no
second forward, logits only where the loss reads them); rows that share a prompt run it once."""

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from bench.update_peak import update_flops
from rlctl.backends import grouped_attention
from rlctl.backends.hf import HFPolicy
from rlctl.config import UpdateConfig
from rlctl.trainer import TrainBatch, Trainer


def batch_of(prompt_ids, response_lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    response_ids = [torch.randint(3, 500, (length,), generator=g).tolist() for length in response_lengths]
    width = max(response_lengths)
    mask = torch.tensor([[t < length for t in range(width)] for length in response_lengths])

    def noise(scale):
        return torch.where(mask, torch.randn(len(response_lengths), width, generator=g) * scale, 0)

    return TrainBatch(
        prompt_ids=prompt_ids, response_ids=response_ids, response_mask=mask, advantages=noise(1.0),
        old_logprobs=noise(0.1) - 6.0, ref_logprobs=noise(0.1) - 6.0, old_values=None, returns=None,
    )


def counted(trainer, batch) -> int:
    with FlopCounterMode(display=False) as counter:
        trainer.train(batch)
    return counter.get_total_flops()


@pytest.fixture
def policy(tiny_model, monkeypatch):
    # the attention in SDPA's kernel, which the counter does not count: what is counted is the
    # linear layers' products (rlctl's grouped attention runs its padded blocks as products)
    monkeypatch.setattr(grouped_attention, "MAX_FP32_SCORES", 0)
    return HFPolicy.load(tiny_model, "cpu")


def test_an_update_runs_the_products_of_its_tokens_and_no_more(policy, monkeypatch):
    monkeypatch.setenv("RLCTL_SHARE_PROMPTS", "never")
    prompts = [[5 + i] * (3 + i % 4) for i in range(6)]
    responses = [1, 7, 3, 12, 5, 9]  # uneven: padded to 12, they would cost more
    trainer = Trainer(policy, UpdateConfig(lr=1e-4, micro_batch_size=4))
    work = update_flops(policy.model, [len(p) for p in prompts], responses, attention=False)
    assert counted(trainer, batch_of(prompts, responses)) == work


def test_rows_that_share_a_prompt_run_it_once(policy, monkeypatch):
    monkeypatch.setenv("RLCTL_SHARE_PROMPTS", "always")
    prompts = [[7] * 10] * 4 + [[9] * 6] * 4
    responses = [4, 6, 2, 5, 3, 8, 6, 1]
    trainer = Trainer(policy, UpdateConfig(lr=1e-4, micro_batch_size=8))
    each_prompt_once = update_flops(policy.model, [10, 0, 0, 0, 6, 0, 0, 0], responses, attention=False)
    assert counted(trainer, batch_of(prompts, responses)) == each_prompt_once


def test_attention_adds_the_causal_pairs_of_every_layer(policy):
    config = policy.model.config
    width = config.num_attention_heads * (getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads)
    linear = update_flops(policy.model, [3, 1], [2, 4], attention=False)
    pairs = 5 * 6 // 2 + 5 * 6 // 2  # two rows of 5 tokens
    assert update_flops(policy.model, [3, 1], [2, 4]) - linear == 12 * width * pairs * config.num_hidden_layers
