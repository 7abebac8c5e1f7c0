"""The controller: `rlctl pipeline CONFIG.toml` and the Python `Pipeline`.

Runs rollout → score → advantage → update (→ in-memory weight hand-over) for N iterations in
one process, with the models loaded once and kept resident. Every stage's output is still
committed to the run folder, so any stage can be replayed:

    RUN/config.resolved.toml       RUN/metrics.jsonl
    RUN/iter-NNNN/{prompts,rollout,score,advantage,update}/   (+ val/ on validation iterations)
    RUN/checkpoints/iter-NNNN/     HF folder + trainer_state/ (+ critic/), every save_every
    RUN/refs/iter-NNNN/            the reference from then on, with pipeline.ref_sync_every

Resume: a re-run continues from the newest committed checkpoint; the stages after it are
recomputed or, when their committed output has the same key, read back. Everything a stage
depends on (data order, sampling seed, optimizer state and step, KL controller state) is a
function of the iteration and what was committed, so a resumed run is bit-identical to an
uninterrupted one on the CPU.

    rlctl pipeline examples/grpo.toml --iterations 20
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import replace
from functools import cached_property
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

from rlctl import faults, mkl_kernels
from rlctl.algos.kl import KLControllerState
from rlctl.algos.sampling import enough, select_groups
from rlctl.backends import compiled_layers
from rlctl.completion_log import drawn_completions
from rlctl.config import (
    POLICY,
    RESOLVED_CONFIG,
    TRAINED_RM,
    Config,
    UpdateConfig,
    apply_overrides,
    from_dict,
    load_config,
    paths_relative_to,
    recorded_config,
    resolve_estimator_inputs,
    to_dict,
    to_toml,
)
from rlctl.dtypes import AUTO, models_device, resolve_dtypes
from rlctl.durations import describe_duration, parse_duration
from rlctl.errors import ConfigError, InputError
from rlctl.lineage import make_manifest, shards_ref
from rlctl.loggers import Loggers, check_loggers
from rlctl.manifest import MANIFEST_NAME, InputRef, Manifest, strict_json_value
from rlctl.modelinit import preset_fields
from rlctl.passes import ModelShape, as_recorded, decided_micro_batch_tokens, ranks_at_once
from rlctl.prompt_stream import (
    PromptStream,
    newly_retired,
    pass_rates,
    retired_digest,
    retirement_epochs,
)
from rlctl.ref_sync import (
    RefSync,
    check_mixable,
    prune_references,
    synced_ref_dir,
    write_synced_reference,
)
from rlctl.rewards import RewardSet, describe_rewards, load_rewards, scoring_model_folders
from rlctl.run_checks import run_findings
from rlctl.runinfo import best_iteration, iteration_folders, iteration_number
from rlctl.sample_stats import (
    reward_component_means,
    reward_stats,
    rollout_stats,
    source_stats,
    validation_metrics,
)
from rlctl.shards import Shards, commit_empty, filesystem, is_committed, read, read_manifest, write
from rlctl.stages.rollout import stage_config as rollout_stage_config
from rlctl.tensors import list_lengths
from rlctl.threads import ThreadGovernor
from rlctl.workers import held_reward_models

STAGES = ("rollout", "score", "advantage", "update")


def resolve_pass_tokens(cfg: Config, recorded: Config | None) -> Config:
    """`update.micro_batch_tokens` with "auto" decided, as the dtypes are: as the run first
    decided it (a run started before the key existed recorded "auto" and ran without a cap:
    "0"), else for the machine its models train on and their shapes (rlctl.passes)."""
    value = cfg.update.micro_batch_tokens
    if value == AUTO and recorded is not None:
        value = as_recorded(recorded.update.micro_batch_tokens)
    elif value == AUTO:
        shape = ModelShape.of_folder(cfg.model.path) or ModelShape.of(preset_fields(cfg.model.init_preset))
        # a critic not on disk yet (the policy's folder before init, a warm start's RUN/sft) is the policy's shape
        critic = (ModelShape.of_folder(cfg.model.critic) or shape) if cfg.model.critic else None
        value = decided_micro_batch_tokens(value, models_device(cfg.model.device, cfg.workers), shape, critic=critic, ranks=ranks_at_once(cfg.workers))
    return replace(cfg, update=replace(cfg.update, micro_batch_tokens=value))


# The warm starts before iteration 1, in the order they run: each trains the weights the one
# before it left (model.path for the first) on its section's data into RUN/<name>, and the
# last one's folder is the run's initial policy.
WARM_STARTS = ("sft", "dpo", "kto")
REWARD_MODEL_DIR = "reward_model"  # RUN/reward_model: the reward model trained on reward_model.data


def resolve_model_paths(cfg: Config, run_dir: Path) -> Config:
    """Fill in the run's model folder and the `policy` shorthands: the initial policy's weights,
    which after a warm start (sft.data, dpo.data, kto.data) are its folder's, not model.path's."""
    model = cfg.model
    path = model.path or str(run_dir / "model")
    start = initial_policy(replace(cfg, model=replace(model, path=path)), run_dir)
    ref = start if model.ref == POLICY else model.ref
    critic = start if model.critic == POLICY else model.critic
    return resolve_trained_reward(replace(cfg, model=replace(model, path=path, ref=ref, critic=critic)), run_dir)


def resolve_trained_reward(cfg: Config, run_dir: Path) -> Config:
    """`rm:trained` as the folder the run trains its reward model into, and reward_model.base's
    `policy` as the initial policy; a reward model trained for no reward is refused."""
    specs = [cfg.score.reward] + [term.fn for term in cfg.score.rewards]
    used = TRAINED_RM in specs
    if used and not cfg.reward_model.data:
        raise ConfigError(f"score: {TRAINED_RM} is the reward model the run trains on reward_model.data, which is not set")
    if cfg.reward_model.data and not used:
        raise ConfigError(f"reward_model.data trains a reward model that no reward uses: set score.reward = \"{TRAINED_RM}\" (or a score.rewards term's fn)")
    if not used:
        return cfg
    trained = f"rm:{run_dir / REWARD_MODEL_DIR}"

    def fix(spec: str) -> str:
        return trained if spec == TRAINED_RM else spec

    base = initial_policy(cfg, run_dir) if cfg.reward_model.base == POLICY else cfg.reward_model.base
    score = replace(cfg.score, reward=fix(cfg.score.reward), rewards=tuple(replace(t, fn=fix(t.fn)) for t in cfg.score.rewards))
    return replace(cfg, score=score, reward_model=replace(cfg.reward_model, base=base))


def warm_starts(cfg: Config) -> list[str]:
    """The warm starts the run trains before iteration 1, in order: those whose data is set."""
    return [name for name in WARM_STARTS if getattr(cfg, name).data]


def initial_policy(cfg: Config, run_dir: Path) -> str:
    """The weights iteration 1 starts from: the last warm start's folder, or model.path."""
    done = warm_starts(cfg)
    return str(run_dir / done[-1]) if done else cfg.model.path


def warm_start_base(cfg: Config, run_dir: Path, name: str) -> str:
    """The weights the warm start `name` trains: the folder of the one run before it, or model.path."""
    before = [w for w in warm_starts(cfg) if WARM_STARTS.index(w) < WARM_STARTS.index(name)]
    return str(run_dir / before[-1]) if before else cfg.model.path


def checked_shapes(table: pa.Table | None, data, source: str) -> None:
    """Every prompt of a prompt file shaped as the rollout will shape it (data.prompt_template,
    data.system_prompt), before any work: a prompt it cannot apply to is one error naming the file."""
    from rlctl.stages.rollout import shaped_prompts

    if table is None:
        return
    try:
        shaped_prompts(table, data)
    except InputError as exc:
        raise InputError(f"{source}: {exc}") from None


def moving_reference_plan(section) -> str:
    """The plan's words for a DPO or KTO warm start's moving reference (`ref_sync_every`), or nothing."""
    if not section.ref_sync_every:
        return ""
    towards = "reset to the policy" if section.ref_sync_alpha == 1 else f"moved {section.ref_sync_alpha:g} of the way to the policy"
    return f", the reference {towards} every {section.ref_sync_every} steps"


