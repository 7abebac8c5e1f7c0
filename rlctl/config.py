"""TOML config → typed, frozen config objects, one per section; `--set a.b=c` overrides.

Sections map 1:1 to the dataclasses below (`[model]` → `ModelConfig`, ...). Unknown keys are
errors that suggest the nearest valid key; type errors name the key, the expected type and the
value; TOML syntax errors give the line. The resolved config is written into every manifest.

    cfg = load_config("examples/ppo.toml", overrides=["update.lr=1e-5"])
    cfg.update.lr  # 1e-05
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import math
import re
import sys
import types
import typing
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from rlctl.choices import (
    AUTOCAST_CHOICES,
    COMPUTE_DTYPES,
    DPO_LOSSES,
    F_DIVERGENCE_LOSSES,
    F_DIVERGENCES,
    KL_CONTROLLERS,
    KTO_LOSSES,
    LOSS_AGG_MODES,
    LR_SCHEDULES,
    OLD_LOGPROBS,
    ONLINE_DPO_LOSSES,
    OTB_ROLLOUT_IS,
    PAIRINGS,
    PF_PPO,
    POLICY_LOSSES,
    REFERENCE_FREE_LOSSES,
    REJECTION_RULES,
    RESHARD_DTYPES,
    ROLLOUT_BACKENDS,
    RUN_CHECKS,
    STD_SCOPES,
    SUM_PI_SQUARED_ESTIMATORS,
    TOOL_FORMATS,
    TRUNCATE,
    WORKER_BACKENDS,
)
from rlctl.durations import parse_duration
from rlctl.errors import ConfigError

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib


# --- range rules: checked when a section is built (TOML, --set and flags alike) -------------

Rule = Callable[[Any], "str | None"]


def at_least(low: float) -> Rule:
    return lambda v: None if v >= low else f"must be ≥ {low}"


def above(low: float) -> Rule:
    return lambda v: None if v > low else f"must be > {low}"


def between(low: float, high: float) -> Rule:
    return lambda v: None if low <= v <= high else f"must be between {low} and {high}"


def one_of(*options: str) -> Rule:
    return lambda v: None if v in options else f"must be one of {', '.join(options)}"


def check_ranges(section: object, name: str, rules: dict[str, Rule]) -> None:
    """Raise a one-line ConfigError for the first key of `section` outside its rule; every
    float must be finite."""
    for key in (f.name for f in dataclasses.fields(section)):
        value = getattr(section, key)
        if isinstance(value, float) and not math.isfinite(value):
            raise ConfigError(f"{name}.{key} must be a finite number, got {value!r}")
        rule = rules.get(key)
        problem = rule(value) if rule else None
        if problem:
            raise ConfigError(f"{name}.{key} {problem}, got {value!r}")


DEFAULT_REWARD = "builtin:length"
LOGGER_NAMES = ("console", "jsonl", "tensorboard", "wandb", "mlflow")


@dataclass(frozen=True)
class ModelConfig:
    """Which models the run holds: the policy, and optionally a reference and a critic."""

    path: str = ""  # policy: HF folder or rlctl checkpoint
    ref: str = ""  # reference model for KL ("" = none)
    critic: str = ""  # critic (value head on a causal LM) for GAE ("" = none)
    device: str = "auto"  # auto | cpu | cuda
    init_preset: str = ""  # when set and `path` does not exist: `rlctl model init` it first
    init_seed: int = 0  # seed of the model `init_preset` makes


@dataclass(frozen=True)
class DataConfig:
    """The prompts each iteration draws, and how they become token ids."""

    prompts: str = ""  # prompts: a .jsonl, .json (JSON Lines or one array of objects) or .parquet file, or a shard folder (any fsspec URL)
    val_prompts: str = ""  # held-out prompts scored every pipeline.val_every iterations, greedily unless pipeline.val_temperature ("" = none)
    batch_size: int = 8  # prompts per iteration
    shuffle: bool = True  # a new seeded permutation of the prompts every epoch
    max_prompt_tokens: int = 512  # longest prompt in tokens (see truncate)
    truncate: str = "error"  # a prompt over max_prompt_tokens (or the model's context less max_new_tokens): error | left (its start cut) | drop (left out of the prompts drawn from, named on stderr: verl's filter_overlong_prompts)
    chat_template: bool = False  # render plain prompts through the tokenizer's chat template
    chat_template_kwargs: dict[str, bool | int | float | str] = field(default_factory=dict)  # values the chat template reads besides the messages, e.g. {enable_thinking = false} (Qwen3's non-thinking mode): every prompt, an SFT example's turns and a tool's chat turn are rendered with them (verl's data.apply_chat_template_kwargs, TRL's chat_template_kwargs)
    prompt_template: str = ""  # a plain prompt put into this text where it says {prompt}, before any chat template (e.g. "{prompt} Let's think step by step."; OpenRLHF's input_template); "" = as it is
    system_prompt: str = ""  # a system message put first in every chat prompt (messages, or a plain one under chat_template) that has none; "" = none
    retire_pass_rate: float = 0.0  # a prompt whose samples pass (reward ≥ pass_threshold) at this rate or more when drawn is left out of the epochs that begin after its iteration (Skywork-OR1's online difficulty filtering: 1 = the prompts every sample solved); in (0, 1]; 0 = off
    pass_threshold: float = 1.0  # with retire_pass_rate: a sample passes when its reward (as the reward gave it, before score's overlong and length penalties) is at least this

    def __post_init__(self) -> None:
        check_ranges(self, "data", {
            "batch_size": at_least(1), "max_prompt_tokens": at_least(1), "truncate": one_of(*TRUNCATE),
            "retire_pass_rate": lambda v: None if 0 <= v <= 1 else "must be in [0, 1] (0 = off)",
        })
        if self.prompt_template and "{prompt}" not in self.prompt_template:
            raise ConfigError(f"data.prompt_template must say where the prompt goes with {{prompt}}, got {self.prompt_template!r}")


@dataclass(frozen=True)
class RolloutConfig:
    """Generation: how many samples per prompt, how long, how random, on which engine."""

    n: int = 1  # samples per prompt (the group size of GRPO/RLOO)
    max_new_tokens: int = 64  # response length limit in tokens
    temperature: float = 1.0  # sampling temperature; 0 = greedy
    top_p: float = 1.0  # nucleus sampling: smallest token set with this probability mass; 1 = off
    top_k: int = 0  # sample among the k likeliest tokens; 0 = off
    min_p: float = 0.0  # min-p sampling: leave out the tokens less likely than min_p × the likeliest one (vLLM's and TRL's min_p); 0 = off
    repetition_penalty: float = 1.0  # > 1 makes the tokens already in the prompt or the response less likely to be drawn (their logits ÷ it where positive, × it where negative: transformers' and vLLM's repetition_penalty, TRL's); the recorded log-probs stay the policy's; 1 = off
    stop: tuple[str, ...] = ()  # stop strings: a response ends at the first token that completes one, and keeps it (vLLM's stop, TRL's generation_kwargs)
    tool: str = ""  # a tool (file.py:fn, module:fn, builtin:calculator) given each response that stopped at a stop string: the text it returns is appended (not trained on) and generation goes on; None ends the response ("" = none)
    max_tool_calls: int = 4  # tool calls per response at most; then a response ends at its stop string
    tool_format: str = "text"  # text: the tool's answer appended as it is | chat: as a chat message of tool_role, through the tokenizer's chat template (the assistant's turn closed, the next opened)
    tool_role: str = "tool"  # the role of the tool's message with tool_format = "chat"
    tool_timeout: float = 60.0  # seconds one call of the tool (on a batch of responses) may take
    seed: int = 0  # sampling seed; each row is seeded from (seed, row)
    greedy_baseline: bool = False  # also decode one greedy response per prompt, never trained on: its reward is the prompt's baseline (advantage.estimator = "remax")
    backend: str = "hf"  # hf | vllm
    batch_size: int = 64  # sequences generated together
    dtype: str = "auto"  # compute dtype of generation: auto (bf16 where the CPU/GPU has native bf16, else fp32) | fp32 | bf16 (the HF engine generates from a bf16 copy of the weights)

    def __post_init__(self) -> None:
        check_ranges(self, "rollout", {
            "n": at_least(1), "max_new_tokens": at_least(1), "temperature": at_least(0.0), "top_p": lambda v: None if 0 < v <= 1 else "must be in (0, 1]",
            "top_k": at_least(0), "min_p": lambda v: None if 0 <= v < 1 else "must be in [0, 1)", "repetition_penalty": above(0.0), "batch_size": at_least(1), "dtype": one_of(*COMPUTE_DTYPES), "backend": one_of(*ROLLOUT_BACKENDS),
            "stop": lambda v: "must not hold an empty string (it would end every response before it starts)" if any(not s for s in v) else None,
            "max_tool_calls": at_least(1), "tool_timeout": at_least(0.0), "tool_format": one_of(*TOOL_FORMATS),
        })


@dataclass(frozen=True)
class RewardTerm:
    """One of several rewards: `{fn = "builtin:gsm8k", weight = 1.0, name = "correct"}`."""

    fn: str  # a reward spec, as --reward takes it
    weight: float = 1.0  # its score's factor in the total reward
    name: str = ""  # its column reward/NAME; "" = the function's name
    sources: tuple[str, ...] = ()  # the data_sources it scores (verl's reward by data_source); () = every sample

    def __post_init__(self) -> None:
        check_ranges(self, "score.rewards", {"fn": lambda v: None if v else "must name a reward"})


@dataclass(frozen=True)
class ScoreConfig:
    """The reward, and the forward passes that add reference/old log-probs and critic values."""

    reward: str = DEFAULT_REWARD  # file.py:fn, module:fn, builtin:NAME, rm:MODEL_URI, judge:MODEL_URI or an http(s):// endpoint
    rewards: tuple[RewardTerm, ...] = ()  # several weighted rewards instead of `reward` (TRL's reward_funcs + reward_weights)
    reward_timeout: float = 60.0  # seconds a reward call (or one http request) may take
    batch_size: int = 64  # sequences per forward pass at most (ref, policy, critic, rm: reward model)
    batch_tokens: int = 8192  # padded tokens (sequences × the longest) per forward pass at most: fewer sequences then, a longer one alone; 0 = no cap
    http_batch_size: int = 16  # http rewards: samples per request
    http_concurrency: int = 4  # http rewards: requests in flight at once
    http_retries: int = 2  # http rewards: more tries of a request that timed out or got 429/5xx
    dtype: str = "auto"  # compute dtype of the ref/policy/critic forward passes and an rm: reward model: auto (bf16 where native, else fp32) | fp32 | bf16 (the reference from a bf16 copy of its weights; policy, critic and reward model under autocast)
    old_logprobs: str = "auto"  # in a pipeline: recompute (a policy forward) | rollout (the engine's own) | update (the update's own forward, one optimizer step per batch) | auto: rollout when engine and trainer are fp32, else update when exact, else recompute
    sum_pi_squared: bool = False  # also write each response token's Σπ² under the policy, from the old log-probs' forward (the optimal_token_baseline estimator's; a pipeline sets it for that estimator)
    overlong_buffer: int = 0  # DAPO's soft overlong penalty over the last N tokens before max_new_tokens; 0 = off
    overlong_penalty: float = 1.0  # the penalty at max_new_tokens (it grows linearly over the buffer)
    length_penalty: float = 0.0  # Kimi k1.5's length reward, with this weight: among a prompt's samples λ = 0.5 − (length − shortest)/(longest − shortest) in tokens; a correct one (reward ≥ length_penalty_pass) gets weight·λ, the others weight·min(0, λ); 0 = off
    judge_template: str = ""  # judge:MODEL_URI rewards: the question the judge model answers yes or no, with {prompt}, {response} and {ground_truth} filled in ("" = rlctl.judge's: is the response a correct answer to the question, given the reference answer?)
    judge_yes: str = "Yes"  # judge: the verdict word whose probability (against judge_no's) is the reward
    judge_no: str = "No"  # judge: the other verdict
    length_penalty_pass: float = 1.0  # with length_penalty: a sample is correct when its reward (before any shaping) is at least this

    def __post_init__(self) -> None:
        if self.rewards and self.reward != DEFAULT_REWARD:
            raise ConfigError(f"score.reward ({self.reward}) and score.rewards are both set: list every reward in score.rewards")
        if self.judge_template:
            from rlctl.judge import check_template

            check_template(self.judge_template, error=ConfigError)
        if not self.judge_yes.strip() or not self.judge_no.strip() or self.judge_yes == self.judge_no:
            raise ConfigError(f"score.judge_yes and score.judge_no must be two different words, got {self.judge_yes!r} and {self.judge_no!r}")
        check_ranges(self, "score", {"old_logprobs": one_of(*OLD_LOGPROBS), "http_batch_size": at_least(1), "http_concurrency": at_least(1), "http_retries": at_least(0), "overlong_buffer": at_least(0), "overlong_penalty": at_least(0.0), "length_penalty": at_least(0.0), "reward_timeout": at_least(0.0), "batch_size": at_least(1), "batch_tokens": at_least(0), "dtype": one_of(*COMPUTE_DTYPES)})


@dataclass(frozen=True)
class AdvantageConfig:
    """Rewards → advantages and returns (pure math), with the optional KL penalty."""

    estimator: str = "grpo"  # gae | gpg (α·(score − group mean), with update.policy_loss = gpg) | grpo | gdpo (several rewards: each normalized within its group on its own, then weighted and summed, then whitened over the batch) | rloo | opo | grpo_passk | reinforce_pp | reinforce_pp_baseline | remax (with rollout.greedy_baseline) | optimal_token_baseline (with score's old log-probs and Σπ²) | online_dpo (each group's best and worst sample a DPO pair, against model.ref; docs/algorithms.md)
    gamma: float = 1.0  # discount of GAE and REINFORCE++ returns
    lam: float = 1.0  # GAE's lambda
    critic_lam: float = -1.0  # gae: the λ of the critic's targets (returns), apart from the advantages' (VAPO's decoupled GAE: 1.0, targets free of the critic's own bias); -1 = lam
    length_adaptive_alpha: float = 0.0  # gae: > 0 gives each sequence's advantages λ = 1 − 1/(α·l), l its response length (VAPO's length-adaptive GAE, α 0.05); 0 = lam
    norm_by_std: bool = True  # GRPO: divide by the group's reward std (false = Dr. GRPO)
    otb_zero_tail: bool = False  # optimal_token_baseline: no baseline for a group's one longest sample past its second longest (verl's handle_zero_tail)
    otb_rollout_is: str = "auto"  # optimal_token_baseline: weigh paths by the squared truncated IS weights π_old/π_rollout the update applies (verl's, with rollout correction): auto (update.rollout_is and its threshold, where the config has an [update]: a pipeline, --config) | off | token | sequence
    otb_rollout_is_threshold: float = 2.0  # the truncation of those weights (auto: update.rollout_is_threshold)
    dpo_beta: float = 0.1  # online_dpo: the preference loss's β
    dpo_loss: str = "sigmoid"  # online_dpo: the preference loss (rlctl dpo's of that name): sigmoid | ipo | hinge | sigmoid_norm | nca_pair | bco_pair | sppo_hard | apo_zero | apo_down
    dpo_pairs: str = "best_worst"  # online_dpo: the pairs of a prompt's samples: best_worst (its best and worst, as the paper's two samples) | all (every two whose rewards differ, the better chosen)
    dpo_loss_agg: str = "auto"  # online_dpo: the update's loss_agg_mode its advantages are scaled for (auto: update.loss_agg_mode, where the config has an [update])
    dpo_loss_horizon: int = 0  # online_dpo with seq-mean-token-sum-norm: the update's loss_horizon (auto: update.loss_horizon); 0 = the batch's longest response
    std_scope: str = "group"  # GRPO with norm_by_std: the std of the prompt's group, or of the whole batch (TRL's scale_rewards="batch", Lite PPO)
    kl_coef: float = 0.0  # KL penalty in the per-token reward (needs model.ref); 0 = off
    pf_ppo: str = "off"  # policy filtration (PF-PPO, verl's use_pf_ppo): train on the batch redrawn with replacement by a weight of each reward: pow (|reward|^pf_ppo_weight_pow) | max_min (the batch's best and worst) | max_random (the best 4× the others) | off
    pf_ppo_weight_pow: float = 2.0  # pf_ppo = pow: the power of |reward|
    pf_ppo_seed: int = 0  # pf_ppo's draw: this seed with the batch's ids and rewards (a replay draws the same rows)
    kl_estimator: str = "k1"  # k1 | k2 | k3 | abs (verl's kl, mse, low_var_kl; + suffix: k2's gradient)
    kl_controller: str = "fixed"  # fixed | adaptive
    kl_target: float = 0.1  # adaptive controller: the KL it steers towards
    kl_horizon: int = 10000  # adaptive controller: the horizon of its proportional update

    def __post_init__(self) -> None:
        check_ranges(self, "advantage", {
            "gamma": between(0.0, 1.0), "lam": between(0.0, 1.0), "critic_lam": lambda v: None if v == -1 or 0 <= v <= 1 else "must be -1 (lam) or between 0.0 and 1.0",
            "length_adaptive_alpha": at_least(0.0), "kl_coef": at_least(0.0), "kl_controller": one_of(*KL_CONTROLLERS),
            "kl_target": above(0.0), "kl_horizon": at_least(1), "std_scope": one_of(*STD_SCOPES), "pf_ppo": one_of(*PF_PPO),
            "otb_rollout_is": one_of(*OTB_ROLLOUT_IS), "otb_rollout_is_threshold": above(1.0),
            "pf_ppo_weight_pow": at_least(0.0), "dpo_beta": above(0.0), "dpo_loss": one_of(*ONLINE_DPO_LOSSES), "dpo_pairs": one_of(*PAIRINGS),
            "dpo_loss_agg": one_of("auto", *LOSS_AGG_MODES), "dpo_loss_horizon": at_least(0),
        })


@dataclass(frozen=True)
class LoraConfig:
    """LoRA adapters (peft) on the policy: `update.lora = {r = 16, alpha = 32}`."""

    r: int = 0  # adapter rank; 0 = off (full fine-tuning)
    alpha: float = 16.0  # scaling numerator: the update is B·A·alpha/r
    dropout: float = 0.0  # dropout on the adapter's input
    target_modules: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")  # module names adapted

    def __post_init__(self) -> None:
        check_ranges(self, "update.lora", {"r": at_least(0), "alpha": above(0.0), "dropout": between(0.0, 1.0)})
        if self.r and not self.target_modules:
            raise ConfigError("update.lora.target_modules must name at least one module")


@dataclass(frozen=True)
class UpdateConfig:
    """The policy (and critic) update: PPO-style losses, batching, optimizer."""

    lr: float = 1e-6  # policy learning rate (AdamW)
    critic_lr: float = 1e-5  # critic learning rate (AdamW)
    epochs: int = 1  # passes over the batch per update (PPO epochs)
    mini_batch_size: int = 0  # sequences per optimizer step; 0 = the whole batch
    disable_dropout: bool = True  # the model's dropout off while training (TRL's disable_dropout), so the update's log-probs are the old policy's on its first step, as score's and the engine's (computed without dropout); false trains with the model's own dropout
    target_kl: float = 0.0  # stop an update's epochs and mini-batches once a mini-batch's approximate KL from the old policy (k3: approx_kl) exceeds 1.5 × target_kl, before stepping on it; its first step always runs (Spinning Up's and SB3's target_kl); 0 = off
    micro_batch_size: int = 4  # sequences per forward/backward
    micro_batch_tokens: str = "auto"  # padded tokens per forward/backward at most (fewer sequences then): auto (CPU: 4096, fewer where the training state and a pass would outgrow 3/4 of the machine's memory; GPU: no cap) | 0 (no cap) | N
    clip_ratio_low: float = 0.2  # PPO clip below: ratio ≥ 1 - clip_ratio_low
    clip_ratio_high: float = 0.2  # PPO clip above: ratio ≤ 1 + clip_ratio_high (DAPO's clip-higher: 0.28)
    clip_ratio_c: float = 3.0  # dual clip for negative advantages; 0 disables (PPO only)
    policy_loss: str = "ppo"  # ppo | gspo (sequence-level ratio: set clip_ratio_low/high ≈ 3e-4/4e-4, loss_agg_mode seq-mean-token-mean) | cispo (the importance weight clipped, every token keeps a gradient: set clip_ratio_low = 1, tune clip_ratio_high) | kl_cov (no clip; a KL term on the tokens of largest covariance: kl_cov_ratio, kl_cov_coef) | gmpo (a sequence's geometric-mean ratio, each token's log-ratio clipped: set clip_ratio_low/high = 0.4, loss_agg_mode seq-mean-token-mean) | clip_cov (PPO's clip, and a few tokens of high covariance drawn to have no gradient: clip_cov_ratio, clip_cov_lb, clip_cov_ub) | gpg (the plain policy gradient −A·log p, no ratio, no clip: with advantage.estimator = gpg) | sapo (a smooth gate instead of the clip: sapo_tau_pos, sapo_tau_neg; loss_agg_mode seq-mean-token-mean) | vespo (no clip: each sequence's gradient weighed by a smooth function of its importance weight: vespo_k_pos, vespo_lambda_pos, vespo_k_neg, vespo_lambda_neg)
    kl_cov_ratio: float = 2e-4  # kl_cov: the share of a pass's tokens, those of largest advantage × log-prob covariance, that get the KL term (verl's kl_cov_ratio)
    kl_cov_coef: float = 1.0  # kl_cov: the weight of that |log p - log p_old| term (verl's ppo_kl_coef)
    clip_cov_ratio: float = 2e-4  # clip_cov: the share of a pass's tokens drawn to have no gradient (one at least; verl's clip_cov_ratio)
    clip_cov_lb: float = 1.0  # clip_cov: the draw is among the tokens whose advantage × log-prob covariance is above this ...
    clip_cov_ub: float = 5.0  # ... and below this (verl's clip_cov_lb, clip_cov_ub)
    sapo_tau_pos: float = 1.0  # sapo: the gate's temperature for tokens of positive advantage (verl's tau_pos)
    sapo_tau_neg: float = 1.05  # sapo: ... of the others; larger than sapo_tau_pos, so negative updates fade sooner (verl's tau_neg)
    vespo_k_pos: float = 2.0  # vespo: the power k of the weight φ(w) = w^k · e^(λ(1 − w)) of a sequence of positive advantage, w its importance weight: larger k, less weight where w < 1 (TRL's vespo_k_pos)
    vespo_lambda_pos: float = 3.0  # vespo: its decay λ: larger λ, less weight where w > 1 (TRL's vespo_lambda_pos)
    vespo_k_neg: float = 3.0  # vespo: k of a sequence of negative advantage (TRL's vespo_k_neg)
    vespo_lambda_neg: float = 2.0  # vespo: λ of a sequence of negative advantage (TRL's vespo_lambda_neg)
    off_policy_mask: float = 0.0  # DeepSeek-V3.2's off-policy sequence masking: a sequence of negative advantage whose mean log(π_rollout/π) over its tokens exceeds this leaves the policy gradient (its tokens stay in the divisor; TRL's off_policy_mask_threshold, e.g. 0.5); 0 = off
    entropy_advantage: float = 0.0  # α > 0: each token's advantage raised by min(α·H, |A|/κ), H its entropy under the policy being trained (Cheng et al. 2025's entropy-based advantage shaping; the paper's α 0.4, κ 2); 0 = off
    entropy_advantage_kappa: float = 2.0  # κ of entropy_advantage: the raise is at most |A|/κ, so no advantage changes sign
    top_entropy_quantile: float = 1.0  # the policy gradient of each forward pass's highest-entropy tokens only, this share of them (0.2: Wang et al.'s "80/20"; TRL's top_entropy_quantile); 1 = every token
    loss_agg_mode: str = "token-mean"  # token-mean | seq-mean-token-sum | seq-mean-token-mean | seq-mean-token-sum-norm
    rollout_is: str = "off"  # off | token | sequence: truncated importance weights engine → trainer (verl's rollout_is)
    rollout_is_threshold: float = 2.0  # the truncation of those weights
    rollout_is_batch_normalize: bool = False  # scale those weights to a mean of 1 over the batch's tokens (sequence level: its sequences), after the truncation (verl's rollout_is_batch_normalize)
    rollout_rs: str = "off"  # off | rejection rules, comma-separated: token_k1, token_k2, token_k3, seq_sum_k1..k3, seq_mean_k1..k3, seq_max_k2, seq_max_k3: tokens or sequences whose old policy strays too far from the engine's leave the loss (verl's rollout_rs; docs/algorithms.md)
    rollout_rs_threshold: str = ""  # each rule's bound, comma-separated (or one for all): k1 lower_upper on π_rollout/π_old (e.g. 0.5_2.0; upper alone: lower = 1/upper), k2/k3 an upper bound
    loss_horizon: int = 0  # seq-mean-token-sum-norm divisor; 0 = longest response in the batch
    use_kl_loss: bool = False  # KL to the reference as a loss term (GRPO style) instead of in the reward
    kl_loss_coef: float = 0.001  # weight of that KL loss
    kl_loss_estimator: str = "k3"  # estimator of that KL loss (as advantage.kl_estimator)
    kl_loss_unbiased: bool = False  # with use_kl_loss: each token's KL term × its importance ratio π/π_old, gradient and all, so the loss's gradient is the reverse KL's own on samples of the old policy (DeepSeek-V3.2's unbiased KL estimate; TRL's use_bias_correction_kl)
    entropy_coef: float = 0.0  # entropy bonus weight; 0 = off (the entropy is still reported, with no backward through it)
    entropy_target: float = 0.0  # > 0: adaptive entropy control (Skywork-OR1; TRL's use_adaptive_entropy, entropy_target): the bonus applies only after an optimizer step whose mean token entropy was at or below this, its coefficient (entropy_coef at the start, saved in checkpoints) up by entropy_coef_delta after each such step, down after each other; 0 = a fixed entropy_coef
    entropy_coef_delta: float = 0.005  # adaptive entropy control: the coefficient's change per optimizer step
    entropy_coef_min: float = 0.0  # adaptive entropy control: the coefficient's floor
    entropy_coef_max: float = 1.0  # adaptive entropy control: the coefficient's ceiling
    mask_truncated: bool = False  # responses cut at max_new_tokens (finish_reason "length") take no part in the loss: no gradient, no tokens in its divisor (DAPO's overlong filtering, TRL's mask_truncated_completions)
    skip_zero_advantage: bool = True  # rows whose advantage is 0 at every token skip their forward and backward where the loss has no KL or entropy term and no critic trains (their gradient is exactly 0); statistics then cover the trained rows
    cliprange_value: float = 0.5  # critic: clip of the value change per update
    vf_coef: float = 1.0  # critic loss weight
    max_grad_norm: float = 1.0  # gradient clipping by global norm; 0 = off
    weight_decay: float = 0.0  # AdamW weight decay
    warmup_steps: int = 0  # linear learning-rate warm-up, in optimizer steps
    lr_schedule: str = "constant"  # constant | linear | cosine: after the warm-up, lr falls to lr × min_lr_ratio at optimizer step decay_steps, then holds
    decay_steps: int = 0  # optimizer steps from the first to the floor of a linear or cosine schedule (the pipeline's plan says its steps per iteration)
    min_lr_ratio: float = 0.0  # the floor of the decay, as a share of lr
    critic_warmup: int = 0  # optimizer steps at the start that train only the critic (PPO with a fresh value head; verl's trainer.critic_warmup counts iterations, --dry-run says the steps per iteration); the policy's lr schedule starts after
    bf16: str = "auto"  # bf16 autocast in training: auto (where the CPU/GPU has native bf16) | true | false
    gradient_checkpointing: bool = False  # recompute each decoder layer's activations in the backward instead of keeping them: less memory for ~30% more compute (verl's enable_gradient_checkpointing)
    compile: bool = False  # torch.compile the decoder layers' training pass: ~5–20 s once per process (a C++ compiler on the CPU), then small-preset updates 0.93× (fp32) / 0.87× (bf16), Qwen2.5-0.5B's shape ~1×
    seed: int = 0  # seed of mini-batch shuffling and dropout
    allow_skipped_steps: bool = False  # a step whose gradient is not finite is skipped; by default that fails the update
    lora: LoraConfig = field(default_factory=LoraConfig)  # train LoRA adapters instead of every weight (r > 0)

    def __post_init__(self) -> None:
        if isinstance(self.bf16, bool):  # UpdateConfig(bf16=True) from Python, as TOML's `bf16 = true` reads
            object.__setattr__(self, "bf16", "true" if self.bf16 else "false")
        if isinstance(self.micro_batch_tokens, int) and not isinstance(self.micro_batch_tokens, bool):  # UpdateConfig(micro_batch_tokens=4096)
            object.__setattr__(self, "micro_batch_tokens", str(self.micro_batch_tokens))
        if isinstance(self.rollout_rs_threshold, (int, float)) and not isinstance(self.rollout_rs_threshold, bool):  # TOML's rollout_rs_threshold = 2.0
            object.__setattr__(self, "rollout_rs_threshold", repr(float(self.rollout_rs_threshold)))
        check_ranges(self, "update", {
            "lr": above(0.0), "critic_lr": above(0.0), "epochs": at_least(1), "target_kl": at_least(0.0), "mini_batch_size": at_least(0), "micro_batch_size": at_least(1),
            "clip_ratio_low": between(0.0, 1.0), "clip_ratio_high": at_least(0.0),
            "clip_ratio_c": lambda v: None if v == 0 or v > 1 else "must be 0 (off) or > 1", "policy_loss": one_of(*POLICY_LOSSES),
            "kl_cov_ratio": lambda v: None if 0 < v <= 1 else "must be in (0, 1]", "kl_cov_coef": at_least(0.0),
            "top_entropy_quantile": lambda v: None if 0 < v <= 1 else "must be in (0, 1]",
            "clip_cov_ratio": lambda v: None if 0 < v <= 1 else "must be in (0, 1]",
            "sapo_tau_pos": above(0.0), "sapo_tau_neg": above(0.0),
            "vespo_k_pos": at_least(0.0), "vespo_k_neg": at_least(0.0), "vespo_lambda_pos": above(0.0), "vespo_lambda_neg": above(0.0), "off_policy_mask": at_least(0.0), "entropy_advantage": at_least(0.0), "entropy_advantage_kappa": above(1.0),
            "entropy_target": at_least(0.0), "entropy_coef_delta": at_least(0.0), "entropy_coef_min": at_least(0.0), "entropy_coef_max": at_least(0.0),
            "rollout_is": one_of("off", "token", "sequence"), "rollout_is_threshold": above(1.0),
            "rollout_rs": lambda v: None if v == "off" or (v.strip() and all(part.strip() in REJECTION_RULES for part in v.split(",") if part.strip()))
            else f"must be off or rules from {', '.join(REJECTION_RULES)}, comma-separated",
            "loss_horizon": at_least(0), "kl_loss_coef": at_least(0.0), "cliprange_value": above(0.0), "vf_coef": at_least(0.0),
            "max_grad_norm": at_least(0.0), "weight_decay": at_least(0.0), "warmup_steps": at_least(0), "bf16": one_of(*AUTOCAST_CHOICES),
            "lr_schedule": one_of(*LR_SCHEDULES), "decay_steps": at_least(0), "min_lr_ratio": between(0.0, 1.0), "critic_warmup": at_least(0),
            "micro_batch_tokens": lambda v: None if v == "auto" or (isinstance(v, str) and v.isascii() and v.isdigit()) else "must be auto, 0 (no cap) or a number of tokens",
        })


@dataclass(frozen=True)
class SftConfig:
    """Supervised fine-tuning (`rlctl sft`): cross-entropy on demonstrated responses, the warm
    start a policy gets before RL (TRL's SFTTrainer, verl's SFT trainer)."""

    data: str = ""  # in a pipeline: demonstrations to fine-tune model.path on before iteration 1 (RUN/sft, the run's initial policy unless dpo.data or kto.data trains after it; "" = no warm start)
    val_data: str = ""  # in a pipeline: held-out demonstrations, their loss before and after each epoch
    lr: float = 1e-5  # learning rate (AdamW)
    epochs: int = 1  # passes over the examples
    save_steps: int = 0  # a checkpoint also every N optimizer steps within an epoch, to resume from mid-epoch (beside OUT, removed at the end); 0 = at each epoch's end only
    batch_size: int = 16  # examples per optimizer step
    micro_batch_size: int = 4  # examples per forward/backward
    micro_batch_tokens: str = "auto"  # padded tokens per forward/backward at most, as update.micro_batch_tokens
    max_tokens: int = 0  # prompt + response tokens of an example at most; 0 = the model's context
    truncate: str = "error"  # an example over max_tokens: error | right (its response cut; the cut response has no end token)
    assistant_turns: str = "last"  # messages without a response column: last = the trailing assistant turns are the response | all = every assistant turn is trained, the user and tool turns between them context (TRL's assistant_only_loss)
    min_reward: float = 0.0  # data that is scored rollouts (a score stage's output): only samples rewarded at least this are trained on (rejection-sampling fine-tuning)
    per_prompt: int = 1  # scored rollouts: each prompt's best samples kept, at most this many (1: RAFT's best of n; 0: every one over min_reward, ReST-EM's)
    max_grad_norm: float = 1.0  # gradient clipping by global norm; 0 = off
    weight_decay: float = 0.0  # AdamW weight decay
    warmup_steps: int = 0  # linear learning-rate warm-up, in optimizer steps
    lr_schedule: str = "constant"  # constant | linear | cosine: after the warm-up, lr falls towards lr × min_lr_ratio, reached after the last optimizer step
    min_lr_ratio: float = 0.0  # the floor of the decay, as a share of lr
    bf16: str = "auto"  # bf16 autocast: auto (where the CPU/GPU has native bf16) | true | false
    gradient_checkpointing: bool = False  # recompute each decoder layer's activations in the backward: less memory for ~30% more compute
    seed: int = 0  # seed of the example order
    lora: LoraConfig = field(default_factory=LoraConfig)  # train LoRA adapters instead of every weight (r > 0)

    def __post_init__(self) -> None:
        if isinstance(self.bf16, bool):
            object.__setattr__(self, "bf16", "true" if self.bf16 else "false")
        if isinstance(self.micro_batch_tokens, int) and not isinstance(self.micro_batch_tokens, bool):
            object.__setattr__(self, "micro_batch_tokens", str(self.micro_batch_tokens))
        check_ranges(self, "sft", {
            "lr": above(0.0), "epochs": at_least(1), "save_steps": at_least(0), "batch_size": at_least(1), "micro_batch_size": at_least(1), "max_tokens": at_least(0),
            "truncate": one_of("error", "right"), "max_grad_norm": at_least(0.0), "weight_decay": at_least(0.0), "warmup_steps": at_least(0),
            "lr_schedule": one_of(*LR_SCHEDULES), "min_lr_ratio": between(0.0, 1.0), "bf16": one_of(*AUTOCAST_CHOICES), "assistant_turns": one_of("last", "all"), "per_prompt": at_least(0),
            "micro_batch_tokens": lambda v: None if v == "auto" or (isinstance(v, str) and v.isascii() and v.isdigit()) else "must be auto, 0 (no cap) or a number of tokens",
        })


@dataclass(frozen=True)
class RewardModelConfig:
    """Reward-model training (`rlctl reward-model`): a Bradley-Terry model of preference pairs,
    a sequence-classification head on a causal LM, that `rm:FOLDER` then scores with (TRL's
    RewardTrainer, OpenRLHF's train_rm)."""

    data: str = ""  # in a pipeline: preference pairs to train RUN/reward_model on before iteration 1 (score.reward = "rm:trained" scores with it; "" = none)
    val_data: str = ""  # in a pipeline: held-out pairs, their loss and accuracy before and after each epoch
    base: str = "policy"  # in a pipeline: the model the reward model starts from: policy (the run's initial policy: model.path, or the last warm start's folder) or a folder
    disable_dropout: bool = True  # the model's dropout off while training (TRL's RewardConfig.disable_dropout)
    lr: float = 1e-5  # learning rate (AdamW)
    epochs: int = 1  # passes over the pairs
    save_steps: int = 0  # a checkpoint also every N optimizer steps within an epoch, to resume from mid-epoch (beside OUT, removed at the end); 0 = at each epoch's end only
    batch_size: int = 16  # pairs per optimizer step
    micro_batch_size: int = 4  # pairs per forward/backward (each pair is two sequences)
    max_tokens: int = 0  # tokens of a prompt and response at most; 0 = the model's context
    too_long: str = "error"  # a pair with a side over max_tokens: error | drop (left out of training, counted in the manifest)
    center_coef: float = 0.0  # weight of the mean squared (chosen + rejected) reward, which keeps rewards centred on 0 (TRL's center_rewards_coefficient); 0 = off
    min_reward_gap: float = 0.0  # data that is scored rollouts (a score stage's output): each prompt's best and worst sample's text are a pair where their rewards differ by more than this (a reward learned from another's scores)
    max_grad_norm: float = 1.0  # gradient clipping by global norm; 0 = off
    weight_decay: float = 0.0  # AdamW weight decay
    warmup_steps: int = 0  # linear learning-rate warm-up, in optimizer steps
    lr_schedule: str = "constant"  # constant | linear | cosine, as sft.lr_schedule
    min_lr_ratio: float = 0.0  # the floor of the decay, as a share of lr
    bf16: str = "auto"  # bf16 autocast: auto (where the CPU/GPU has native bf16) | true | false
    gradient_checkpointing: bool = False  # recompute each decoder layer's activations in the backward: less memory for ~30% more compute
    seed: int = 0  # seed of the pair order and of the new head's initial weights
    lora: LoraConfig = field(default_factory=LoraConfig)  # train LoRA adapters and the head instead of every weight (r > 0); the reward model written is merged

    def __post_init__(self) -> None:
        if isinstance(self.bf16, bool):
            object.__setattr__(self, "bf16", "true" if self.bf16 else "false")
        check_ranges(self, "reward_model", {
            "lr": above(0.0), "epochs": at_least(1), "save_steps": at_least(0), "batch_size": at_least(1), "micro_batch_size": at_least(1), "max_tokens": at_least(0),
            "too_long": one_of("error", "drop"), "center_coef": at_least(0.0), "min_reward_gap": at_least(0.0), "max_grad_norm": at_least(0.0), "weight_decay": at_least(0.0),
            "warmup_steps": at_least(0), "lr_schedule": one_of(*LR_SCHEDULES), "min_lr_ratio": between(0.0, 1.0), "bf16": one_of(*AUTOCAST_CHOICES),
            "base": lambda v: None if v else "must be policy or a model folder",
        })


@dataclass(frozen=True)
class ReshardConfig:
    """Converting a checkpoint into what inference loads."""

    to: str = "hf"  # hf: one HF folder (the only target; see stages/reshard.py)
    dtype: str = "fp32"  # bf16 | fp16 | fp32
    merge_lora: bool = False  # a LoRA checkpoint: write base + adapter merged (W + B·A·alpha/r)

    def __post_init__(self) -> None:
        check_ranges(self, "reshard", {"dtype": one_of(*RESHARD_DTYPES)})


@dataclass(frozen=True)
class PipelineConfig:
    """The end-to-end run: iterations, checkpoints, validation, sampling rounds, trackers."""

    iterations: int = 1  # iterations to run (a re-run with more continues the run)
    run_dir: str = "runs/default"  # run folder: stage outputs, checkpoints, metrics.jsonl
    save_every: int = 1  # checkpoint every N iterations (and at the end); resume starts there
    keep_checkpoints: int = 2  # 0 = keep all
    keep_best: str = ""  # a metric (e.g. val/score): an iteration that betters it saves a checkpoint, kept besides the last keep_checkpoints ("" = none)
    best_is: str = "max"  # max | min: which way keep_best's metric is better
    keep_shards: int = 0  # keep the stage outputs of the last K iterations; 0 = all
    val_every: int = 0  # 0 = no validation
    val_before_train: bool = False  # validate the initial weights before iteration 1: iteration 0's metrics row, RUN/iter-0000/val (verl's val_before_train)
    val_n: int = 1  # samples per validation prompt: val/score is their mean (verl's mean@N), val/best_of_N the mean of each prompt's best (best@N)
    val_temperature: float = 0.0  # sampling temperature of validation; 0 = greedy (one sample per prompt then)
    log_completions: int = 0  # N of each iteration's samples (drawn from seed and iteration) printed under its line — prompt's end, response, reward, advantage — and sent to the trackers: TensorBoard text, a wandb table, an MLflow file (TRL's log_completions, num_completions_to_print); 0 = none
    seed: int = 0  # seed of the prompt order
    rollout_is_threshold: float = 2.0  # importance ratio trainer/engine beyond which a token counts as mismatched
    dynamic_sampling: bool = False  # DAPO: train only on groups whose rewards differ, sampling more prompts to fill the batch
    max_sampling_rounds: int = 4  # with dynamic_sampling: rounds of prompts at most per iteration (then dropped groups fill up)
    dynamic_sampling_metric: str = "reward"  # with dynamic_sampling: the scores' column whose values must differ within a group: reward (the total), or a reward/... column a reward reports, e.g. reward/acc without the overlong penalty (verl's filter_groups.metric)
    ref_sync_every: int = 0  # move the reference towards the policy after every N iterations' update: ref ← α·policy + (1 − α)·ref, written to RUN/refs/iter-NNNN (TRL's sync_ref_model, TR-DPO; α = 1: ProRL's reference reset); 0 = never (model.ref stays)
    ref_sync_alpha: float = 1.0  # α of ref_sync_every, in (0, 1]: 1 = the policy's weights; TRL's ref_model_mixup_alpha is 0.6
    loggers: tuple[str, ...] = ("console", "jsonl")  # also: tensorboard, wandb, mlflow (metrics.jsonl is always written)
    wandb_project: str = "rlctl"  # the wandb project of the wandb logger
    wandb_mode: str = "online"  # online | offline (offline: RUN/wandb, no network; `wandb sync` it later)
    mlflow_uri: str = ""  # tracking URI of the mlflow logger; "" = the file store RUN/mlruns
    mlflow_experiment: str = "rlctl"  # the MLflow experiment of the mlflow logger
    time_limit: str = ""  # wall-clock budget of one `rlctl pipeline` invocation, e.g. "3h50m" under a 4-hour job limit: after an iteration, when the next one (as long as the longest since the first) would end past it, the run checkpoints and stops, exit 0, and the same command resumes; "" = none
    ignore_checks: tuple[str, ...] = ()  # what `rlctl show RUN` and the pipeline leave unsaid (rlctl.run_checks): truncated | constant_reward | equal_rewards | engine_mismatch | rejected | kl_stopped | skipped_steps | collapsed

    def __post_init__(self) -> None:
        unknown = [name for name in self.loggers if name not in LOGGER_NAMES]
        if unknown:
            raise ConfigError(f"pipeline.loggers: unknown logger {unknown[0]!r}; available: {', '.join(LOGGER_NAMES)}")
        unknown = [name for name in self.ignore_checks if name not in RUN_CHECKS]
        if unknown:
            raise ConfigError(f"pipeline.ignore_checks: unknown check {unknown[0]!r}; the checks: {', '.join(RUN_CHECKS)}")
        if self.dynamic_sampling_metric != "reward" and not self.dynamic_sampling_metric.startswith("reward/"):
            raise ConfigError(f"pipeline.dynamic_sampling_metric must be reward or a reward/... column of the scores, got {self.dynamic_sampling_metric!r}")
        check_ranges(self, "pipeline", {"wandb_mode": one_of("online", "offline"), "max_sampling_rounds": at_least(1), "rollout_is_threshold": above(1.0), "iterations": at_least(1), "save_every": at_least(0), "keep_checkpoints": at_least(0), "keep_shards": at_least(0), "val_every": at_least(0), "val_n": at_least(1), "val_temperature": at_least(0.0), "log_completions": at_least(0), "best_is": one_of("max", "min"), "ref_sync_every": at_least(0)})
        if not 0 < self.ref_sync_alpha <= 1:
            raise ConfigError(f"pipeline.ref_sync_alpha must be in (0, 1], got {self.ref_sync_alpha!r}")
        if self.time_limit and not parse_duration(self.time_limit):
            raise ConfigError(f"pipeline.time_limit must be a duration above 0 like 3h50m, 90m, 45s or 3600 (seconds), got {self.time_limit!r}")


@dataclass(frozen=True)
class WorkersConfig:
    """Who holds the models: this process (local), or a group of Ray actors, one rank each."""

    backend: str = "local"  # local | ray
    num_workers: int = 1  # data-parallel ranks of the policy group (ray)
    address: str = ""  # "" = an embedded Ray for this command; auto or HOST:PORT joins a cluster
    cpus_per_worker: int = 1  # Ray CPUs of a worker, and its torch/OpenMP threads
    threads: int = 0  # local workers' torch threads (a Ray worker's: cpus_per_worker); 0 = the CPUs available, fewer while other processes keep some busy (N: fixed, so results repeat bit for bit beside other load too)
    gpus_per_worker: float = 0.0  # 1 on a GPU machine: NCCL instead of gloo
    placement: str = "colocate"  # colocate: a rank holds policy, reference, critic | split: the reference and the critic each in a pool of their own
    reference: str = "replicated"  # replicated: a full copy per rank | sharded: FSDP2 shards at rest, gathered to score

    def __post_init__(self) -> None:
        check_ranges(self, "workers", {
            "reference": one_of("replicated", "sharded"), "placement": one_of("colocate", "split"), "backend": one_of(*WORKER_BACKENDS), "num_workers": at_least(1), "cpus_per_worker": at_least(1), "threads": at_least(0), "gpus_per_worker": at_least(0.0),
        })


@dataclass(frozen=True)
class VLLMConfig:
    """What vLLM users tune, for `rollout.backend = "vllm"` (ignored by the hf engine)."""

    gpu_memory_utilization: float = 0.5  # share of a GPU's memory vLLM may take (weights + KV cache)
    max_num_seqs: int = 256  # sequences decoded together
    tensor_parallel_size: int = 1  # GPUs one vLLM engine spans
    enforce_eager: bool = False  # no CUDA graphs (always eager on the CPU)
    dtype: str = "auto"  # auto (= rollout.dtype) | float32 | bfloat16 | float16
    cpu_kv_cache_gib: int = 1  # KV-cache GiB of the CPU engine (VLLM_CPU_KVCACHE_SPACE)
    sleep_mode: bool = True  # GPU: free the KV cache and weights while the trainer updates
    probe_tokens: int = 8  # greedy tokens per probe prompt in the weight-sync check
    probe_tolerance: float = 1e-3  # |engine - trainer| log-prob bound of that check (fp32 engines; bf16/fp16 engines use at least 0.1)

    def __post_init__(self) -> None:
        check_ranges(self, "vllm", {
            "gpu_memory_utilization": lambda v: None if 0 < v <= 1 else "must be in (0, 1]", "max_num_seqs": at_least(1),
            "tensor_parallel_size": at_least(1), "dtype": one_of("auto", "float32", "bfloat16", "float16"),
            "cpu_kv_cache_gib": at_least(1), "probe_tokens": at_least(1), "probe_tolerance": above(0.0),
        })


@dataclass(frozen=True)
class DpoConfig:
    """Direct preference optimization (`rlctl dpo`): the policy trained on preference pairs
    against its own starting weights as the reference, without a reward model or sampling
    (TRL's DPOTrainer, OpenRLHF's train_dpo)."""

    data: str = ""  # in a pipeline: preference pairs to train the policy on before iteration 1, after sft.data's warm start (RUN/dpo, the run's initial policy unless kto.data's follows; "" = none)
    val_data: str = ""  # in a pipeline: held-out pairs, their loss and accuracy before and after each epoch
    beta: float = 0.1  # strength of the pull towards the reference: the implicit reward is beta × (log π − log π_ref) of a response (orpo: the odds-ratio term's weight, its paper's lambda)
    loss: str = "sigmoid"  # several, comma-separated, are summed with loss_weights (MPO: "sigmoid,bco_pair"; TRL's loss_type list): sigmoid (DPO) | robust (rDPO: unbiased under label noise) | ipo (squared, per-token log-ratios) | hinge (SLiC) | simpo (no reference: per-token log-probs, margin simpo_gamma) | orpo (no reference: the chosen NLL plus beta × the odds ratio's loss) | TRL's sigmoid_norm, exo_pair, nca_pair, bco_pair, sppo_hard, apo_zero, apo_down, discopop, aot, aot_unpaired (docs/algorithms.md)
    loss_weights: tuple[float, ...] = ()  # with several losses: each one's weight, in order (TRL's loss_weights; MPO's [0.8, 0.2]); () = 1 each
    label_smoothing: float = 0.0  # the assumed share of pairs labelled the wrong way round (sigmoid: conservative DPO; robust; simpo; aot; exo_pair, which needs it > 0); 0 = none
    simpo_gamma: float = 0.5  # SimPO's target reward margin (dpo.loss = "simpo"; the paper's beta is 2-2.5)
    discopop_tau: float = 0.05  # DiscoPOP's temperature of the mix of its logistic and exponential losses (dpo.loss = "discopop"; TRL's discopop_tau)
    f_divergence: str = "reverse_kl"  # the divergence from the reference the loss regularizes with (f-DPO): reverse_kl (DPO's) | forward_kl | js_divergence | alpha_divergence; not reverse_kl: the losses on the chosen-rejected difference only (sigmoid, robust, ipo, hinge, sigmoid_norm, exo_pair, discopop)
    f_alpha: float = 0.5  # alpha_divergence's α in (0, 1): f'(u) = (1 − u^−α)/α, near 0 the reverse KL, near 1 the forward (TRL's f_alpha_divergence_coef is 1 − α; equal at 0.5)
    ld_alpha: float = 1.0  # LD-DPO: a response's tokens past its pair's shorter side's length weigh this much in its log-probability (policy and reference alike; TRL's ld_alpha), in [0, 1]; 1 = every token fully (DPO's)
    use_weighting: bool = False  # WPO: each pair's loss times its responses' weights, exp of the mean of log π(y_t) − log Σπ² over each response's tokens (how likely the policy is to sample it; TRL's use_weighting)
    reference_free: bool = False  # no reference: its log-probabilities taken as 0, so the loss compares the policy's own (TRL's reference_free; with sft_weight = 1, CPO's loss); none computed
    sft_weight: float = 0.0  # the chosen responses' NLL per token added to the loss with this weight (RPO; TRL's loss_type [..., "sft"]); 0 = none
    min_reward_gap: float = 0.0  # data that is scored rollouts (a score stage's output): each prompt's best and worst sample are a pair where their rewards differ by more than this
    scored_pairs: str = "best_worst"  # data that is scored rollouts: best_worst (each prompt's best and worst sample a pair) | all (every two of its samples whose rewards differ by more than min_reward_gap, the better chosen)
    disable_dropout: bool = True  # the model's dropout off while training (TRL's disable_dropout): the policy's log-probs at the first step are the reference's, computed without dropout
    ref_sync_every: int = 0  # move the reference towards the policy after every N optimizer steps: ref ← α·policy + (1 − α)·ref, then its log-probs of the training pairs recomputed (TR-DPO; TRL's sync_ref_model, ref_model_sync_steps); 0 = the starting weights throughout
    ref_sync_alpha: float = 1.0  # α of ref_sync_every, in (0, 1]: 1 = the policy's weights (TR-DPO's hard update, no copy held); below 1 a copy of the weights is held (TRL's ref_model_mixup_alpha is 0.6)
    lr: float = 1e-6  # learning rate (AdamW)
    epochs: int = 1  # passes over the pairs
    save_steps: int = 0  # a checkpoint also every N optimizer steps within an epoch, to resume from mid-epoch (beside OUT, removed at the end); 0 = at each epoch's end only
    batch_size: int = 16  # pairs per optimizer step
    micro_batch_size: int = 4  # pairs per forward/backward (each pair is two sequences)
    micro_batch_tokens: str = "auto"  # padded tokens per forward/backward at most, as update.micro_batch_tokens
    max_tokens: int = 0  # prompt + response tokens of a side at most; 0 = the model's context
    truncate: str = "error"  # a side over max_tokens: error | right (its response cut; the cut response has no end token)
    max_grad_norm: float = 1.0  # gradient clipping by global norm; 0 = off
    weight_decay: float = 0.0  # AdamW weight decay
    warmup_steps: int = 0  # linear learning-rate warm-up, in optimizer steps
    lr_schedule: str = "constant"  # constant | linear | cosine, as sft.lr_schedule
    min_lr_ratio: float = 0.0  # the floor of the decay, as a share of lr
    bf16: str = "auto"  # bf16 autocast: auto (where the CPU/GPU has native bf16) | true | false
    gradient_checkpointing: bool = False  # recompute each decoder layer's activations in the backward: less memory for ~30% more compute
    seed: int = 0  # seed of the pair order
    lora: LoraConfig = field(default_factory=LoraConfig)  # train LoRA adapters instead of every weight (r > 0)

    def __post_init__(self) -> None:
        if isinstance(self.bf16, bool):
            object.__setattr__(self, "bf16", "true" if self.bf16 else "false")
        if isinstance(self.micro_batch_tokens, int) and not isinstance(self.micro_batch_tokens, bool):
            object.__setattr__(self, "micro_batch_tokens", str(self.micro_batch_tokens))
        check_ranges(self, "dpo", {
            "beta": above(0.0), "loss": lambda v: next((f"must be losses from {', '.join(DPO_LOSSES)}, comma-separated (an unknown {name!r})" for name in v.split(",") if name not in DPO_LOSSES), None), "scored_pairs": one_of(*PAIRINGS), "simpo_gamma": at_least(0.0), "discopop_tau": above(0.0), "f_divergence": one_of(*F_DIVERGENCES), "ld_alpha": between(0.0, 1.0), "sft_weight": at_least(0.0), "min_reward_gap": at_least(0.0), "label_smoothing": lambda v: None if 0.0 <= v < 0.5 else "must be at least 0 and below 0.5",
            "lr": above(0.0), "epochs": at_least(1), "save_steps": at_least(0), "batch_size": at_least(1),
            "micro_batch_size": at_least(1), "max_tokens": at_least(0), "truncate": one_of("error", "right"), "max_grad_norm": at_least(0.0),
            "weight_decay": at_least(0.0), "warmup_steps": at_least(0), "lr_schedule": one_of(*LR_SCHEDULES), "min_lr_ratio": between(0.0, 1.0),
            "bf16": one_of(*AUTOCAST_CHOICES), "ref_sync_every": at_least(0),
            "micro_batch_tokens": lambda v: None if v == "auto" or (isinstance(v, str) and v.isascii() and v.isdigit()) else "must be auto, 0 (no cap) or a number of tokens",
        })
        losses = self.losses
        if len(set(losses)) < len(losses):
            raise ConfigError(f"dpo.loss names a loss twice ({self.loss!r}): give it once, with its weight in dpo.loss_weights")
        if len(losses) > 1 and set(losses) & set(REFERENCE_FREE_LOSSES):
            raise ConfigError(f"dpo.loss = {self.loss!r}: simpo and orpo have no reference and stand alone, not beside other losses")
        if self.loss_weights and len(self.loss_weights) != len(losses):
            raise ConfigError(f"dpo.loss_weights gives {len(self.loss_weights)} weight(s) for the {len(losses)} loss(es) of dpo.loss = {self.loss!r}: one each, in order")
        if any(not math.isfinite(w) or w < 0 for w in self.loss_weights):
            raise ConfigError(f"dpo.loss_weights must be finite and ≥ 0, got {list(self.loss_weights)}")
        if self.label_smoothing and not set(losses) & {"sigmoid", "robust", "simpo", "exo_pair", "aot", "aot_unpaired"}:
            raise ConfigError(f"dpo.label_smoothing applies to the sigmoid, robust, simpo, exo_pair and aot losses, not dpo.loss = {self.loss!r}: set it to 0")
        if self.use_weighting and set(losses) & {"aot", "aot_unpaired"}:
            raise ConfigError(f"dpo.use_weighting weighs each pair's loss, and dpo.loss = {self.loss!r} pairs margins by rank across the micro-batch, not by pair: set one of them off")
        if not 0 < self.f_alpha < 1:
            raise ConfigError(f"dpo.f_alpha must be between 0 and 1 (exclusive), got {self.f_alpha!r}")
        if self.ld_alpha != 1 and set(losses) & set(REFERENCE_FREE_LOSSES):
            raise ConfigError(f"dpo.ld_alpha weighs the log-ratios of DPO's losses against a reference, which dpo.loss = {self.loss!r} has none of: leave it 1")
        if self.f_divergence != "reverse_kl" and not set(losses) <= set(F_DIVERGENCE_LOSSES):
            raise ConfigError(f"dpo.f_divergence = {self.f_divergence!r} applies to the losses on the chosen-rejected difference ({', '.join(F_DIVERGENCE_LOSSES)}), not dpo.loss = {self.loss!r}: leave it reverse_kl")
        if "exo_pair" in losses and not self.label_smoothing:
            raise ConfigError("dpo.loss = \"exo_pair\" needs dpo.label_smoothing > 0 (EXO's ε, the labels' assumed error; the paper's 1e-3)")
        if self.sft_weight and self.loss == "orpo":
            raise ConfigError("dpo.sft_weight adds the chosen responses' NLL, which dpo.loss = \"orpo\" has already: set it to 0")
        if self.ref_sync_every and set(losses) & set(REFERENCE_FREE_LOSSES):
            raise ConfigError(f"dpo.ref_sync_every moves the reference, which dpo.loss = {self.loss!r} has none of: set it to 0")
        if self.ref_sync_every and self.reference_free:
            raise ConfigError("dpo.ref_sync_every moves the reference, which dpo.reference_free leaves out: set one of them off")
        check_ref_sync(self, "dpo")

    @property
    def losses(self) -> list[str]:
        """The preference losses dpo.loss names (one, or several summed)."""
        return self.loss.split(",")

    @property
    def has_reference(self) -> bool:
        """Whether the loss compares with a reference's log-probabilities (computed once, before training)."""
        return not self.reference_free and not set(self.losses) & set(REFERENCE_FREE_LOSSES)


def check_ref_sync(section, name: str) -> None:
    """A moving reference's settings (`ref_sync_every`, `ref_sync_alpha` of dpo or kto) that can work."""
    if not 0 < section.ref_sync_alpha <= 1:
        raise ConfigError(f"{name}.ref_sync_alpha must be in (0, 1], got {section.ref_sync_alpha!r}")
    if section.ref_sync_every and section.lora.r and section.ref_sync_alpha < 1:
        raise ConfigError(f"{name}.ref_sync_alpha below 1 mixes every weight of the policy into a held copy, and a LoRA run trains its adapters only: set it to 1 (the policy's weights) or lora.r = 0")


@dataclass(frozen=True)
class KtoConfig:
    """Kahneman-Tversky optimization (`rlctl kto`): the policy trained on responses labelled
    desirable or undesirable, no pairs needed, against its own starting weights as the reference
    (TRL's KTOTrainer, OpenRLHF's train_kto)."""

    data: str = ""  # in a pipeline: labelled examples (or pairs) to train the policy on before iteration 1, after sft.data's and dpo.data's warm starts (RUN/kto, the run's initial policy; "" = none)
    val_data: str = ""  # in a pipeline: held-out examples, their loss and margin before and after each epoch
    beta: float = 0.1  # strength of the pull towards the reference: the implicit reward is beta × (log π − log π_ref) of a response
    loss: str = "kto"  # kto (the paper's, against the reference point z) | apo_zero_unpaired (APO-zero on single responses: desirable ones up, undesirable down, each against the reference; no z, so no mismatched pairs computed; TRL's loss_type)
    desirable_weight: float = 1.0  # the desirable examples' loss weight (lambda_D; the paper keeps lambda_D × desirable / (lambda_U × undesirable) in [1, 4/3])
    undesirable_weight: float = 1.0  # the undesirable examples' loss weight (lambda_U)
    min_reward_gap: float = 0.0  # data that is scored rollouts (a score stage's output): each prompt's best (desirable) and worst (undesirable) sample, where their rewards differ by more than this
    disable_dropout: bool = True  # the model's dropout off while training (TRL's disable_dropout): the policy's log-probs at the first step are the reference's, computed without dropout
    ref_sync_every: int = 0  # move the reference towards the policy after every N optimizer steps: ref ← α·policy + (1 − α)·ref, then its log-probs of the training examples and their mismatched pairs recomputed (TR-KTO; TRL's sync_ref_model); 0 = the starting weights throughout
    ref_sync_alpha: float = 1.0  # α of ref_sync_every, in (0, 1], as dpo.ref_sync_alpha
    lr: float = 1e-6  # learning rate (AdamW)
    epochs: int = 1  # passes over the examples
    save_steps: int = 0  # a checkpoint also every N optimizer steps within an epoch, to resume from mid-epoch (beside OUT, removed at the end); 0 = at each epoch's end only
    batch_size: int = 16  # examples per optimizer step (the reference point is estimated over them)
    micro_batch_size: int = 8  # examples per forward/backward
    micro_batch_tokens: str = "auto"  # padded tokens per forward/backward at most, as update.micro_batch_tokens
    max_tokens: int = 0  # prompt + response tokens of an example at most; 0 = the model's context
    truncate: str = "error"  # an example over max_tokens: error | right (its response cut; the cut response has no end token)
    max_grad_norm: float = 1.0  # gradient clipping by global norm; 0 = off
    weight_decay: float = 0.0  # AdamW weight decay
    warmup_steps: int = 0  # linear learning-rate warm-up, in optimizer steps
    lr_schedule: str = "constant"  # constant | linear | cosine, as sft.lr_schedule
    min_lr_ratio: float = 0.0  # the floor of the decay, as a share of lr
    bf16: str = "auto"  # bf16 autocast: auto (where the CPU/GPU has native bf16) | true | false
    gradient_checkpointing: bool = False  # recompute each decoder layer's activations in the backward: less memory for ~30% more compute
    seed: int = 0  # seed of the example order and of the mismatched pairs
    lora: LoraConfig = field(default_factory=LoraConfig)  # train LoRA adapters instead of every weight (r > 0)

    def __post_init__(self) -> None:
        if isinstance(self.bf16, bool):
            object.__setattr__(self, "bf16", "true" if self.bf16 else "false")
        if isinstance(self.micro_batch_tokens, int) and not isinstance(self.micro_batch_tokens, bool):
            object.__setattr__(self, "micro_batch_tokens", str(self.micro_batch_tokens))
        check_ranges(self, "kto", {
            "beta": above(0.0), "loss": one_of(*KTO_LOSSES), "desirable_weight": above(0.0), "undesirable_weight": above(0.0), "min_reward_gap": at_least(0.0),
            "lr": above(0.0), "epochs": at_least(1), "save_steps": at_least(0), "batch_size": at_least(2),
            "micro_batch_size": at_least(1), "max_tokens": at_least(0), "truncate": one_of("error", "right"), "max_grad_norm": at_least(0.0),
            "weight_decay": at_least(0.0), "warmup_steps": at_least(0), "lr_schedule": one_of(*LR_SCHEDULES), "min_lr_ratio": between(0.0, 1.0),
            "bf16": one_of(*AUTOCAST_CHOICES), "ref_sync_every": at_least(0),
            "micro_batch_tokens": lambda v: None if v == "auto" or (isinstance(v, str) and v.isascii() and v.isdigit()) else "must be auto, 0 (no cap) or a number of tokens",
        })
        check_ref_sync(self, "kto")


@dataclass(frozen=True)
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    score: ScoreConfig = field(default_factory=ScoreConfig)
    advantage: AdvantageConfig = field(default_factory=AdvantageConfig)
    update: UpdateConfig = field(default_factory=UpdateConfig)
    reshard: ReshardConfig = field(default_factory=ReshardConfig)
    pipeline: PipelineConfig = field(default_factory=PipelineConfig)
    workers: WorkersConfig = field(default_factory=WorkersConfig)
    vllm: VLLMConfig = field(default_factory=VLLMConfig)
    sft: SftConfig = field(default_factory=SftConfig)
    reward_model: RewardModelConfig = field(default_factory=RewardModelConfig)
    dpo: DpoConfig = field(default_factory=DpoConfig)
    kto: KtoConfig = field(default_factory=KtoConfig)


SECTIONS: dict[str, type] = typing.get_type_hints(Config)


RESOLVED_CONFIG = "config.resolved.toml"  # what a pipeline run folder records it runs with


def resolve_estimator_inputs(cfg: Config) -> Config:
    """What the optimal token baseline reads, decided from the rest of the config: score's Σπ²
    on (`score.sum_pi_squared`), and `advantage.otb_rollout_is = auto` as the update's
    importance weights; online DPO's `dpo_loss_agg = auto` as the update's aggregation. Other
    estimators' configs are returned as they are."""
    if cfg.advantage.estimator == "online_dpo" and cfg.advantage.dpo_loss_agg == "auto":
        return replace(cfg, advantage=replace(cfg.advantage, dpo_loss_agg=cfg.update.loss_agg_mode, dpo_loss_horizon=cfg.update.loss_horizon))
    if cfg.advantage.estimator not in SUM_PI_SQUARED_ESTIMATORS:
        return cfg
    advantage = cfg.advantage
    if advantage.otb_rollout_is == "auto":
        advantage = replace(advantage, otb_rollout_is=cfg.update.rollout_is, otb_rollout_is_threshold=cfg.update.rollout_is_threshold)
    return replace(cfg, score=replace(cfg.score, sum_pi_squared=True), advantage=advantage)


def recorded_config(run_dir: str | Path) -> Config | None:
    """The config a run folder saved when it started, if any."""
    saved = Path(run_dir) / RESOLVED_CONFIG
    return load_config(saved) if saved.exists() else None


def load_config(path: str | Path | None = None, overrides: list[str] | None = None, *, data: dict | None = None) -> Config:
    """Read `path` (or take `data`), apply `section.key=value` overrides, return a `Config`."""
    raw: dict[str, Any] = {}
    if path is not None:
        raw = parse_toml_file(path)
    elif data is not None:
        raw = data
    cfg = from_dict(raw, source=str(path) if path else "config")
    return apply_overrides(cfg, overrides or [])


def parse_toml_file(path: str | Path) -> dict[str, Any]:
    path = Path(path)
    if not path.exists():
        raise ConfigError(f"config file {str(path)!r} does not exist")
    if not path.is_file():
        raise ConfigError(f"config file {str(path)!r} is a folder, not a TOML file")
    try:
        return tomllib.loads(path.read_text(encoding="utf-8"))
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{path}: not UTF-8 text (byte {exc.start}); TOML files are UTF-8") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path}: TOML syntax error: {exc}") from exc


