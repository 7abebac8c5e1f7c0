"""The update the TRL harness makes, built in code: one batch and one trainer, for benches that
time `Trainer.train` alone (bench.malloc_bench, bench.update_peak).

The batch has the harness's shape (bench.trl_bench): 64 rows, 16 prompts of 12 tokens × 4
samples each, responses of 40–64 tokens, random token ids, advantages and log-probs (the update's
arithmetic does not depend on their values); the trainer is GRPO's with the k3 KL loss against
given reference log-probs, one optimizer step over one micro-batch of all rows.
"""

from __future__ import annotations

PROMPTS, SAMPLES, PROMPT_TOKENS = 16, 4, 12
ROWS = PROMPTS * SAMPLES


def harness_batch(policy, seed: int = 0, prompts: int = PROMPTS):
    """A `TrainBatch` of the harness's shape for `policy`'s vocabulary (`prompts` × SAMPLES rows)."""
    import torch

    from rlctl.trainer import TrainBatch

    g = torch.Generator().manual_seed(seed)
    vocab = min(1000, policy.model.config.vocab_size)
    rows = prompts * SAMPLES
    distinct = [torch.randint(3, vocab, (PROMPT_TOKENS,), generator=g).tolist() for _ in range(prompts)]
    prompt_ids = [prompt for prompt in distinct for _ in range(SAMPLES)]  # each prompt's samples side by side
    response_ids = [torch.randint(3, vocab, (40 + (i * 7) % 25,), generator=g).tolist() for i in range(rows)]
    width = max(len(r) for r in response_ids)
    mask = torch.tensor([[t < len(r) for t in range(width)] for r in response_ids])

    def noise(scale: float) -> torch.Tensor:
        return torch.where(mask, torch.randn(rows, width, generator=g) * scale, 0)

    return TrainBatch(
        prompt_ids=prompt_ids, response_ids=response_ids, response_mask=mask, advantages=noise(1.0),
        old_logprobs=noise(0.1) - 6.0, ref_logprobs=noise(0.1) - 6.0, old_values=None, returns=None,
    )


def harness_trainer(policy, bf16: str, rows: int = ROWS, compile: bool = False):
    """The harness's trainer for `policy` (one micro-batch of `rows` rows); `bf16`: update.bf16
    ("false", "true" or "auto"); `compile`: update.compile."""
    from rlctl.config import UpdateConfig
    from rlctl.trainer import Trainer

    return Trainer(policy, UpdateConfig(lr=1e-6, micro_batch_size=rows, use_kl_loss=True, kl_loss_coef=0.04, bf16=bf16, compile=compile))