def validate(cfg: Config, *, from_stage: str | None = None, until_stage: str | None = None) -> None:
    """Everything that can be checked before any work: fails with one line, exit code 2."""
    from rlctl.algos.advantages import (
        ESTIMATORS,
        NEEDS_BASELINES,
        NEEDS_COMPONENTS,
        NEEDS_PAIRS,
        NEEDS_SUM_PI_SQUARED,
        NEEDS_VALUES,
    )
    from rlctl.stages.advantage import check_config
    from rlctl.tool_turns import check_tool
    from rlctl.trainer import check_update_config

    for flag, stage in (("--from", from_stage), ("--until", until_stage)):
        if stage is not None and stage not in STAGES:
            raise ConfigError(f"{flag} {stage!r}: unknown stage; stages are {', '.join(STAGES)}")
    if from_stage and until_stage and STAGES.index(from_stage) > STAGES.index(until_stage):
        raise ConfigError(f"--from {from_stage} comes after --until {until_stage}")
    if not cfg.data.prompts:
        raise ConfigError("data.prompts is not set: the pipeline needs a prompt file or folder")
    if not cfg.model.path and not cfg.model.init_preset:
        raise ConfigError("set model.path (a model folder) or model.init_preset (tiny|small|medium) to make one")
    check_config(cfg.advantage)
    check_tool(cfg.rollout.tool, cfg.rollout.stop)
    if cfg.pipeline.val_before_train and not cfg.data.val_prompts:
        raise ConfigError("pipeline.val_before_train validates the initial weights on data.val_prompts: set it")
    if cfg.pipeline.keep_best.startswith("val/") and not (cfg.data.val_prompts and cfg.pipeline.val_every):
        raise ConfigError(f"pipeline.keep_best = {cfg.pipeline.keep_best!r} is measured by validation: set data.val_prompts and pipeline.val_every")
    check_loggers(cfg.pipeline.loggers)
    for section in WARM_STARTS:
        if getattr(cfg, section).data and getattr(cfg, section).lora.r:
            raise ConfigError(
                f"{section}.data: the pipeline's warm start trains every weight ({section}.lora.r = 0): for LoRA, run `rlctl {section}` and `rlctl reshard --merge-lora` first"
            )
    if cfg.score.old_logprobs == "update" and not one_step_on_policy(cfg):
        raise ConfigError("score.old_logprobs = \"update\" needs one optimizer step per batch (update.epochs = 1, one mini-batch)")
    if cfg.score.old_logprobs == "update" and kl_in_reward(cfg):
        raise ConfigError("score.old_logprobs = \"update\" leaves the advantage's KL in the reward without the policy's log-probs: use recompute, or the KL as a loss")
    ESTIMATORS.get(cfg.advantage.estimator)
    if cfg.advantage.kl_coef > 0 and not cfg.model.ref:
        raise ConfigError("advantage.kl_coef > 0 needs a reference model: set model.ref")
    if cfg.update.use_kl_loss and not cfg.model.ref:
        raise ConfigError("update.use_kl_loss needs a reference model: set model.ref")
    if cfg.pipeline.ref_sync_every and not cfg.model.ref:
        raise ConfigError("pipeline.ref_sync_every moves the reference model towards the policy: set model.ref")
    if cfg.pipeline.ref_sync_every and cfg.update.lora.r:
        raise ConfigError("pipeline.ref_sync_every mixes the policy's full weights into the reference: with update.lora.r the checkpoints hold only the adapter")
    if cfg.update.critic_warmup and not cfg.model.critic:
        raise ConfigError("update.critic_warmup trains only the critic for its steps: set model.critic")
    if cfg.advantage.estimator in NEEDS_VALUES and not cfg.model.critic:
        raise ConfigError(f"estimator {cfg.advantage.estimator} needs a critic: set model.critic")
    if cfg.advantage.estimator in NEEDS_PAIRS:
        if not cfg.model.ref:
            raise ConfigError(f"estimator {cfg.advantage.estimator} compares the policy's pairs with a reference: set model.ref (\"policy\": the starting weights)")
        if cfg.rollout.n < 2:
            raise ConfigError(f"estimator {cfg.advantage.estimator} makes a pair of each prompt's best and worst sample: set rollout.n ≥ 2")
        if cfg.advantage.kl_coef > 0:
            raise ConfigError(f"estimator {cfg.advantage.estimator} holds the policy to the reference through advantage.dpo_beta: set advantage.kl_coef = 0")
    if cfg.advantage.estimator in NEEDS_COMPONENTS and len(cfg.score.rewards) < 2:
        raise ConfigError(f"estimator {cfg.advantage.estimator} normalizes each of several rewards on its own: set score.rewards to two or more")
    if cfg.advantage.estimator in NEEDS_BASELINES and not cfg.rollout.greedy_baseline:
        raise ConfigError(f"estimator {cfg.advantage.estimator} needs each prompt's greedy reward: set rollout.greedy_baseline = true")
    if cfg.update.rollout_is != "off" and cfg.update.rollout_is_batch_normalize and old_logprobs_source(cfg) == "update":
        raise ConfigError("update.rollout_is_batch_normalize needs the whole batch's weights before the update: set score.old_logprobs = recompute (or auto), not update")
    if cfg.score.sum_pi_squared and old_logprobs_source(cfg) != "recompute":
        reader = f"estimator {cfg.advantage.estimator} reads" if cfg.advantage.estimator in NEEDS_SUM_PI_SQUARED else "score.sum_pi_squared writes"
        raise ConfigError(
            f"{reader} each token's Σπ² from the policy's forward that recomputes the old log-probs: with score.old_logprobs = {cfg.score.old_logprobs} "
            "there is none; set it to recompute (or auto)"
        )
    if cfg.update.rollout_rs != "off" and old_logprobs_source(cfg) != "recompute":
        raise ConfigError(
            f"update.rollout_rs compares the trainer's old log-probs with the engine's: with score.old_logprobs = {cfg.score.old_logprobs} "
            "there is nothing to compare; set it to recompute (or auto)"
        )
    if cfg.data.batch_size < 1 or cfg.rollout.n < 1 or cfg.pipeline.iterations < 1:
        raise ConfigError("data.batch_size, rollout.n and pipeline.iterations must be at least 1")
    check_update_config(cfg.update, cfg.data.batch_size * cfg.rollout.n)
    compiled_layers.check_compile(cfg.update.compile, models_device(cfg.model.device, cfg.workers))
    if cfg.rollout.backend == "vllm":
        from rlctl.backends.base import sampling_params
        from rlctl.backends.vllm_engine import logprobs_mode, require_vllm

        require_vllm()
        logprobs_mode(sampling_params(cfg.rollout))
    if cfg.rollout.temperature <= 0:
        raise ConfigError("rollout.temperature must be > 0 for training rollouts (validation is greedy unless pipeline.val_temperature)")
    if cfg.pipeline.val_n > 1 and cfg.pipeline.val_temperature == 0:
        raise ConfigError(f"pipeline.val_n = {cfg.pipeline.val_n} with val_temperature = 0: greedy samples of a prompt are all alike; set pipeline.val_temperature (e.g. 0.6)")
    if cfg.pipeline.dynamic_sampling and cfg.rollout.n < 2:
        raise ConfigError("pipeline.dynamic_sampling keeps groups whose rewards differ: it needs rollout.n ≥ 2")
    if cfg.workers.backend == "ray" and cfg.workers.address not in ("", "auto"):
        from rlctl.workers.ray import check_reachable

        check_reachable(cfg.workers.address)


def select_prompts(
    dataset: pa.Table, *, iteration: int, batch_size: int, shuffle: bool, seed: int, start: int | None = None, retired: Mapping[str, int] | None = None,
) -> pa.Table:
    """The prompts of `iteration` (1-based): consecutive slices of a stream of epochs, each
    epoch a seeded permutation of the prompts in play (all but the `retired` ids, each mapped
    to the first epoch without it: rlctl.prompt_stream); `start` (a position in that stream)
    overrides the slice, for dynamic sampling's extra rounds. A pure function of its arguments."""
    start = (iteration - 1) * batch_size if start is None else start
    rows = prompt_stream(dataset, shuffle=shuffle, seed=seed, retired=retired).rows(start, batch_size)
    return dataset.take(pa.array(rows, pa.int64()))


def prompt_stream(dataset: pa.Table, *, shuffle: bool, seed: int, retired: Mapping[str, int] | None) -> PromptStream:
    return PromptStream(retirement_epochs(dataset.column("id"), retired), seed=seed, shuffle=shuffle)


