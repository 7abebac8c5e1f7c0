"""The update: micro-batching is exactly one big batch; updates are deterministic and
continue one another through the saved optimizer state; what an optimizer writes in place (the
trained weights, restored state) lives in the process's memory, not a file's mapping."""

import contextlib
import os

import numpy as np
import pytest
import torch

from rlctl import trainer_state
from rlctl.algos.losses import LOSS_AGG_MODES
from rlctl.backends.hf import HFPolicy
from rlctl.config import UpdateConfig
from rlctl.trainer import TrainBatch, Trainer, flat_gradients


def make_batch(seed=0, n=8, vocab=512):
    g = torch.Generator().manual_seed(seed)
    prompt_ids, response_ids = [], []
    for i in range(n):
        prompt_ids.append(torch.randint(3, vocab, (2 + i % 3,), generator=g).tolist())
        response_ids.append(torch.randint(3, vocab, (1 + (i * 5) % 7,), generator=g).tolist())
    T = max(len(r) for r in response_ids)
    mask = torch.tensor([[t < len(r) for t in range(T)] for r in response_ids])
    def noise(scale):
        return torch.where(mask, torch.randn(n, T, generator=g) * scale, 0)
    return TrainBatch(
        prompt_ids=prompt_ids, response_ids=response_ids, response_mask=mask,
        advantages=noise(1.0), old_logprobs=noise(0.1) - 6.0, ref_logprobs=noise(0.1) - 6.0, old_values=None, returns=None,
    )


@pytest.fixture
def policy(tiny_model):
    return HFPolicy.load(tiny_model, "cpu")


@pytest.mark.parametrize("mode,policy_loss", [(mode, "ppo") for mode in LOSS_AGG_MODES] + [("seq-mean-token-mean", "gspo"), ("seq-mean-token-mean", "gmpo"), ("token-mean", "cispo"), ("token-mean", "gpg"), ("seq-mean-token-mean", "sapo"), ("seq-mean-token-sum", "vespo")])
def test_micro_batch_sizes_give_the_same_gradient(policy, mode, policy_loss):
    batch = make_batch()
    grads = []
    for micro in (1, 2, 4):
        cfg = UpdateConfig(micro_batch_size=micro, loss_agg_mode=mode, use_kl_loss=True, entropy_coef=0.01, policy_loss=policy_loss)
        trainer = Trainer(policy, cfg)
        trainer.accumulate_gradients(batch, torch.arange(batch.size))
        grads.append(flat_gradients(policy.model))
    scale = np.abs(grads[0]).max()
    assert scale > 0
    for other in grads[1:]:
        np.testing.assert_allclose(other, grads[0], atol=1e-6 * max(scale, 1.0), rtol=0)


def test_rollout_importance_weights_scale_each_tokens_policy_gradient(policy):
    from dataclasses import replace

    batch = make_batch(seed=2)
    grads = {}
    for name, rollout, level in (("off", None, "off"), ("same", batch.old_logprobs, "token"), ("lower", batch.old_logprobs - 0.5, "token")):
        trainer = Trainer(policy, UpdateConfig(micro_batch_size=8, rollout_is=level, rollout_is_threshold=10.0))
        trainer.accumulate_gradients(replace(batch, rollout_logprobs=rollout), torch.arange(batch.size))
        grads[name] = flat_gradients(policy.model)
    np.testing.assert_allclose(grads["same"], grads["off"], atol=1e-7, rtol=0)  # engine = trainer: weight 1
    # the engine gave every token 0.5 nats less: each token's loss weighs exp(0.5)
    np.testing.assert_allclose(grads["lower"], grads["off"] * np.exp(0.5), atol=1e-6 * np.abs(grads["off"]).max(), rtol=1e-4)


def run_update(tiny_model, batch, cfg, state=None):
    policy = HFPolicy.load(tiny_model, "cpu")
    trainer = Trainer(policy, cfg)
    if state is not None:
        trainer.load_state_dict(state)
    metrics = trainer.train(batch)
    return policy, trainer, metrics


def weights(policy):
    return {k: v.clone() for k, v in policy.model.state_dict().items()}


def test_identical_inputs_give_identical_weights(tiny_model):
    cfg = UpdateConfig(lr=1e-3, mini_batch_size=4, micro_batch_size=2, epochs=2)
    a, _, ma = run_update(tiny_model, make_batch(), cfg)
    b, _, mb = run_update(tiny_model, make_batch(), cfg)
    assert all(torch.equal(x, y) for x, y in zip(weights(a).values(), weights(b).values()))
    assert ma["step"] == 4 and ma["pg_loss"] == mb["pg_loss"]


def test_two_updates_with_restored_state_equal_one_continuous_run(tiny_model):
    cfg = UpdateConfig(lr=1e-3, micro_batch_size=4, warmup_steps=3)
    first, t1, _ = run_update(tiny_model, make_batch(0), cfg)
    t1.train(make_batch(1))
    continuous = weights(first)

    first, t1, _ = run_update(tiny_model, make_batch(0), cfg)
    state = {k: v for k, v in t1.state_dict().items()}
    resumed = HFPolicy(first.model, first.tokenizer, first.device)
    t2 = Trainer(resumed, cfg)
    t2.load_state_dict(state)
    t2.train(make_batch(1))
    assert t2.step == 2
    assert all(torch.equal(continuous[k], v) for k, v in weights(resumed).items())


def test_warmup_scales_the_learning_rate():
    trainer_cfg = UpdateConfig(lr=1.0, warmup_steps=4)
    lr_at = Trainer.lr_at
    fake = type("T", (), {"cfg": trainer_cfg})()
    assert [lr_at(fake, s) for s in range(5)] == [0.25, 0.5, 0.75, 1.0, 1.0]


def test_mini_batch_that_does_not_divide_is_an_input_error(policy):
    from rlctl.errors import InputError

    with pytest.raises(InputError, match="mini_batch_size=3 does not divide the batch of 8"):
        Trainer(policy, UpdateConfig(mini_batch_size=3)).train(make_batch())


@pytest.mark.parametrize("entropy_coef", [0.0, 0.01])
def test_an_entropy_bonus_of_zero_runs_no_backward_through_the_entropy(tiny_model, monkeypatch, entropy_coef):
    """The entropy is still reported, but with a coefficient of 0 it stays out of the loss: the
    chunked log-softmax's backward gets no entropy gradient to push through [tokens, V]."""
    from rlctl.algos import logprobs

    monkeypatch.setattr(logprobs, "CHUNK_ELEMENTS", 64)  # the tiny model's logits through the chunked path
    received = []
    backward = logprobs.ChunkedLogSoftmax.backward

    def recording(ctx, grad_logp, grad_entropy):
        received.append(grad_entropy)
        return backward(ctx, grad_logp, grad_entropy)

    monkeypatch.setattr(logprobs.ChunkedLogSoftmax, "backward", staticmethod(recording))
    _, _, metrics = run_update(tiny_model, make_batch(), UpdateConfig(lr=1e-3, micro_batch_size=8, entropy_coef=entropy_coef))
    assert received and metrics["entropy"] > 0
    assert all((grad is None) == (entropy_coef == 0) for grad in received)


def test_bf16_autocast_trains_with_finite_gradients(tiny_model):
    before = weights(HFPolicy.load(tiny_model, "cpu"))
    policy, _, metrics = run_update(tiny_model, make_batch(), UpdateConfig(lr=1e-3, micro_batch_size=4, bf16=True))
    assert np.isfinite(metrics["grad_norm"]) and "skipped_steps" not in metrics
    assert any(not torch.equal(before[k], v) for k, v in weights(policy).items())


