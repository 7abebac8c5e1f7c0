"""The HF backend's sampling loop: stop tokens end rows early (and drop them from the batch),
log-probs match a scoring forward pass, and a seed fixes the output."""

import functools
import math

import numpy as np
import pytest
import torch

from rlctl.backends.base import SamplingParams
from rlctl.backends.hf import HFPolicy, distinct_prompts


@pytest.fixture
def policy(tiny_model):
    return HFPolicy.load(tiny_model, "cpu")


def prompts(policy):
    texts = ["hello there", "12 + 3 =", "a", "The answer is"]
    return [policy.tokenizer(t)["input_ids"] for t in texts] * 3


def test_rows_that_sample_a_stop_token_end_early_and_keep_exact_logprobs(policy):
    policy.stop_ids = list(range(0, 512, 17))  # 1 token in 17 stops: rows finish at different steps
    batch = prompts(policy)
    active_counts = []
    out = policy.generate(batch, SamplingParams(max_new_tokens=12, temperature=1.0, seed=0), on_tokens=active_counts.append)
    stopped = [g for g in out if g.finish_reason == "stop"]
    assert stopped and any(g.finish_reason == "length" for g in out)
    for g in out:
        if g.finish_reason == "stop":
            assert g.response_ids[-1] in policy.stop_ids and all(t not in policy.stop_ids for t in g.response_ids[:-1])
        else:
            assert len(g.response_ids) == 12
    assert active_counts[0] == len(batch) and active_counts[-1] < len(batch)  # finished rows left the batch
    rescored = policy.logprobs(batch, [g.response_ids for g in out], temperature=1.0)
    for g, lp in zip(out, rescored):
        np.testing.assert_allclose(g.logprobs, lp, atol=1e-4)


def test_greedy_is_argmax_and_seed_fixes_sampling(policy):
    batch = prompts(policy)
    greedy = policy.generate(batch, SamplingParams(max_new_tokens=6, temperature=0.0))
    assert greedy[0].response_ids == greedy[4].response_ids  # same prompt, same greedy answer
    a = policy.generate(batch, SamplingParams(max_new_tokens=6, temperature=0.8, top_p=0.9, top_k=50, seed=7))
    b = policy.generate(batch, SamplingParams(max_new_tokens=6, temperature=0.8, top_p=0.9, top_k=50, seed=7))
    c = policy.generate(batch, SamplingParams(max_new_tokens=6, temperature=0.8, top_p=0.9, top_k=50, seed=8))
    assert [g.response_ids for g in a] == [g.response_ids for g in b] != [g.response_ids for g in c]


def test_min_p_samples_only_tokens_at_least_that_share_as_likely_as_the_likeliest(policy):
    """Each sampled token's probability under the scoring forward (at the temperature) is at
    least min_p × its position's largest; its log-prob is the full distribution's, as always."""
    from rlctl.backends.hf import pack

    batch = prompts(policy)
    out = policy.generate(batch, SamplingParams(max_new_tokens=6, temperature=1.3, seed=3, min_p=0.3))
    responses = [g.response_ids for g in out]
    packed = pack(batch, responses, policy.pad_id, "cpu")
    with torch.no_grad():
        logits = policy.model(input_ids=packed.input_ids, attention_mask=packed.attention_mask, position_ids=packed.position_ids).logits
    logp = torch.log_softmax(logits.gather(1, packed.logit_index.unsqueeze(-1).expand(-1, -1, logits.shape[-1])) / 1.3, -1)
    for row, (g, ids) in enumerate(zip(out, responses)):
        for t, token in enumerate(ids):
            assert logp[row, t, token] >= logp[row, t].max() + math.log(0.3) - 1e-4
            assert g.logprobs[t] == pytest.approx(float(logp[row, t, token]), abs=1e-4)
    unfiltered = policy.generate(batch, SamplingParams(max_new_tokens=6, temperature=1.3, seed=3))
    assert [g.response_ids for g in unfiltered] != responses  # at 1.3 the tail is drawn without it


def test_the_repetition_penalty_divides_positive_and_multiplies_negative_logits_of_seen_tokens():
    from rlctl.algos.logprobs import penalized

    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0]])
    seen = torch.tensor([[True, True, False, False]])
    assert penalized(logits, seen, 2.0).tolist() == [[1.0, -2.0, 0.5, 3.0]]