class Pipeline:
    """One RL run: `step()` runs the next iteration and returns its metrics; `run()` runs all."""

    def __init__(
        self, cfg: Config, *, run_dir: str | Path | None = None, reward_fn: Callable | None = None,
        view=None, from_stage: str | None = None, until_stage: str | None = None, base_dir: Path | None = None,
        resume_with_changes: bool = False,
    ) -> None:
        self.run_dir = Path(run_dir or cfg.pipeline.run_dir)
        cfg = resolve_model_paths(paths_relative_to(cfg, base_dir), self.run_dir)
        recorded = recorded_config(self.run_dir)
        cfg = resolve_estimator_inputs(resolve_pass_tokens(resolve_dtypes(cfg, recorded), recorded))
        validate(cfg, from_stage=from_stage, until_stage=until_stage)
        self.config_changes = check_resume_config(self.run_dir, cfg, allow=resume_with_changes)
        self.cfg = cfg
        self.from_stage, self.until_stage = from_stage, until_stage
        # a reward model the run trains is loaded once trained (before iteration 1's score)
        self._reward_fn = reward_fn
        # on a Ray group its ranks hold the rm: models, loaded with it (when the run first needs a model)
        self._scorers = held_reward_models(cfg.score, cfg.workers) if reward_fn is None else {}
        held_later = (cfg.reward_model.data or self._scorers) and reward_fn is None
        self._reward: RewardSet | None = None if held_later else load_rewards(cfg.score, device=cfg.model.device, reward_fn=reward_fn)
        dataset = read(cfg.data.prompts, "prompts")
        self.dataset, self.dataset_ref = dataset.table, shards_ref(dataset)
        self.val_dataset = read(cfg.data.val_prompts, "prompts").table if cfg.data.val_prompts else None
        for table, source in ((self.dataset, cfg.data.prompts), (self.val_dataset, cfg.data.val_prompts)):
            checked_shapes(table, cfg.data, source)
        self._run_lock = None
        self._loggers: Loggers | None = None
        self._governor: ThreadGovernor | None = None
        self.view = view
        self._workers = None
        self._warm_started = self._reward_model_trained = False
        self._stepped = False  # --from/--until shape only the first iteration of this run
        self._findings_said: set[str] = set()
        checkpoint = latest_checkpoint(self.run_dir)
        self.checkpoint = checkpoint
        state = _pipeline_state(checkpoint) if checkpoint else {}
        self.iteration = int(state.get("iteration", 0))
        self.checkpoint_iteration = self.iteration if checkpoint else None
        self.kl_state = KLControllerState(float(state.get("kl_coef", cfg.advantage.kl_coef)), int(state.get("kl_steps", 0)))
        self.history: list[dict] = list(state.get("history", []))
        self.ref_sync = RefSync(cfg.pipeline.ref_sync_every, cfg.pipeline.ref_sync_alpha)
        self._recorded_ref = state.get("ref_source") if self.ref_sync.every else None  # the reference of the checkpoint's iteration
        self._ref_source: str | None = None  # the reference the next iteration scores with (made on first use)
        if self.ref_sync.every and checkpoint is None:
            start = initial_policy(cfg, self.run_dir)
            if all(Path(folder, "config.json").exists() for folder in (start, cfg.model.ref)):
                check_mixable(start, cfg.model.ref)  # before the run folder is made (else when the workers load)
        self.config_changes_before: list = list(state.get("config_changes", []))
        self.checkpoint_iteration_at_start = self.iteration
        # where the next iteration's prompts start in the prompt stream (dynamic sampling's extra rounds move it on)
        self.stream_position = int(state.get("stream_position", self.iteration * cfg.data.batch_size))
        # data.retire_pass_rate: prompt id → the first epoch without it
        self.retired_prompts: dict[str, int] = {str(k): int(v) for k, v in state.get("retired_prompts", {}).items()}
        self.prompts_exhausted = False  # the last iteration retired the last prompts in play: run() ends
        self._started = time.monotonic()  # pipeline.time_limit counts from here
        self._save_seconds = 0.0  # how long the last checkpoint took to save

    # -- construction ----------------------------------------------------------------

    @classmethod
    def from_config(cls, source: str | Path | dict, overrides: list[str] | None = None, **kwargs) -> Pipeline:
        """From a TOML path or a dict of sections; `overrides` are `section.key=value`."""
        if isinstance(source, dict):
            cfg = apply_overrides(from_dict(source), overrides or [])
            return cls(cfg, **kwargs)
        path = Path(source)
        cfg = load_config(path, overrides or [])
        if not cfg.pipeline.run_dir or cfg.pipeline.run_dir == "runs/default":
            cfg = replace(cfg, pipeline=replace(cfg.pipeline, run_dir=str(Path("runs") / path.stem)))
        return cls(cfg, base_dir=path.parent, **kwargs)

    @property
    def workers(self):
        """The resident models, loaded on first use (once per run)."""
        if self._workers is None:
            from rlctl.workers import make_workers
            from rlctl.workers.local import checkpoint_sources

            self._initial_models()
            self._reward_model_ready()  # before iteration 1, as the warm start
            policy, critic = checkpoint_sources(str(self.checkpoint) if self.checkpoint else None, self.cfg, initial_policy(self.cfg, self.run_dir))
            cfg = self.cfg
            if self.ref_sync.every:
                cfg = replace(cfg, model=replace(cfg.model, ref=self.reference_source))
                check_mixable(policy, cfg.model.ref)  # before any work, not at the first sync
            self._workers = make_workers(cfg, policy_source=policy, critic_source=critic, log_dir=self.run_dir / "logs" / "ray", scorers=self._scorers)
        return self._workers

    @property
    def reference_source(self) -> str:
        """The folder of the reference the next iteration scores with: model.ref until the
        first sync, then the newest RUN/refs/iter-NNNN (made again on resume when the run
        stopped between a checkpoint and its sync)."""
        if self._ref_source is None:
            ref = self._recorded_ref or self.cfg.model.ref
            if self.checkpoint is not None and self.ref_sync.due(self.checkpoint_iteration or 0):
                ref = str(write_synced_reference(synced_ref_dir(self.run_dir, self.checkpoint_iteration), policy=self.checkpoint, ref=ref, alpha=self.ref_sync.alpha))
            self._ref_source = ref
        return self._ref_source

    @property
    def reward(self) -> RewardSet:
        """The score stage's rewards; a reward model the run trains (reward_model.data) is
        trained first, after the warm start when it starts from the initial policy."""
        if self._reward is None:
            self._reward_model_ready()
            held = self.workers.reward_model if self._scorers else None  # the group's ranks hold the rm: models
            self._reward = load_rewards(self.cfg.score, device=self.cfg.model.device, reward_models=held)
        return self._reward

    def _reward_model_ready(self) -> None:
        """The reward model the run trains (reward_model.data) trained, once."""
        if self.cfg.reward_model.data and not self._reward_model_trained:
            self._initial_models()
            self._train_reward_model()
            self._reward_model_trained = True

    @property
    def _reward_spec(self) -> str:
        """What the score stage's manifest records of the rewards, without loading them (a
        committed score's check need not start a Ray group)."""
        return self.reward.spec if self._reward_fn is not None else describe_rewards(self.cfg.score)

    @cached_property
    def reward_model_inputs(self) -> list[InputRef]:
        """The `rm:` folders the score stage reads, by manifest (or weights) digest: worked out
        once, after a reward model the run trains exists."""
        from rlctl.lineage import model_ref

        if self._reward_fn is not None:
            return []
        self._reward_model_ready()
        return [model_ref(folder) for folder in scoring_model_folders(self.cfg.score)]

    def _initial_models(self) -> None:
        """model.path made from model.init_preset when it does not exist, and the warm start run
        (both kept when done: a second call, or a resumed run, finds them)."""
        from rlctl.modelinit import init_model

        if not Path(self.cfg.model.path, "config.json").exists():
            if not self.cfg.model.init_preset:
                raise InputError(f"model {self.cfg.model.path!r} does not exist (set model.init_preset to create it)")
            init_model(self.cfg.model.path, self.cfg.model.init_preset, self.cfg.model.init_seed)
        if warm_starts(self.cfg) and not self._warm_started:
            self._warm_start()
            self._warm_started = True

    def _train_reward_model(self) -> None:
        """Train reward_model.base on reward_model.data into RUN/reward_model (`rlctl
        reward-model`); a committed one with the same inputs and settings is kept (resume)."""
        from rlctl import reward_model
        from rlctl.supervised import describe_epoch

        def report(row: dict) -> None:
            if self.view is not None:
                self.view.message(describe_epoch(row, "reward-model"))

        cfg = self.cfg
        reward_model.run(
            data=cfg.reward_model.data, val_data=cfg.reward_model.val_data or None, model=cfg.reward_model.base,
            out=str(self.run_dir / REWARD_MODEL_DIR), cfg=cfg, device=cfg.model.device, report=report,
        )

    def _warm_start(self) -> None:
        """Before iteration 1, each warm start in turn (`rlctl sft`, `dpo`, `kto`) on its
        section's data, from the weights the one before it left, into RUN/<name>; a committed
        folder with the same inputs and settings is kept (resume)."""
        from rlctl import dpo, kto, sft
        from rlctl.supervised import describe_epoch

        commands = {"sft": sft.run, "dpo": dpo.run, "kto": kto.run}
        cfg = self.cfg
        for name in warm_starts(cfg):
            section = getattr(cfg, name)

            def report(row: dict, command: str = name) -> None:
                if self.view is not None:
                    self.view.message(describe_epoch(row, command))

            commands[name](
                data=section.data, val_data=section.val_data or None, model=warm_start_base(cfg, self.run_dir, name), out=str(self.run_dir / name),
                cfg=cfg, device=cfg.model.device, report=report,
            )

    # -- running ---------------------------------------------------------------------

    def run(self, iterations: int | None = None) -> list[dict]:
        total = iterations or self.cfg.pipeline.iterations
        rows = []
        took_lock = self._run_lock is None
        steps: list[float] = []  # seconds of each iteration this invocation ran
        try:
            while self.iteration < total:
                started = time.monotonic()
                row = self.step(total=total)
                steps.append(time.monotonic() - started)
                rows.append(row)
                if row.get("stopped_early") or self.prompts_exhausted:
                    break
                if self.iteration < total and self._out_of_time(steps):
                    break
        finally:
            if took_lock:
                self._release_lock()
        return rows

    def step(self, total: int | None = None) -> dict[str, Any]:
        """Run the next iteration; returns its metrics row (`reward_mean`, `kl_divergence`, ...)."""
        total = total or max(self.cfg.pipeline.iterations, self.iteration + 1)
        self._hold_run_lock()
        self._write_resolved_config()
        i = self.iteration + 1
        cfg, workers = self.cfg, self.workers
        if i == 1 and cfg.pipeline.val_before_train and self.val_dataset is not None:
            self._validate_before_training()
        timings: dict[str, float] = {}
        io = {"seconds": 0.0}
        first = not self._stepped
        stages = self._stages_to_run(first=first)
        self._stepped = True
        weights = workers.weights_digest()
        weights_source = self._weights_source(i)
        model_inputs = [InputRef("policy", weights)]
        if workers.critic is not None:
            model_inputs.append(InputRef("critic", workers.critic_digest()))
        if workers.ref is not None:
            ref = self.reference_source if self.ref_sync.every else cfg.model.ref
            model_inputs.append(InputRef(f"ref@{ref}", read_manifest(ref)[1] if ref != cfg.model.ref else "frozen"))
        base_state = {"iteration": i, "weights_source": weights_source, "policy_version": workers.trainer.step}
        if self.ref_sync.every:
            base_state["ref_source"] = self.reference_source  # replay scores with it

        def stage(name, config, inputs, compute, schema, write_parts=None, kind=None):
            rerun = first and self.from_stage is not None and (kind or name) in stages  # --from re-runs its stages
            return self._stage(i, name, config, inputs, compute, schema, stages, rerun, timings, io, base_state, write_parts, kind=kind)

        dynamic = cfg.pipeline.dynamic_sampling
        rounds: list[tuple[Shards, Shards]] = []  # (rollout, score) of each round
        for r in range(1, (cfg.pipeline.max_sampling_rounds if dynamic else 1) + 1):
            if r > 1 and not self._batch_left(self.stream_position + (r - 1) * cfg.data.batch_size, self.retired_prompts):
                break  # data.retire_pass_rate left too few prompts for another round: dropped groups fill the batch, as at the round cap
            _, rollout, score = self._sampling_round(i, r, stage, model_inputs)
            if score is None:
                return self._stop_early(i, timings)
            rounds.append((rollout, score))
            metric = cfg.pipeline.dynamic_sampling_metric
            if not dynamic or enough([group_metric(sc.table, metric) for _, sc in rounds], cfg.rollout.n, cfg.data.batch_size):
                break
        if dynamic:
            filter_config = {"n": cfg.rollout.n, "batch_prompts": cfg.data.batch_size, **({"metric": metric} if metric != "reward" else {})}
            score = stage(
                "filter", {"dynamic_sampling": filter_config}, [sc.ref() for _, sc in rounds],
                lambda: filtered_batch([sc.table for _, sc in rounds], cfg.rollout.n, cfg.data.batch_size, metric), "scores", kind="score",
            )
            rollout = score  # what is trained on: the metrics describe it
        kl_config = {"kl_coef": self.kl_state.kl_coef, "steps": self.kl_state.steps}
        advantage = stage(
            "advantage", {"advantage": to_dict(cfg.advantage), "kl_state": kl_config}, [score.ref()],
            lambda: self._advantage(score.table), "batch",
        )
        if advantage is None:
            return self._stop_early(i, timings)
        saved = advantage.manifest.state.get("kl_controller", kl_config)
        next_kl = KLControllerState(float(saved["kl_coef"]), int(saved["steps"]))
        if "update" not in stages:
            return self._stop_early(i, timings)
        update_manifest = make_manifest("update", {"update": to_dict(cfg.update)}, [advantage.ref(), *model_inputs], seed=cfg.update.seed)
        started = time.perf_counter()
        if self.view:
            self.view.stage("update", total=None)
        from rlctl.trainer import TrainBatch

        workers.pause_engine()
        compute_state = self._compute_state(self._fit_threads(), by_workers=True)
        train_metrics = {**workers.trainer.train(TrainBatch.from_table(advantage.table, own_old_logprobs=old_logprobs_source(cfg) == "update")), "torch_threads": _one_count(compute_state.get("torch_threads"))}
        timings["update"] = time.perf_counter() - started
        started = time.perf_counter()
        handover = workers.hand_over_weights()
        timings["handover"] = time.perf_counter() - started
        row = self._metrics_row(i, rollout.table, score.table, advantage.manifest.metrics, train_metrics, timings, io)
        if dynamic:
            row.update({f"dynamic_sampling/{k}": v for k, v in score.manifest.metrics.items()})
        row.update({key: handover[key] for key in ("weights_in_sync", "weight_sync_seconds") if key in handover})
        stream_end = self.stream_position + len(rounds) * cfg.data.batch_size
        retiring = self._retirements([sc.table for _, sc in rounds], stream_end)
        exhausted = not self._batch_left(stream_end, {**self.retired_prompts, **retiring})
        if cfg.data.retire_pass_rate:
            row.update({"prompts_retired": len(self.retired_prompts) + len(retiring), "prompts_retired_now": len(retiring)})
        saving = (cfg.pipeline.save_every and i % cfg.pipeline.save_every == 0) or i == total or exhausted
        if cfg.pipeline.val_every and self.val_dataset is not None and i % cfg.pipeline.val_every == 0:
            row.update(self._validate(i, weights_kept=saving or bool(cfg.pipeline.keep_best)))  # a better score saves one
        saving = saving or self._betters_the_best(row)
        syncing = self.ref_sync.due(i)  # mixed from the checkpoint: one is saved
        saving = saving or syncing
        if self.ref_sync.every:
            row["ref_syncs"] = i // self.ref_sync.every  # with this iteration's, if it syncs
        update_manifest.metrics = row
        update_manifest.state = {
            **base_state, **compute_state, "handover": handover, "policy_version_after": workers.trainer.step, "train_metrics": train_metrics,
        }
        self._commit_manifest(self._dir(i, "update"), update_manifest)
        faults.point(f"iter-{i:04d}:after-update")
        self.history.append(row)
        self.kl_state = next_kl
        self.iteration = i
        self.stream_position += len(rounds) * cfg.data.batch_size
        self.retired_prompts.update(retiring)
        self.prompts_exhausted = exhausted
        if saving:
            self._save_checkpoint(i)
        faults.point(f"iter-{i:04d}:after-checkpoint")
        if syncing:
            self._sync_reference(i)
        self._write_metrics()
        self._trackers().log(row)
        completions = drawn_completions(advantage.table, cfg.pipeline.log_completions, seed=cfg.pipeline.seed, iteration=i)
        self._trackers().log_completions(completions, i)
        self._prune(i)
        if syncing or (self.ref_sync.every and cfg.pipeline.keep_shards):
            prune_references(self.run_dir, current=self.reference_source)
        if self.view:
            self.view.iteration_done(row, total)
            if completions:
                self.view.completions(i, completions)
            self._say_new_findings()
            if exhausted:
                self.view.message(
                    f"rlctl: iteration {i}: the training prompts left in play are fewer than a batch (data.retire_pass_rate = {cfg.data.retire_pass_rate:g} "
                    "retired the others: the policy passes them); the run ends here, checkpointed"
                )
        return row

    def _out_of_time(self, steps: list[float]) -> bool:
        """pipeline.time_limit: would the next iteration (as long as the longest since the first,
        which also loads the models) end past it? Then the last one is checkpointed (if it was
        not) and the run stops there, to resume with the same command."""
        limit = parse_duration(self.cfg.pipeline.time_limit) if self.cfg.pipeline.time_limit else None
        if limit is None:
            return False
        elapsed = time.monotonic() - self._started
        next_step = max(steps[1:] or steps)
        unsaved = self.checkpoint_iteration != self.iteration
        if elapsed + next_step + (self._save_seconds if unsaved else 0.0) <= limit:
            return False
        if unsaved:
            self._save_checkpoint(self.iteration)
        if self.view:
            self.view.message(
                f"rlctl: iteration {self.iteration}: stopping within pipeline.time_limit = {self.cfg.pipeline.time_limit} "
                f"({describe_duration(elapsed)} gone, an iteration takes up to {describe_duration(next_step)}); checkpointed: the same command resumes here"
            )
        return True

    def _retirements(self, scores: list[pa.Table], stream_end: int) -> dict[str, int]:
        """data.retire_pass_rate: the prompts this iteration's samples (every round's) retire,
        each from the first epoch that begins after the iteration's last drawn prompt."""
        data = self.cfg.data
        if not data.retire_pass_rate:
            return {}
        epoch, _ = self._prompt_stream(self.retired_prompts).locate(stream_end - 1)
        return newly_retired(self.retired_prompts, pass_rates(scores, data.pass_threshold), pass_rate=data.retire_pass_rate, from_epoch=epoch + 1)

    def _batch_left(self, start: int, retired: Mapping[str, int]) -> bool:
        """Whether a batch can be drawn from stream position `start` (always, unless
        data.retire_pass_rate has retired the prompts a batch needs)."""
        return not self.cfg.data.retire_pass_rate or self._prompt_stream(retired).holds(start + self.cfg.data.batch_size - 1)

    def _prompt_stream(self, retired: Mapping[str, int]) -> PromptStream:
        return prompt_stream(self.training_prompts[0], shuffle=self.cfg.data.shuffle, seed=self.cfg.pipeline.seed, retired=retired)

    def _say_new_findings(self) -> None:
        """What the metrics suggest changing (rlctl.run_checks), each check the first time it
        fires in this process: once said, `rlctl show RUN` keeps the current state."""
        for finding in run_findings(self.history, self.cfg, self.run_dir):
            if finding.check not in self._findings_said:
                self._findings_said.add(finding.check)
                self.view.message(f"rlctl: {finding.message}")

    def _compute_state(self, threads: int | None, *, by_workers: bool) -> dict:
        """What a stage's last bits depend on besides its inputs, for its manifest: torch's
        threads (replay runs the stage at the same count) and MKL's kernels, of this process
        (`threads`: what _fit_threads set for local workers) or of the Ray ranks that compute
        it (`by_workers`; stages the controller computes record nothing then)."""
        if threads is not None:
            return {"torch_threads": threads, "mkl_kernels": mkl_kernels.recorded()}
        return dict(getattr(self.workers, "compute_state", {})) if by_workers else {}

    def _fit_threads(self) -> int | None:
        """Before a stage: torch's threads = `workers.threads`, or (0) the CPUs other processes
        left free (local workers; a Ray worker's are its cpus_per_worker)."""
        if self.cfg.workers.backend != "local":
            return None
        if self._governor is None:
            self._governor = ThreadGovernor(self.cfg.workers.threads)
        return self._governor.adjust()

    def _trackers(self) -> Loggers:
        """The `pipeline.loggers` beyond metrics.jsonl, opened at the first iteration run."""
        if self._loggers is None:
            self._loggers = Loggers(self.cfg.pipeline.loggers, run_dir=self.run_dir, config=to_dict(self.cfg), settings=self.cfg.pipeline)
        return self._loggers

    def _sampling_round(self, i: int, r: int, stage, model_inputs):
        """Prompts, rollout and score of round `r` of iteration `i` (round 1: the iteration's own
        folders; later rounds of dynamic sampling: `prompts-rN`, `rollout-rN`, `score-rN`, on the
        next prompts of the stream and their own sampling seed)."""
        cfg = self.cfg
        suffix = "" if r == 1 else f"-r{r}"
        start = self.stream_position + (r - 1) * cfg.data.batch_size
        prompts_config = {"data": to_dict(cfg.data), "seed": cfg.pipeline.seed}
        if cfg.pipeline.dynamic_sampling:
            prompts_config["stream_start"] = start
        retired = dict(self.retired_prompts) if cfg.data.retire_pass_rate else None
        if retired:
            prompts_config["retired"] = {"prompts": len(retired), "digest": retired_digest(retired)}
        dataset, limit = self.training_prompts
        prompts = stage(
            "prompts" + suffix, prompts_config, [self.dataset_ref],
            lambda: (select_prompts(dataset, iteration=i, batch_size=cfg.data.batch_size, shuffle=cfg.data.shuffle, seed=cfg.pipeline.seed, start=start, retired=retired),
                     {"stream_start": start, **({"prompt_token_limit": limit} if limit is not None else {}), **({"retired_prompts": retired} if retired else {})}, {}),
            "prompts", kind="prompts",
        )
        rollout_cfg = replace(cfg.rollout, seed=cfg.rollout.seed + i + ROUND_SEED_STRIDE * (r - 1))
        rollout = stage(
            "rollout" + suffix, rollout_stage_config(rollout_cfg, cfg.data, cfg.vllm), [prompts.ref(), model_inputs[0]],
            lambda: _with_stats(self._rollout(prompts.table, rollout_cfg), rollout_stats), "rollouts",
            write_parts=self._rollout_parts(prompts.table, rollout_cfg), kind="rollout",
        )
        if rollout is None:
            return prompts, None, None
        score = stage(
            "score" + suffix, {"score": to_dict(cfg.score), "reward": self._reward_spec, "old_logprobs": old_logprobs_source(cfg)}, [rollout.ref(), *model_inputs, *self.reward_model_inputs],
            lambda: _with_stats(self._score(rollout.table), reward_stats), "scores",
            write_parts=self._score_parts(rollout.table), kind="score",
        )
        return prompts, rollout, score

    def _hold_run_lock(self) -> None:
        """One pipeline per run folder: the lock is held from the first step until close()."""
        if self._run_lock is None:
            from rlctl.locks import FolderLock

            self.run_dir.mkdir(parents=True, exist_ok=True)
            fs, path = filesystem(str(self.run_dir))
            self._run_lock = FolderLock.acquire(fs, path, what="pipeline run")

    def close(self) -> None:
        """Stop the workers (a Ray group's processes) and release the run folder."""
        workers = getattr(self, "_workers", None)
        if workers is not None:
            workers.close()
            self._workers = None
        if getattr(self, "_loggers", None) is not None:
            self._loggers.close()
            self._loggers = None
        if getattr(self, "_governor", None) is not None:
            self._governor.restore()
            self._governor = None
        self._release_lock()

    def _release_lock(self) -> None:
        lock = getattr(self, "_run_lock", None)  # None too when __init__ failed early
        if lock is not None:
            lock.release()
            self._run_lock = None

    def __enter__(self) -> Pipeline:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self) -> None:
        self.close()

    def _warm_start_plan(self) -> list[str]:
        """The plan's line for each warm start: what it trains, on what, and how."""
        cfg, names = self.cfg, warm_starts(self.cfg)
        how = {
            "sft": lambda: f"fine-tuned on {cfg.sft.data}",
            "dpo": lambda: f"trained on the pairs {cfg.dpo.data} (DPO, {cfg.dpo.loss} loss, beta {cfg.dpo.beta:g}{', no reference' if cfg.dpo.reference_free else ''}{moving_reference_plan(cfg.dpo)})",
            "kto": lambda: f"trained on the labelled examples {cfg.kto.data} (KTO, beta {cfg.kto.beta:g}{moving_reference_plan(cfg.kto)})",
        }
        lines = []
        for name in names:
            section = getattr(cfg, name)
            last = " (the initial policy: model.ref/critic = \"policy\" mean it)" if name == names[-1] else ""
            lines.append(
                f"warm start    {self.run_dir / name}: {warm_start_base(cfg, self.run_dir, name)} {how[name]()}, "
                f"{section.epochs} epoch(s) at lr {section.lr:g}, before iteration 1{last}"
            )
        return lines

    def plan(self) -> str:
        """What a run would do: iterations, stages, models, outputs, and what is already done."""
        cfg, total = self.cfg, self.cfg.pipeline.iterations
        first = self.iteration + 1
        lines = [
            f"run folder    {self.run_dir}",
            f"resume from   {self.checkpoint or 'the start (no committed checkpoint)'}",
            f"iterations    {first}..{total} of {total}" if first <= total else f"iterations    none left ({total} done)",
            f"stages        {' → '.join(self._stages_to_run())} → hand-over ({describe_handover(cfg)})",
            f"policy        {cfg.model.path}{' (created: ' + cfg.model.init_preset + ')' if not Path(cfg.model.path, 'config.json').exists() else ''}",
            *self._warm_start_plan(),
            *([f"training      LoRA adapters r={cfg.update.lora.r}, alpha={cfg.update.lora.alpha:g} on {', '.join(cfg.update.lora.target_modules)}; "
               "checkpoints hold the adapter (reshard --merge-lora)"] if cfg.update.lora.r else []),
            f"reference     {cfg.model.ref or '-'}{' (the policy base with its adapters disabled, if it is that folder)' if cfg.update.lora.r and cfg.model.ref else ''}"
            + (f"; {describe_ref_sync(self.ref_sync, self.run_dir)}" if self.ref_sync.every else ""),
            f"critic        {cfg.model.critic or '-'}",
            f"workers       {describe_workers(cfg)}",
            *([f"reward model  {self.run_dir / REWARD_MODEL_DIR}: trained on {cfg.reward_model.data} from {cfg.reward_model.base}, "
               f"{cfg.reward_model.epochs} epoch(s) at lr {cfg.reward_model.lr:g}, before iteration 1"] if cfg.reward_model.data else []),
            f"reward        {self._reward.spec if self._reward is not None else describe_rewards(cfg.score)}"
            + (" (a replica on every Ray rank, each scoring its share)" if self._scorers else ""),
            f"prompts       {cfg.data.prompts} ({self.dataset.num_rows} rows, {cfg.data.batch_size} per iteration × n={cfg.rollout.n}"
            + (" and a greedy response each: the baseline, not trained on)" if cfg.rollout.greedy_baseline else ")")
            + (f"; a prompt whose samples pass (reward ≥ {cfg.data.pass_threshold:g}) at a rate ≥ {cfg.data.retire_pass_rate:g} is retired from the epochs after"
               f" ({len(self.retired_prompts)} retired so far)" if cfg.data.retire_pass_rate else ""),
            f"outputs       {self.run_dir}/iter-NNNN/{{prompts,rollout,score,{'filter,' if cfg.pipeline.dynamic_sampling else ''}advantage,update}}, metrics.jsonl",
            *([f"sampling      dynamic: groups with equal rewards dropped, up to {cfg.pipeline.max_sampling_rounds} rounds (prompts-rN, rollout-rN, score-rN)"]
              if cfg.pipeline.dynamic_sampling else []),
            f"algorithm     {describe_algorithm(cfg)}",
            f"optimizer     AdamW, {describe_schedule(cfg.update, cfg.data.batch_size * cfg.rollout.n)}",
            *([f"correction    {describe_correction(cfg)}"] if cfg.update.rollout_is != "off" or cfg.update.rollout_rs != "off" else []),
            f"checkpoints   {self.run_dir}/checkpoints/ every {cfg.pipeline.save_every or 'run end'}, keep {cfg.pipeline.keep_checkpoints or 'all'}",
            *([f"time limit    {cfg.pipeline.time_limit}: when the next iteration would end past it, checkpoint and stop (the same command resumes)"]
              if cfg.pipeline.time_limit else []),
        ]
        committed = [
            f"iter-{i:04d}/{name}" for i in range(first, total + 1) for name in ("prompts", *STAGES) if is_committed(str(self._dir(i, name)))
        ]
        lines.append("would reuse   " + (", ".join(committed) + " (when their keys still match)" if committed else "nothing (no committed stage after the checkpoint)"))
        return "\n".join(lines)

    def _weights_source(self, i: int) -> str | None:
        """A folder holding exactly the weights iteration `i` starts from, if one is on disk."""
        if self.checkpoint is not None and self.checkpoint_iteration == i - 1:
            return str(self.checkpoint)
        return initial_policy(self.cfg, self.run_dir) if i == 1 else None

    # -- stages ----------------------------------------------------------------------

    def _stages_to_run(self, first: bool = True) -> tuple[str, ...]:
        """Stages of an iteration: --from/--until cut only the first one this run executes."""
        if not first:
            return STAGES
        start = STAGES.index(self.from_stage) if self.from_stage else 0
        last = STAGES.index(self.until_stage) if self.until_stage else len(STAGES) - 1
        return STAGES[start : last + 1]

    def _stage(self, i, name, config, inputs, compute, schema, stages, rerun, timings, io, base_state, write_parts=None, kind=None) -> Shards | None:
        """Read back a committed output with the same key, or compute and commit it. With
        `write_parts(uri, manifest)` the workers write the parts and it commits; the controller
        then reads the committed (verified) output back."""
        uri = str(self._dir(i, name))
        manifest = make_manifest(name, config, inputs, seed=config.get("rollout", {}).get("seed"))
        if is_committed(uri):
            existing, digest = read_manifest(uri)
            if existing.key == manifest.key and not rerun:
                started = time.perf_counter()
                try:
                    shards = read(uri, schema)  # verified against its manifest
                except InputError as exc:
                    notice(f"rlctl: {uri} is committed but damaged ({exc}); recomputing it")
                else:
                    io["seconds"] += time.perf_counter() - started
                    timings[name] = 0.0
                    return shards
        kind = kind or name  # dynamic sampling's round and filter folders count as their stage
        if kind != "prompts" and kind not in stages:
            if STAGES.index(kind) < STAGES.index(stages[0]):
                raise InputError(f"iteration {i}: stage {name} is not committed with the current config, so --from {stages[0]} cannot start there")
            return None
        if self.view:
            self.view.stage(name, total=None)
        base_state = {**base_state, **self._compute_state(self._fit_threads(), by_workers=write_parts is not None)}
        started = time.perf_counter()
        if write_parts is not None:
            manifest.state = dict(base_state)
            write_parts(uri, manifest)
            timings[name] = time.perf_counter() - started
            started = time.perf_counter()
            shards = read(uri, schema)
            io["seconds"] += time.perf_counter() - started
            return shards
        table, state, metrics = compute()
        timings[name] = time.perf_counter() - started
        manifest.state = {**base_state, **state}
        manifest.metrics = metrics
        started = time.perf_counter()
        write(table, uri, manifest, schema=schema)
        _, digest = read_manifest(uri)
        io["seconds"] += time.perf_counter() - started
        return Shards(table, uri, manifest, digest)

    @cached_property
    def training_prompts(self) -> tuple[pa.Table, int | None]:
        """The prompts the iterations draw from, and with data.truncate = "drop" the token limit
        whose over-long prompts were left out (verl's filter_overlong_prompts: before the draw,
        so every batch is full); once per run, with the rollout engine's tokenizer."""
        return self._fitting(self.dataset)

    @cached_property
    def validation_prompts(self) -> pa.Table | None:
        return None if self.val_dataset is None else self._fitting(self.val_dataset)[0]

    def _fitting(self, table: pa.Table) -> tuple[pa.Table, int | None]:
        from rlctl.stages.rollout import fitting_prompts, prompt_limit

        if self.cfg.data.truncate != "drop":
            return table, None
        engine, max_new_tokens = self.workers.engine, self.cfg.rollout.max_new_tokens
        kept, _ = fitting_prompts(table, engine.tokenizer, self.cfg.data, context_length=engine.context_length, max_new_tokens=max_new_tokens)
        return kept, prompt_limit(self.cfg.data, engine.context_length, max_new_tokens)[0]

    def _rollout(self, prompts: pa.Table, rollout_cfg) -> pa.Table:
        from rlctl.stages.rollout import rollout_table

        total = prompts.num_rows * (rollout_cfg.n + rollout_cfg.greedy_baseline) * rollout_cfg.max_new_tokens
        if self.view:
            self.view.stage("rollout", total=total)
        on_tokens = self.view.advance if self.view else None
        return rollout_table(prompts, self.workers.engine, rollout_cfg, self.cfg.data, policy_version=self.workers.trainer.step, on_tokens=on_tokens)

    def _rollout_parts(self, prompts: pa.Table, rollout_cfg):
        from rlctl.stages.rollout import rollout_parts_on_workers

        return self._written_by_workers("rollout", lambda out, manifest: rollout_parts_on_workers(
            self.workers, prompts, rollout_cfg, self.cfg.data, self.workers.trainer.step, out, manifest))

    def _written_by_workers(self, name: str, write):
        """`write_parts(uri, manifest)` for a stage whose output the workers write themselves
        (a Ray group: `write(out, manifest)` commits it), or None for local workers."""
        if not getattr(self.workers, "writes_parts", False):
            return None
        from rlctl.shards import OutputSpec

        def write_parts(uri: str, manifest: Manifest) -> Manifest:
            if self.view:
                self.view.stage(name, total=None)
            return write(OutputSpec(uri), manifest)

        return write_parts

    def _scoring_models(self):
        from rlctl.stages.score import ScoringModels

        w = self.workers
        return ScoringModels(ref=w.ref, policy=w.policy if old_logprobs_source(self.cfg) == "recompute" else None, critic=w.critic)

    def _score(self, rollouts: pa.Table) -> pa.Table:
        from rlctl.stages.score import score_table

        return score_table(rollouts, self.reward, self._scoring_models(), self.cfg.score)

    def _score_parts(self, rollouts: pa.Table):
        from rlctl.stages.score import score_parts_on_workers

        return self._written_by_workers("score", lambda out, manifest: score_parts_on_workers(
            self.workers, rollouts, self.reward, self._scoring_models(), self.cfg.score, out, manifest))

    def _advantage(self, scores: pa.Table):
        from rlctl.stages.advantage import advantage_table

        table, next_state, stats = advantage_table(scores, self.cfg.advantage, self.kl_state)
        return table, {"kl_controller": {"kl_coef": next_state.kl_coef, "steps": next_state.steps}}, stats

    def _validate(self, i: int, *, weights_kept: bool, weights_source: str | None = None) -> dict[str, float]:
        """Rollouts on the held-out prompts — greedy, or `pipeline.val_n` samples each at
        `pipeline.val_temperature` from the same seed every time, so iterations compare —
        scored with the same reward. Its manifest names the checkpoint about to hold these
        weights (`weights_kept`: this iteration saves one), or `weights_source` (the initial
        weights, validated before training), so `rlctl replay` can re-run it."""
        from rlctl.evaluate import known_answers
        from rlctl.stages.rollout import rollout_table
        from rlctl.stages.score import ScoringModels, score_table

        settings = self.cfg.pipeline
        compute_state = self._compute_state(self._fit_threads(), by_workers=True)  # the threads it runs at, for replay
        sampling = replace(self.cfg.rollout, n=settings.val_n, temperature=settings.val_temperature, seed=0, greedy_baseline=False)
        table = rollout_table(self.validation_prompts, self.workers.engine, sampling, self.cfg.data, policy_version=self.workers.trainer.step)
        scored = score_table(table, self.reward, ScoringModels(), self.cfg.score)
        metrics = validation_metrics(scored, settings.val_n, known_answers(scored, self.reward.spec) if settings.val_n > 1 else None)
        state = {
            "iteration": i, "policy_version": self.workers.trainer.step, **compute_state,
            "weights_source": str(self.run_dir / "checkpoints" / f"iter-{i:04d}") if weights_kept else weights_source,
        }
        manifest = Manifest(stage="validate", config={"rollout": to_dict(sampling), "reward": self.reward.spec}, state=state, metrics=metrics)
        write(scored, str(self._dir(i, "val")), manifest, schema="scores")
        return metrics

    def _validate_before_training(self) -> None:
        """pipeline.val_before_train: the initial weights' validation, as iteration 0's row of
        the metrics (RUN/iter-0000/val), once per run (a resume before the first checkpoint
        validates again)."""
        if any(row["iteration"] == 0 for row in self.history):
            return
        if self.view:
            self.view.stage("validate", total=None)
        row = {"iteration": 0, **self._validate(0, weights_kept=False, weights_source=self._weights_source(1))}
        self.history.append(row)
        self._write_metrics()
        self._trackers().log(row)
        if self.view:
            self.view.message("before training: " + "  ".join(f"{k} {v:.4g}" for k, v in row.items() if k.startswith("val/") and "/" not in k[4:]))

    def _stop_early(self, i: int, timings: dict) -> dict:
        row = {"iteration": i, "stopped_early": True, **{f"seconds/{k}": v for k, v in timings.items()}}
        if self.view:
            self.view.message(f"iter {i}: stopped after --until {self.until_stage}")
        return row

    # -- metrics, checkpoints, files --------------------------------------------------

    def _metrics_row(self, i, rollouts: pa.Table, scores: pa.Table, adv_stats: dict, train: dict, timings: dict, io: dict) -> dict:
        tokens = int(list_lengths(rollouts.column("response_ids")).sum())
        rewards = np.asarray(scores.column("reward").to_pylist(), dtype=np.float64)
        kl = adv_stats.get("kl")  # None without a reference model: not recorded
        row: dict[str, Any] = {
            "iteration": i,
            "policy_version": int(train.get("step", 0)),
            "reward_mean": float(rewards.mean()),
            "reward_std": float(rewards.std()),
            "kl": kl,
            "kl_divergence": kl,
            "kl_coef": float(adv_stats.get("kl_coef", self.kl_state.kl_coef)),
            "entropy": train.get("entropy"),
            "pg_loss": train.get("pg_loss"),
            "vf_loss": train.get("vf_loss"),
            "pg_clipfrac": train.get("pg_clipfrac"),
            "pg_clipfrac_lower": train.get("pg_clipfrac_lower"),
            "ppo_kl": train.get("ppo_kl"),
            "grad_norm": train.get("grad_norm"),
            "lr": train.get("lr"),
            **rollout_stats(rollouts),
            **reward_stats(scores),
            "logprob_mismatch": _logprob_mismatch(scores) if "old_logprobs" in scores.column_names else train.get("logprob_mismatch"),  # "update": measured in the update
            **rollout_correction(scores, self.cfg.pipeline.rollout_is_threshold),
            "rollout_tokens_per_s": tokens / timings["rollout"] if timings.get("rollout") else None,
            "train_tokens_per_s": train.get("tokens_per_s"),
            "prompt_sharing": train.get("prompt_sharing"),
            "zero_advantage_skipped": train.get("zero_advantage_skipped"),  # share of the rows the update left out (rlctl.trainer.rows_with_gradient)
            **{k: train[k] for k in ("skipped_steps", "vf_skipped_steps") if k in train},  # optimizer steps left out for a non-finite gradient
            **({"critic_warmup": train["critic_warmup"]} if "critic_warmup" in train else {}),  # the share of steps that trained only the critic
            **({"truncated_masked": train["truncated_masked"]} if "truncated_masked" in train else {}),  # update.mask_truncated: the share of rows out of the loss
            **({"entropy_tokens_kept": train["entropy_tokens_kept"]} if "entropy_tokens_kept" in train else {}),  # update.top_entropy_quantile: the share of tokens in the policy gradient
            **{k: train[k] for k in ("off_policy_masked", "vespo_weight", "entropy_coef", "entropy_coef_applied", "entropy_advantage") if k in train},  # update.off_policy_mask: the share of tokens it left out; vespo: its mean weight φ; update.entropy_target: its coefficients
            **{k: train[k] for k in ("approx_kl", "kl_stopped_early", "optimizer_steps") if k in train},  # update.target_kl: its measure, whether it stopped the update, the steps made
            **{k: v for k, v in train.items() if k.startswith("rollout_rs/") or k == "rollout_is_batch_mean"},  # update.rollout_rs: the shares rejected; the IS weights' batch mean before normalizing
            **{k: v for k, v in adv_stats.items() if k.startswith(("pf_ppo/", "variance_proxy/", "dpo/"))},  # advantage.pf_ppo: the share of rows drawn, their mean reward; with Σπ²: the gradient's variance proxies; online_dpo: its pairs
            "torch_threads": train.get("torch_threads"),
            "seconds/io": io["seconds"],
            **reward_component_means(scores),
            **source_stats(scores),  # a mixed dataset: each data_source's reward and length
        }
        row.update({f"seconds/{k}": v for k, v in timings.items()})
        row["seconds/total"] = sum(timings.values()) + io["seconds"]
        return row

    def _betters_the_best(self, row: dict) -> bool:
        """Whether this iteration's row betters pipeline.keep_best's metric over every earlier
        row (its checkpoint is then saved, and kept)."""
        metric = self.cfg.pipeline.keep_best
        if not metric or not isinstance(row.get(metric), (int, float)):
            return False
        return best_iteration([*self.history, row], metric, self.cfg.pipeline.best_is) == row["iteration"]

    def _save_checkpoint(self, i: int) -> None:
        directory = self.run_dir / "checkpoints" / f"iter-{i:04d}"
        state = {"iteration": i, "kl_coef": self.kl_state.kl_coef, "kl_steps": self.kl_state.steps, "history": self.history, "stream_position": self.stream_position}
        if self.cfg.data.retire_pass_rate:
            state["retired_prompts"] = self.retired_prompts
        if self.ref_sync.every:
            state["ref_source"] = self.reference_source  # the reference of iteration i; a sync after it is made from this checkpoint
        if self.config_changes:  # --resume-with-changes: the change joins the record of the run
            state["config_changes"] = [*self.config_changes_before, {"from_iteration": self.checkpoint_iteration_at_start + 1, "changes": self.config_changes}]
        manifest = Manifest(stage="checkpoint", config={"iteration": i}, state={"policy_version": self.workers.trainer.step})
        started = time.monotonic()
        self.workers.save(str(directory), manifest, state)
        self._save_seconds = time.monotonic() - started
        self.checkpoint, self.checkpoint_iteration = directory, i
        keep, settings = self.cfg.pipeline.keep_checkpoints, self.cfg.pipeline
        best = best_iteration(self.history, settings.keep_best, settings.best_is) if settings.keep_best else None
        if keep > 0:
            for old in committed_checkpoints(self.run_dir)[:-keep]:
                if iteration_number(old) != best:  # pipeline.keep_best's stays
                    shutil.rmtree(old, ignore_errors=True)

    def _sync_reference(self, i: int) -> None:
        """The reference moved towards the policy just checkpointed, written to RUN/refs and
        loaded by the workers in place of the one before."""
        folder = str(write_synced_reference(synced_ref_dir(self.run_dir, i), policy=self.checkpoint, ref=self.reference_source, alpha=self.ref_sync.alpha))
        self.workers.load_reference(folder)
        self._ref_source = folder
        faults.point(f"iter-{i:04d}:after-ref-sync")

    def _prune(self, i: int) -> None:
        keep = self.cfg.pipeline.keep_shards
        if keep <= 0:
            return
        for old in range(1, i - keep + 1):
            folder = self.run_dir / f"iter-{old:04d}"
            for stage_dir in folder.iterdir() if folder.is_dir() else ():
                if stage_dir.name != "update":  # every stage output, dynamic sampling's rounds too; update is a manifest
                    shutil.rmtree(stage_dir, ignore_errors=True)

    def _write_metrics(self) -> None:
        rows = (json.dumps(strict_json_value(row), sort_keys=True, allow_nan=False) + "\n" for row in self.history)
        _atomic_write(self.run_dir / "metrics.jsonl", "".join(rows))

    def _write_resolved_config(self) -> None:
        self.run_dir.mkdir(parents=True, exist_ok=True)
        _atomic_write(self.run_dir / RESOLVED_CONFIG, to_toml(self.cfg))

    def _commit_manifest(self, folder: Path, manifest: Manifest) -> None:
        commit_empty(str(folder), manifest)

    def _dir(self, i: int, name: str) -> Path:
        return self.run_dir / f"iter-{i:04d}" / name


