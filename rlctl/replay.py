"""`rlctl replay RUN/iter-NNNN/STAGE`: re-run one recorded stage of a pipeline run from its
recorded inputs, config, seed and weights, into a scratch folder; `--check` compares with the
recorded output; `--set` changes config for "what if" debugging.

    rlctl replay runs/grpo/iter-0003/advantage --check
    rlctl replay runs/grpo/iter-0003/advantage --set advantage.norm_by_std=false --out /tmp/what-if
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pyarrow as pa

from rlctl import mkl_kernels
from rlctl.config import (
    RESOLVED_CONFIG,
    Config,
    apply_overrides,
    recorded_config,
    section_from_dict,
)
from rlctl.errors import InputError
from rlctl.manifest import Manifest
from rlctl.passes import as_recorded
from rlctl.rewards import is_code_reward
from rlctl.shards import read, read_manifest, write
from rlctl.workers import held_reward_models

REPLAYABLE = ("prompts", "rollout", "score", "filter", "advantage", "update", "val")
TIMING_KEYS = ("seconds", "tokens_per_s")


def replay_stage(
    stage_dir: str, *, check: bool = False, out: str | None = None, overrides: list[str] | None = None,
    reward: str | None = None, trust_run_code: bool = False,
) -> str:
    """Re-run `stage_dir`. A reward that is code (file.py:fn, module:fn) recorded in the run
    folder runs only with `trust_run_code`; `reward` names the reward to use instead."""
    path = Path(stage_dir.rstrip("/"))
    folder, iter_dir = path.name, path.parent
    name, _, round_ = folder.partition("-r")  # dynamic sampling's rounds: prompts-r2, rollout-r2, score-r2
    run_dir = iter_dir.parent
    if name not in REPLAYABLE or (round_ and not round_.isdigit()):
        raise InputError(f"{stage_dir}: not a stage folder; replayable stages are {', '.join(REPLAYABLE)}")
    run_cfg = recorded_config(run_dir)
    if run_cfg is None:
        raise InputError(f"{run_dir}: not a pipeline run folder (no {RESOLVED_CONFIG})")
    recorded, _ = read_manifest(str(path))
    cfg = _recorded_config(run_cfg, recorded, overrides or [])
    target = out or str(run_dir / "replay" / iter_dir.name / folder)
    if name in ("score", "val"):
        cfg = _replay_rewards(cfg, recorded, f"{iter_dir.name}/{folder}", reward, trust_run_code)
    if name in ("rollout", "val") and cfg.rollout.tool and is_code_reward(cfg.rollout.tool) and not trust_run_code:
        raise InputError(
            f"replaying {iter_dir.name}/{folder} would run the tool code the run folder names ({cfg.rollout.tool}); "
            "pass --trust-run-code if you trust this run folder"
        )
    replay = {"prompts": _prompts, "rollout": _rollout, "score": _score, "filter": _filter, "advantage": _advantage, "update": _update, "val": _val}[name]
    result = replay(cfg, recorded, Round(iter_dir, f"-r{round_}" if round_ else ""), target)
    if not check:
        return f"replayed {iter_dir.name}/{name} into {target}"
    verdict = _compare_update(result, recorded) if isinstance(result, dict) else compare_tables(read(str(path)).table, result)
    return verdict + _kernels_note(recorded) + _compile_note(recorded, cfg)


def _kernels_note(recorded: Manifest) -> str:
    """Where the stage ran on other MKL kernels than this process (rlctl.mkl_kernels), a note
    that its last bits may differ for that reason, and how to run it as recorded."""
    was, now = recorded.state.get("mkl_kernels"), mkl_kernels.recorded()
    if was is None or was == now:
        return ""
    if isinstance(was, list):  # Ray ranks on hosts that ran different kernels
        return f" (recorded with MKL's {', '.join(map(str, was))} kernels on its ranks, replayed with its {now} ones: the last bits may differ)"
    return f" (recorded with MKL's {was} kernels, replayed with its {now} ones: the last bits may differ; RLCTL_MKL_KERNELS={was} runs it as recorded)"


def _compile_note(recorded: Manifest, cfg: Config) -> str:
    """Where an update replays with its decoder layers compiled and it ran them eager, or the
    other way round (`--set update.compile=...`), a note that its last bits may differ."""
    if recorded.stage != "update":
        return ""
    was = bool(recorded.config.get("update", {}).get("compile", False))  # recorded before the key: eager
    if was == cfg.update.compile:
        return ""
    how = {True: "compiled", False: "eager"}
    return f" (recorded with {how[was]} decoder layers, replayed with {how[cfg.update.compile]} ones: the last bits may differ)"


def _replay_rewards(cfg: Config, recorded: Manifest, stage: str, reward: str | None, trust_run_code: bool) -> Config:
    """The config whose rewards the replayed score uses: `reward` when given, else the
    recorded ones, which must not be code unless the user trusts the run folder."""
    if reward is not None:
        return dataclasses.replace(cfg, score=dataclasses.replace(cfg.score, reward=reward, rewards=()))
    recorded_spec = recorded.config.get("reward", cfg.score.reward)
    specs = [term.fn for term in cfg.score.rewards] or [recorded_spec]
    if recorded_spec.startswith("callable:"):
        raise InputError(
            f"{stage} used a Python function given to Pipeline(reward_fn=...) ({recorded_spec.partition(':')[2]}); replay cannot "
            "import it: pass --reward file.py:function (or module:function, builtin:NAME) that computes the same reward"
        )
    code = [spec for spec in specs if is_code_reward(spec)]
    if code and not trust_run_code:
        raise InputError(
            f"replaying {stage} would run the reward code the run folder names ({', '.join(code)}); "
            "pass --reward SPEC to choose it yourself, or --trust-run-code if you trust this run folder"
        )
    if cfg.score.rewards:
        return cfg
    return dataclasses.replace(cfg, score=dataclasses.replace(cfg.score, reward=recorded_spec))


@dataclasses.dataclass(frozen=True)
class Round:
    """The iteration folder of a replayed stage, and which dynamic-sampling round it belongs to."""

    iter_dir: Path
    suffix: str = ""  # "" for round 1 (and every stage of a run without dynamic sampling), else "-rN"

    def __truediv__(self, stage: str) -> Path:
        """The folder of `stage` in this round (`prompts` → `prompts-r2`)."""
        return self.iter_dir / (stage + self.suffix)

    @property
    def name(self) -> str:
        return self.iter_dir.name


def _recorded_config(run_cfg: Config, recorded: Manifest, overrides: list[str]) -> Config:
    """The run's config with the stage's recorded sections in place, then the overrides."""
    known = {f.name for f in dataclasses.fields(Config)}
    sections = {k: section_from_dict(k, v) for k, v in recorded.config.items() if k in known}
    cfg = dataclasses.replace(run_cfg, **sections)
    cfg = dataclasses.replace(cfg, update=dataclasses.replace(cfg.update, micro_batch_tokens=as_recorded(cfg.update.micro_batch_tokens)))
    if "skip_zero_advantage" not in recorded.config.get("update", {"skip_zero_advantage": None}):  # recorded before the key: every row trained
        cfg = dataclasses.replace(cfg, update=dataclasses.replace(cfg.update, skip_zero_advantage=False))
    if "batch_tokens" not in recorded.config.get("score", {"batch_tokens": None}):  # recorded before the key: passes by rows alone
        cfg = dataclasses.replace(cfg, score=dataclasses.replace(cfg.score, batch_tokens=0))
    cfg = apply_overrides(cfg, overrides)
    threads = recorded.state.get("torch_threads") or recorded.state.get("train_metrics", {}).get("torch_threads")
    if isinstance(threads, int) and threads > 0 and cfg.workers.backend == "local" and not cfg.workers.threads:  # a list: Ray ranks that differed
        cfg = dataclasses.replace(cfg, workers=dataclasses.replace(cfg.workers, threads=threads))  # as the stage ran
    return cfg


def _weights(recorded: Manifest) -> str:
    source = recorded.state.get("weights_source")
    if not source or not Path(source, "config.json").exists():
        raise InputError(
            f"the weights this stage used ({source}) were not kept; replay needs them (pipeline.save_every=1, keep_checkpoints=0 keeps all)"
        )
    return source


def _prompts(cfg: Config, recorded: Manifest, iter_dir: Round, target: str) -> pa.Table:
    from rlctl.pipeline import select_prompts

    dataset = read(cfg.data.prompts, "prompts").table
    limit = recorded.state.get("prompt_token_limit")  # data.truncate = "drop": the prompts over it were left out before the draw
    if limit is not None:
        from transformers import AutoTokenizer

        from rlctl.stages.rollout import fitting_prompts

        tokenizer = AutoTokenizer.from_pretrained(cfg.model.path, trust_remote_code=False)
        dataset, _ = fitting_prompts(dataset, tokenizer, dataclasses.replace(cfg.data, max_prompt_tokens=int(limit)))
    i = recorded.state["iteration"]
    start = recorded.state.get("stream_start")  # recorded since dynamic sampling; else the iteration's slice
    table = select_prompts(
        dataset, iteration=i, batch_size=cfg.data.batch_size, shuffle=cfg.data.shuffle, seed=recorded.config.get("seed", cfg.pipeline.seed),
        start=int(start) if start is not None else None, retired=recorded.state.get("retired_prompts"),  # data.retire_pass_rate's, as drawn
    )
    write(table, target, Manifest(stage="prompts", state={"replay_of": str(iter_dir / "prompts")}), schema="prompts")
    return read(target).table


def _run_workers(cfg: Config, *, policy: str, ref: str = "", critic: str | None = None, train: bool = False, generate: bool = False, scorers: dict | None = None):
    """The kind of workers the run used (its [workers] section), so a replay splits the rows,
    and shards the training, exactly as the run did; `generate` starts the run's rollout engine;
    `scorers`: the `rm:` models a Ray group's ranks held."""
    from rlctl.workers import worker_group

    return worker_group(
        cfg.workers, policy=policy, ref=ref or None, critic=critic, update=cfg.update if train else None,
        temperature=cfg.rollout.temperature, device=cfg.model.device, rollout=cfg.rollout if generate else None, engine=cfg.vllm, scorers=scorers,
    )