def test_sampling_with_a_repetition_penalty_draws_from_the_penalized_logits_and_reports_the_policys_logprobs():
    from rlctl.algos.logprobs import sample_next

    logits = torch.tensor([[3.0, 2.5, -4.0]])
    seen = torch.tensor([[True, False, False]])
    token, logp = sample_next(logits=logits, temperature=0.0, top_p=1.0, top_k=0, uniform=torch.zeros(1), seen=seen, repetition_penalty=2.0)
    assert token.tolist() == [1]  # 3.0 / 2 = 1.5 < 2.5: the seen token no longer wins
    assert logp.tolist() == pytest.approx(torch.log_softmax(logits, -1)[0, 1:2].tolist())
    unseen = sample_next(logits=logits, temperature=0.0, top_p=1.0, top_k=0, uniform=torch.zeros(1), seen=seen, repetition_penalty=1.0)[0]
    assert unseen.tolist() == [0]


def test_a_strong_repetition_penalty_keeps_a_response_from_repeating_its_prompt_or_itself(policy):
    """Greedy with a penalty of 1e4: no drawn token is one the prompt or the response holds
    already (the tiny model's unpenalized greedy answers do repeat); sampled at T = 1 the
    log-probs are the policy's own (a scoring forward's), not the penalized ones."""
    batch = prompts(policy)[:4]

    def repeats(out):
        return sum(token in set(ids) | set(g.response_ids[:t]) for ids, g in zip(batch, out) for t, token in enumerate(g.response_ids))

    plain = policy.generate(batch, SamplingParams(max_new_tokens=16, temperature=0.0))
    strong = policy.generate(batch, SamplingParams(max_new_tokens=16, temperature=0.0, repetition_penalty=1e4))
    assert repeats(plain) > 0 and repeats(strong) == 0
    sampled = policy.generate(batch, SamplingParams(max_new_tokens=12, temperature=1.0, seed=4, repetition_penalty=1.5))
    rescored = policy.logprobs(batch, [g.response_ids for g in sampled], temperature=1.0)
    for g, lp in zip(sampled, rescored):
        np.testing.assert_allclose(g.logprobs, lp, atol=1e-4)
    assert [g.response_ids for g in sampled] != [g.response_ids for g in policy.generate(batch, SamplingParams(max_new_tokens=12, temperature=1.0, seed=4))]


def test_bf16_generation_is_seeded_and_close_to_the_fp32_definition(policy):
    batch = prompts(policy)
    params = SamplingParams(max_new_tokens=8, temperature=1.0, seed=3)
    a = policy.generate(batch, params, compute_dtype="bf16")
    b = policy.generate(batch, params, compute_dtype="bf16")
    assert [g.response_ids for g in a] == [g.response_ids for g in b]
    rescored = policy.logprobs(batch, [g.response_ids for g in a], temperature=1.0)  # fp32, as score does
    for g, lp in zip(a, rescored):
        np.testing.assert_allclose(g.logprobs, lp, atol=0.1)
    assert next(policy.model.parameters()).dtype == __import__("torch").float32  # weights untouched


def test_unknown_compute_dtype_is_an_input_error(policy):
    from rlctl.errors import InputError

    with pytest.raises(InputError, match="compute dtype must be one of auto, fp32, bf16"):
        policy.generate(prompts(policy)[:1], SamplingParams(max_new_tokens=2), compute_dtype="fp8")


def test_the_lm_head_runs_only_from_the_first_response_position_with_the_same_result(policy):
    from rlctl.backends.hf import first_response_logit, pack

    prompt_ids = [[5, 6, 7, 8, 9, 10, 11], [12, 13, 14], [15, 16, 17, 18]]
    response_ids = [[20, 21, 22], [23, 24, 25, 26, 27], []]  # the last row has no response
    batch = pack(prompt_ids, response_ids, policy.pad_id, policy.device)
    assert first_response_logit(batch) == 2  # the shortest prompt's last position
    assert policy._keeps_logits
    kept_logp, kept_entropy = policy.forward(batch, temperature=0.8, statistic="entropy")
    policy._keeps_logits = False  # the full [B, L, V] logits, as before
    full_logp, full_entropy = policy.forward(batch, temperature=0.8, statistic="entropy")
    mask = batch.response_mask
    assert torch.equal(kept_logp[mask], full_logp[mask]) and torch.equal(kept_entropy[mask], full_entropy[mask])