# --- helpers ---------------------------------------------------------------------------------


ROUND_SEED_STRIDE = 1_000_003  # dynamic sampling: round r of iteration i samples with seed + i + stride·(r-1)


def group_metric(scores: pa.Table, metric: str) -> list[float]:
    """The values of `pipeline.dynamic_sampling_metric` that must differ within a group: the
    `reward` column, or a `reward/...` one that every sample's reward reported as a number."""
    if metric not in scores.column_names:
        reported = sorted((name for name in scores.column_names if name == "reward" or name.startswith("reward/")), key=lambda name: (name != "reward", name))
        raise InputError(f"pipeline.dynamic_sampling_metric = {metric}: the scores have no such column (they have {', '.join(reported)})")
    column = scores.column(metric)
    if column.null_count or not (pa.types.is_floating(column.type) or pa.types.is_integer(column.type) or pa.types.is_boolean(column.type)):
        raise InputError(f"pipeline.dynamic_sampling_metric = {metric}: not a number for every sample ({column.type}, {column.null_count} missing)")
    return [float(value) for value in column.to_pylist()]


def filtered_batch(scores: list[pa.Table], n: int, batch_prompts: int, metric: str = "reward") -> tuple[pa.Table, dict, dict]:
    """The rows dynamic sampling trains on, from the rounds' score tables (rlctl.algos.sampling):
    the groups whose `metric` differs."""
    selection = select_groups([group_metric(t, metric) for t in scores], n, batch_prompts)
    parts = []
    for r, table in enumerate(scores):
        rows = [row for round_, row in selection.rows if round_ == r]
        if rows:
            parts.append(table.take(pa.array(rows, pa.int64())).replace_schema_metadata(scores[0].schema.metadata))
    table = pa.concat_tables(parts).combine_chunks()
    stats = {"groups_kept": selection.kept, "groups_dropped": selection.dropped, "groups_filled": selection.filled, "rounds": len(scores)}
    return table, {}, stats


