"""Direct preference optimization: a pair's sides are read as the rollout and `rlctl sft` read a
prompt and a response, the reference is the starting weights, the loss is DPO's with passes that
sum to one batch's gradient, and the policy learns to prefer the chosen responses."""

import json
import math

import pyarrow as pa
import pytest
import torch
from safetensors.torch import load_file

from rlctl.backends.hf import HFPolicy
from rlctl.choices import DPO_LOSSES
from rlctl.config import DataConfig, DpoConfig, load_config
from rlctl.dpo import (
    DpoPairs,
    DpoTrainer,
    dpo_losses,
    encode_dpo_pairs,
    evaluate,
    f_score,
    log1mexp,
    run,
)
from rlctl.errors import InputError
from rlctl.sft import encode_examples
from rlctl.shards import read


@pytest.fixture(scope="module")
def policy(tiny_model):
    return HFPolicy.load(tiny_model, "cpu")


def table_of(tmp_path, rows, *schema: str) -> pa.Table:
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return read(str(path), *schema).table


def encode(policy, table, cfg=DpoConfig(micro_batch_tokens="0")) -> DpoPairs:
    return encode_dpo_pairs(table, policy.tokenizer, DataConfig(), cfg, end_ids=policy.stop_ids, context_length=policy.context_length, source="test")


def number_pairs(count: int) -> list[dict]:
    return [{"id": f"p{i}", "prompt": f"Type a number: {i}", "chosen": f"{7 * i + 3}", "rejected": "no idea" if i % 2 else "maybe so"} for i in range(count)]


def test_each_side_is_the_prompt_and_a_response_as_sft_reads_them(policy, tmp_path):
    question = [{"role": "user", "content": "2+2"}]
    pairs = encode(policy, table_of(tmp_path, [
        {"prompt": "2+2=", "chosen": "4", "rejected": "five"},
        {"messages": question, "chosen": "4", "rejected": "5"},
    ]))
    as_sft = encode_examples(
        table_of(tmp_path, [{"prompt": "2+2=", "response": "4"}, {"messages": question, "response": "4"}], "prompts"), policy.tokenizer, DataConfig(),
        load_config().sft, end_ids=policy.stop_ids, context_length=None, source="test",
    )
    assert pairs.chosen.prompt_ids == pairs.rejected.prompt_ids == as_sft.prompt_ids
    assert pairs.chosen.response_ids == as_sft.response_ids
    tok = policy.tokenizer
    assert tok.decode(pairs.rejected.response_ids[0]) == "five" + tok.eos_token and tok.decode(pairs.rejected.response_ids[1]) == "5<|im_end|>"


def test_a_side_over_max_tokens_is_one_error_naming_the_pair_and_side(policy, tmp_path):
    table = table_of(tmp_path, [{"prompt": "a", "chosen": "b", "rejected": "c " * 40}])
    with pytest.raises(InputError, match=r"the rejected response of pair '0' has \d+ tokens, over 20 \(dpo.max_tokens\): use --set dpo.truncate=right"):
        encode(policy, table, DpoConfig(max_tokens=20))


def test_the_loss_is_dpos_with_label_smoothing():
    chosen, rejected, ref_chosen, ref_rejected = torch.tensor([-3.0, -5.0]), torch.tensor([-4.0, -2.0]), torch.tensor([-3.5, -4.0]), torch.tensor([-3.5, -2.5])
    losses, chosen_reward, rejected_reward = dpo_losses(chosen, rejected, ref_chosen, ref_rejected, beta=0.5)
    h = (chosen - ref_chosen) - (rejected - ref_rejected)  # 1.0, -1.5
    assert torch.allclose(losses, -torch.log(torch.sigmoid(0.5 * h)))
    assert torch.allclose(chosen_reward - rejected_reward, 0.5 * h)
    smoothed, _, _ = dpo_losses(chosen, rejected, ref_chosen, ref_rejected, beta=0.5, label_smoothing=0.1)
    assert torch.allclose(smoothed, -0.9 * torch.log(torch.sigmoid(0.5 * h)) - 0.1 * torch.log(torch.sigmoid(-0.5 * h)))


CHOSEN, REJECTED, REF_CHOSEN, REF_REJECTED = torch.tensor([-3.0, -5.0]), torch.tensor([-4.0, -2.0]), torch.tensor([-3.5, -4.0]), torch.tensor([-3.5, -2.5])
CHOSEN_TOKENS, REJECTED_TOKENS = torch.tensor([2, 4]), torch.tensor([5, 1])


def sigma(x: torch.Tensor) -> torch.Tensor:
    return torch.sigmoid(x)