def from_dict(raw: dict[str, Any], source: str = "config") -> Config:
    sections = {}
    for name, values in raw.items():
        if name not in SECTIONS:
            raise ConfigError(f"{source}: unknown section [{name}]{suggest(name, SECTIONS)}")
        if not isinstance(values, dict):
            raise ConfigError(f"{source}: [{name}] must be a table of keys")
        sections[name] = section_from_dict(name, values, source)
    return Config(**sections)


def section_from_dict(name: str, values: dict[str, Any], source: str = "config"):
    cls = SECTIONS[name]
    hints = typing.get_type_hints(cls)
    kwargs = {}
    for key, value in values.items():
        if key not in hints:
            raise ConfigError(f"{source}: unknown key {name}.{key}{suggest_key(name, key)}")
        kwargs[key] = coerce(value, hints[key], f"{name}.{key}")
    try:
        return cls(**kwargs)
    except ConfigError as exc:
        raise ConfigError(f"{source}: {exc}") from None


def apply_overrides(cfg: Config, overrides: list[str]) -> Config:
    """`cfg` with every `--set section.key=value` applied, each section checked once with all of
    its new values, so that settings which depend on each other can come in any order."""
    pending: dict[str, dict[str, Any]] = {}
    given: dict[str, list[str]] = {}
    for item in overrides:
        dotted, sep, text = item.partition("=")
        section, dot, key = dotted.strip().partition(".")
        if not sep or not dot:
            raise ConfigError(f"--set {item!r}: expected section.key=value")
        if section not in SECTIONS:
            raise ConfigError(f"--set {item!r}: unknown section {section!r}{suggest(section, SECTIONS)}")
        hints = typing.get_type_hints(SECTIONS[section])
        key, _, inner = key.partition(".")  # update.lora.r: a key of the table update.lora
        if key not in hints or (inner and not dataclasses.is_dataclass(hints[key])):
            raise ConfigError(f"--set {item!r}: unknown key {section}.{key}{suggest_key(section, key)}")
        value = parse_scalar(text)
        if hints[key] is str and isinstance(value, (int, float)) and not isinstance(value, bool):
            value = text.strip()  # a text key keeps what was typed: TOML would read update.rollout_rs_threshold=1_2 as 12
        changes = pending.setdefault(section, {})
        if inner:
            table = dataclasses.asdict(changes.get(key, getattr(getattr(cfg, section), key)))
            if inner not in table:
                raise ConfigError(f"--set {item!r}: unknown key {section}.{key}.{inner}{suggest(inner, table, prefix=f'{section}.{key}.')}")
            value = {**table, inner: value}
        changes[key] = coerce(value, hints[key], dotted)
        given.setdefault(section, []).append(item)
    for section, changes in pending.items():
        try:
            cfg = replace(cfg, **{section: replace(getattr(cfg, section), **changes)})
        except ConfigError as exc:
            raise ConfigError(f"--set {', '.join(repr(item) for item in given[section])}: {exc}") from None
    return cfg