def latest_checkpoint(run_dir: Path) -> Path | None:
    """The newest committed checkpoint that verifies; a damaged newer one is skipped, saying so."""
    from rlctl.checkpoint import is_intact

    damaged = []
    for candidate in reversed(committed_checkpoints(run_dir)):
        reason = is_intact(str(candidate))
        if reason is None:
            if damaged:
                notice(f"rlctl: resuming from {candidate.name}: {', '.join(damaged)} did not verify")
            return candidate
        notice(f"rlctl: checkpoint {candidate} is damaged: {reason}")
        damaged.append(candidate.name)
    if damaged:
        notice("rlctl: no intact checkpoint left; starting the run from its initial model")
    return None


def committed_checkpoints(run_dir: Path) -> list[Path]:
    """Checkpoint folders with a manifest, oldest first (numeric order)."""
    return [p for p in iteration_folders(run_dir / "checkpoints") if (p / MANIFEST_NAME).exists()]


def old_logprobs_source(cfg: Config) -> str:
    """Where the update's old log-probs come from: "rollout" (the engine's own), "recompute"
    (score's policy forward) or "update" (the update's own forward, detached, as TRL does).
    auto picks the cheapest exact one: the rollout's when the engine is the training module in
    fp32 and training is fp32 too (they are the trainer's to ~3e-7); the update's own when it
    makes one optimizer step on the batch and the advantage needs no policy log-probs (no KL in
    the reward): before that step the policy is the old policy; else a recompute — always with
    update.rollout_rs or rollout_is_batch_normalize, which need them before the update, and
    with score.sum_pi_squared, which comes from their forward. The
    dtypes must be decided (`resolve_dtypes`) before this is asked."""
    if cfg.score.old_logprobs != "auto":
        return cfg.score.old_logprobs
    if cfg.update.rollout_rs != "off" or (cfg.update.rollout_is != "off" and cfg.update.rollout_is_batch_normalize):
        return "recompute"  # rejection compares the trainer's old log-probs with the engine's; the normalizer is the whole batch's weights
    if cfg.score.sum_pi_squared:
        return "recompute"  # Σπ² comes from that forward (the optimal token baseline's)
    if cfg.rollout.backend == "hf" and cfg.rollout.dtype == "fp32" and cfg.update.bf16 == "false":
        return "rollout"
    return "update" if one_step_on_policy(cfg) and not kl_in_reward(cfg) else "recompute"