EXPECTED = {  # each loss as its paper writes it; h = 1.0, -1.5 above, the per-token h' = 0.5/2 - (-0.5)/5, -1/4 - 0.5/1
    "sigmoid": lambda h, hp, b, e: -(1 - e) * torch.log(sigma(b * h)) - e * torch.log(sigma(-b * h)),
    "robust": lambda h, hp, b, e: (-(1 - e) * torch.log(sigma(b * h)) + e * torch.log(sigma(-b * h))) / (1 - 2 * e),
    "ipo": lambda h, hp, b, e: (hp - 1 / (2 * b)) ** 2,
    "hinge": lambda h, hp, b, e: torch.clamp(1 - b * h, min=0),
    # no reference: per-token log-probs -3/2 - (-4/5), -5/4 - (-2/1), less gamma / beta = 0.3 / 0.5
    "simpo": lambda h, hp, b, e: -(1 - e) * torch.log(sigma(b * (torch.tensor([-0.7, 0.75]) - 0.6))) - e * torch.log(sigma(-b * (torch.tensor([-0.7, 0.75]) - 0.6))),
    # no reference: the chosen side's NLL per token (3/2, 5/4) plus beta times the odds ratio's loss, odds = p / (1 - p) of p = exp(log-prob per token)
    "orpo": lambda h, hp, b, e: torch.tensor([1.5, 1.25]) - b * torch.log(sigma(log_odds(torch.tensor([-1.5, -1.25])) - log_odds(torch.tensor([-0.8, -2.0])))),
    "sigmoid_norm": lambda h, hp, b, e: -torch.log(sigma(b * hp)),
    # EXO: KL(Bernoulli(q) ‖ Bernoulli(1 − e)), q = σ(β·h) the policy's pairwise preference, 1 − e the labels'
    "exo_pair": lambda h, hp, b, e: sigma(b * h) * torch.log(sigma(b * h) / (1 - e)) + sigma(-b * h) * torch.log(sigma(-b * h) / e),
    # below, each response's own log-ratio: r_c = 0.5, -1.0 and r_r = -0.5, 0.5
    "nca_pair": lambda h, hp, b, e: -torch.log(sigma(b * RC)) - 0.5 * torch.log(sigma(-b * RC)) - 0.5 * torch.log(sigma(-b * RR)),
    "bco_pair": lambda h, hp, b, e: -torch.log(sigma(b * RC)) - torch.log(sigma(-b * RR)),
    "sppo_hard": lambda h, hp, b, e: (RC - 1 / (2 * b)) ** 2 + (RR + 1 / (2 * b)) ** 2,
    "apo_zero": lambda h, hp, b, e: (1 - sigma(b * RC)) + sigma(b * RR),
    "apo_down": lambda h, hp, b, e: sigma(b * RC) + (1 - sigma(b * (RC - RR))),
    # DiscoPOP at τ = 0.05: the logistic loss where β·h is well below 0, the exponential one above
    "discopop": lambda h, hp, b, e: (1 - sigma(b * h / 0.05)) * -torch.log(sigma(b * h)) + sigma(b * h / 0.05) * torch.exp(-b * h),
    # AOT: sigmoid DPO on margins paired by rank: the policy's sorted chosen-rejected margins against the reference's sorted ones
    "aot": lambda h, hp, b, e: smoothed_sigmoid(b * (torch.sort(CHOSEN - REJECTED).values - torch.sort(REF_CHOSEN - REF_REJECTED).values), e),
    # ... unpaired: the sorted chosen log-ratios (-1.0, 0.5) against the sorted rejected ones (-0.5, 0.5)
    "aot_unpaired": lambda h, hp, b, e: smoothed_sigmoid(b * torch.tensor([-0.5, 0.0]), e),
}
RC, RR = torch.tensor([0.5, -1.0]), torch.tensor([-0.5, 0.5])


def smoothed_sigmoid(x: torch.Tensor, e: float) -> torch.Tensor:
    return -(1 - e) * torch.log(sigma(x)) - e * torch.log(sigma(-x))


def log_odds(mean_logp: torch.Tensor) -> torch.Tensor:
    p = torch.exp(mean_logp.double())
    return torch.log(p / (1 - p)).float()


@pytest.mark.parametrize("loss", DPO_LOSSES)
def test_every_loss_is_its_papers_formula_with_dpos_implicit_rewards(loss):
    assert set(EXPECTED) == set(DPO_LOSSES)
    eps = 0.2 if loss in ("sigmoid", "robust", "simpo", "exo_pair", "aot", "aot_unpaired") else 0.0
    losses, chosen_reward, rejected_reward = dpo_losses(
        CHOSEN, REJECTED, REF_CHOSEN, REF_REJECTED, beta=0.5, loss=loss, label_smoothing=eps, chosen_tokens=CHOSEN_TOKENS, rejected_tokens=REJECTED_TOKENS,
        simpo_gamma=0.3,
    )
    assert torch.equal(RC, CHOSEN - REF_CHOSEN) and torch.equal(RR, REJECTED - REF_REJECTED)
    h = (CHOSEN - REF_CHOSEN) - (REJECTED - REF_REJECTED)
    per_token = (CHOSEN - REF_CHOSEN) / CHOSEN_TOKENS - (REJECTED - REF_REJECTED) / REJECTED_TOKENS
    assert torch.allclose(per_token, torch.tensor([0.35, -0.75]))
    assert torch.allclose(losses, EXPECTED[loss](h, per_token, 0.5, eps))
    if loss in ("simpo", "orpo"):  # their implicit reward: beta times the per-token log-prob
        assert torch.allclose(chosen_reward, 0.5 * CHOSEN / CHOSEN_TOKENS) and torch.allclose(rejected_reward, 0.5 * REJECTED / REJECTED_TOKENS)
    else:
        assert torch.allclose(chosen_reward, 0.5 * (CHOSEN - REF_CHOSEN)) and torch.allclose(rejected_reward, 0.5 * (REJECTED - REF_REJECTED))


@pytest.mark.parametrize(("divergence", "derivative"), [
    ("reverse_kl", lambda u: torch.log(u)), ("forward_kl", lambda u: 1 - 1 / u), ("js_divergence", lambda u: torch.log(2 * u / (1 + u))),
    ("alpha_divergence", lambda u: (1 - u ** -0.3) / 0.3),
])
def test_an_f_divergence_scores_each_log_ratio_as_its_derivative_at_the_likelihood_ratio(divergence, derivative):
    """f-DPO: with u = π/π_ref, a side's score is f'(u), and the losses on the difference of the
    sides take the scores' difference where DPO takes the log-ratios'."""
    logratio = torch.tensor([-3.0, -0.4, 0.0, 0.7, 2.5], dtype=torch.float64)
    assert torch.allclose(f_score(logratio, divergence, 0.3), derivative(torch.exp(logratio)))
    losses, chosen_reward, _ = dpo_losses(CHOSEN, REJECTED, REF_CHOSEN, REF_REJECTED, beta=0.5, f_divergence=divergence, f_alpha=0.3)
    h = derivative(torch.exp(RC.double())) - derivative(torch.exp(RR.double()))
    assert torch.allclose(losses.double(), -torch.log(sigma(0.5 * h)), atol=1e-6)
    assert torch.allclose(chosen_reward, 0.5 * RC)  # the implicit reward stays β·(log π − log π_ref)