def _run_rewards(cfg: Config, workers, scorers: dict):
    """The run's rewards, the `rm:` models scored where the run scored them (`scorers`: on the ranks)."""
    from rlctl.rewards import load_rewards

    return load_rewards(cfg.score, device=cfg.model.device, reward_models=workers.reward_model if scorers else None)


def _rollout(cfg: Config, recorded: Manifest, iter_dir: Round, target: str) -> pa.Table:
    from rlctl.shards import OutputSpec
    from rlctl.stages.rollout import rollout_parts_on_workers, rollout_table

    prompts = read(str(iter_dir / "prompts"), "prompts").table
    version = recorded.state["policy_version"]
    manifest = Manifest(stage="rollout", seed=cfg.rollout.seed, state={"replay_of": str(iter_dir / "rollout")})
    with _run_workers(cfg, policy=_weights(recorded), generate=True) as workers:
        if workers.writes_parts:
            rollout_parts_on_workers(workers, prompts, cfg.rollout, cfg.data, version, OutputSpec(target), manifest)
        else:
            write(rollout_table(prompts, workers.engine, cfg.rollout, cfg.data, policy_version=version), target, manifest, schema="rollouts")
    return read(target).table


def _score(cfg: Config, recorded: Manifest, iter_dir: Round, target: str) -> pa.Table:
    from rlctl.pipeline import old_logprobs_source
    from rlctl.stages.score import ScoringModels, score_table

    weights = _weights(recorded)
    critic = None
    if cfg.model.critic:
        critic_dir = Path(weights) / "critic"
        critic = str(critic_dir) if critic_dir.exists() else cfg.model.critic
    scorers = held_reward_models(cfg.score, cfg.workers)
    ref = recorded.state.get("ref_source") or cfg.model.ref  # a reference that followed the policy (pipeline.ref_sync_every): the one it scored with
    with _run_workers(cfg, policy=weights, ref=ref, critic=critic, scorers=scorers) as workers:
        reward = _run_rewards(cfg, workers, scorers)
        models = ScoringModels(ref=workers.ref, policy=workers.policy if old_logprobs_source(cfg) == "recompute" else None, critic=workers.critic)
        table = score_table(read(str(iter_dir / "rollout"), "rollouts").table, reward, models, cfg.score)
    write(table, target, Manifest(stage="score", state={"replay_of": str(iter_dir / "score")}), schema="scores")
    return read(target).table