def one_step_on_policy(cfg: Config) -> bool:
    """Does the update make exactly one optimizer step on each batch (one epoch, one mini-batch)?"""
    batch = cfg.data.batch_size * cfg.rollout.n
    return cfg.update.epochs == 1 and cfg.update.mini_batch_size in (0, batch)


def kl_in_reward(cfg: Config) -> bool:
    """Does the advantage stage put a KL penalty (policy vs reference) into the reward?"""
    return cfg.advantage.kl_coef > 0


def describe_schedule(update: UpdateConfig, batch_size: int) -> str:
    """`lr 1e-06, 2 optimizer steps per iteration, cosine decay to 0.1× at step 60 (iteration 30)`."""
    from rlctl.trainer import optimizer_steps

    steps = optimizer_steps(update, batch_size)
    text = f"lr {update.lr:g}, {steps} optimizer step{'s' if steps > 1 else ''} per iteration"
    if update.warmup_steps:
        text += f", warm-up over {update.warmup_steps} steps"
    if update.lr_schedule != "constant":
        text += f", {update.lr_schedule} decay to {update.min_lr_ratio:g}× at step {update.decay_steps} (iteration {update.decay_steps / steps:g})"
    return text


def describe_workers(cfg: Config) -> str:
    w = cfg.workers
    if w.backend == "local":
        return "local (models in this process)"
    where = w.address or "an embedded Ray"
    kind = "NCCL" if w.gpus_per_worker else "gloo"
    own = [role for role, model in (("the reference", cfg.model.ref), ("the critic", cfg.model.critic)) if model] if w.placement == "split" else []
    pools = f" ({' and '.join(own)} in {'a pool' if len(own) == 1 else 'pools'} of {'its' if len(own) == 1 else 'their'} own: {len(own) + 1}× the ranks)" if own else ""
    return f"ray: {w.num_workers} × ({w.cpus_per_worker} CPU{', ' + format(w.gpus_per_worker, 'g') + ' GPU' if w.gpus_per_worker else ''}) on {where}, FSDP2 over {kind}{pools}"