def test_the_alpha_divergence_runs_from_the_reverse_kl_to_the_forward_and_stays_finite_far_below_the_reference():
    logratio = torch.tensor([-2.0, 0.5, 1.5], dtype=torch.float64)
    assert torch.allclose(f_score(logratio, "alpha_divergence", 1e-6), logratio, atol=1e-5)
    assert torch.allclose(f_score(logratio, "alpha_divergence", 1 - 1e-6), f_score(logratio, "forward_kl"), atol=1e-4)
    far = torch.tensor([-500.0])  # a response e^-500 as likely as under the reference: u^-α overflows float32 unheld
    assert torch.isfinite(f_score(far, "alpha_divergence", 0.5)).all() and torch.isfinite(f_score(far, "forward_kl")).all()
    assert torch.isfinite(dpo_losses(far, torch.tensor([-1.0]), torch.tensor([0.0]), torch.tensor([-1.0]), beta=0.1, f_divergence="forward_kl")[0]).all()


def test_discopops_slope_at_h_0_is_positive_for_a_small_tau_so_training_from_the_reference_first_lowers_h():
    """DiscoPOP's mix σ(β·h/τ) rises fast around 0 for a small τ, weighing in its exponential term
    (1 at h = 0, above the logistic's log 2): the loss grows with h there (TRL's β = 0.1, τ = 0.05:
    slope 0.0784), and falls for a larger τ."""
    for tau, sign in ((0.05, 1), (1.0, -1)):
        h = torch.zeros(1, dtype=torch.float64, requires_grad=True)
        zero = torch.zeros(1, dtype=torch.float64)
        dpo_losses(h, zero, zero, zero, beta=0.1, loss="discopop", discopop_tau=tau)[0].sum().backward()
        assert sign * float(h.grad) > 0.05
    rise, mix = (0.1 / 0.05) / 4, 0.5  # the mix m at h = 0 and its slope (β/τ)·m(1 − m)
    slope = rise * (1 - math.log(2)) - (1 - mix) * 0.1 * 0.5 - mix * 0.1  # m' times the terms' gap, less each term's own slope (β·σ(0), β) weighted
    h = torch.zeros(1, dtype=torch.float64, requires_grad=True)
    dpo_losses(h, torch.zeros(1, dtype=torch.float64), torch.zeros(1, dtype=torch.float64), torch.zeros(1, dtype=torch.float64), beta=0.1, loss="discopop")[0].sum().backward()
    assert float(h.grad) == pytest.approx(slope, rel=1e-9)


def test_a_loss_on_each_sides_own_ratio_takes_no_other_f_divergence():
    with pytest.raises(ValueError, match="the nca_pair loss takes the reverse KL only"):
        dpo_losses(CHOSEN, REJECTED, REF_CHOSEN, REF_REJECTED, beta=0.5, loss="nca_pair", f_divergence="js_divergence")


def test_ld_dpo_weighs_each_sides_tokens_past_the_shorter_sides_length_by_alpha():
    """Pair 0: chosen 3 trained tokens, rejected 6 (a turn between them not trained); pair 1: 2 and 2."""
    from rlctl.algos.preference import desensitized_weights

    counted = torch.tensor([
        [1, 1, 1, 0, 0, 0, 0], [0, 1, 1, 0, 0, 0, 0],  # the chosen sides
        [1, 1, 0, 1, 1, 1, 1], [1, 1, 0, 0, 0, 0, 0],  # the rejected sides
    ], dtype=torch.bool)
    got = desensitized_weights(counted, 0.25)
    assert got.tolist() == [
        [1, 1, 1, 0, 0, 0, 0], [0, 1, 1, 0, 0, 0, 0],
        [1, 1, 0, 1, 0.25, 0.25, 0.25], [1, 1, 0, 0, 0, 0, 0],  # the rejected side's tokens past the chosen side's 3 weigh α
    ]
    assert torch.equal(desensitized_weights(counted, 1.0), counted.float())


