"""The allowed values of every choice: config rules, `--help`, validation and the shell
completions all read these lists. Kept free of torch so `rlctl --help` starts in milliseconds;
where a registry is the source (estimators, KL estimators, loss modes, presets, built-in
rewards), tests/unit/test_config_doc.py checks that the list here is the registry's."""

COMPUTE_DTYPES = ("auto", "fp32", "bf16")
AUTOCAST_CHOICES = ("auto", "true", "false")
RESHARD_DTYPES = ("bf16", "fp16", "fp32")
ROLLOUT_BACKENDS = ("hf", "vllm")
WORKER_BACKENDS = ("local", "ray")
TRUNCATE = ("error", "left", "drop")
KL_CONTROLLERS = ("fixed", "adaptive")
STD_SCOPES = ("group", "batch")
PF_PPO = ("off", "pow", "max_min", "max_random")
OTB_ROLLOUT_IS = ("auto", "off", "token", "sequence")  # advantage.otb_rollout_is  # advantage.pf_ppo (rlctl.algos.filtration): verl's reweight_method
TOOL_FORMATS = ("text", "chat")
SHARD_FORMATS = ("arrow", "parquet")
RESHARD_TARGETS = ("hf",)
OLD_LOGPROBS = ("auto", "recompute", "rollout", "update")
PIPELINE_STAGES = ("rollout", "score", "advantage", "update")
SHOW_LAYOUTS = ("auto", "table", "records")
RUN_CHECKS = ("truncated", "constant_reward", "equal_rewards", "engine_mismatch", "rejected", "kl_stopped", "skipped_steps", "collapsed")  # rlctl.run_checks' findings

ESTIMATORS = ("gae", "gdpo", "gpg", "grpo", "grpo_passk", "online_dpo", "opo", "optimal_token_baseline", "reinforce_pp", "reinforce_pp_baseline", "remax", "rloo")
SUM_PI_SQUARED_ESTIMATORS = ("optimal_token_baseline",)  # estimators that read score's Σπ² and old log-probs
KL_ESTIMATORS = ("abs", "abs+", "k1", "k1+", "k2", "k2+", "k3", "k3+", "kl", "kl+", "low_var_kl", "low_var_kl+", "mse", "mse+")
LOSS_AGG_MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")
POLICY_LOSSES = ("ppo", "gspo", "cispo", "kl_cov", "gmpo", "clip_cov", "gpg", "sapo", "vespo")
REJECTION_RULES = (  # update.rollout_rs (rlctl.algos.rejection): verl's rollout_rs options
    "token_k1", "token_k2", "token_k3", "seq_sum_k1", "seq_sum_k2", "seq_sum_k3",
    "seq_mean_k1", "seq_mean_k2", "seq_mean_k3", "seq_max_k2", "seq_max_k3",
)
LR_SCHEDULES = ("constant", "linear", "cosine")
DPO_LOSSES = ("sigmoid", "robust", "ipo", "hinge", "simpo", "orpo", "sigmoid_norm", "exo_pair", "nca_pair", "bco_pair", "sppo_hard", "apo_zero", "apo_down", "discopop", "aot", "aot_unpaired")
REFERENCE_FREE_LOSSES = ("simpo", "orpo")  # preference losses without a reference model
ONLINE_DPO_LOSSES = ("sigmoid", "ipo", "hinge", "sigmoid_norm", "nca_pair", "bco_pair", "sppo_hard", "apo_zero", "apo_down")  # advantage.dpo_loss: the preference losses with no setting beyond β
PAIRINGS = ("best_worst", "all")  # advantage.dpo_pairs, dpo.scored_pairs: which of a prompt's samples make preference pairs
KTO_LOSSES = ("kto", "apo_zero_unpaired")  # kto.loss (rlctl.kto.kto_losses): TRL KTOConfig's loss_type
F_DIVERGENCES = ("reverse_kl", "forward_kl", "js_divergence", "alpha_divergence")  # dpo.f_divergence (rlctl.dpo.f_score)
F_DIVERGENCE_LOSSES = ("sigmoid", "robust", "ipo", "hinge", "sigmoid_norm", "exo_pair", "discopop")  # the losses on the difference of the two sides' scores, which take any of them
PRESETS = ("tiny", "small", "medium")
BUILTIN_REWARDS = ("countdown", "gsm8k", "gsm8k_flexible", "length", "math", "mcq", "qa_em", "qa_f1", "think_format")