def _val(cfg: Config, recorded: Manifest, iter_dir: Round, target: str) -> pa.Table:
    """The validation again: the held-out prompts, sampled as recorded (its `rollout` section)
    from the iteration's checkpoint, scored with the run's reward."""
    from rlctl.stages.rollout import rollout_table
    from rlctl.stages.score import ScoringModels, score_table

    if not cfg.data.val_prompts:
        raise InputError(f"{iter_dir.name}/val: the run's config names no data.val_prompts to validate on")
    prompts = read(cfg.data.val_prompts, "prompts").table
    scorers = held_reward_models(cfg.score, cfg.workers)
    with _run_workers(cfg, policy=_weights(recorded), generate=True, scorers=scorers) as workers:
        table = rollout_table(prompts, workers.engine, cfg.rollout, cfg.data, policy_version=recorded.state["policy_version"])
        scored = score_table(table, _run_rewards(cfg, workers, scorers), ScoringModels(), cfg.score)
    write(scored, target, Manifest(stage="validate", state={"replay_of": str(iter_dir / "val")}), schema="scores")
    return read(target).table


def _advantage(cfg: Config, recorded: Manifest, iter_dir: Round, target: str) -> pa.Table:
    from rlctl.algos.kl import KLControllerState
    from rlctl.stages.advantage import advantage_table, check_config

    check_config(cfg.advantage)
    saved = recorded.config.get("kl_state", {"kl_coef": cfg.advantage.kl_coef, "steps": 0})
    state = KLControllerState(float(saved["kl_coef"]), int(saved["steps"]))
    scores = iter_dir / "filter" if (iter_dir / "filter").exists() else iter_dir / "score"  # dynamic sampling trains on the filter's rows
    table, _, _ = advantage_table(read(str(scores), "scores").table, cfg.advantage, state)
    write(table, target, Manifest(stage="advantage", state={"replay_of": str(iter_dir / "advantage")}), schema="batch")
    return read(target).table