def casts_to_bf16(run) -> int:
    """How many tensor casts to bf16 `run()` makes (below autocast, where its casts happen)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        casts = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            if func is torch.ops.aten._to_copy.default and kwargs.get("dtype") == torch.bfloat16:
                Count.casts += 1
            return func(*args, **kwargs)

    with Count():
        run()
    return Count.casts


def test_a_weight_is_cast_to_bf16_once_for_all_the_passes_of_a_step():
    from rlctl.backends.hf import casts_kept

    weight, inputs, cpu = torch.nn.Parameter(torch.randn(4, 4)), torch.randn(2, 4), torch.device("cpu")
    model = torch.nn.Linear(4, 4, bias=False)
    model.weight = weight

    def three_passes(kept: bool):
        def run():
            with casts_kept(cpu, kept):
                for _ in range(3):
                    with torch.autocast("cpu", dtype=torch.bfloat16):
                        out = model(inputs)
                    assert out.dtype == torch.bfloat16
                    assert not torch.is_autocast_enabled("cpu")  # the loss and backward run without autocast
                    out.float().sum().backward()
        return run

    # each pass casts its input, and its backward the loss's gradient (through .float()); the weight:
    assert casts_to_bf16(three_passes(False)) == 3 * 3  # at every pass
    assert casts_to_bf16(three_passes(True)) == 3 * 2 + 1  # once


def test_casts_kept_over_a_steps_passes_give_the_same_gradient_bits(tiny_model, monkeypatch):
    import rlctl.trainer as trainer_module

    batch, grads = make_batch(), []
    for kept in (True, False):
        if not kept:
            monkeypatch.setattr(trainer_module, "casts_kept", lambda device, bf16: contextlib.nullcontext())
        policy = HFPolicy.load(tiny_model, "cpu")
        trainer = Trainer(policy, UpdateConfig(micro_batch_size=2, bf16="true", use_kl_loss=True))
        trainer.accumulate_gradients(batch, torch.arange(batch.size))
        grads.append(flat_gradients(policy.model))
    assert np.abs(grads[0]).max() > 0 and np.array_equal(grads[0], grads[1])


@pytest.mark.parametrize("bf16", [False, True])
def test_one_step_on_its_own_logprobs_is_the_step_on_recomputed_ones(tiny_model, bf16):
    """score.old_logprobs = "update": before its one optimizer step the policy is the old
    policy, so the update's own forward (detached) stands for a recompute, as in TRL."""
    from dataclasses import replace

    cfg = UpdateConfig(lr=1e-3, micro_batch_size=3, bf16=bf16, use_kl_loss=True, entropy_coef=0.01)
    batch = make_batch(seed=4)
    policy = HFPolicy.load(tiny_model, "cpu")
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):  # the recompute score makes in the same dtype
        recomputed = policy.logprobs(batch.prompt_ids, batch.response_ids, temperature=1.0, batch_size=3)
    old = torch.zeros_like(batch.advantages)
    for i, row in enumerate(recomputed):
        old[i, : len(row)] = torch.tensor(row)
    a, _, ma = run_update(tiny_model, replace(batch, old_logprobs=old, rollout_logprobs=old - 0.25), cfg)
    b, _, mb = run_update(tiny_model, replace(batch, old_logprobs=None, rollout_logprobs=old - 0.25), cfg)
    for key in ("pg_loss", "kl", "entropy", "grad_norm"):
        assert mb[key] == pytest.approx(ma[key], rel=1e-2, abs=1e-3) if bf16 else mb[key] == pytest.approx(ma[key], abs=1e-6)
    assert mb["logprob_mismatch"] == pytest.approx(0.25, abs=1e-2 if bf16 else 1e-5)  # engine vs trainer, still measured
    wa, wb = weights(a), weights(b)
    diffs = torch.cat([(wa[k] - wb[k]).abs().reshape(-1) for k in wa])
    if bf16:  # Adam's first step is ±lr per weight: bf16 noise can flip the sign of a near-zero gradient
        assert float(diffs.max()) <= 2.01 * cfg.lr and float(diffs.mean()) < 2e-5, (float(diffs.max()), float(diffs.mean()))
    else:  # the same function by other GEMM calls (rows per call): fp32 rounding, which Adam's first step
        # (lr · g / (|g| + eps)) magnifies where |g| is near eps; seen 7e-6 on MKL's Intel kernels, 2 × lr if the old log-probs were wrong
        assert float(diffs.max()) < 2e-5 and float(diffs.mean()) < 1e-8, (float(diffs.max()), float(diffs.mean()))


@pytest.mark.parametrize("cfg", [UpdateConfig(epochs=2), UpdateConfig(mini_batch_size=4)])
def test_own_logprobs_are_refused_past_the_first_optimizer_step(tiny_model, cfg):
    from dataclasses import replace

    from rlctl.errors import InputError

    with pytest.raises(InputError, match="only on its first optimizer step"):
        run_update(tiny_model, replace(make_batch(), old_logprobs=None), cfg)


def test_bf16_training_on_the_cpu_takes_eager_attention_only_for_short_sequences(tiny_model):
    from rlctl.backends.hf import EAGER_ATTENTION_MAX_SCORES, HFPolicy, training_forward

    cpu, model = torch.device("cpu"), HFPolicy.load(tiny_model, "cpu").model
    before = model.config._attn_implementation

    def attention(**kw) -> str:
        with training_forward(model, cpu, **kw):
            assert torch.is_autocast_enabled("cpu") is kw["bf16"]
            return model.config._attn_implementation

    heads = model.config.num_attention_heads
    assert attention(bf16=True, rows=64, length=76) == "eager"  # bf16 matmuls, not the math kernel's fp32 ones
    assert attention(bf16=True, rows=64, length=int((EAGER_ATTENTION_MAX_SCORES / (64 * heads)) ** 0.5) + 1) == before  # long: scores too big
    assert attention(bf16=False, rows=64, length=76) == before  # fp32: SDPA as always
    assert model.config._attn_implementation == before and torch.is_autocast_enabled("cpu") is False  # nothing leaks out


def test_the_policys_recompute_in_bf16_is_the_updates_own_forward(tiny_model):
    """`logprobs(as_trained=True)` computes what the update's first forward computes (the same
    autocast and attention), so a one-step PPO ratio starts at 1 in bf16 as in fp32."""
    from rlctl.backends.hf import HFPolicy, pack, training_forward

    policy = HFPolicy.load(tiny_model, "cpu")
    prompts, responses = [[5, 6, 7], [8, 9]], [[10, 11, 12, 13], [14, 15]]
    recomputed = policy.logprobs(prompts, responses, temperature=1.0, batch_size=2, compute_dtype="bf16", as_trained=True)
    packed = pack(prompts, responses, policy.pad_id, policy.device)
    with torch.no_grad(), training_forward(policy.model, policy.device, True, rows=2, length=packed.input_ids.shape[1]):
        trained = policy.forward(packed, temperature=1.0)[0]
    for row, values in enumerate(recomputed):
        assert values == pytest.approx(trained[row, : len(values)].tolist(), abs=1e-6)


def test_each_ranks_share_is_cut_into_passes_of_similar_lengths():
    """Rows are ordered by length inside a rank's share before the share is cut into passes:
    a pass pads to similar lengths (measured: 13.4 → 8.9 s per update for lengths of 8–256
    tokens, micro-batches of 8), and every rank still trains on the same rows as before."""
    from rlctl.trainer import RankGroup

    indices = torch.randperm(12, generator=torch.Generator().manual_seed(0))
    lengths = [5, 90, 12, 60, 7, 33, 81, 2, 44, 70, 19, 55]
    for rank in (0, 1):
        group = RankGroup(rank=rank, size=2)
        plain = group.micro_batches(indices, 2)
        ordered = group.micro_batches(indices, 2, lengths)
        assert sorted(r for rows, _ in ordered for r in rows) == sorted(r for rows, _ in plain for r in rows)
        flat = [lengths[r] for rows, _ in ordered for r in rows]
        assert flat == sorted(flat)