def override_section(section_cfg, **values):
    """`section_cfg` with the given keys replaced, skipping None (flags the user did not pass)."""
    given = {k: v for k, v in values.items() if v is not None}
    if not given:
        return section_cfg
    name = next(n for n, cls in SECTIONS.items() if isinstance(section_cfg, cls))
    hints = typing.get_type_hints(type(section_cfg))
    return replace(section_cfg, **{k: coerce(v, hints[k], f"{name}.{k}") for k, v in given.items()})


def parse_scalar(text: str) -> Any:
    """A `--set` value: TOML syntax when it parses (1e-5, true, "x", [1, 2]), else a bare string."""
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text


# values older rlctl wrote into configs (run folders' config.resolved.toml), read as today's
# and booleans of keys that also take "auto"
LEGACY_VALUES = {
    "score.old_logprobs": {True: "recompute", False: "rollout"}, "update.bf16": {True: "true", False: "false"}, "sft.bf16": {True: "true", False: "false"},
    "reward_model.bf16": {True: "true", False: "false"}, "dpo.bf16": {True: "true", False: "false"},
    "kto.bf16": {True: "true", False: "false"},
}


def coerce(value: Any, expected: Any, key: str) -> Any:
    if isinstance(value, bool) and key in LEGACY_VALUES:
        value = LEGACY_VALUES[key].get(value, value)
    origin = typing.get_origin(expected)
    if origin in (typing.Union, types.UnionType):
        options = typing.get_args(expected)
        if value is None and type(None) in options:
            return None
        expected = next(t for t in options if t is not type(None))
    if origin is tuple:
        return _coerce_tuple(value, typing.get_args(expected)[0], key)
    if origin is dict:
        return _coerce_mapping(value, key)
    if dataclasses.is_dataclass(expected):
        return _coerce_table(value, expected, key)
    if expected is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "false", "1", "0", "yes", "no"):
            return value.lower() in ("true", "1", "yes")
    elif expected is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
    elif expected is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
    elif expected is str:
        if isinstance(value, (str, int, float)) and not isinstance(value, bool):
            return str(value)
    raise ConfigError(f"{key}: expected {expected.__name__}, got {value!r}")