def test_ld_dpo_scores_the_policy_and_the_reference_alike_and_its_passes_give_the_steps_gradient(tiny_model, tmp_path):
    """ld_alpha = 0.3: each side's log-probability is the sum over its first ℓ trained tokens plus
    0.3 × the rest (ℓ the pair's shorter side), the reference's too; the NLL of sft_weight stays the
    chosen response's plain one; passes of any size give one gradient."""
    gradients = []
    for micro in (1, 5):
        policy = HFPolicy.load(tiny_model, "cpu")
        cfg = DpoConfig(batch_size=5, micro_batch_size=micro, micro_batch_tokens="0", bf16="false", lr=1e-9, max_grad_norm=0.0, beta=0.3, ld_alpha=0.3, sft_weight=0.5)
        trainer = DpoTrainer(policy, cfg, total_steps=1)
        pairs = trainer.with_reference(encode(policy, table_of(tmp_path, number_pairs(5))))
        pairs = DpoPairs(pairs.chosen, pairs.rejected, [v - 0.5 * i for i, v in enumerate(pairs.ref_chosen)], [v + 0.2 for v in pairs.ref_rejected])
        trainer.train_epoch(pairs, 1)
        gradients.append(torch.cat([p.grad.reshape(-1) for p in policy.model.parameters() if p.grad is not None]))
    assert torch.allclose(gradients[0], gradients[1], atol=1e-6)
    policy.model.zero_grad()

    def token_logps(prompt_ids, response_ids) -> list[torch.Tensor]:
        out = []
        for prompt, response in zip(prompt_ids, response_ids):
            logp = torch.log_softmax(policy.model(input_ids=torch.tensor([prompt + response])).logits[0].double(), -1)
            out.append(logp[torch.arange(len(prompt) - 1, len(prompt) - 1 + len(response)), torch.tensor(response)])
        return out

    chosen, rejected = (token_logps(pairs.chosen.prompt_ids, side.response_ids) for side in (pairs.chosen, pairs.rejected))
    assert any(len(c) != len(r) for c, r in zip(chosen, rejected))  # some pairs have a longer side to weigh
    shared = [min(len(c), len(r)) for c, r in zip(chosen, rejected)]
    weighed = [torch.stack([t[:n].sum() + 0.3 * t[n:].sum() for t, n in zip(side, shared)]) for side in (chosen, rejected)]
    start = HFPolicy.load(tiny_model, "cpu")
    fresh = DpoTrainer(start, DpoConfig(micro_batch_size=2, micro_batch_tokens="0", bf16="false", ld_alpha=0.3), total_steps=1).with_reference(encode(start, table_of(tmp_path, number_pairs(5))))
    for side, values in ((fresh.chosen, fresh.ref_chosen), (fresh.rejected, fresh.ref_rejected)):  # the reference weighed alike
        with torch.no_grad():
            start_logps = [torch.log_softmax(start.model(input_ids=torch.tensor([p + r])).logits[0].double(), -1)[torch.arange(len(p) - 1, len(p) - 1 + len(r)), torch.tensor(r)]
                           for p, r in zip(side.prompt_ids, side.response_ids)]
        assert values == pytest.approx([float(t[:n].sum() + 0.3 * t[n:].sum()) for t, n in zip(start_logps, shared)], abs=1e-4)
    tokens = [torch.tensor([len(t) for t in side]) for side in (chosen, rejected)]
    losses, _, _ = dpo_losses(
        weighed[0], weighed[1], torch.tensor(pairs.ref_chosen).double(), torch.tensor(pairs.ref_rejected).double(), beta=0.3,
        chosen_tokens=tokens[0], rejected_tokens=tokens[1], sft_weight=0.5, chosen_plain=torch.stack([t.sum() for t in chosen]),
    )
    losses.mean().backward()
    direct = torch.cat([p.grad.reshape(-1) for p in policy.model.parameters() if p.grad is not None]).float()
    assert torch.allclose(gradients[0], direct, atol=2e-5 * float(direct.abs().max()))


def test_wpos_weight_is_how_likely_the_policy_samples_a_response_relative_to_its_distributions_sharpness():
    from rlctl.algos.preference import wpo_weights

    # row 0: p = 0.1 where Σp² = 0.5, then p = 0.5 where Σp² = 0.25 (a position not trained between); row 1: a uniform distribution's token
    logp = torch.log(torch.tensor([[0.1, 0.9, 0.5], [0.25, 0.0, 0.0]]).clamp(min=1e-12))
    sum_pi_squared = torch.tensor([[0.5, 0.9, 0.25], [0.25, 1.0, 1.0]])
    counted = torch.tensor([[True, False, True], [True, False, False]])
    got = wpo_weights(logp, sum_pi_squared, counted)
    assert torch.allclose(got, torch.tensor([math.exp((math.log(0.1 / 0.5) + math.log(0.5 / 0.25)) / 2), 1.0]))


def test_wpo_weighs_each_pairs_loss_by_its_responses_weights_under_the_policy_in_passes_of_any_size(tiny_model, tmp_path):
    losses_seen, gradients = [], []
    for micro in (1, 5):
        policy = HFPolicy.load(tiny_model, "cpu")
        cfg = DpoConfig(batch_size=5, micro_batch_size=micro, micro_batch_tokens="0", bf16="false", lr=1e-9, max_grad_norm=0.0, beta=0.3, use_weighting=True)
        trainer = DpoTrainer(policy, cfg, total_steps=1)
        pairs = trainer.with_reference(encode(policy, table_of(tmp_path, number_pairs(5))))
        pairs = DpoPairs(pairs.chosen, pairs.rejected, [v - 0.5 * i for i, v in enumerate(pairs.ref_chosen)], [v + 0.2 for v in pairs.ref_rejected])
        losses_seen.append(trainer.evaluate(pairs)[0])
        trainer.train_epoch(pairs, 1)
        gradients.append(torch.cat([p.grad.reshape(-1) for p in policy.model.parameters() if p.grad is not None]))
    assert losses_seen[0] == pytest.approx(losses_seen[1], rel=1e-5) and torch.allclose(gradients[0], gradients[1], atol=1e-6)
    policy.model.zero_grad()

    def side(prompt_ids, response_ids):
        sums, weights = [], []
        for prompt, response in zip(prompt_ids, response_ids):
            logits = policy.model(input_ids=torch.tensor([prompt + response])).logits[0].double()[len(prompt) - 1: len(prompt) - 1 + len(response)]
            logp = torch.log_softmax(logits, -1)
            token = logp[torch.arange(len(response)), torch.tensor(response)]
            sums.append(token.sum())
            weights.append(torch.exp((token - torch.log(torch.exp(2 * logp).sum(-1))).mean()).detach())
        return torch.stack(sums), torch.stack(weights)

    (chosen, chosen_weight), (rejected, rejected_weight) = side(pairs.chosen.prompt_ids, pairs.chosen.response_ids), side(pairs.chosen.prompt_ids, pairs.rejected.response_ids)
    assert float((chosen_weight * rejected_weight).min()) < 0.9  # weights that matter
    plain, _, _ = dpo_losses(chosen, rejected, torch.tensor(pairs.ref_chosen).double(), torch.tensor(pairs.ref_rejected).double(), beta=0.3)
    weighed = plain * chosen_weight * rejected_weight
    assert losses_seen[0] == pytest.approx(float(weighed.detach().mean()), rel=1e-4)
    weighed.mean().backward()
    direct = torch.cat([p.grad.reshape(-1) for p in policy.model.parameters() if p.grad is not None]).float()
    assert torch.allclose(gradients[0], direct, atol=2e-5 * float(direct.abs().max()))