# keys that do not change what is trained: how long, where, how often saved, how the models are held
NOT_TRAINING = {
    "pipeline": {
        "iterations", "run_dir", "save_every", "keep_checkpoints", "keep_best", "best_is", "keep_shards", "val_before_train", "val_every", "val_n", "val_temperature", "rollout_is_threshold",
        "loggers", "log_completions", "wandb_project", "wandb_mode", "mlflow_uri", "mlflow_experiment", "ignore_checks", "time_limit",
    },
    "model": {"device", "init_preset", "init_seed"}, "data": {"val_prompts"}, "workers": None, "vllm": None, "rollout": {"tool_timeout"},
    # the rollout's own log-probs or a recompute: the same numbers to ~3e-7 where auto picks the former; how passes are cut
    "score": {"old_logprobs", "batch_size", "batch_tokens", "http_batch_size"},
    # how passes are cut, compiled or not, rows of zero advantage left out or not: the same gradients to float rounding
    "update": {"micro_batch_tokens", "compile", "skip_zero_advantage"},
}


def training_config(cfg: Config) -> dict[str, Any]:
    """`section.key → value` of every key that shapes the training (see NOT_TRAINING)."""
    out = {}
    for section, values in to_dict(cfg).items():
        skip = NOT_TRAINING.get(section, set())
        if skip is None:
            continue
        out.update({f"{section}.{key}": value for key, value in values.items() if key not in skip})
    return out


def check_resume_config(run_dir: Path, cfg: Config, *, allow: bool) -> dict[str, list]:
    """A run folder with progress resumes with the config it started with: a change to a key
    that shapes the training is exit 2 with the changed keys, unless `allow`
    (`--resume-with-changes`); then the changes are returned, for the next checkpoint's record."""
    saved = run_dir / RESOLVED_CONFIG
    if not saved.exists() or not committed_checkpoints(run_dir):
        return {}
    before, after = training_config(load_config(saved)), training_config(cfg)
    changes = {key: [before.get(key), after.get(key)] for key in sorted(set(before) | set(after)) if before.get(key) != after.get(key)}
    if changes and not allow:
        shown = "; ".join(f"{k}: {a!r} → {b!r}" for k, (a, b) in list(changes.items())[:4]) + ("; ..." if len(changes) > 4 else "")
        raise InputError(f"{run_dir} was started with another config ({shown}); use a new run folder, or --resume-with-changes to go on with it")
    if changes:
        notice(f"rlctl: resuming {run_dir} with changed keys: {', '.join(changes)} (recorded in the next checkpoint)")
    return changes


CLIPPED = {  # update.policy_loss → what its clip_ratio_low/high bound, in the plan's words
    "ppo": "ratio", "clip_cov": "ratio", "gspo": "sequence ratio", "cispo": "IS weight", "gmpo": "log-ratio",
}