def _coerce_mapping(value: Any, key: str) -> dict[str, bool | int | float | str]:
    """A TOML inline table of names to plain values (true, 3, 0.5, "text"), as a dict."""
    if not isinstance(value, dict):
        raise ConfigError(f"{key}: expected a table like {{name = value}}, got {value!r}")
    bad = next((name for name, item in value.items() if not isinstance(name, str) or not isinstance(item, (bool, int, float, str))), None)
    if bad is not None:
        raise ConfigError(f"{key}: {bad!r} must be a name with a boolean, number or text value, got {value[bad]!r}")
    return dict(value)


def _coerce_tuple(value: Any, item: type, key: str) -> tuple:
    """A TOML array (of tables, for a dataclass item type) as a tuple of `item`."""
    if not isinstance(value, (list, tuple)):
        raise ConfigError(f"{key}: expected an array, got {value!r}")
    if not dataclasses.is_dataclass(item):
        return tuple(coerce(v, item, key) for v in value)
    return tuple(_coerce_table(v, item, key, entry=True) for v in value)


def _coerce_table(value: Any, cls: type, key: str, *, entry: bool = False) -> Any:
    """A TOML table (or an instance) as the dataclass `cls`, its keys checked and coerced."""
    if isinstance(value, cls):
        return value
    hints = typing.get_type_hints(cls)
    if not isinstance(value, dict):
        raise ConfigError(f"{key}: expected {'tables' if entry else 'a table'} like {{{', '.join(f'{k} = ...' for k in hints)}}}, got {value!r}")
    unknown = [k for k in value if k not in hints]
    if unknown:
        raise ConfigError(f"{key}: unknown key {unknown[0]!r}{suggest(unknown[0], hints)}")
    missing = [f.name for f in dataclasses.fields(cls) if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING and f.name not in value]
    if missing:
        raise ConfigError(f"{key}: every entry needs {missing[0]}, got {value!r}")
    return cls(**{k: coerce(x, hints[k], f"{key}.{k}") for k, x in value.items()})