@pytest.mark.parametrize("loss", ["sigmoid", "ipo", "simpo"])
def test_an_sft_weight_adds_the_chosen_responses_nll_per_token_to_any_loss(loss):
    kwargs = {"beta": 0.5, "loss": loss, "chosen_tokens": CHOSEN_TOKENS, "rejected_tokens": REJECTED_TOKENS}
    plain, chosen_reward, rejected_reward = dpo_losses(CHOSEN, REJECTED, REF_CHOSEN, REF_REJECTED, **kwargs)
    with_nll = dpo_losses(CHOSEN, REJECTED, REF_CHOSEN, REF_REJECTED, sft_weight=0.2, **kwargs)
    assert torch.allclose(with_nll[0], plain + 0.2 * torch.tensor([3 / 2, 5 / 4]))  # RPO: alpha times -log pi(y_c) / |y_c|
    assert torch.equal(with_nll[1], chosen_reward) and torch.equal(with_nll[2], rejected_reward)  # the rewards are the preference loss's


def test_orpos_log_odds_are_accurate_where_a_response_is_near_certain_or_near_impossible():
    mean_logp = torch.tensor([-1e-6, -1e-3, -0.5, -0.7, -5.0, -40.0])
    want = torch.log(-torch.expm1(mean_logp.double()))  # log(1 - p) in double precision
    assert torch.allclose(log1mexp(mean_logp).double(), want, rtol=1e-6)
    assert torch.isfinite(log1mexp(torch.tensor([0.0]))).all()  # every token certain: a finite loss, not inf


def test_robust_dpo_is_unbiased_under_flipped_labels():
    """Its expected loss over a label flipped with probability eps is the clean sigmoid loss."""
    h, eps = torch.tensor([0.7, -2.0, 3.0]), 0.3
    right = dpo_losses(h, torch.zeros(3), torch.zeros(3), torch.zeros(3), beta=1.0, loss="robust", label_smoothing=eps)[0]
    flipped = dpo_losses(torch.zeros(3), h, torch.zeros(3), torch.zeros(3), beta=1.0, loss="robust", label_smoothing=eps)[0]
    assert torch.allclose((1 - eps) * right + eps * flipped, -torch.log(torch.sigmoid(h)))


def test_several_losses_are_summed_with_their_weights_and_the_first_ones_implicit_rewards():
    """MPO (TRL's loss_type = ["sigmoid", "bco_pair"], loss_weights = [0.8, 0.2])."""
    args = (CHOSEN, REJECTED, REF_CHOSEN, REF_REJECTED)
    sigmoid, rewards_c, rewards_r = dpo_losses(*args, beta=0.5, loss="sigmoid")
    bco, _, _ = dpo_losses(*args, beta=0.5, loss="bco_pair")
    mixed, mixed_c, mixed_r = dpo_losses(*args, beta=0.5, loss="sigmoid,bco_pair", loss_weights=(0.8, 0.2))
    assert torch.allclose(mixed, 0.8 * sigmoid + 0.2 * bco) and torch.equal(mixed_c, rewards_c) and torch.equal(mixed_r, rewards_r)
    assert torch.allclose(dpo_losses(*args, beta=0.5, loss="sigmoid,bco_pair")[0], sigmoid + bco)  # 1 each by default
    assert torch.equal(dpo_losses(*args, beta=0.5, loss="sigmoid", loss_weights=(0.5,))[0], 0.5 * sigmoid)


def summed_logps(model, prompt_ids, response_ids) -> torch.Tensor:
    """Each response's summed log-probability from the model's full logits, one row at a time."""
    out = []
    for prompt, response in zip(prompt_ids, response_ids):
        logp = torch.log_softmax(model(input_ids=torch.tensor([prompt + response])).logits[0].double(), -1)
        positions = torch.arange(len(prompt) - 1, len(prompt) - 1 + len(response))
        out.append(logp[positions, torch.tensor(response)].sum())
    return torch.stack(out)