def _filter(cfg: Config, recorded: Manifest, iter_dir: Round, target: str) -> pa.Table:
    """Dynamic sampling's selection again, from the recorded rounds' scores."""
    from rlctl.pipeline import filtered_batch

    rounds = int(recorded.metrics.get("rounds", 1))
    scores = [read(str(iter_dir.iter_dir / ("score" if r == 1 else f"score-r{r}")), "scores").table for r in range(1, rounds + 1)]
    table, _, _ = filtered_batch(scores, cfg.rollout.n, cfg.data.batch_size, cfg.pipeline.dynamic_sampling_metric)
    write(table, target, Manifest(stage="filter", state={"replay_of": str(iter_dir / "filter")}), schema="scores")
    return read(target).table


def _update(cfg: Config, recorded: Manifest, iter_dir: Round, target: str) -> dict:
    from rlctl.checkpoint import load_trainer_state
    from rlctl.lineage import make_manifest
    from rlctl.pipeline import old_logprobs_source
    from rlctl.trainer import TrainBatch
    from rlctl.workers.local import checkpoint_sources

    weights = _weights(recorded)
    checkpoint = weights if load_trainer_state(weights) is not None else None
    policy, critic = checkpoint_sources(checkpoint, cfg, weights)  # iteration 1: the initial policy (a warm start's RUN/sft)
    with _run_workers(cfg, policy=policy, critic=critic, train=True) as workers:
        batch = read(str(iter_dir / "advantage"), "batch").table
        own = old_logprobs_source(cfg) == "update" and "old_logprobs" not in batch.column_names  # as the run trained
        metrics = workers.trainer.train(TrainBatch.from_table(batch, own_old_logprobs=own))
        workers.hand_over_weights()
        manifest = make_manifest("update", {"update": dataclasses.asdict(cfg.update)}, [])
        manifest.metrics = metrics
        manifest.state = {"replay_of": str(iter_dir / "update")}
        workers.save(target, manifest, {"iteration": recorded.state.get("iteration")})
        digest_key, _ = recorded_weights(recorded)
        return {digest_key: workers.weights_digest(stream=digest_key == STREAM_DIGEST_KEY), "metrics": metrics}


DIGEST_KEY = "weights_digest"  # the hand-over's record of the trained weights (rlctl.digests.module_digest)
STREAM_DIGEST_KEY = "weights_sha256"  # what runs recorded before it hold (rlctl.digests.stream_digest)


def recorded_weights(recorded: Manifest) -> tuple[str, str | None]:
    """(the key, the digest) the recorded hand-over names the trained weights by."""
    handover = recorded.state.get("handover", {})
    key = DIGEST_KEY if DIGEST_KEY in handover or STREAM_DIGEST_KEY not in handover else STREAM_DIGEST_KEY
    return key, handover.get(key)


def _compare_update(result: dict, recorded: Manifest) -> str:
    digest_key, expected = recorded_weights(recorded)
    if expected != result[digest_key]:
        return f"differs: weights after the update have digest {result[digest_key][:16]}…, recorded {str(expected)[:16]}…"
    recorded_metrics = recorded.state.get("train_metrics", {})
    for key, value in result["metrics"].items():
        if any(t in key for t in TIMING_KEYS) or key not in recorded_metrics:
            continue
        old = recorded_metrics[key]
        if old != value:  # bit-identical training gives bit-identical metrics
            return f"differs: metric {key}: recorded {old!r}, replayed {value!r}"
    return "identical"


def compare_tables(recorded: pa.Table, replayed: pa.Table) -> str:
    """'identical', or the first difference: column, row and both values."""
    if recorded.column_names != replayed.column_names:
        return f"differs: columns {recorded.column_names} vs {replayed.column_names}"
    if recorded.num_rows != replayed.num_rows:
        return f"differs: {recorded.num_rows} rows recorded, {replayed.num_rows} replayed"
    for name in recorded.column_names:
        a, b = recorded.column(name), replayed.column(name)
        if a.equals(b):
            continue
        for row, (x, y) in enumerate(zip(a.to_pylist(), b.to_pylist())):
            if x != y:
                return f"differs: column {name!r} row {row}: recorded {_short(x)}, replayed {_short(y)}"
    return "identical"


def _short(value) -> str:
    text = json.dumps(value) if not isinstance(value, str) else repr(value)
    return text if len(text) < 120 else text[:117] + "…"