def to_dict(cfg: Any) -> dict[str, Any]:
    return dataclasses.asdict(cfg)


def to_toml(cfg: Config) -> str:
    """A TOML rendering of the resolved config (flat sections of scalars)."""
    lines = []
    for name, values in to_dict(cfg).items():
        lines.append(f"[{name}]")
        for key, value in values.items():
            lines.append(f"{key} = {_toml_value(value)}")
        lines.append("")
    return "\n".join(lines)


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k if re.fullmatch(r'[A-Za-z0-9_-]+', k) else json.dumps(k)} = {_toml_value(v)}" for k, v in value.items()) + "}"
    return json.dumps(str(value), ensure_ascii=False)  # JSON's string escapes are TOML's: a stop string "\n\n" stays one line


# what verl and TRL users type, for the key that means it here
FOREIGN_KEYS = {
    "learning_rate": "update.lr", "lr_warmup_steps": "update.warmup_steps", "lr_scheduler_type": "update.lr_schedule", "warmup_style": "update.lr_schedule", "num_train_epochs": "update.epochs",
    "ppo_epochs": "update.epochs", "ppo_mini_batch_size": "update.mini_batch_size", "ppo_micro_batch_size": "update.micro_batch_size",
    "per_device_train_batch_size": "update.micro_batch_size", "clip_ratio": "update.clip_ratio_low", "cliprange": "update.clip_ratio_low",
    "kl_loss_type": "update.kl_loss_estimator", "loss_weights": "dpo.loss_weights", "grad_clip": "update.max_grad_norm",
    "num_generations": "rollout.n", "max_completion_length": "rollout.max_new_tokens", "response_length": "rollout.max_new_tokens",
    "max_prompt_length": "data.max_prompt_tokens", "train_batch_size": "data.batch_size", "adv_estimator": "advantage.estimator",
    "kl_penalty": "advantage.kl_estimator", "beta": "advantage.kl_coef", "norm_adv_by_std_in_grpo": "advantage.norm_by_std", "scale_rewards": "advantage.std_scope",
    "total_epochs": "pipeline.iterations", "total_training_steps": "pipeline.iterations", "save_freq": "pipeline.save_every",
    "test_freq": "pipeline.val_every", "reward_funcs": "score.rewards", "reward_weights": "score.rewards", "report_to": "pipeline.loggers", "gpu_memory_utilization": "vllm.gpu_memory_utilization",
    "epsilon": "update.clip_ratio_low", "epsilon_high": "update.clip_ratio_high", "delta": "update.clip_ratio_c",
    "off_policy_mask_threshold": "update.off_policy_mask", "use_adaptive_entropy": "update.entropy_target", "use_bias_correction_kl": "update.kl_loss_unbiased", "mask_truncated_completions": "update.mask_truncated",
}