@pytest.mark.parametrize(("loss", "first"), [
    ("sigmoid", math.log(2)), ("robust", math.log(2)), ("ipo", (1 / (2 * 0.1)) ** 2), ("hinge", 1.0), ("sigmoid_norm", math.log(2)),
    ("exo_pair", math.log(0.5) - 0.5 * math.log(1e-3 * (1 - 1e-3))), ("nca_pair", 2 * math.log(2)), ("bco_pair", 2 * math.log(2)),
    ("sppo_hard", 2 * (1 / (2 * 0.1)) ** 2), ("apo_zero", 1.0), ("apo_down", 1.0), ("discopop", 0.5 * math.log(2) + 0.5),
    ("aot", math.log(2)), ("aot_unpaired", math.log(2)), ("sigmoid,bco_pair", 0.8 * math.log(2) + 0.2 * 2 * math.log(2)),
])
def test_the_reference_is_the_starting_weights_so_the_first_loss_is_the_one_at_h_0(policy, tmp_path, loss, first):
    pairs = encode(policy, table_of(tmp_path, number_pairs(5)))
    smoothing = 1e-3 if loss == "exo_pair" else 0.0
    weights = (0.8, 0.2) if "," in loss else ()  # MPO's
    trainer = DpoTrainer(policy, DpoConfig(micro_batch_size=2, micro_batch_tokens="0", bf16="false", loss=loss, loss_weights=weights, beta=0.1, label_smoothing=smoothing), total_steps=1)
    referenced = trainer.with_reference(pairs)
    with torch.no_grad():
        want = summed_logps(policy.model, pairs.chosen.prompt_ids, pairs.chosen.response_ids)
    assert referenced.ref_chosen == pytest.approx(want.tolist(), abs=1e-4)
    loss_value, accuracy = trainer.evaluate(referenced)
    assert loss_value == pytest.approx(first, rel=1e-5) and accuracy == 0.0  # no pair's chosen reward above its rejected one's yet


@pytest.mark.parametrize(("loss", "sft_weight"), [("sigmoid", 0.0), ("ipo", 0.0), ("orpo", 0.0), ("sigmoid", 0.7)])  # per-token values: each side's own token count in any pass
def test_passes_of_any_size_give_the_gradient_of_the_batchs_mean_loss(tiny_model, tmp_path, loss, sft_weight):
    gradients = []
    for micro, cap in ((1, "0"), (5, "0"), (4, "40")):
        policy = HFPolicy.load(tiny_model, "cpu")
        cfg = DpoConfig(
            batch_size=5, micro_batch_size=micro, micro_batch_tokens=cap, bf16="false", lr=1e-9, max_grad_norm=0.0, beta=0.3, loss=loss, sft_weight=sft_weight,
        )
        trainer = DpoTrainer(policy, cfg, total_steps=1)
        pairs = trainer.with_reference(encode(policy, table_of(tmp_path, number_pairs(5))))
        # a reference other than the weights, so the gradient is not the one at h = 0
        pairs = DpoPairs(pairs.chosen, pairs.rejected, [v - 0.5 * i for i, v in enumerate(pairs.ref_chosen)], [v + 0.2 for v in pairs.ref_rejected])
        trainer.train_epoch(pairs, 1)  # one optimizer step of lr 1e-9: the gradient is the one to compare
        gradients.append(torch.cat([p.grad.reshape(-1) for p in policy.model.parameters() if p.grad is not None]))
    assert torch.allclose(gradients[0], gradients[1], atol=1e-6) and torch.allclose(gradients[0], gradients[2], atol=1e-6)
    policy.model.zero_grad()
    chosen = summed_logps(policy.model, pairs.chosen.prompt_ids, pairs.chosen.response_ids)
    rejected = summed_logps(policy.model, pairs.rejected.prompt_ids, pairs.rejected.response_ids)
    tokens = [torch.tensor([len(r) for r in side.response_ids]) for side in (pairs.chosen, pairs.rejected)]
    losses, _, _ = dpo_losses(
        chosen, rejected, torch.tensor(pairs.ref_chosen).double(), torch.tensor(pairs.ref_rejected).double(), beta=0.3, loss=loss,
        chosen_tokens=tokens[0], rejected_tokens=tokens[1], sft_weight=sft_weight,
    )
    losses.mean().backward()
    direct = torch.cat([p.grad.reshape(-1) for p in policy.model.parameters() if p.grad is not None]).float()
    assert torch.allclose(gradients[0], direct, atol=2e-5 * float(direct.abs().max()))  # fp32 passes against a double computation


def test_dpo_learns_to_prefer_the_chosen_responses_and_writes_a_checkpoint(tiny_model, tmp_path):
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in number_pairs(16)))
    cfg = load_config(None, ["dpo.epochs=3", "dpo.lr=1e-3", "dpo.batch_size=4", "dpo.bf16=false"])
    reported = []
    manifest = run(data=str(tmp_path / "train.jsonl"), val_data=str(tmp_path / "train.jsonl"), model=tiny_model, out=str(tmp_path / "dpo"), cfg=cfg, device="cpu", report=reported.append)
    assert [r["epoch"] for r in reported] == [0, 1, 2, 3] and reported[0]["val_loss"] == pytest.approx(math.log(2), abs=1e-6)
    assert reported[-1]["val_loss"] < 0.3 and reported[-1]["val_accuracy"] == 1.0 and reported[-1]["margin"] > 0
    assert manifest.stage == "dpo" and manifest.state["optimizer_steps"] == 12 and manifest.state["pairs"] == 16
    trained = HFPolicy.load(str(tmp_path / "dpo"), "cpu")
    start = HFPolicy.load(tiny_model, "cpu")
    pairs = encode(start, table_of(tmp_path, number_pairs(16)))
    with torch.no_grad():
        moved = [summed_logps(m.model, pairs.chosen.prompt_ids, side.response_ids) for m in (trained, start) for side in (pairs.chosen, pairs.rejected)]
    assert float(((moved[0] - moved[2]) - (moved[1] - moved[3])).mean()) > 0  # chosen up against rejected, relative to the start
    again = run(data=str(tmp_path / "train.jsonl"), val_data=str(tmp_path / "train.jsonl"), model=tiny_model, out=str(tmp_path / "dpo"), cfg=cfg, device="cpu")
    assert again.state.get("skipped")