@pytest.mark.parametrize("compute_dtype", ["fp32", "bf16"])
def test_the_lm_head_is_handed_contiguous_hidden_states(policy, monkeypatch, compute_dtype):
    """The prompt pass and transformers' forward keep some positions' logits only; a strided
    view of the hidden states would make torch's matmul a batched product, which in bf16 on the
    CPU copies the head's weight once per row."""
    from rlctl.backends import unpadded
    from rlctl.backends.hf import pack

    seen = []
    hooks = [m.get_output_embeddings().register_forward_pre_hook(lambda module, args: seen.append((tuple(args[0].shape), args[0].is_contiguous())))
             for m in (policy.model, policy._bf16.of(policy.model))]
    batch = [policy.tokenizer(t)["input_ids"] for t in ("hello there", "12 + 3 =", "The answer is")]
    policy.generate(batch, SamplingParams(max_new_tokens=2, seed=0), compute_dtype=compute_dtype)
    monkeypatch.setattr(unpadded, "for_model", lambda model: None)  # transformers' own forward
    policy.forward(pack(batch, [[20, 21], [22], [23, 24, 25]], policy.pad_id, policy.device), temperature=1.0)
    for hook in hooks:
        hook.remove()
    assert seen[0][0][:2] == (3, 1) and seen[-1][0][1] > 1  # the prompt pass's last positions; the forward's response positions
    assert all(contiguous for _, contiguous in seen)


def test_bf16_generation_follows_the_trained_weights(tiny_model, tmp_path):
    """The bf16 copy is refreshed from the fp32 module at every call: after the weights change
    (an update), bf16 generation is the new weights' own."""
    from rlctl.modelinit import init_model

    policy = HFPolicy.load(tiny_model, "cpu")
    other = HFPolicy.load(str(init_model(tmp_path / "other", "tiny", seed=1)), "cpu")
    batch = prompts(policy)
    greedy = SamplingParams(max_new_tokens=8, temperature=0.0, seed=0)
    before = policy.generate(batch, greedy, compute_dtype="bf16")
    policy.model.load_state_dict(other.model.state_dict())  # what an optimizer step does, only more
    after = policy.generate(batch, greedy, compute_dtype="bf16")
    assert [g.response_ids for g in after] == [g.response_ids for g in other.generate(batch, greedy, compute_dtype="bf16")]
    assert [g.response_ids for g in after] != [g.response_ids for g in before]


def test_scoring_in_length_ordered_batches_gives_each_row_its_own_logprobs(policy):
    """Rows are batched by length (less padding) and come back in the caller's order, each
    as scoring it alone gives it."""
    from rlctl.backends.hf import batches_by_length

    g = torch.Generator().manual_seed(0)
    lengths = [9, 2, 14, 5, 11, 3, 7]
    prompt_ids = [torch.randint(3, 500, (2 + i % 3,), generator=g).tolist() for i in range(len(lengths))]
    response_ids = [torch.randint(3, 500, (n,), generator=g).tolist() for n in lengths]
    batches = batches_by_length(prompt_ids, response_ids, 3)
    assert sorted(i for rows in batches for i in rows) == list(range(len(lengths)))
    assert [len(prompt_ids[i]) + lengths[i] for rows in batches for i in rows] == sorted(len(p) + n for p, n in zip(prompt_ids, lengths))
    together = policy.logprobs(prompt_ids, response_ids, temperature=1.0, batch_size=3)
    for p, r, got in zip(prompt_ids, response_ids, together):
        alone = policy.logprobs([p], [r], temperature=1.0)[0]
        assert len(got) == len(r)
        np.testing.assert_allclose(got, alone, atol=1e-5)


def test_prompts_are_generated_in_length_ordered_batches_and_come_back_in_order(policy):
    """A rollout batches prompts of similar length (less left padding); each row keeps its own
    random stream, so its tokens are those of generating it alone."""
    texts = ["a", "12 + 3 = and then some more words here", "hello", "The answer is, after a long think,", "b c"]
    batch = [policy.tokenizer(t)["input_ids"] for t in texts]
    params = SamplingParams(max_new_tokens=6, temperature=1.0, seed=5)
    together = policy.generate(batch, params, batch_size=2)
    for i, prompt in enumerate(batch):
        alone = policy.generate([prompt], params, first_row=i)[0]
        assert together[i].response_ids == alone.response_ids
        np.testing.assert_allclose(together[i].logprobs, alone.logprobs, atol=1e-5)