def describe_algorithm(cfg: Config) -> str:
    """The plan's line for the math: `grpo (÷ group std); ppo loss, ratio clipped to [0.8, 1.2],
    token-mean; old log-probs: rollout`."""
    advantage, update = cfg.advantage, cfg.update
    estimator = advantage.estimator
    if estimator == "gae":
        lam = f"λ 1 − 1/({advantage.length_adaptive_alpha:g}·length)" if advantage.length_adaptive_alpha else f"λ {advantage.lam:g}"
        critic = f", the critic's returns λ {advantage.critic_lam:g}" if advantage.critic_lam != -1 else ""
        estimator += f" (γ {advantage.gamma:g}, {lam}{critic})"
    elif estimator in ("grpo", "grpo_passk"):
        estimator += f" (÷ {advantage.std_scope} std)" if advantage.norm_by_std else " (no std)"
    elif estimator == "optimal_token_baseline":
        weights = f", × ρ̄² of {advantage.otb_rollout_is} IS weights ≤ {advantage.otb_rollout_is_threshold:g}" if advantage.otb_rollout_is in ("token", "sequence") else ""
        estimator += f" (paths weighed by score's Σπ²{weights}{', zero tail' if advantage.otb_zero_tail else ''})"
    elif estimator == "gdpo":
        from rlctl.rewards import term_name

        rewards = ", ".join(term.name or term_name(term.fn) for term in cfg.score.rewards)
        estimator += f" (each of {rewards} ÷ its group's std, weighted, summed, ÷ the batch's std)"
    elif estimator == "online_dpo":
        paired = "each prompt's best and worst sample a pair" if advantage.dpo_pairs == "best_worst" else "every two samples of a prompt whose rewards differ a pair"
        estimator += f" ({paired}, {advantage.dpo_loss} loss, β {advantage.dpo_beta:g}, scaled for {advantage.dpo_loss_agg})"
    if advantage.kl_coef > 0:
        estimator += f", KL {advantage.kl_estimator} × {advantage.kl_coef:g} in the reward" + (" (adaptive)" if advantage.kl_controller == "adaptive" else "")
    if advantage.pf_ppo != "off":
        estimator += f", batch redrawn by pf_ppo {advantage.pf_ppo}" + (f" (|reward|^{advantage.pf_ppo_weight_pow:g})" if advantage.pf_ppo == "pow" else "")
    loss = f"{update.policy_loss} loss"
    if update.policy_loss in CLIPPED:
        low, high = update.clip_ratio_low, update.clip_ratio_high
        bounds = f"[−{low:g}, {high:g}]" if update.policy_loss == "gmpo" else f"[{1 - low:g}, {1 + high:g}]"
        loss += f", {CLIPPED[update.policy_loss]} clipped to {bounds}" + (f", dual clip {update.clip_ratio_c:g}" if update.policy_loss == "ppo" and update.clip_ratio_c else "")
    loss += f", {update.loss_agg_mode}"
    if update.use_kl_loss:
        loss += f", KL loss {update.kl_loss_estimator} × {update.kl_loss_coef:g}" + (" × π/π_old" if update.kl_loss_unbiased else "")
    if update.entropy_target:
        loss += (
            f", entropy bonus while the entropy is ≤ {update.entropy_target:g}, its coefficient from {update.entropy_coef:g} "
            f"± {update.entropy_coef_delta:g} a step within [{update.entropy_coef_min:g}, {update.entropy_coef_max:g}]"
        )
    elif update.entropy_coef:
        loss += f", entropy bonus × {update.entropy_coef:g}"
    if update.off_policy_mask:
        loss += f", negative sequences past KL {update.off_policy_mask:g} from the rollout masked"
    if update.entropy_advantage:
        loss += f", advantages + min({update.entropy_advantage:g}·H, |A|/{update.entropy_advantage_kappa:g})"
    if update.target_kl:
        from rlctl.trainer import KL_STOP_FACTOR

        loss += f", stopped past KL {KL_STOP_FACTOR:g} × {update.target_kl:g}"
    return f"{estimator}; {loss}; old log-probs: {old_logprobs_source(cfg)}"


def describe_correction(cfg: Config) -> str:
    """The plan's line for the rollout correction: `token importance weights truncated at 2,
    over their batch mean; rejected: token_k1 where π_rollout/π_old leaves [0.5, 2], ...`."""
    from rlctl.algos.rejection import parse_rules

    update, parts = cfg.update, []
    if update.rollout_is != "off":
        parts.append(f"{update.rollout_is} importance weights truncated at {update.rollout_is_threshold:g}" + (", over their batch mean" if update.rollout_is_batch_normalize else ""))
    if update.rollout_rs != "off":
        rules = [
            f"{rule.name} where π_rollout/π_old leaves [{rule.lower:g}, {rule.upper:g}]" if rule.lower is not None else f"{rule.name} above {rule.upper:g}"
            for rule in parse_rules(update.rollout_rs, update.rollout_rs_threshold)
        ]
        parts.append("rejected: " + ", ".join(rules))
    return "; ".join(parts) + f" (engine vs the old log-probs: {old_logprobs_source(cfg)})"


def describe_ref_sync(sync: RefSync, run_dir: Path) -> str:
    towards = "reset to the policy" if sync.alpha == 1 else f"← {sync.alpha:g}·policy + {1 - sync.alpha:g}·reference"
    return f"{towards} after every {sync.every} iteration(s)' update ({run_dir}/refs/iter-NNNN, a checkpoint saved then)"


def describe_handover(cfg: Config) -> str:
    if cfg.rollout.backend == "vllm":
        return "in-place push into the vLLM engine, probe-checked every iteration"
    return "in memory"


def notice(text: str) -> None:
    """A line for the user on stderr (what rlctl decided on their behalf)."""
    print(text, file=sys.stderr, flush=True)


def _pipeline_state(checkpoint: Path) -> dict:
    """The controller state committed with a checkpoint (iteration, KL controller, history)."""
    state = read_manifest(str(checkpoint))[0].state.get("pipeline")
    if not isinstance(state, dict):
        raise InputError(f"{checkpoint}: its manifest carries no pipeline state (not a pipeline checkpoint)")
    return state


def rollout_correction(scores: pa.Table, threshold: float) -> dict[str, float]:
    """How far the engine that sampled is from the trainer, per token (verl's rollout-correction
    metrics): the importance ratio trainer/engine = exp(old_logprobs - rollout_logprobs), its
    mean and max, and the share of tokens whose ratio lies beyond [1/threshold, threshold].
    The update trains on score's recomputed `old_logprobs` either way."""
    pair = _token_logprobs(scores)
    if pair is None or not len(pair[0]):
        return {}
    log_ratio = pair[1] - pair[0]
    ratio = np.exp(np.clip(log_ratio, -30.0, 30.0))
    return {
        "rollout_is/ratio_mean": float(ratio.mean()), "rollout_is/ratio_max": float(ratio.max()),
        "rollout_is/frac_beyond_threshold": float((np.abs(log_ratio) > np.log(threshold)).mean()),
    }


def _one_count(threads) -> int | None:
    """A metric's thread count: None where Ray ranks on different hosts ran with different ones
    (the update's manifest keeps each rank's)."""
    return threads if isinstance(threads, int) else None


def _logprob_mismatch(scores: pa.Table) -> float | None:
    """Mean |rollout log-prob - training-side log-prob| per token: engine/trainer drift."""
    pair = _token_logprobs(scores)
    if pair is None:
        return None
    return float(np.abs(pair[0] - pair[1]).mean()) if len(pair[0]) else 0.0


def _token_logprobs(scores: pa.Table) -> tuple[np.ndarray, np.ndarray] | None:
    """(engine's rollout_logprobs, trainer's old_logprobs) of every response token the policy
    sampled (a tool's tokens have no engine log-prob), or None."""
    if "old_logprobs" not in scores.column_names or scores.column("old_logprobs").null_count:
        return None

    def flat(column: str) -> np.ndarray:
        return np.concatenate([np.asarray(x, dtype=np.float64) for x in scores.column(column).to_pylist()] or [np.zeros(0)])

    engine, trainer = flat("rollout_logprobs"), flat("old_logprobs")
    if "loss_mask" in scores.column_names:
        sampled = flat("loss_mask").astype(bool)
        engine, trainer = engine[sampled], trainer[sampled]
    return engine, trainer


def _atomic_write(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def _with_stats(table: pa.Table, stats) -> tuple[pa.Table, dict, dict]:
    """A stage's (table, state, metrics) where its metrics are `stats(table)`."""
    return table, {}, stats(table)


# --- the command ---------------------------------------------------------------------------


def run_pipeline_command(
    *, config: Path, overrides: list[str], iterations: int | None, resume: bool, from_stage: str | None,
    until_stage: str | None, run_dir: str | None, dry_run: bool, quiet: bool, resume_with_changes: bool = False,
) -> None:
    """`rlctl pipeline`: build the run (validating everything first), then plan or run it."""
    from rlctl.runview import make_view

    if iterations is not None:
        overrides = [*overrides, f"pipeline.iterations={iterations}"]
    if run_dir is not None:
        overrides = [*overrides, f"pipeline.run_dir={run_dir}"]
    pipeline = Pipeline.from_config(config, overrides, from_stage=from_stage, until_stage=until_stage, resume_with_changes=resume_with_changes)
    if resume and pipeline.checkpoint is None and not pipeline.run_dir.exists():
        raise InputError(f"--resume: no run at {pipeline.run_dir} to resume")
    total = pipeline.cfg.pipeline.iterations
    if dry_run:
        print(pipeline.plan())
        return
    quiet = quiet or "console" not in pipeline.cfg.pipeline.loggers
    with pipeline, make_view(quiet=quiet, first_iteration=pipeline.iteration, total=total) as view:
        pipeline.view = view
        pipeline._hold_run_lock()
        if pipeline.cfg.workers.backend != "local":
            view.message(f"workers: {describe_workers(pipeline.cfg)}")
            if os.environ.get("RLCTL_VERBOSE"):
                notice(f"rlctl: Ray's logs are copied to {pipeline.run_dir / 'logs' / 'ray'} when the run stops")
        if pipeline.iteration >= total:
            view.message(f"{pipeline.run_dir}: all {total} iterations are done")
        pipeline.run(total)
    print(pipeline.run_dir)