def grouped_batch(seed=0, prompts=3, n=4, vocab=512):
    """GRPO's shape: each prompt sampled n times."""
    from dataclasses import replace

    batch = make_batch(seed=seed, n=prompts * n, vocab=vocab)
    return replace(batch, prompt_ids=[batch.prompt_ids[i // n * n] for i in range(batch.size)])


def test_the_rows_of_one_prompt_stay_together_in_the_passes_of_every_rank():
    """When a mini-batch repeats prompts, its rows are shared out and cut into passes a group
    at a time (groups by their longest row), so a pass runs each prompt once; every rank still
    makes the same number of passes and together they train on every row once."""
    from rlctl.trainer import RankGroup

    groups = [i // 3 for i in range(12)]  # 4 prompts × 3 samples
    lengths = [5, 90, 12, 60, 7, 33, 81, 2, 44, 70, 19, 55]
    indices = torch.randperm(12, generator=torch.Generator().manual_seed(0))
    shares = [RankGroup(rank=rank, size=2).micro_batches(indices, 3, lengths, groups) for rank in (0, 1)]
    assert len(shares[0]) == len(shares[1]) == 2
    passes = [rows for share in shares for rows, weight in share if weight]
    assert sorted(r for rows in passes for r in rows) == list(range(12))
    assert all(len({groups[r] for r in rows}) == 1 for rows in passes)
    longest = [max(lengths[r] for r in rows) for rows, _ in shares[0]]
    assert longest == sorted(longest)
    alone = RankGroup().micro_batches(indices, 4, lengths, groups)  # groups of 3 in passes of 4: split where they must be
    assert [len(rows) for rows, _ in alone] == [4, 4, 4]


@pytest.mark.parametrize("micro,empty", [(1, False), (3, False), (4, False), (12, False), (4, True)])
def test_an_update_on_groups_runs_each_prompt_once_per_pass_with_the_gradient_of_full_forwards(policy, micro, empty, monkeypatch):
    """Rows that share a prompt (GRPO) run it once per pass (`forward_sharing_prompts`): the
    same gradient as one full-sequence forward per row, to fp32 rounding; a pass whose rows
    have no response token (`empty`: a whole group) still makes its forward calls (FSDP ranks
    keep step) and adds nothing."""
    from dataclasses import replace

    from rlctl.backends.hf import pack

    monkeypatch.setenv("RLCTL_SHARE_PROMPTS", "always")  # the tiny model alone would not pay for it
    batch = grouped_batch()
    if empty:
        mask = batch.response_mask.clone()
        mask[4:8] = False
        batch = replace(batch, response_ids=[[] if 4 <= i < 8 else r for i, r in enumerate(batch.response_ids)], response_mask=mask)
    cfg = UpdateConfig(micro_batch_size=micro, use_kl_loss=True, entropy_coef=0.01)
    calls = []
    shared_forward = policy.forward_sharing_prompts

    def counting(prompt_ids, response_ids, **kwargs):
        calls.append(len({tuple(p) for p in prompt_ids}))
        return shared_forward(prompt_ids, response_ids, **kwargs)

    def full_forward(prompt_ids, response_ids, **kwargs):
        return policy.forward(pack(prompt_ids, response_ids, policy.pad_id, policy.device), **kwargs)

    grads = []
    for forward in (counting, full_forward):
        policy.forward_sharing_prompts = forward
        Trainer(policy, cfg).accumulate_gradients(batch, torch.randperm(batch.size, generator=torch.Generator().manual_seed(1)))
        grads.append(flat_gradients(policy.model))
    assert len(calls) == -(-batch.size // micro)
    assert sum(calls) == len({(i // micro, i // 4) for i in range(batch.size)})  # groups side by side, cut into passes
    scale = np.abs(grads[1]).max()
    np.testing.assert_allclose(grads[0], grads[1], atol=1e-5 * max(scale, 1.0), rtol=0)


def test_the_policys_recompute_of_groups_is_the_updates_own_forward(tiny_model, monkeypatch):
    """Rows that share a prompt are recomputed (`as_trained`) as the update runs them, each
    prompt once: a one-step PPO ratio starts at 1 in bf16 for GRPO's groups too."""
    from rlctl.backends.hf import HFPolicy, training_forward

    monkeypatch.setenv("RLCTL_SHARE_PROMPTS", "always")
    policy = HFPolicy.load(tiny_model, "cpu")
    prompts, responses = [[5, 6, 7], [5, 6, 7], [8, 9], [8, 9]], [[10, 11, 12, 13], [14, 15], [16], [17, 18, 19]]
    recomputed = policy.logprobs(prompts, responses, temperature=1.0, batch_size=4, compute_dtype="bf16", as_trained=True)
    with torch.no_grad(), training_forward(policy.model, policy.device, True, rows=4, length=7):
        trained = policy.forward_sharing_prompts(prompts, responses, temperature=1.0)[0]
    for row, values in enumerate(recomputed):
        assert values == pytest.approx(trained[row, : len(values)].tolist(), abs=1e-6)


def test_prompts_are_shared_where_the_saved_compute_outweighs_a_second_model_call(monkeypatch):
    """A second model call per pass costs more than a few repeated prompt tokens save on small
    models, so rows run each distinct prompt once only when the repeated prompt tokens times the
    model's parameters reach the device's threshold (the same rule for the update's
    mini-batches and for scoring); RLCTL_SHARE_PROMPTS=always|never overrides it."""
    from rlctl.backends.hf import worth_sharing_prompts
    from rlctl.errors import InputError

    group = [[g] * 12 for g in range(16) for _ in range(4)]  # GRPO at TRL's shape: 576 repeated prompt tokens
    assert worth_sharing_prompts(group, parameters=24_000_000, device_type="cpu")  # the small preset
    assert not worth_sharing_prompts(group, parameters=854_144, device_type="cpu")  # the tiny one: the call costs more
    assert not worth_sharing_prompts(group, parameters=24_000_000, device_type="cuda")  # GPU FLOPs are cheap
    # Qwen2.5-0.5B on an H200, 8 prompts × 8 samples: 200-token prompts ran 0.60× as fast shared, 2,000-token ones 1.40×
    def grpo_batch(prompt_tokens: int) -> list[list[int]]:
        return [[p] * prompt_tokens for p in range(8) for _ in range(8)]

    assert not worth_sharing_prompts(grpo_batch(200), parameters=494_032_768, device_type="cuda")
    assert worth_sharing_prompts(grpo_batch(2000), parameters=494_032_768, device_type="cuda")
    assert not worth_sharing_prompts([[1] * 12, [2] * 12], parameters=10**10, device_type="cpu")  # nothing repeats
    monkeypatch.setenv("RLCTL_SHARE_PROMPTS", "always")
    assert worth_sharing_prompts(group, parameters=854_144, device_type="cpu")
    assert not worth_sharing_prompts([[1] * 12, [2] * 12], parameters=854_144, device_type="cpu")
    monkeypatch.setenv("RLCTL_SHARE_PROMPTS", "never")
    assert not worth_sharing_prompts(group, parameters=24_000_000, device_type="cpu")
    monkeypatch.setenv("RLCTL_SHARE_PROMPTS", "sometimes")
    with pytest.raises(InputError, match="RLCTL_SHARE_PROMPTS"):
        worth_sharing_prompts(group, parameters=24_000_000, device_type="cpu")


@pytest.mark.parametrize("share", ["always", "never"])
def test_the_update_reports_the_share_of_its_steps_that_ran_each_prompt_once(tiny_model, monkeypatch, share):
    monkeypatch.setenv("RLCTL_SHARE_PROMPTS", share)
    _, _, metrics = run_update(tiny_model, grouped_batch(), UpdateConfig(lr=1e-3, micro_batch_size=4, mini_batch_size=6))
    assert metrics["prompt_sharing"] == (1.0 if share == "always" else 0.0)


def test_every_rank_makes_as_many_token_capped_passes_as_the_busiest_one():
    """With a token cap the ranks' shares cut into different numbers of passes (one has the long
    rows); each rank pads to the largest number with weight-0 passes, and together they train
    on every row once."""
    from rlctl.trainer import RankGroup

    lengths = [5, 6, 7, 8, 9, 10, 200, 210, 220, 230, 240, 250]
    indices = torch.arange(12)
    shares = [RankGroup(rank=rank, size=2).micro_batches(indices, 6, lengths, max_tokens=500) for rank in (0, 1)]
    assert len(shares[0]) == len(shares[1]) == 3  # rank 1's six long rows: two per pass
    assert [len(rows) for rows, weight in shares[1]] == [2, 2, 2]
    assert [len(rows) for rows, weight in shares[0] if weight] == [6]
    assert sum(1 for _, weight in shares[0] if weight == 0) == 2
    assert sorted(r for share in shares for rows, weight in share if weight for r in rows) == list(range(12))


@pytest.mark.parametrize("cap", ["0", "12", "auto"])
def test_a_token_cap_gives_the_same_gradient(policy, cap):
    """How the passes are cut by tokens changes no gradient beyond float rounding."""
    batch = make_batch()
    grads = []
    for tokens in ("0", cap):
        trainer = Trainer(policy, UpdateConfig(micro_batch_size=8, micro_batch_tokens=tokens, use_kl_loss=True, entropy_coef=0.01))
        trainer.accumulate_gradients(batch, torch.arange(batch.size))
        grads.append(flat_gradients(policy.model))
    np.testing.assert_allclose(grads[1], grads[0], atol=1e-6 * max(np.abs(grads[0]).max(), 1.0), rtol=0)


def mapped_file(tensor: torch.Tensor) -> str | None:
    """The file whose mapping holds `tensor`'s memory (/proc/self/maps), None for the process's own."""
    address = tensor.data_ptr()
    with open("/proc/self/maps") as maps:
        for line in maps:
            fields = line.split()
            start, end = (int(x, 16) for x in fields[0].split("-"))
            if start <= address < end:
                return fields[5] if len(fields) > 5 and fields[5].startswith("/") else None
    return None


linux_only = pytest.mark.skipif(not os.path.exists("/proc/self/maps"), reason="reads /proc/self/maps")


@linux_only
def test_the_trained_weights_leave_the_checkpoints_file_mapping_before_the_first_step(tiny_model):
    policy = HFPolicy.load(tiny_model, "cpu")
    if not any(str(mapped_file(p) or "").endswith(".safetensors") for p in policy.model.parameters()):
        pytest.skip("this transformers copies the weights out of the file when loading")
    before = {name: p.detach().clone() for name, p in policy.model.named_parameters()}
    Trainer(policy, UpdateConfig(lr=1e-3))
    assert all(mapped_file(p) is None for p in policy.model.parameters())  # an in-place step faults no page
    assert all(torch.equal(before[name], p) for name, p in policy.model.named_parameters())


@linux_only
def test_restored_optimizer_state_lives_in_the_processs_memory(tmp_path, tiny_model):
    _, trainer, _ = run_update(tiny_model, make_batch(0), UpdateConfig(lr=1e-3, micro_batch_size=4))
    state = trainer.state_dict()
    trainer_state.save(tmp_path, step=state["step"], optimizers={n: state.get(n) for n in trainer_state.OPTIMIZER_NAMES})
    restored = trainer_state.load(tmp_path)["optimizer"]["state"]
    tensors = [t for entry in restored.values() for t in entry.values() if isinstance(t, torch.Tensor) and t.numel() > 1024]
    assert tensors and all(mapped_file(t) is None for t in tensors)


def zero_advantage_groups(batch, groups):
    """`batch` (grouped_batch's: 4 samples per prompt) with every row of `groups` at advantage 0,
    as GRPO gives a group whose samples all scored alike."""
    from dataclasses import replace

    advantages = batch.advantages.clone()
    for g in groups:
        advantages[4 * g : 4 * g + 4] = 0.0
    return replace(batch, advantages=advantages)


def counted_rows(policy, monkeypatch):
    """The rows each policy forward of the update runs, in a list that fills as it trains."""
    rows = []
    forward = policy.forward

    def counting(packed, **kwargs):
        rows.append(int(packed.input_ids.shape[0]))
        return forward(packed, **kwargs)

    monkeypatch.setattr(policy, "forward", counting)
    return rows


def test_rows_of_zero_advantage_skip_their_passes_and_leave_the_gradient_as_it_was(policy, monkeypatch):
    """Without a KL loss or an entropy bonus a row whose advantage is 0 everywhere adds nothing
    to any gradient: the update leaves it out (fewer rows through the forward) and the gradient
    is the one computed with it, to fp32 rounding; the loss's divisors stay the mini-batch's."""
    monkeypatch.setenv("RLCTL_SHARE_PROMPTS", "never")
    batch = zero_advantage_groups(grouped_batch(prompts=4), groups=[1, 3])
    rows = counted_rows(policy, monkeypatch)
    grads, stats = {}, {}
    for skip in (True, False):
        rows.clear()
        cfg = UpdateConfig(micro_batch_size=4, loss_agg_mode="seq-mean-token-mean", skip_zero_advantage=skip)
        stats[skip] = Trainer(policy, cfg).accumulate_gradients(batch, torch.randperm(batch.size, generator=torch.Generator().manual_seed(3)))
        grads[skip] = flat_gradients(policy.model)
        stats[skip]["rows"] = sum(rows)
    assert (stats[True]["rows"], stats[False]["rows"]) == (8, 16)
    assert (stats[True]["zero_advantage_skipped"], stats[False]["zero_advantage_skipped"]) == (0.5, 0.0)
    scale = np.abs(grads[False]).max()
    assert scale > 0
    np.testing.assert_allclose(grads[True], grads[False], atol=1e-6 * max(scale, 1.0), rtol=0)
    assert stats[True]["pg_loss"] == pytest.approx(stats[False]["pg_loss"], abs=1e-6)


@pytest.mark.parametrize("term", [{"use_kl_loss": True}, {"entropy_coef": 0.01}])
def test_rows_of_zero_advantage_train_where_a_kl_loss_or_an_entropy_bonus_reads_them(policy, monkeypatch, term):
    monkeypatch.setenv("RLCTL_SHARE_PROMPTS", "never")
    batch = zero_advantage_groups(grouped_batch(prompts=4), groups=[1, 3])
    rows = counted_rows(policy, monkeypatch)
    stats = Trainer(policy, UpdateConfig(micro_batch_size=4, **term)).accumulate_gradients(batch, torch.arange(batch.size))
    assert sum(rows) == 16 and stats["zero_advantage_skipped"] == 0.0


def test_a_step_whose_rows_all_have_zero_advantage_is_the_step_on_zero_gradients(tiny_model, monkeypatch):
    """Nothing to train on still makes the optimizer step (AdamW's decay and moments move as they
    would on the zero gradients the rows give), from one row's pass with its loss scaled by 0."""
    monkeypatch.setenv("RLCTL_SHARE_PROMPTS", "never")
    batch = zero_advantage_groups(grouped_batch(prompts=2), groups=[0, 1])
    cfg = dict(lr=1e-2, micro_batch_size=4, weight_decay=0.1)
    before, _, _ = run_update(tiny_model, grouped_batch(prompts=2), UpdateConfig(lr=1e-2))  # a policy that has moved
    results = {}
    for skip in (True, False):
        policy = HFPolicy(before.model, before.tokenizer, before.device)
        start = weights(policy)
        trainer = Trainer(policy, UpdateConfig(**cfg, skip_zero_advantage=skip))
        rows = counted_rows(policy, monkeypatch)
        metrics = trainer.train(batch)
        results[skip] = (weights(policy), sum(rows), metrics["zero_advantage_skipped"], metrics["grad_norm"])
        policy.model.load_state_dict(start)
    (skipped, skipped_rows, share, norm), (full, full_rows, _, full_norm) = results[True], results[False]
    assert (skipped_rows, full_rows, share, norm, full_norm) == (1, 8, 1.0, 0.0, 0.0)
    assert all(torch.equal(skipped[k], full[k]) for k in full)
    assert any(not torch.equal(skipped[k], start[k]) for k in start)  # weight decay moved them


def test_a_replay_leaves_out_zero_advantage_rows_only_where_the_recorded_update_did():
    """An update manifest records the key; one written before it existed trained every row, and
    its replay does too (the same gradients to the last bit); `--set` still decides."""
    from rlctl.config import Config
    from rlctl.lineage import make_manifest
    from rlctl.replay import _recorded_config

    def replayed(update_section, overrides=()):
        return _recorded_config(Config(), make_manifest("update", {"update": update_section}, []), list(overrides)).update.skip_zero_advantage

    assert replayed({"lr": 1e-3, "skip_zero_advantage": True}) is True
    assert replayed({"lr": 1e-3, "skip_zero_advantage": False}) is False
    assert replayed({"lr": 1e-3}) is False
    assert replayed({"lr": 1e-3}, ["update.skip_zero_advantage=true"]) is True


def test_the_trainer_follows_the_configured_schedule_and_a_decay_needs_its_steps():
    from rlctl.errors import InputError
    from rlctl.trainer import check_update_config, optimizer_steps

    cosine = UpdateConfig(lr=1.0, warmup_steps=1, lr_schedule="cosine", decay_steps=3, min_lr_ratio=0.2, mini_batch_size=4, epochs=2)
    fake = type("T", (), {"cfg": cosine})()
    assert [Trainer.lr_at(fake, s) for s in range(5)] == pytest.approx([1.0, 1.0, 0.6, 0.2, 0.2])
    assert optimizer_steps(cosine, 8) == 4 and optimizer_steps(UpdateConfig(epochs=3), 8) == 3
    with pytest.raises(InputError, match=r"update.lr_schedule = cosine decays until update.decay_steps \(0\), which must exceed update.warmup_steps \(0\): "
                                         r"set it in optimizer steps; this batch takes 4 optimizer steps per update"):
        check_update_config(UpdateConfig(lr_schedule="cosine", mini_batch_size=4, epochs=2), 8)


def test_the_critics_warm_up_trains_only_the_critic_then_the_policy_starts_its_schedule(tiny_model):
    from dataclasses import replace

    from rlctl.backends.hf import ValueModel

    policy = HFPolicy.load(tiny_model, "cpu")
    critic = ValueModel.load(tiny_model, torch.device("cpu"))
    batch = make_batch()
    batch = replace(batch, old_values=torch.where(batch.response_mask, 0.1, 0.0), returns=torch.where(batch.response_mask, 1.0, 0.0))
    cfg = UpdateConfig(lr=1e-3, critic_lr=1e-3, mini_batch_size=4, micro_batch_size=4, critic_warmup=3, warmup_steps=2)
    trainer = Trainer(policy, cfg, critic=critic)
    before, critic_before = weights(policy), {k: v.clone() for k, v in critic.state_dict().items()}

    first = trainer.train(batch)  # steps 0 and 1: both within the warm-up
    assert all(torch.equal(before[k], v) for k, v in weights(policy).items())  # the policy sat still
    assert any(not torch.equal(critic_before[k], v) for k, v in critic.state_dict().items())  # the critic learned
    assert (first["critic_warmup"], first["lr"]) == (1.0, 0.0) and "pg_loss" not in first and first["vf_loss"] > 0

    second = trainer.train(batch)  # step 2 still warms the critic; step 3 is the policy's first, at its warm-up's first rate
    assert second["critic_warmup"] == 0.5 and second["lr"] == pytest.approx(1e-3 / 2)
    assert "pg_loss" in second and any(not torch.equal(before[k], v) for k, v in weights(policy).items())


def keep_rows(batch, rows):
    """`batch` with only `rows` (their tokens, advantages, log-probs), as if the others were never sampled."""
    from dataclasses import replace

    index = torch.tensor(rows)
    width = max(len(batch.response_ids[i]) for i in rows)
    return replace(
        batch, prompt_ids=[batch.prompt_ids[i] for i in rows], response_ids=[batch.response_ids[i] for i in rows],
        **{name: getattr(batch, name)[index][:, :width] for name in ("response_mask", "advantages", "old_logprobs", "ref_logprobs")},
    )


@pytest.mark.parametrize("term", [{}, {"use_kl_loss": True, "entropy_coef": 0.01}], ids=["policy loss", "with kl and entropy"])
def test_masked_truncated_responses_train_as_if_they_were_never_sampled(policy, monkeypatch, term):
    """update.mask_truncated (DAPO's overlong filtering): a response cut at the length limit
    adds nothing to any term of the loss nor tokens to its divisor (token-mean): the gradient
    is the one of the batch without those rows, and their forwards are not run."""
    from dataclasses import replace

    monkeypatch.setenv("RLCTL_SHARE_PROMPTS", "never")
    batch = make_batch(seed=4)
    truncated = torch.tensor([i in (1, 4, 5) for i in range(batch.size)])
    kept = [i for i in range(batch.size) if not truncated[i]]
    rows = counted_rows(policy, monkeypatch)
    grads = {}
    for name, cfg, data in (
        ("masked", UpdateConfig(micro_batch_size=8, mask_truncated=True, **term), replace(batch, truncated=truncated)),
        ("without them", UpdateConfig(micro_batch_size=8, **term), keep_rows(batch, kept)),
        ("not masked", UpdateConfig(micro_batch_size=8, **term), replace(batch, truncated=truncated)),
    ):
        rows.clear()
        Trainer(policy, cfg).accumulate_gradients(data.without_truncated() if cfg.mask_truncated else data, torch.arange(data.size))
        grads[name] = (flat_gradients(policy.model), sum(rows))
    scale = np.abs(grads["without them"][0]).max()
    np.testing.assert_allclose(grads["masked"][0], grads["without them"][0], atol=1e-6 * max(scale, 1.0), rtol=0)
    assert grads["masked"][1] == grads["without them"][1] == len(kept)
    assert np.abs(grads["not masked"][0] - grads["without them"][0]).max() > 1e-3 * scale


def test_an_update_on_truncated_responses_only_leaves_the_policy_where_it_was(tiny_model):
    """Every response truncated and masked: zero gradients, so AdamW's first step moves nothing
    (no weight decay); the metrics say the share of rows out of the loss."""
    from dataclasses import replace

    batch = make_batch(seed=1)
    everything = replace(batch, truncated=torch.ones(batch.size, dtype=torch.bool))
    policy = HFPolicy.load(tiny_model, "cpu")
    start = weights(policy)
    metrics = Trainer(policy, UpdateConfig(lr=1e-2, mask_truncated=True)).train(everything)
    assert metrics["truncated_masked"] == 1.0 and metrics["grad_norm"] == 0.0
    assert metrics["zero_advantage_skipped"] == 0.0  # left out as truncated, not for their advantage
    assert all(torch.equal(start[k], v) for k, v in weights(policy).items())
    half = replace(batch, truncated=torch.arange(batch.size) % 2 == 0)
    assert Trainer(policy, UpdateConfig(lr=1e-2, mask_truncated=True)).train(half)["truncated_masked"] == 0.5


def test_a_tools_tokens_take_no_part_in_the_loss(policy, monkeypatch):
    """Tokens a tool wrote (loss_mask False, rollout.tool) are context: whatever advantages or
    old log-probs they carry, the gradient is the same; and TrainBatch reads the mask."""
    from dataclasses import replace

    import pyarrow as pa

    monkeypatch.setenv("RLCTL_SHARE_PROMPTS", "never")
    batch = make_batch(seed=6)
    tool = torch.zeros_like(batch.response_mask)
    tool[:, 1:3] = True  # the second and third tokens of every response are a tool's
    trained = replace(batch, response_mask=batch.response_mask & ~tool)
    grads = []
    for noise in (0.0, 5.0):
        scrambled = replace(trained, advantages=trained.advantages + noise * tool, old_logprobs=trained.old_logprobs - noise * tool)
        Trainer(policy, UpdateConfig(micro_batch_size=8, use_kl_loss=True, entropy_coef=0.01)).accumulate_gradients(scrambled, torch.arange(batch.size))
        grads.append(flat_gradients(policy.model))
    np.testing.assert_array_equal(grads[0], grads[1])
    table = pa.table({
        "prompt_ids": [[5, 6], [7]], "response_ids": [[1, 2, 3], [4, 5]], "advantages": [[0.1, 0.2, 0.3], [0.4, 0.5]],
        "rollout_logprobs": [[-1.0, 0.0, -1.0], [-1.0, -1.0]], "loss_mask": [[True, False, True], [True, True]],
    })
    assert TrainBatch.from_table(table).response_mask.tolist() == [[True, False, True], [True, True, False]]


def test_gradient_checkpointing_gives_the_same_gradient_and_runs_the_layers_again_in_the_backward(tiny_model, monkeypatch):
    """update.gradient_checkpointing trades memory for compute: each decoder layer's forward
    runs again in the backward, and the gradient is the one without it (to fp32 rounding)."""
    monkeypatch.setenv("RLCTL_SHARE_PROMPTS", "never")
    batch = make_batch(seed=8)
    grads, layer_calls = {}, {}
    for checkpointed in (False, True):
        policy = HFPolicy.load(tiny_model, "cpu")
        policy.model.train()  # as Trainer.train sets it: layers checkpoint only in training
        layer = policy.model.model.layers[0]
        calls = []
        layer.register_forward_pre_hook(lambda *_, calls=calls: calls.append(1))  # a recompute may stop before the layer returns
        Trainer(policy, UpdateConfig(micro_batch_size=8, gradient_checkpointing=checkpointed, bf16="false")).accumulate_gradients(batch, torch.arange(batch.size))
        grads[checkpointed], layer_calls[checkpointed] = flat_gradients(policy.model), len(calls)
    assert layer_calls == {False: 1, True: 2}  # one forward pass; with checkpointing, once more in the backward
    scale = np.abs(grads[False]).max()
    np.testing.assert_allclose(grads[True], grads[False], atol=1e-6 * max(scale, 1.0), rtol=0)


def test_compiled_layers_are_not_checkpointed():
    from rlctl.errors import InputError
    from rlctl.trainer import check_update_config

    with pytest.raises(InputError, match="update.compile and update.gradient_checkpointing: choose one"):
        check_update_config(UpdateConfig(compile=True, gradient_checkpointing=True))


@pytest.mark.parametrize("rollout_is", ["off", "token"])
def test_a_top_entropy_quantile_is_the_gradient_of_the_kept_tokens_policy_loss_over_every_tokens_divisor(policy, monkeypatch, rollout_is):
    """update.top_entropy_quantile: the step is the one whose other tokens had no advantage (their
    policy-gradient terms gone, the token-mean's divisor unchanged), and it reports the share kept;
    with the rollout's importance weights too (they weigh the kept tokens' terms only)."""
    from dataclasses import replace

    import rlctl.trainer as trainer_module
    from rlctl.algos.losses import high_entropy_tokens

    g = torch.Generator().manual_seed(4)
    n, width = 8, 5  # rows of one length: the pass holds them in the batch's order, unpadded
    batch = replace(
        make_batch(seed=4, n=n), prompt_ids=torch.randint(3, 512, (n, 3), generator=g).tolist(), response_ids=torch.randint(3, 512, (n, width), generator=g).tolist(),
        response_mask=torch.ones(n, width, dtype=torch.bool), advantages=torch.randn(n, width, generator=g), old_logprobs=torch.full((n, width), -6.0), ref_logprobs=None,
        rollout_logprobs=-6.0 + 0.3 * torch.randn(n, width, generator=g) if rollout_is != "off" else None,
    )
    settings = {"micro_batch_size": n, "rollout_is": rollout_is}
    seen = []

    def recorded(entropy, mask, top_quantile):
        seen.append(high_entropy_tokens(entropy, mask, top_quantile))
        return seen[-1]

    monkeypatch.setattr(trainer_module, "high_entropy_tokens", recorded)
    stats = Trainer(policy, UpdateConfig(**settings, top_entropy_quantile=0.25)).accumulate_gradients(batch, torch.arange(n))
    selected = flat_gradients(policy.model)
    (kept,) = seen
    Trainer(policy, UpdateConfig(**settings)).accumulate_gradients(replace(batch, advantages=torch.where(kept, batch.advantages, 0)), torch.arange(n))
    np.testing.assert_allclose(selected, flat_gradients(policy.model), atol=1e-7, rtol=0)
    assert int(kept.sum()) == 10 and stats["entropy_tokens_kept"] == pytest.approx(10 / 40)  # the quantile's cut: 10 of 40 tokens


def test_rejected_tokens_and_rows_leave_the_loss_and_its_divisor_as_if_never_sampled(policy, monkeypatch, tiny_model):
    """update.rollout_rs: the gradient is the one of the batch whose mask holds only the kept
    tokens, without the rows that keep none (their forwards not run); train reports the shares,
    and refuses a batch without the engine's log-probs."""
    from dataclasses import replace

    from rlctl.algos.rejection import kept_tokens, parse_rules
    from rlctl.errors import InputError

    monkeypatch.setenv("RLCTL_SHARE_PROMPTS", "never")
    batch = make_batch(seed=5)
    g = torch.Generator().manual_seed(5)
    data = replace(batch, rollout_logprobs=batch.old_logprobs + torch.where(batch.response_mask, torch.randn(batch.old_logprobs.shape, generator=g) * 0.3, 0))
    settings = {"rollout_rs": "token_k1,seq_max_k2", "rollout_rs_threshold": "0.75_1.33,0.15"}
    rules = parse_rules(settings["rollout_rs"], settings["rollout_rs_threshold"])
    kept, _ = kept_tokens(rules, old_logprobs=data.old_logprobs, rollout_logprobs=data.rollout_logprobs, response_mask=data.response_mask)
    whole = [i for i in range(data.size) if kept[i].any()]
    assert 0 < len(whole) < data.size and int(kept[whole].sum()) < int(data.response_mask[whole].sum())  # rows and single tokens rejected
    rows = counted_rows(policy, monkeypatch)
    rejected, metrics = data.without_rejected(rules)
    Trainer(policy, UpdateConfig(micro_batch_size=8, **settings)).accumulate_gradients(rejected, torch.arange(data.size))
    with_rules = (flat_gradients(policy.model), sum(rows))
    rows.clear()
    Trainer(policy, UpdateConfig(micro_batch_size=8)).accumulate_gradients(keep_rows(replace(data, response_mask=kept), whole), torch.arange(len(whole)))
    scale = np.abs(flat_gradients(policy.model)).max()
    np.testing.assert_allclose(with_rules[0], flat_gradients(policy.model), atol=1e-6 * max(scale, 1.0), rtol=0)
    assert with_rules[1] == sum(rows) == len(whole)
    assert metrics["rollout_rs/masked_fraction"] == pytest.approx(1 - int(kept.sum()) / int(data.response_mask.sum()))
    trained = Trainer(HFPolicy.load(tiny_model, "cpu"), UpdateConfig(lr=1e-3, **settings)).train(data)
    assert trained["rollout_rs/seq_masked_fraction"] > trained["rollout_rs/seq_max_k2/seq_masked_fraction"] > 0
    with pytest.raises(InputError, match="rollout_rs compares the old policy's log-probs with the engine's"):
        Trainer(policy, UpdateConfig(**settings)).train(batch)


def test_the_sapo_temperatures_reach_the_loss(policy, monkeypatch):
    import rlctl.trainer as trainer_module
    from rlctl.algos.losses import sapo_policy_loss

    seen = []

    def recorded(**kwargs):
        seen.append((kwargs["sapo_tau_pos"], kwargs["sapo_tau_neg"]))
        return sapo_policy_loss(**kwargs)

    monkeypatch.setitem(trainer_module.POLICY_LOSSES, "sapo", recorded)
    batch = make_batch(seed=6)
    Trainer(policy, UpdateConfig(micro_batch_size=8, policy_loss="sapo", sapo_tau_pos=1.5, sapo_tau_neg=2.5)).accumulate_gradients(batch, torch.arange(batch.size))
    assert seen == [(1.5, 2.5)]


@pytest.mark.parametrize("level", ["token", "sequence"])
def test_normalized_importance_weights_are_the_truncated_ones_over_their_batch_mean(policy, tiny_model, level):
    """update.rollout_is_batch_normalize: the policy gradient is the unnormalized one divided by
    the mean truncated weight over the batch's tokens (sequence level: its sequences); an
    engine that is off by the same amount everywhere then weighs nothing at all."""
    from dataclasses import replace

    from rlctl.algos.losses import rollout_is_weights
    from rlctl.errors import InputError

    batch = make_batch(seed=7)
    g = torch.Generator().manual_seed(7)
    data = replace(batch, rollout_logprobs=batch.old_logprobs + torch.where(batch.response_mask, torch.randn(batch.old_logprobs.shape, generator=g) * 0.4, 0))
    grads = {}
    for name, normalize, rows in (("raw", False, data), ("normalized", True, data), ("off", False, batch), ("uniform", True, replace(data, rollout_logprobs=batch.old_logprobs - 0.5))):
        cfg = UpdateConfig(micro_batch_size=8, rollout_is="off" if name == "off" else level, rollout_is_threshold=1.5, rollout_is_batch_normalize=normalize)
        trainer = Trainer(policy, cfg)
        trainer.accumulate_gradients(rows.with_normalized_weights(level, 1.5) if normalize else rows, torch.arange(rows.size))
        grads[name] = flat_gradients(policy.model)
    weights = rollout_is_weights(old_logprobs=data.old_logprobs, rollout_logprobs=data.rollout_logprobs, response_mask=data.response_mask, level=level, threshold=1.5)
    mean = float(weights[data.response_mask].mean()) if level == "token" else float(weights.amax(-1).mean())
    assert 0.5 < mean < 1.4 and (weights[data.response_mask] == 1.5).any()  # some truncated, so the mean is not 1
    scale = np.abs(grads["raw"]).max()
    np.testing.assert_allclose(grads["normalized"], grads["raw"] / mean, atol=1e-6 * scale, rtol=1e-5)
    np.testing.assert_allclose(grads["uniform"], grads["off"], atol=1e-6 * np.abs(grads["off"]).max(), rtol=1e-5)
    metrics = Trainer(HFPolicy.load(tiny_model, "cpu"), UpdateConfig(lr=1e-3, rollout_is=level, rollout_is_threshold=1.5, rollout_is_batch_normalize=True)).train(data)
    assert metrics["rollout_is_batch_mean"] == pytest.approx(mean, rel=1e-5)
    if level == "token":  # the reported weight is a token mean: 1 once normalized over the tokens
        assert metrics["rollout_is_weight"] == pytest.approx(1.0, rel=1e-4)
    with pytest.raises(InputError, match="rollout_is_batch_normalize needs the whole batch's weights"):
        replace(data, old_logprobs=None).with_normalized_weights(level, 1.5)


def on_policy_batch(policy, seed=5):
    """make_batch with the policy's own log-probs as the old ones: the update starts at KL 0."""
    from dataclasses import replace

    batch = make_batch(seed=seed)
    own = policy.logprobs(batch.prompt_ids, batch.response_ids, temperature=1.0)
    old = torch.zeros_like(batch.advantages)
    for row, values in enumerate(own):
        old[row, : len(values)] = torch.tensor(values)
    return replace(batch, old_logprobs=old)


def test_approx_kl_is_the_token_mean_of_k3_from_the_old_policy(policy):
    from dataclasses import replace

    batch = make_batch(seed=3)
    trainer = Trainer(policy, UpdateConfig(micro_batch_size=3, target_kl=0.01))
    stats = trainer.accumulate_gradients(batch, torch.arange(batch.size))
    new = policy.logprobs(batch.prompt_ids, batch.response_ids, temperature=1.0)
    log_ratio = [n - o for row, values in enumerate(new) for n, o in zip(values, batch.old_logprobs[row].tolist())]
    expected = np.mean([np.expm1(x) - x for x in log_ratio])
    assert stats["approx_kl"] == pytest.approx(expected, rel=1e-4)
    assert "approx_kl" not in Trainer(policy, replace(UpdateConfig(micro_batch_size=3), target_kl=0.0)).accumulate_gradients(batch, torch.arange(batch.size))


def test_target_kl_stops_the_update_before_the_first_step_past_it_with_the_weights_of_the_steps_before(tiny_model, monkeypatch):
    """Spinning Up's and SB3's rule: the first mini-batch (after the first step) whose
    approximate KL from the old policy exceeds 1.5 × target_kl is not stepped on, and the
    update ends there; its weights are those the update had after the steps it made."""
    cfg = UpdateConfig(lr=3e-3, epochs=3, mini_batch_size=4, micro_batch_size=4)
    kls, snapshots = [], []
    measured = Trainer.accumulate_gradients
    stepped = Trainer._optimizer_step

    def record_kl(self, batch, indices):
        stats = measured(self, batch, indices)
        kls.append(stats["approx_kl"])
        return stats

    def record_weights(self):
        stats = stepped(self)
        snapshots.append(weights(self.policy))
        return stats

    monkeypatch.setattr(Trainer, "accumulate_gradients", record_kl)
    monkeypatch.setattr(Trainer, "_optimizer_step", record_weights)
    policy = HFPolicy.load(tiny_model, "cpu")
    batch = on_policy_batch(policy)
    _, _, whole = run_update(tiny_model, batch, replace_cfg(cfg, target_kl=1e9))  # never reached: all 6 steps
    assert whole["optimizer_steps"] == 6 and whole["kl_stopped_early"] == 0.0 and len(kls) == 6
    assert kls[0] < 1e-6 < kls[1] < kls[-1]  # on-policy at the first step, moving away after
    first_over = max(j for j in range(1, 6) if kls[j] > max(kls[:j]))  # a step whose KL is past every one before it
    assert first_over >= 2
    target = (kls[first_over] + max(kls[:first_over])) / 2 / 1.5  # between the step before and the one past
    everything = snapshots[:]
    kls.clear()
    snapshots.clear()
    trained, _, stopped = run_update(tiny_model, batch, replace_cfg(cfg, target_kl=target))
    assert stopped["optimizer_steps"] == first_over and stopped["kl_stopped_early"] == 1.0
    after = weights(trained)
    assert all(torch.equal(after[k], everything[first_over - 1][k]) for k in after)
    assert all(p.grad is None for p in trained.model.parameters())  # the unapplied mini-batch's gradients went


def replace_cfg(cfg, **changes):
    from dataclasses import replace

    return replace(cfg, **changes)


def model_with_dropout(tmp_path, tiny_model, rate=0.3) -> str:
    """The tiny model with attention dropout (its Qwen2 config's attention_dropout)."""
    import json
    import shutil

    folder = tmp_path / "dropout"
    shutil.copytree(tiny_model, folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "attention_dropout": rate}))
    return str(folder)


def attention_dropouts(model) -> set[float]:
    return {m.attention_dropout for m in model.modules() if isinstance(getattr(m, "attention_dropout", None), float)}


@pytest.mark.parametrize("disable", [True, False])
def test_the_update_trains_without_the_models_dropout_so_its_first_step_is_on_policy(tmp_path, tiny_model, disable):
    """update.disable_dropout (TRL's): on the old policy's own log-probs (an eval forward, as
    score's and the engine's) the first step's ratio is 1 at every token; with the model's
    dropout on in training it is not."""
    policy = HFPolicy.load(model_with_dropout(tmp_path, tiny_model), "cpu")
    batch = on_policy_batch(policy)
    trainer = Trainer(policy, UpdateConfig(micro_batch_size=8, disable_dropout=disable))
    metrics = trainer.train(batch)
    if disable:
        assert attention_dropouts(policy.model) == {0.0}
        assert abs(metrics["ppo_kl"]) < 1e-6 and metrics["pg_clipfrac"] == 0.0
    else:
        assert attention_dropouts(policy.model) == {0.3}
        assert abs(metrics["ppo_kl"]) > 1e-3


def test_preference_trainers_turn_the_models_dropout_off_and_sft_keeps_it(tmp_path, tiny_model):
    from rlctl.config import DpoConfig, KtoConfig, RewardModelConfig, SftConfig
    from rlctl.supervised import SupervisedSteps

    folder = model_with_dropout(tmp_path, tiny_model)
    for cfg, expected in ((DpoConfig(), 0.0), (KtoConfig(), 0.0), (RewardModelConfig(), 0.0), (DpoConfig(disable_dropout=False), 0.3), (SftConfig(), 0.3)):
        model = HFPolicy.load(folder, "cpu").model
        SupervisedSteps(model, cfg, device_type="cpu", total_steps=1, command="test")
        assert attention_dropouts(model) == {expected}, cfg


def equal_length_batch(seed: int, n: int = 8, width: int = 5):
    """make_batch's rows at one response length: a pass holds them in the batch's order, unpadded."""
    from dataclasses import replace

    g = torch.Generator().manual_seed(seed)
    return replace(
        make_batch(seed=seed, n=n), prompt_ids=torch.randint(3, 512, (n, 3), generator=g).tolist(), response_ids=torch.randint(3, 512, (n, width), generator=g).tolist(),
        response_mask=torch.ones(n, width, dtype=torch.bool), advantages=torch.randn(n, width, generator=g), old_logprobs=-6.0 + 0.1 * torch.randn(n, width, generator=g),
        ref_logprobs=-6.0 + 0.1 * torch.randn(n, width, generator=g),
    )


def test_the_vespo_settings_and_the_rollouts_correction_reach_its_weight_instead_of_scaling_its_loss(policy, monkeypatch):
    """policy_loss = vespo: its four settings reach the loss; with update.rollout_is its
    sequences' log-weights join w (TRL's VESPO folds the correction in) and the loss is not
    multiplied by the weights again; the update reports φ's token-weighted mean."""
    from dataclasses import replace

    import rlctl.trainer as trainer_module
    from rlctl.algos.losses import rollout_is_weights, sequence_log_weights, vespo_policy_loss

    monkeypatch.setenv("RLCTL_SHARE_PROMPTS", "never")
    seen = []

    def recorded(**kwargs):
        seen.append((kwargs, vespo_policy_loss(**kwargs)))
        return seen[-1][1]

    monkeypatch.setitem(trainer_module.POLICY_LOSSES, "vespo", recorded)
    batch = equal_length_batch(seed=7)
    g = torch.Generator().manual_seed(7)
    batch = replace(batch, rollout_logprobs=batch.old_logprobs + torch.where(batch.response_mask, 0.2 * torch.randn(batch.old_logprobs.shape, generator=g), 0))
    settings = {"vespo_k_pos": 1.5, "vespo_lambda_pos": 2.5, "vespo_k_neg": 2.0, "vespo_lambda_neg": 1.0}
    n = batch.size
    stats = Trainer(policy, UpdateConfig(micro_batch_size=n, policy_loss="vespo", rollout_is="token", rollout_is_threshold=1.5, **settings)).accumulate_gradients(batch, torch.arange(n))
    ((kwargs, out),) = seen
    assert {k: kwargs[k] for k in settings} == settings
    m = kwargs["response_mask"]
    expected = sequence_log_weights(rollout_is_weights(old_logprobs=batch.old_logprobs, rollout_logprobs=batch.rollout_logprobs, response_mask=m, level="token", threshold=1.5), m, "token")
    torch.testing.assert_close(kwargs["behaviour_log_weight"], expected)
    with_correction = flat_gradients(policy.model)
    # the same gradient as the loss handed those log-weights directly, with no importance weights after it
    monkeypatch.setitem(trainer_module.POLICY_LOSSES, "vespo", lambda **kw: vespo_policy_loss(**{**kw, "behaviour_log_weight": expected}))
    Trainer(policy, UpdateConfig(micro_batch_size=n, policy_loss="vespo", **settings)).accumulate_gradients(batch, torch.arange(n))
    np.testing.assert_allclose(with_correction, flat_gradients(policy.model), atol=1e-7, rtol=0)
    assert stats["vespo_weight"] == pytest.approx(float((out.weight.squeeze(-1) * m.sum(-1)).sum() / m.sum()), rel=1e-6)


def test_the_off_policy_mask_is_the_step_whose_dropped_tokens_had_no_advantage(policy, monkeypatch):
    """update.off_policy_mask: the step is the one on the batch whose masked tokens' advantages
    are 0 (the divisors the same), the mask measured against the engine's log-probs where the
    batch has them (else the old policy's), and the update reports the share left out."""
    from dataclasses import replace

    import rlctl.trainer as trainer_module
    from rlctl.algos.losses import off_policy_sequences

    monkeypatch.setenv("RLCTL_SHARE_PROMPTS", "never")
    batch = equal_length_batch(seed=8)
    n = batch.size
    far = (torch.arange(n) % 2 == 0).unsqueeze(1)  # the even rows' engine was far likelier than this policy (~6 nats a token): masked where negative
    batch = replace(batch, rollout_logprobs=torch.where(batch.response_mask, torch.where(far, -0.1, -20.0), 0))
    seen = []

    def recorded(**kwargs):
        seen.append((kwargs["behaviour_logprobs"], off_policy_sequences(**kwargs)))
        return seen[-1][1]

    monkeypatch.setattr(trainer_module, "off_policy_sequences", recorded)
    stats = Trainer(policy, UpdateConfig(micro_batch_size=n, off_policy_mask=0.5)).accumulate_gradients(batch, torch.arange(n))
    masked = flat_gradients(policy.model)
    ((behaviour, kept),) = seen
    width = kept.shape[1]
    torch.testing.assert_close(behaviour, batch.rollout_logprobs[:, :width])
    dropped = batch.response_mask[:, :width] & ~kept
    assert dropped.any() and (batch.advantages[:, :width][dropped] < 0).all() and not dropped[~far.squeeze(1)].any()
    Trainer(policy, UpdateConfig(micro_batch_size=n)).accumulate_gradients(replace(batch, advantages=torch.where(dropped, 0, batch.advantages[:, :width])), torch.arange(n))
    np.testing.assert_allclose(masked, flat_gradients(policy.model), atol=1e-7, rtol=0)
    assert stats["off_policy_masked"] == pytest.approx(int(dropped.sum()) / int(batch.response_mask.sum()))
    seen.clear()
    Trainer(policy, UpdateConfig(micro_batch_size=n, off_policy_mask=0.5)).accumulate_gradients(replace(batch, rollout_logprobs=None), torch.arange(n))
    torch.testing.assert_close(seen[0][0], batch.old_logprobs[:, :width])  # no engine log-probs: the old policy's


def test_an_unbiased_kl_loss_is_the_gradient_of_each_tokens_kl_times_its_importance_ratio(policy, monkeypatch):
    """update.kl_loss_unbiased: the KL loss is Σ ratio·k over the tokens (ratio = π/π_old, with its
    gradient), written here directly through the policy's forward; it differs from the plain one."""
    from dataclasses import replace

    from rlctl.algos.kl import KL_ESTIMATORS
    from rlctl.algos.losses import aggregate
    from rlctl.backends.hf import pack

    monkeypatch.setenv("RLCTL_SHARE_PROMPTS", "never")
    batch = make_batch(seed=9)
    n = batch.size
    batch = replace(batch, advantages=torch.zeros_like(batch.advantages))  # the KL loss alone moves the policy
    settings = {"micro_batch_size": n, "use_kl_loss": True, "kl_loss_coef": 1.0, "kl_loss_estimator": "k3", "bf16": "false"}
    Trainer(policy, UpdateConfig(kl_loss_unbiased=True, **settings)).accumulate_gradients(batch, torch.arange(n))
    unbiased = flat_gradients(policy.model)
    Trainer(policy, UpdateConfig(**settings)).accumulate_gradients(batch, torch.arange(n))
    plain = flat_gradients(policy.model)
    policy.model.zero_grad(set_to_none=True)
    packed = pack(batch.prompt_ids, batch.response_ids, policy.pad_id, "cpu")
    logp, _ = policy.forward(packed, temperature=1.0)
    width = logp.shape[1]
    mask = packed.response_mask
    kl = KL_ESTIMATORS.get("k3")(logprobs=logp, ref_logprobs=batch.ref_logprobs[:, :width])
    ratio = torch.exp(logp - batch.old_logprobs[:, :width])
    aggregate(loss=kl * ratio, response_mask=mask, mode="token-mean", batch_tokens=int(mask.sum()), batch_seqs=n, horizon=width).backward()
    direct = flat_gradients(policy.model)
    scale = np.abs(direct).max()
    np.testing.assert_allclose(unbiased, direct, atol=1e-5 * scale, rtol=0)
    assert np.abs(unbiased - plain).max() > 0.1 * scale


def test_entropy_shaped_advantages_give_the_step_of_the_batch_with_those_advantages(policy, monkeypatch):
    """update.entropy_advantage: the step is the one on the batch whose advantages are the shaped
    ones (from the same forward's entropy), and the update reports their mean raise."""
    from dataclasses import replace

    import rlctl.trainer as trainer_module
    from rlctl.algos.losses import entropy_shaped_advantages

    monkeypatch.setenv("RLCTL_SHARE_PROMPTS", "never")
    batch = equal_length_batch(seed=10)
    n = batch.size
    seen = []

    def recorded(advantages, entropy, **kwargs):
        seen.append(entropy_shaped_advantages(advantages, entropy, **kwargs))
        return seen[-1]

    monkeypatch.setattr(trainer_module, "entropy_shaped_advantages", recorded)
    stats = Trainer(policy, UpdateConfig(micro_batch_size=n, entropy_advantage=0.4, entropy_advantage_kappa=2.0)).accumulate_gradients(batch, torch.arange(n))
    shaped_step = flat_gradients(policy.model)
    (shaped,) = seen
    assert (shaped - batch.advantages).abs().max() > 0.05  # the tiny model's entropy (~6 nats) raised them
    Trainer(policy, UpdateConfig(micro_batch_size=n)).accumulate_gradients(replace(batch, advantages=shaped.float()), torch.arange(n))
    np.testing.assert_allclose(shaped_step, flat_gradients(policy.model), atol=1e-7, rtol=0)
    assert stats["entropy_advantage"] == pytest.approx(float((shaped - batch.advantages).mean()), rel=1e-5)