@pytest.mark.parametrize(("loss", "free"), [("simpo", False), ("orpo", False), ("sigmoid", True), ("ipo", True)])
def test_a_reference_free_loss_computes_no_reference(policy, tmp_path, monkeypatch, loss, free):
    pairs = encode(policy, table_of(tmp_path, number_pairs(3)))

    def no_forward(*args, **kwargs):
        raise AssertionError("a reference forward for a reference-free loss")

    trainer = DpoTrainer(policy, DpoConfig(micro_batch_tokens="0", bf16="false", loss=loss, reference_free=free), total_steps=1)
    monkeypatch.setattr(policy, "forward", no_forward)
    referenced = trainer.with_reference(pairs)
    assert referenced.ref_chosen == referenced.ref_rejected == [0.0, 0.0, 0.0]


def test_reference_free_dpo_with_the_chosen_nll_is_cpos_loss(policy, tmp_path):
    """dpo.reference_free with sft_weight = 1: −log σ(β·(log π(y_c) − log π(y_r))) + the chosen
    response's NLL per token (Xu et al.'s CPO; TRL's CPOTrainer with cpo_alpha = 1)."""
    pairs = encode(policy, table_of(tmp_path, number_pairs(4)))
    trainer = DpoTrainer(policy, DpoConfig(micro_batch_tokens="0", bf16="false", beta=0.2, reference_free=True, sft_weight=1.0), total_steps=1)
    loss, _ = trainer.evaluate(trainer.with_reference(pairs))
    with torch.no_grad():
        chosen, rejected = (summed_logps(policy.model, pairs.chosen.prompt_ids, side.response_ids) for side in (pairs.chosen, pairs.rejected))
    tokens = torch.tensor([len(r) for r in pairs.chosen.response_ids])
    want = -torch.nn.functional.logsigmoid(0.2 * (chosen - rejected)) - chosen / tokens
    assert loss == pytest.approx(float(want.mean()), rel=1e-5)


@pytest.mark.parametrize(("loss", "settings", "fall"), [
    ("robust", ["dpo.label_smoothing=0.1"], 0.5), ("ipo", ["dpo.beta=0.5"], 0.5), ("hinge", [], 0.5), ("simpo", ["dpo.beta=2.0"], 0.5),
    ("orpo", ["dpo.beta=0.5"], 0.6),  # ORPO's loss is mostly the chosen responses' NLL per token (6.6 at the start), which falls slower
    ("sigmoid_norm", [], 0.8), ("exo_pair", ["dpo.label_smoothing=0.001"], 0.5), ("bco_pair", [], 0.5), ("sppo_hard", ["dpo.beta=0.5"], 0.5),
    ("nca_pair", [], 0.8), ("apo_zero", [], 0.6), ("apo_down", [], 0.6),  # terms on each side's own ratio, which saturate slower
    ("discopop", ["dpo.discopop_tau=1"], 0.5),  # at TRL's τ = 0.05 its slope at h = 0 is positive: see the test below
    ("sigmoid", ["dpo.ld_alpha=0.3"], 0.5),
    ("sigmoid", ["dpo.use_weighting=true"], 0.5),
    ("sigmoid", ["dpo.reference_free=true", "dpo.sft_weight=1"], 0.6),  # CPO: mostly the chosen responses' NLL, as ORPO's
    ("sigmoid", ["dpo.f_divergence=forward_kl"], 0.5), ("sigmoid", ["dpo.f_divergence=js_divergence"], 0.5), ("sigmoid", ["dpo.f_divergence=alpha_divergence"], 0.5),
])
def test_every_loss_learns_to_prefer_the_chosen_responses(tiny_model, tmp_path, loss, settings, fall):
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in number_pairs(16)))
    cfg = load_config(None, ["dpo.epochs=3", "dpo.lr=1e-3", "dpo.batch_size=4", "dpo.bf16=false", f"dpo.loss={loss}", *settings])
    reported = []
    manifest = run(data=str(tmp_path / "train.jsonl"), val_data=str(tmp_path / "train.jsonl"), model=tiny_model, out=str(tmp_path / "dpo"), cfg=cfg, device="cpu", report=reported.append)
    assert reported[-1]["val_loss"] < fall * reported[0]["val_loss"] and reported[-1]["val_accuracy"] == 1.0 and reported[-1]["margin"] > 0
    assert manifest.config["dpo"]["loss"] == loss


# --- a reference that moves towards the policy (dpo.ref_sync_every; TR-DPO) ------------------


def weights_of(model) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in model.named_parameters()}