def test_distinct_prompts_keep_first_seen_order_and_map_every_row():
    distinct, source = distinct_prompts([[1, 2], [3], [1, 2], [1, 2], [3], [4, 5, 6]])
    assert distinct == [[1, 2], [3], [4, 5, 6]]
    assert source == [0, 1, 0, 0, 1, 2]


def test_a_prompt_sampled_n_times_runs_its_forward_once_and_each_row_samples_as_if_alone(policy):
    """GRPO's groups: the prompt's pass runs once per distinct prompt, computing the last
    position's logits only; its rows continue from copies of that cache, and each still samples
    what generating it alone samples."""
    texts = ["hello there", "12 + 3 =", "The answer is"]
    group = [policy.tokenizer(t)["input_ids"] for t in texts for _ in range(4)]
    params = SamplingParams(max_new_tokens=8, temperature=1.0, top_p=0.9, seed=11)
    seen = []
    forward = policy.model.forward

    @functools.wraps(forward)
    def recording(*args, **kwargs):
        seen.append((tuple(kwargs["input_ids"].shape), kwargs.get("logits_to_keep")))
        return forward(*args, **kwargs)

    policy.model.forward = recording
    together = policy.generate(group, params)
    del policy.model.forward
    prompt_rows, prompt_length = seen[0][0]
    assert prompt_rows == len(texts) and seen[0][1].tolist() == [prompt_length - 1]
    assert all(shape == (len(group), 1) for shape, _ in seen[1:2])  # the first decode step: every row
    for i, prompt in enumerate(group):
        alone = policy.generate([prompt], params, first_row=i)[0]
        assert together[i].response_ids == alone.response_ids
        np.testing.assert_allclose(together[i].logprobs, alone.logprobs, atol=1e-5)
    assert len({tuple(g.response_ids) for g in together}) > len(texts)  # the copies sample apart


def test_batches_by_prompt_keep_a_prompts_rows_together_within_the_batch_size():
    from rlctl.backends.hf import batches_by_prompt

    prompt_ids = [[1], [2, 2], [1], [3, 3, 3], [2, 2], [1], [3, 3, 3], [1]]
    response_ids = [[9] * n for n in (4, 1, 2, 6, 1, 3, 2, 5)]
    batches = batches_by_prompt(prompt_ids, response_ids, 3)
    assert sorted(i for rows in batches for i in rows) == list(range(len(prompt_ids)))
    assert all(len(rows) <= 3 for rows in batches)
    assert batches == [[1, 4], [0, 2, 5], [7, 3, 6]]  # [2, 2] (longest 3), then [1] (longest 6, split 3 + 1), then [3, 3, 3] (9)


@pytest.mark.parametrize("forward", ["rlctl", "transformers"])
def test_scoring_rows_that_share_prompts_runs_each_prompt_once_and_gives_the_full_forwards_logprobs(policy, monkeypatch, forward):
    """A group's prompt runs once (its KV cache copied to its rows), the responses on top: the
    log-probs of one full-sequence forward per row, to fp32 rounding, in the caller's order,
    also with empty responses and groups split across batches; by the unpadded forward over
    real tokens only (rlctl.backends.unpadded) and by transformers' over the padded rows."""
    from rlctl.backends import unpadded

    monkeypatch.setenv("RLCTL_SHARE_PROMPTS", "always")  # the tiny model alone would not pay for it
    monkeypatch.setenv(unpadded.OVERRIDE_ENV, forward)
    g = torch.Generator().manual_seed(1)
    distinct = [torch.randint(3, 500, (2 + i % 4,), generator=g).tolist() for i in range(5)]
    prompt_ids = [distinct[i % 5] for i in range(15)]
    response_ids = [torch.randint(3, 500, (n,), generator=g).tolist() for n in (7, 0, 3, 9, 1, 4, 6, 2, 8, 5, 3, 0, 7, 2, 6)]
    seen = []
    embedding = type(policy.model.get_input_embeddings())
    embed = embedding.forward

    def recording(self, ids):
        seen.append(tuple(ids.shape))
        return embed(self, ids)

    monkeypatch.setattr(embedding, "forward", recording)
    shared = policy.logprobs(prompt_ids, response_ids, temperature=0.7, batch_size=15)
    monkeypatch.setattr(embedding, "forward", embed)
    if forward == "rlctl":  # the real tokens: the distinct prompts', then every row's response
        assert seen == [(sum(map(len, distinct)),), (sum(map(len, response_ids)),)]
    else:  # padded rows: the distinct prompts, then every row
        assert seen[0][0] == len(distinct) and seen[1][0] == len(prompt_ids)
    full = full_forward_logprobs(policy, prompt_ids, response_ids, temperature=0.7)
    for got, want, r in zip(shared, full, response_ids):
        assert len(got) == len(r)
        np.testing.assert_allclose(got, want, atol=1e-5)
    split = policy.logprobs(prompt_ids, response_ids, temperature=0.7, batch_size=4)
    for got, want in zip(split, full):
        np.testing.assert_allclose(got, want, atol=1e-5)
    bf16 = policy.logprobs(prompt_ids, response_ids, temperature=0.7, batch_size=15, compute_dtype="bf16")
    for got, want in zip(bf16, full):
        np.testing.assert_allclose(got, want, atol=0.1)