def suggest_key(section: str, key: str) -> str:
    """The nearest key by spelling: in the section first, then over every section and the names
    verl and TRL use (`lerning_rate` → update.lr); empty when nothing is near."""
    hints = typing.get_type_hints(SECTIONS[section])
    near = difflib.get_close_matches(key, list(hints), n=1, cutoff=0.75)
    if near:
        return f"; did you mean {section}.{near[0]}?"
    everywhere = {f"{name}.{k}": f"{name}.{k}" for name, cls in SECTIONS.items() for k in typing.get_type_hints(cls)}
    by_name = {**{dotted.partition(".")[2]: target for dotted, target in everywhere.items()}, **FOREIGN_KEYS}
    near = difflib.get_close_matches(key, list(by_name), n=1, cutoff=0.75)
    if near:
        return f"; did you mean {by_name[near[0]]}?"
    return suggest(key, hints, prefix=section + ".")


def suggest(word: str, options, prefix: str = "") -> str:
    """`; did you mean X?` for the closest of `options`, else `; valid: ...` naming them all."""
    close = difflib.get_close_matches(word, list(options), n=1, cutoff=0.5)
    return f"; did you mean {prefix}{close[0]}?" if close else f"; valid: {', '.join(sorted(options))}"


POLICY = "policy"  # model.ref / model.critic value meaning "the initial policy's weights"
TRAINED_RM = "rm:trained"  # a reward spec meaning "the reward model this run trains" (RUN/reward_model)