@pytest.mark.parametrize("lora", [0, 4])
def test_a_reference_reset_to_the_policy_after_every_step_makes_every_steps_loss_the_one_at_h_0(tiny_model, tmp_path, lora):
    """α = 1 after every step: each step's forward finds the policy equal to its reference (h = 0,
    loss log 2), yet the gradient there is not 0, so the policy moves, as it does not without the
    sync, where the loss falls; a LoRA run's reference is its adapted policy."""
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in number_pairs(8)))
    common = ["dpo.epochs=2", "dpo.lr=1e-3", "dpo.batch_size=2", "dpo.bf16=false", f"dpo.lora.r={lora}"]
    runs = {}
    for name, extra in (("synced", ["dpo.ref_sync_every=1"]), ("fixed", [])):
        rows = []
        manifest = run(data=str(tmp_path / "train.jsonl"), val_data=str(tmp_path / "train.jsonl"), model=tiny_model, out=str(tmp_path / name),
                       cfg=load_config(None, common + extra), device="cpu", report=rows.append)
        runs[name] = (rows, manifest)
    synced, manifest = runs["synced"]
    assert [r["loss"] for r in synced[1:]] == pytest.approx([math.log(2)] * 2, abs=1e-4)
    assert synced[-1]["grad_norm"] > 1e-3 and manifest.state["ref_syncs"] == 8
    measured = evaluate(data=str(tmp_path / "train.jsonl"), model=str(tmp_path / "synced"), cfg=load_config(None, common), device="cpu")[0]
    assert synced[-1]["val_loss"] == pytest.approx(measured.loss, abs=1e-5)  # held-out pairs: against the starting weights, as --eval measures
    assert measured.loss < math.log(2) - 0.01
    fixed, plain = runs["fixed"]
    assert fixed[-1]["loss"] < math.log(2) - 0.02 and "ref_syncs" not in plain.state
    start, trained = (HFPolicy.load(path, "cpu") for path in (tiny_model, str(tmp_path / "synced")))
    pairs = encode(start, table_of(tmp_path, number_pairs(8)))
    with torch.no_grad():
        moved = [summed_logps(m.model, pairs.chosen.prompt_ids, side.response_ids) for m in (trained, start) for side in (pairs.chosen, pairs.rejected)]
    assert float(((moved[0] - moved[2]) - (moved[1] - moved[3])).mean()) > 0  # chosen up against rejected, relative to the start


def test_a_mixed_reference_is_alpha_times_the_policy_at_each_sync_plus_the_rest_of_the_last_and_scores_as_those_weights(tiny_model, tmp_path):
    policy = HFPolicy.load(tiny_model, "cpu")
    start = weights_of(policy.model)
    cfg = DpoConfig(batch_size=2, micro_batch_size=2, micro_batch_tokens="0", bf16="false", lr=1e-3, ref_sync_every=2, ref_sync_alpha=0.5)
    trainer = DpoTrainer(policy, cfg, total_steps=4)
    at_syncs, sync = [], trainer.sync_reference

    def recorded() -> None:
        at_syncs.append(weights_of(policy.model))
        sync()

    trainer.sync_reference = recorded
    pairs = trainer.with_reference(encode(policy, table_of(tmp_path, number_pairs(8))))
    before = list(pairs.ref_chosen)
    trainer.train_epoch(pairs, 1)
    assert len(at_syncs) == 2  # after steps 2 and 4
    want = {n: 0.5 * at_syncs[1][n] + 0.5 * (0.5 * at_syncs[0][n] + 0.5 * start[n]) for n in start}
    held = {name: w for (name, _), w in zip(trainer.moving_reference.named, trainer.moving_reference.weights)}
    assert max(float((held[n] - want[n]).abs().max()) for n in want) < 1e-6
    assert all(torch.equal(p, at_syncs[1][n]) for n, p in policy.model.named_parameters())  # the swaps gave the policy its weights back, bit for bit
    mixed = HFPolicy.load(tiny_model, "cpu")
    mixed.model.load_state_dict(want, strict=False)
    with torch.no_grad():
        for side, values in ((pairs.chosen, pairs.ref_chosen), (pairs.rejected, pairs.ref_rejected)):
            assert values == pytest.approx(summed_logps(mixed.model, pairs.chosen.prompt_ids, side.response_ids).tolist(), abs=1e-4)
    assert max(abs(a - b) for a, b in zip(before, pairs.ref_chosen)) > 1e-3


class Stopped(Exception):
    """What a report raises to stop a run in its second epoch, as a kill would."""


def stopped_in_epoch_2(run, **args) -> None:
    """`run(**args)` stopped as it reports its second epoch (its epoch checkpoints left behind)."""

    def stop(row: dict) -> None:
        if row["epoch"] == 2:
            raise Stopped

    with pytest.raises(Stopped):
        run(report=stop, **args)


def assert_resumed_as_uninterrupted(resumed, whole, out, keys) -> None:
    """A resumed run's weights are the uninterrupted run's byte for byte, its epochs' figures too."""
    assert (out / "model.safetensors").read_bytes() == (out.parent / "whole" / "model.safetensors").read_bytes()
    for key in keys:
        assert [r[key] for r in resumed.state["epochs"][1:]] == pytest.approx([r[key] for r in whole.state["epochs"][1:]], abs=1e-6)


def test_a_run_stopped_mid_epoch_resumes_its_mixed_reference_to_the_uninterrupted_weights(tiny_model, tmp_path):
    """The epoch checkpoints keep the held copy: step 4, after the resume, mixes into the copy of step 3."""
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in number_pairs(8)))
    cfg = load_config(None, ["dpo.epochs=2", "dpo.lr=1e-3", "dpo.batch_size=4", "dpo.bf16=false", "dpo.save_steps=1", "dpo.ref_sync_every=1", "dpo.ref_sync_alpha=0.5"])
    args = {"data": str(tmp_path / "train.jsonl"), "val_data": str(tmp_path / "train.jsonl"), "model": tiny_model, "cfg": cfg, "device": "cpu"}
    whole = run(out=str(tmp_path / "whole"), **args)
    stopped_in_epoch_2(run, out=str(tmp_path / "dpo"), **args)
    checkpoint = tmp_path / "dpo.progress" / "epoch-0001-step-000001"
    kept = set(load_file(str(checkpoint / "kept.safetensors")))
    assert {"train", "held_out"} <= kept and {f"reference_weights/{name}" for name in weights_of(HFPolicy.load(tiny_model, "cpu").model)} <= kept
    resumed = run(out=str(tmp_path / "dpo"), **args)
    assert_resumed_as_uninterrupted(resumed, whole, tmp_path / "dpo", ("loss", "val_loss", "margin"))  # the last sync's reference, mixed into the restored copy, measures the held-out pairs
    assert resumed.state["ref_syncs"] == 4