@pytest.mark.parametrize("share", ["always", "never"])
@pytest.mark.parametrize("forward", ["rlctl", "transformers"])
def test_scoring_with_sum_pi_squared_gives_the_same_logprobs_and_each_positions_squared_probabilities(policy, monkeypatch, forward, share):
    """score's Σπ² comes from the forward of the old log-probs, whichever way the rows run (a
    prompt once for its rows, or length-ordered batches; rlctl's unpadded forward or
    transformers'): the same log-probs as without it, and Σπ² of one full forward's softmax."""
    from rlctl.backends import unpadded
    from rlctl.backends.hf import pack

    monkeypatch.setenv("RLCTL_SHARE_PROMPTS", share)
    monkeypatch.setenv(unpadded.OVERRIDE_ENV, forward)
    g = torch.Generator().manual_seed(4)
    distinct = [torch.randint(3, 500, (2 + i,), generator=g).tolist() for i in range(3)]
    prompt_ids = [distinct[i % 3] for i in range(7)]
    response_ids = [torch.randint(3, 500, (n,), generator=g).tolist() for n in (4, 0, 6, 2, 5, 3, 1)]
    logprobs, sum_pi_squared = policy.logprobs_with_statistic(prompt_ids, response_ids, statistic="sum_pi_squared", temperature=0.8, batch_size=3)
    assert logprobs == policy.logprobs(prompt_ids, response_ids, temperature=0.8, batch_size=3)
    batch = pack(prompt_ids, response_ids, policy.pad_id, "cpu")
    with torch.no_grad():
        logits = policy.model(input_ids=batch.input_ids, attention_mask=batch.attention_mask, position_ids=batch.position_ids).logits
    probs = torch.softmax(logits.gather(1, batch.logit_index.unsqueeze(-1).expand(-1, -1, logits.shape[-1])) / 0.8, -1)
    for got, want, r in zip(sum_pi_squared, probs.square().sum(-1).tolist(), response_ids):
        assert len(got) == len(r)
        np.testing.assert_allclose(got, want[: len(r)], atol=1e-5)
    assert policy.logprobs_with_statistic(prompt_ids, response_ids, statistic=None, temperature=0.8)[1] is None


def full_forward_logprobs(policy, prompt_ids, response_ids, *, temperature: float) -> list[list[float]]:
    """One full-sequence forward per row (prompt and response together)."""
    from rlctl.backends.hf import pack

    with torch.no_grad():
        logp, _ = policy.forward(pack(prompt_ids, response_ids, policy.pad_id, "cpu"), temperature=temperature)
    return [row[: len(r)] for row, r in zip(logp.tolist(), response_ids)]