def paths_relative_to(cfg: Config, base_dir: Path | None) -> Config:
    """Model and data paths, and reward and tool files, in a config file are relative to the file's folder
    (`base_dir`; None: as given), for `rlctl pipeline` and every stage command's `--config` alike."""
    if base_dir is None:
        return cfg

    def fix(value: str) -> str:
        if not value or value == POLICY or "://" in value or Path(value).is_absolute():
            return value
        return str(base_dir / value)

    model = replace(cfg.model, path=fix(cfg.model.path), ref=fix(cfg.model.ref), critic=fix(cfg.model.critic))
    data = replace(cfg.data, prompts=fix(cfg.data.prompts), val_prompts=fix(cfg.data.val_prompts))
    sft = replace(cfg.sft, data=fix(cfg.sft.data), val_data=fix(cfg.sft.val_data))
    dpo = replace(cfg.dpo, data=fix(cfg.dpo.data), val_data=fix(cfg.dpo.val_data))
    kto = replace(cfg.kto, data=fix(cfg.kto.data), val_data=fix(cfg.kto.val_data))
    rm = cfg.reward_model
    reward_model = replace(rm, data=fix(rm.data), val_data=fix(rm.val_data), base=fix(rm.base))

    def fix_reward(spec: str) -> str:
        kind, _, rest = spec.partition(":")
        if kind == "rm" and spec != TRAINED_RM:
            return f"rm:{fix(rest)}"
        return fix(spec) if kind.endswith(".py") else spec

    terms = tuple(replace(term, fn=fix_reward(term.fn)) for term in cfg.score.rewards)
    return replace(
        cfg, model=model, data=data, sft=sft, dpo=dpo, kto=kto, reward_model=reward_model, rollout=replace(cfg.rollout, tool=fix_reward(cfg.rollout.tool)),
        score=replace(cfg.score, reward=fix_reward(cfg.score.reward), rewards=terms),
    )
