"""Signs in a run's metrics that its training is not doing what the practitioner thinks, each
with what to change: responses cut at the length limit, a reward that gives every sample one
value, prompt groups that carry no signal,
an engine that samples from other probabilities than the trainer computes, a rollout
correction that rejects most of what was sampled, a KL target that stops every update at its
first step, optimizer steps skipped for a non-finite gradient, responses that collapsed to
(nearly) nothing — a reward that passes an empty answer. `rlctl show RUN` lists them, and a pipeline says each the
first time it shows; `pipeline.ignore_checks` leaves out those a run expects (a reward that
wants long responses is not hurt by the length limit). Each rule reads only metrics.jsonl rows
(and the run's resolved config where there is one), so it judges a finished run and a running
one alike."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rlctl.config import Config, recorded_config
from rlctl.errors import RlctlError
from rlctl.sample_stats import EQUAL_REWARD_TOLERANCE

TRUNCATED_SHARE = 0.2  # of the last iteration's responses cut at max_new_tokens
EQUAL_REWARDS_SHARE = 0.9  # of the prompt groups, in each of the last EQUAL_REWARDS_WINDOW iterations
EQUAL_REWARDS_WINDOW = 3
MISMATCHED_TOKENS = 0.01  # of the last iteration's tokens beyond pipeline.rollout_is_threshold
GROUP_RELATIVE = ("grpo", "rloo", "opo", "grpo_passk", "gpg")  # estimators whose advantage is 0 for a group of equal rewards
REJECTED_SHARE = 0.5  # of the responses update.rollout_rs rejected, in each of the last EQUAL_REWARDS_WINDOW iterations
COLLAPSED_LENGTH = 1.5  # mean response tokens (an end token alone is 1), in each of the last EQUAL_REWARDS_WINDOW iterations ...
COLLAPSED_FROM = 4.0  # ... where the first iteration's were at least this many


@dataclass(frozen=True)
class Finding:
    check: str  # one of choices.RUN_CHECKS; `pipeline.ignore_checks` leaves it out
    iterations: tuple[int, ...]
    message: str


def run_findings(rows: list[dict[str, Any]], cfg: Config | None = None, run_dir: str | Path = "RUN") -> list[Finding]:
    """The findings of a run's metrics rows (iterations in order); `cfg` is its resolved config,
    None where the run folder has none (the advice then names every option)."""
    rows = [r for r in rows if not r.get("stopped_early") and r["iteration"] > 0]  # 0: validation before training
    if not rows:
        return []
    window = rows[-EQUAL_REWARDS_WINDOW:]
    constant = constant_reward(window, run_dir, rows)  # then every group is equal too: one finding, not two
    found = [
        truncated(rows[-1], cfg), constant or equal_rewards(window, cfg), engine_mismatch(rows[-1], cfg), rejected(window), kl_stopped(window), skipped_steps(rows),
        collapsed(window, rows[0], run_dir),
    ]
    ignored = cfg.pipeline.ignore_checks if cfg is not None else ()
    return [f for f in found if f is not None and f.check not in ignored]


def truncated(row: dict[str, Any], cfg: Config | None) -> Finding | None:
    share = row.get("response_length/clip_ratio")
    if share is None or share < TRUNCATED_SHARE:
        return None
    limit = row.get("response_length/max")
    at = f" ({limit:.0f} tokens)" if limit is not None else ""
    others = []
    if cfg is None or cfg.score.overlong_buffer <= 0:
        others.append("score.overlong_buffer (DAPO) penalises length gradually")
    if cfg is None or not cfg.update.mask_truncated:
        others.append("update.mask_truncated leaves cut-off responses out of the loss")
    return Finding("truncated", (row["iteration"],), (
        f"iteration {row['iteration']}: {share:.0%} of the responses ended at the length limit{at}, not at a stop token or string, so a reward "
        f"that wants a finished answer judged cut-off text: raise rollout.max_new_tokens if the answers need more room"
        + "".join(f"; {other}" for other in others)
    ))


def constant_reward(rows: list[dict[str, Any]], run_dir: str | Path = "RUN", history: list[dict[str, Any]] | None = None) -> Finding | None:
    """The reward gave every sample of the last iterations one value: a reward function that
    cannot parse the responses (or a task no sample solves) — nothing to learn from, whatever
    the estimator. Where that value is the best of a run whose rewards once differed
    (`history`: every row), the task looks learned instead."""
    if len(rows) < EQUAL_REWARDS_WINDOW or any(r.get("reward_max") is None or r["reward_max"] - r["reward_min"] > EQUAL_REWARD_TOLERANCE for r in rows):
        return None
    first, last = rows[0]["iteration"], rows[-1]["iteration"]
    values = sorted({round(r["reward_max"], 6) for r in rows})
    earlier = [r for r in history or [] if r["iteration"] < first and r.get("reward_max") is not None]
    if len(values) == 1 and earlier and values[0] >= max(r["reward_max"] for r in earlier) and any(r["reward_max"] - r["reward_min"] > EQUAL_REWARD_TOLERANCE for r in earlier):
        return Finding("constant_reward", tuple(r["iteration"] for r in rows), (
            f"iterations {first}-{last}: every sample scored {values[0]:g}, the best reward of the run: the task looks learned, and this "
            "reward has nothing left to teach (stop here, or make the task harder)"
        ))
    return Finding("constant_reward", tuple(r["iteration"] for r in rows), (
        f"iterations {first}-{last}: the reward gave every sample of each iteration the same value ({', '.join(f'{v:g}' for v in values)}), so no advantage "
        f"has anything to learn from: look at what it scored (rlctl show {run_dir}/iter-{last:04d}/score --columns response,reward) "
        "and try the reward function on those responses"
    ))


def equal_rewards(rows: list[dict[str, Any]], cfg: Config | None) -> Finding | None:
    if cfg is not None and (cfg.advantage.estimator not in GROUP_RELATIVE or cfg.pipeline.dynamic_sampling):
        return None  # a critic's or a batch baseline still gives them an advantage; dynamic sampling drops them
    shares = [r.get("groups/equal_rewards") for r in rows]
    if len(rows) < EQUAL_REWARDS_WINDOW or any(s is None or s < EQUAL_REWARDS_SHARE for s in shares):
        return None
    first, last = rows[0]["iteration"], rows[-1]["iteration"]
    estimator = cfg.advantage.estimator.upper() if cfg is not None else "a group-relative estimator (GRPO, RLOO)"
    return Finding("equal_rewards", tuple(r["iteration"] for r in rows), (
        f"iterations {first}-{last}: {min(shares):.0%} or more of the prompt groups gave every sample the same reward "
        f"(mean reward {rows[-1].get('reward_mean', float('nan')):.3g}), and {estimator} gives those groups no advantage: the prompts are "
        "too easy or too hard for the policy now; other prompts, more samples per prompt (rollout.n), pipeline.dynamic_sampling = true, "
        "or data.retire_pass_rate = 1 (the prompts every sample solves left out of later epochs)"
    ))


def engine_mismatch(row: dict[str, Any], cfg: Config | None) -> Finding | None:
    share = row.get("rollout_is/frac_beyond_threshold")
    if share is None or share < MISMATCHED_TOKENS or (cfg is not None and cfg.update.rollout_is != "off"):
        return None
    threshold = f" {cfg.pipeline.rollout_is_threshold:g}" if cfg is not None else ""
    return Finding("engine_mismatch", (row["iteration"],), (
        f"iteration {row['iteration']}: {share:.1%} of the tokens have a trainer/engine probability ratio beyond pipeline.rollout_is_threshold"
        f"{threshold}: the engine samples from other probabilities than the trainer computes (bf16, vLLM, stale weights); "
        'update.rollout_is = "token" weights the update for it'
    ))


def rejected(rows: list[dict[str, Any]]) -> Finding | None:
    """update.rollout_rs rejected most responses in each of the last iterations: most of every
    batch trains nothing, whatever the estimator."""
    shares = [r.get("rollout_rs/seq_masked_fraction") for r in rows]
    if len(rows) < EQUAL_REWARDS_WINDOW or any(s is None or s < REJECTED_SHARE for s in shares):
        return None
    first, last = rows[0]["iteration"], rows[-1]["iteration"]
    measured = last_measured(rows, "logprob_mismatch")
    return Finding("rejected", tuple(r["iteration"] for r in rows), (
        f"iterations {first}-{last}: update.rollout_rs rejected {min(shares):.0%}-{max(shares):.0%} of the responses, so most of each batch "
        f"trained nothing: the engine and the trainer disagree beyond its bounds{measured}; look for stale weights or a lower-precision "
        "engine (rollout.dtype, vllm.dtype), or loosen update.rollout_rs_threshold"
    ))


def kl_stopped(rows: list[dict[str, Any]]) -> Finding | None:
    """update.target_kl stopped every update of the last iterations after its first optimizer
    step: the epochs and mini-batches configured past it cost a forward and a backward each
    and train nothing."""
    if len(rows) < EQUAL_REWARDS_WINDOW or any(r.get("kl_stopped_early") != 1.0 or r.get("optimizer_steps") != 1 for r in rows):
        return None
    first, last = rows[0]["iteration"], rows[-1]["iteration"]
    return Finding("kl_stopped", tuple(r["iteration"] for r in rows), (
        f"iterations {first}-{last}: update.target_kl stopped every update after its first optimizer step{last_measured(rows, 'approx_kl')}, so the further epochs and "
        "mini-batches each ran a pass for nothing: raise update.target_kl, lower update.lr, or take one step per batch (update.epochs = 1, one mini-batch)"
    ))


def last_measured(rows: list[dict[str, Any]], key: str) -> str:
    """" (KEY value at iteration N)" of the last row, "" where it was not measured."""
    value = rows[-1].get(key)
    return f" ({key} {value:.3g} at iteration {rows[-1]['iteration']})" if value is not None else ""


def skipped_steps(rows: list[dict[str, Any]]) -> Finding | None:
    hit = [r for r in rows if (r.get("skipped_steps") or 0) + (r.get("vf_skipped_steps") or 0) > 0]
    if not hit:
        return None
    steps = sum(int((r.get("skipped_steps") or 0) + (r.get("vf_skipped_steps") or 0)) for r in hit)
    shown = ", ".join(str(r["iteration"]) for r in hit[:8]) + (", ..." if len(hit) > 8 else "")
    return Finding("skipped_steps", tuple(r["iteration"] for r in hit), (
        f"iteration{'s' if len(hit) > 1 else ''} {shown}: {steps} optimizer step{'s' if steps > 1 else ''} skipped for a non-finite "
        "gradient (update.allow_skipped_steps): lower update.lr, or look at the rewards' scale"
    ))


def collapsed(rows: list[dict[str, Any]], first: dict[str, Any], run_dir: str | Path = "RUN") -> Finding | None:
    """The responses of the last iterations are (nearly) empty where they were not at the
    start: the policy learned to stop at once, which a reward that scores an empty answer well
    (a judge or reward model never shown one, a rule that reads "no mistakes" as right) teaches
    whatever the task."""
    lengths = [r.get("response_length") for r in rows]
    start = first.get("response_length")
    if len(rows) < EQUAL_REWARDS_WINDOW or start is None or start < COLLAPSED_FROM or any(n is None or n > COLLAPSED_LENGTH for n in lengths):
        return None
    first_i, last = rows[0]["iteration"], rows[-1]["iteration"]
    return Finding("collapsed", tuple(r["iteration"] for r in rows), (
        f"iterations {first_i}-{last}: responses average {max(lengths):.2g} tokens or fewer (iteration {first['iteration']}: {start:.3g}), with mean reward "
        f"{rows[-1].get('reward_mean', float('nan')):.3g}: the policy learned to stop at once, as it does when the reward scores an empty answer well "
        f"(a judge or reward model never shown one); look at what it scored (rlctl show {run_dir}/iter-{last:04d}/score --columns response,reward) "
        "and give such responses no reward"
    ))


def resolved_config(run_dir: str | Path) -> Config | None:
    """The run's recorded config; None where it is missing or unreadable (a run folder of
    another rlctl version): the findings then do without it."""
    try:
        return recorded_config(run_dir)
    except RlctlError:
        return None