def test_rows_sharing_a_prompt_train_with_the_gradients_of_one_full_forward_per_row(policy):
    """The update's forward for GRPO's groups runs each prompt once; the prompt's activations
    feed every row of its group, so its gradients sum over them: the log-probs, entropies and
    parameter gradients of one full-sequence forward per row, to fp32 rounding."""
    from rlctl.backends.hf import pack

    g = torch.Generator().manual_seed(2)
    distinct = [torch.randint(3, 500, (3 + i,), generator=g).tolist() for i in range(3)]
    prompt_ids = [distinct[i // 4] for i in range(12)]
    response_ids = [torch.randint(3, 500, (n,), generator=g).tolist() for n in (5, 8, 2, 7, 6, 1, 8, 4, 3, 8, 5, 6)]
    weights = torch.randn(12, 8, generator=g)
    packed = pack(prompt_ids, response_ids, policy.pad_id, "cpu")

    def gradients(logp, entropy):
        loss = torch.where(packed.response_mask, logp * weights + 0.1 * entropy, 0).sum()
        policy.model.zero_grad(set_to_none=True)
        loss.backward()
        return {name: p.grad.clone() for name, p in policy.model.named_parameters() if p.grad is not None}

    full = policy.forward(packed, temperature=0.9, statistic="entropy")
    shared = policy.forward_sharing_prompts(prompt_ids, response_ids, temperature=0.9, statistic="entropy")
    m = packed.response_mask
    assert shared[0].shape == full[0].shape == shared[1].shape
    torch.testing.assert_close(shared[0][m], full[0][m], atol=1e-5, rtol=0)
    torch.testing.assert_close(shared[1][m], full[1][m], atol=1e-5, rtol=0)
    want, got = gradients(*full), gradients(*shared)
    assert want.keys() == got.keys() and len(want) > 10
    for name in want:
        torch.testing.assert_close(got[name], want[name], atol=1e-5, rtol=1e-4, msg=name)


def test_kept_positions_are_indices_on_the_cpu_and_a_count_elsewhere():
    from rlctl.backends.hf import positions_to_keep

    assert positions_to_keep(3, 7, torch.device("cpu"))["logits_to_keep"].tolist() == [3, 4, 5, 6]
    assert positions_to_keep(3, 7, torch.device("meta")) == {"logits_to_keep": 4}


def test_scoring_batches_stay_within_their_token_cap_and_a_longer_row_runs_alone():
    """`score.batch_tokens`: a batch holds at most that many padded tokens (rows × its longest
    sequence) as well as `batch_size` rows; a sequence longer than the cap is a batch of its own.
    Length-ordered batches and a prompt's rows kept together alike."""
    from rlctl.backends.hf import batches_by_length, batches_by_prompt

    prompt_ids = [[1], [2, 2], [1], [3, 3, 3], [2, 2], [1], [3, 3, 3], [1], [4] * 30]
    response_ids = [[9] * n for n in (4, 1, 2, 6, 1, 3, 2, 5, 10)]
    lengths = [len(p) + len(r) for p, r in zip(prompt_ids, response_ids)]

    def padded(rows):
        return len(rows) * max(lengths[r] for r in rows)

    for batches in (batches_by_length(prompt_ids, response_ids, 8, 12), batches_by_prompt(prompt_ids, response_ids, 8, 12)):
        assert sorted(i for rows in batches for i in rows) == list(range(len(prompt_ids)))
        assert all(len(rows) <= 8 and (padded(rows) <= 12 or len(rows) == 1) for rows in batches)
        assert [8] in batches  # 40 tokens: alone
    assert batches_by_length(prompt_ids, response_ids, 3, 0) == batches_by_length(prompt_ids, response_ids, 3)
    assert batches_by_prompt(prompt_ids, response_ids, 3, 10_000) == batches_by_prompt(prompt_ids, response_ids, 3)
    # the prompt [1]'s four rows (longest 6 tokens) fit two to a batch of 12 tokens
    assert batches_by_prompt(prompt_ids[:8], response_ids[:8], 8, 12)[1:3] == [[0, 2], [5, 7]]


@pytest.mark.parametrize("share", ["always", "never"])
def test_token_capped_scoring_gives_each_row_the_logprobs_of_uncapped_scoring(policy, monkeypatch, share):
    monkeypatch.setenv("RLCTL_SHARE_PROMPTS", share)
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(3, 500, (2 + i % 4,), generator=g).tolist() for i in range(4)]
    prompt_ids = [p for p in prompts for _ in range(3)]
    response_ids = [torch.randint(3, 500, (1 + (i * 5) % 9,), generator=g).tolist() for i in range(len(prompt_ids))]
    uncapped = policy.logprobs(prompt_ids, response_ids, temperature=1.0, batch_size=64)
    capped = policy.logprobs(prompt_ids, response_ids, temperature=1.0, batch_size=64, batch_tokens=16)
    for a, b, r in zip(capped, uncapped, response_ids):
        assert len(a) == len(r)
        np.testing.assert_allclose(a, b, atol=1e-5)
