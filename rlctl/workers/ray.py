"""Models held by a group of Ray actors, one torch.distributed rank each (gloo on the CPU,
NCCL on GPUs): the same methods as `LocalWorkers`, so the controller never knows which it has.

Each rank holds:
- the policy being trained, sharded with FSDP2 (`fully_shard` per decoder layer, then the
  root) over the group's device mesh, and its AdamW optimizer over the shards (a group of
  one rank trains its engine directly, as `LocalWorkers` does: nothing to shard or gather);
- a plain full copy of the policy: the rollout engine and the scorer of old log-probs. After
  every update the hand-over gathers the full parameters into it (no checkpoint is written
  between update and rollout). Generation therefore needs no collective per decode step, and
  ranks may finish their rows at different times. With `rollout.backend = "vllm"` each rank
  also holds a vLLM engine (one per data-parallel rank) that generates instead; the hand-over
  pushes the gathered tensors into it in place and probe-checks it (rlctl.backends.vllm_engine);
- the reference model (never trained), and the critic (sharded for training, a plain copy
  for values), when configured. The reference is a full copy per rank (`workers.reference =
  "replicated"`), or FSDP2 shards (`"sharded"`: 1/N of it per rank at rest, its full weights
  gathered for each scoring call, which every rank makes once, and released after). With `workers.placement = "split"` the reference
  and the critic each live in a pool of their own (another N ranks, another placement group):
  log-probs and values are computed there and handed to the policy ranks with the rows they
  score; the critic pool trains its critic (a critic-only Trainer) on the same mini-batches as
  the policy ranks, and its rank 0 hands its checkpoint files and optimizer state, by Ray
  object reference, to the policy's rank 0, which writes them into the one checkpoint.

Rows are spread over ranks by `rlctl.dispatch` (contiguous slices, results in row order);
sampling draws from one random stream per row, so the rows do not depend on the group size.

Checkpoints stay the public HF folder: rank 0 writes the gathered weights and the full
optimizer state (safetensors + JSON, indexed like a single-process optimizer), so a run
resumes on any number of workers, or locally. torch.distributed.checkpoint is not used: its
metadata is a pickle, and nothing rlctl reads may be one.

    rlctl pipeline examples/grpo.toml --set workers.backend=ray --set workers.num_workers=2
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import sys
import textwrap
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from rlctl import faults, malloc, mkl_kernels
from rlctl.backends.base import Generation, SamplingParams
from rlctl.config import Config, WorkersConfig
from rlctl.dispatch import gather, row_slices
from rlctl.errors import InputError, RlctlError
from rlctl.manifest import Manifest
from rlctl.workers.gather import full_model_state, full_optimizer_state, set_full_optimizer_state

CONNECT_TIMEOUT = 5.0
# run in every worker process of our Ray job before anything of ours: MKL's kernels are chosen
# when torch loads it (rlctl.process_setup; Ray takes this hook only for a whole job, at ray.init)
WORKER_SETUP_HOOK = "rlctl.process_setup.prepare"
FORWARDED_ENV = ("HF_HUB_OFFLINE", "TRANSFORMERS_VERBOSITY")  # and every RLCTL_* (fault points, --no-verify) and VLLM_*


LAST_OUTPUT_LINES = 30  # of a dead rank's stderr, shown above the error line
LAST_OUTPUT_WIDTH = 300


class WorkerDiedError(RlctlError):
    """A worker process of the group ended (OOM, SIGKILL, a native crash, node loss): exit
    code 1. `details`: the end of its stderr (a native abort's message, Python's fault
    handler's stack), which the CLI prints above the error line."""

    def __init__(self, message: str, details: str = "") -> None:
        super().__init__(message)
        self.details = details


def last_output(logs: str | None, pid: int | str) -> tuple[Path, str] | None:
    """The end of worker process `pid`'s stderr in Ray's log folder `logs` (the file Ray
    names worker-<id>-<job>-<pid>.err), or None when there is no such file or nothing in it."""
    if not logs or not str(pid).isdigit():
        return None
    files = sorted(Path(logs).glob(f"worker-*-{pid}.err"), key=lambda f: f.stat().st_mtime)
    if not files:
        return None
    try:
        lines = [line.rstrip()[:LAST_OUTPUT_WIDTH] for line in files[-1].read_text(errors="replace").splitlines() if line.strip()]
    except OSError:
        return None
    return (files[-1], "\n".join(lines[-LAST_OUTPUT_LINES:])) if lines else None


# --- starting and joining Ray ------------------------------------------------------------------


def start_ray(cfg: WorkersConfig, pools: int = 1) -> bool:
    """Start an embedded Ray for this command (room for `pools` groups of `cfg.num_workers`
    ranks), or join `cfg.address`; True when we started it.

    Ray's own logging stays off the terminal: worker output is not forwarded to the driver
    and Ray logs only errors; its files are under the session folder `ray_logs()` names."""
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")  # Ray ≥ 2.60 enables token auth by default
    os.environ.setdefault("RAY_DEDUP_LOGS", "0")
    import ray

    if cfg.address and cfg.address != "auto":
        check_reachable(cfg.address)
    if ray.is_initialized():  # a Python API user's own ray.init(): use that session
        return False
    mkl_kernels.requested_mode()  # a bad RLCTL_MKL_KERNELS or RLCTL_MALLOC: one clear line here, not a worker failing to start
    malloc.requested()
    options: dict[str, Any] = {
        "include_dashboard": False, "log_to_driver": False, "logging_level": "ERROR", "configure_logging": True,
        "runtime_env": {"worker_process_setup_hook": WORKER_SETUP_HOOK},
    }
    if not cfg.address:
        cpus = pools * cfg.num_workers * cfg.cpus_per_worker
        ray.init(num_cpus=cpus, num_gpus=int(round(pools * cfg.num_workers * cfg.gpus_per_worker)) or None, **options)
        say_where_logs_are()
        return True
    try:
        ray.init(address=cfg.address, **options)
    except (ConnectionError, RuntimeError, ValueError) as exc:
        raise InputError(f"workers.address {cfg.address!r}: cannot join a Ray cluster there: {str(exc).splitlines()[0]}") from None
    say_where_logs_are()
    return False


def say_where_logs_are() -> None:
    if os.environ.get("RLCTL_VERBOSE"):
        print(f"rlctl: Ray's logs (worker output, errors) are in {ray_logs()}", file=sys.stderr, flush=True)


def copy_ray_logs(destination: Path) -> Path | None:
    """Copy this node's worker output and Ray's process logs (`*.out`, `*.err`) of the
    session to `destination` (a run folder's logs/ray): they outlive Ray's /tmp session."""
    source = ray_logs()
    if source is None or not Path(source).is_dir():
        return None
    destination.mkdir(parents=True, exist_ok=True)
    for file in Path(source).iterdir():
        if file.is_file() and file.suffix in (".out", ".err"):
            with contextlib.suppress(OSError):  # a file Ray is rotating away
                shutil.copy2(file, destination / file.name)
    return destination


def check_reachable(address: str) -> None:
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        raise InputError(f"workers.address {address!r}: expected auto or HOST:PORT")
    try:
        socket.create_connection((host, int(port)), timeout=CONNECT_TIMEOUT).close()
    except OSError as exc:
        raise InputError(f"workers.address {address!r}: no Ray cluster answers there ({exc.strerror or exc})") from None


def ray_logs() -> str | None:
    """Where this Ray session writes its logs (for --verbose and error messages)."""
    try:
        import ray

        return str(Path(ray._private.worker._global_node.get_session_dir_path()) / "logs")
    except Exception:  # noqa: BLE001 — no session, or a Ray without this private path
        return None


# --- the group, seen from the controller --------------------------------------------------------


class RayWorkers:
    """N ranks holding the policy (and reference, critic); the controller holds only a tokenizer."""

    writes_parts = True  # stage outputs the ranks produce, they write themselves (see rollout_part)

    def __init__(
        self, cfg: Config, *, policy_source: str | None, critic_source: str | None, train: bool = True, temperature: float | None = None,
        log_dir: Path | None = None, reward_model: dict | None = None, scorers: dict[str, dict] | None = None,
    ) -> None:
        """`train=False` builds a group that only generates or scores (no FSDP copy, no optimizer);
        `policy_source=None` a group of only the reference and/or the critic; `reward_model`
        ({"path", "settings": RewardModelConfig}, no other model) a group that trains a reward
        model (rlctl reward-model: rlctl.reward_model.trainable_scorer on each rank, FSDP2-sharded);
        `scorers` ({folder: {"batch_size", "dtype"}}) the `rm:` reward models every rank holds a
        replica of, to score its share of the samples (`reward_model(folder)`)."""
        import ray
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
        from transformers import AutoTokenizer

        from rlctl.backends.hf import check_model_dir, quiet_transformers

        quiet_transformers()
        scorers = dict(scorers or {})
        for source in (policy_source, cfg.model.ref, critic_source, (reward_model or {}).get("path"), *scorers):
            if source:
                check_model_dir(source)  # bad input is exit 2 here, before Ray starts
        from dataclasses import replace

        split = cfg.workers.placement == "split" and policy_source is not None
        split_ref, split_critic = split and bool(cfg.model.ref), split and bool(critic_source)
        self.log_dir = log_dir  # a run folder's logs/ray: Ray's logs are copied there at close
        self._started_ray = start_ray(cfg.workers, pools=1 + split_ref + split_critic)
        self.ref_pool: RayWorkers | None = None  # the reference's own pool (placement = split)
        self.critic_pool: RayWorkers | None = None  # the critic's own pool, training it in lockstep (placement = split)
        try:
            if split_ref:
                self.ref_pool = RayWorkers(replace(cfg, model=replace(cfg.model, path="", critic="")), policy_source=None, critic_source=None, train=False)
            if split_critic:
                self.critic_pool = RayWorkers(
                    replace(cfg, model=replace(cfg.model, path="", ref="")), policy_source=None, critic_source=critic_source, train=train, temperature=temperature,
                )
        except BaseException:
            self.close()
            raise
        if split_ref:
            cfg = replace(cfg, model=replace(cfg.model, ref=""))  # the policy ranks hold no reference
        if split_critic:
            cfg, critic_source = replace(cfg, model=replace(cfg.model, critic="")), None  # ... nor the critic
        self.cfg, self.size = cfg, cfg.workers.num_workers
        self.loads: list[str] = []
        self._digests: dict[tuple[str, int], str] = {}
        bundle = {"CPU": cfg.workers.cpus_per_worker, **({"GPU": cfg.workers.gpus_per_worker} if cfg.workers.gpus_per_worker else {})}
        self._group = placement_group([bundle] * self.size, strategy="PACK")
        try:
            ray.get(self._group.ready(), timeout=60)
        except Exception as exc:  # noqa: BLE001 — GetTimeoutError: the cluster lacks the resources
            self.close()
            raise InputError(f"workers: the Ray cluster cannot place {self.size} workers of {bundle}: {type(exc).__name__}") from None
        threads = str(cfg.workers.cpus_per_worker)
        env = {"OMP_NUM_THREADS": threads, "MKL_NUM_THREADS": threads, "RAY_AUTH_MODE": os.environ["RAY_AUTH_MODE"], "TOKENIZERS_PARALLELISM": "false"}
        env.update({k: v for k, v in os.environ.items() if k.startswith(("RLCTL_", "VLLM_")) or k in FORWARDED_ENV})
        actor = ray.remote(RankWorker)
        self.actors = [
            actor.options(
                num_cpus=cfg.workers.cpus_per_worker, num_gpus=cfg.workers.gpus_per_worker,
                scheduling_strategy=PlacementGroupSchedulingStrategy(placement_group=self._group, placement_group_bundle_index=rank),
                runtime_env={"env_vars": env}, max_restarts=0,
            ).remote()
            for rank in range(self.size)
        ]
        self.pids = self._all("pid")
        master, port = self._call([self.actors[0].rendezvous.remote()])[0]
        setup = {
            "config": asdict(cfg), "policy": policy_source, "critic": critic_source, "master": master, "port": port,
            "train": train and (policy_source is not None or critic_source is not None), "temperature": cfg.rollout.temperature if temperature is None else temperature,
            "reward_model": reward_model, "scorers": scorers,
        }
        self.pad_id, self.vocab_size, self.context_length = self._all("setup", setup, per_rank=lambda rank: {"rank": rank, "world": self.size})[0]
        scorer = (reward_model or {}).get("path")
        self.loads += [f"{role}:{source}" for role, source in (("policy", policy_source), ("ref", cfg.model.ref), ("critic", critic_source), ("reward_model", scorer)) if source]
        self.loads += [f"rm:{folder}" for folder in scorers]
        first_folder = policy_source or cfg.model.ref or critic_source or scorer or next(iter(scorers), None)
        self.tokenizer = AutoTokenizer.from_pretrained(first_folder, padding_side="left", trust_remote_code=False)
        self.trainer = _TrainerProxy(self) if setup["train"] else None
        if self.trainer is not None:
            self.trainer.step = self._call([self.actors[0].step.remote()])[0]
        self.engine = self.policy = _PolicyProxy(self, "policy") if policy_source else None
        self.ref = _PolicyProxy(self, "ref") if cfg.model.ref else None
        if self.ref_pool is not None:
            self.ref, self.loads = self.ref_pool.ref, self.loads + self.ref_pool.loads
        self.critic = _CriticProxy(self) if critic_source else None
        if self.critic_pool is not None:
            self.critic, self.loads = self.critic_pool.critic, self.loads + self.critic_pool.loads
            self.critic_pool._all("set_pad_id", self.pad_id)  # pack the critic's rows as the policy's
        ranks = self._all("compute_settings") + [s for pool in (self.ref_pool, self.critic_pool) if pool for s in pool.rank_settings]
        self.rank_settings = ranks
        self.compute_state = agreed_settings(ranks)  # what a stage's manifest records of the ranks (pipeline)

    # -- the methods the controller calls -------------------------------------------------

    def reward_model(self, folder: str) -> _RewardModelProxy:
        """The `rm:` reward of `folder`, which every rank holds (`scorers`)."""
        return _RewardModelProxy(self, folder)

    def hand_over_weights(self) -> dict:
        """Gather the trained full parameters into every rank's rollout engine (in memory),
        and push them into each rank's vLLM engine when there is one (probe-checked)."""
        if self.critic_pool is not None:
            self.critic_pool._all("hand_over")  # its trained critic gathered into its value scorer
        ranks = self._all("hand_over")
        mode = "in-memory (shared module on the one rank)" if self.size == 1 else "gathered full parameters into each rank's engine (FSDP2 all-gather)"
        handed = {"mode": mode, "workers": self.size, "seconds": max(r["seconds"] for r in ranks),
                  "policy_version": self.trainer.step, "weights_digest": self.weights_digest()}
        if "weights_in_sync" in ranks[0]:  # a rank out of sync raised (exit 1) before this
            handed.update(
                mode=mode + ", pushed in place into each rank's vLLM engine", weights_in_sync=all(r["weights_in_sync"] for r in ranks),
                weight_sync_seconds=max(r["weight_sync_seconds"] for r in ranks), probe_max_logprob_diff=max(r["probe_max_logprob_diff"] for r in ranks),
            )
        return handed

    def load_reference(self, uri: str) -> None:
        """Every rank holding the reference (the reference's own pool with placement = split)
        loads the one at `uri` in its place (pipeline.ref_sync_every)."""
        from rlctl.backends.hf import check_model_dir

        check_model_dir(uri)
        holder = self.ref_pool or self
        holder._all("load_reference", uri)
        self.loads.append(f"ref:{uri}")

    def pause_engine(self) -> None:
        """Before an update: each rank's vLLM engine on a GPU frees its memory (sleep mode)."""
        if self.cfg.rollout.backend == "vllm" and self.engine is not None:
            self._all("pause_engine")

    def weights_digest(self, *, stream: bool = False) -> str:
        """As LocalWorkers.weights_digest, computed on rank 0's engine copy."""
        if stream:
            return self._call([self.actors[0].digest.remote("policy", stream=True)])[0]
        return self._digest("policy")

    def critic_digest(self) -> str:
        return (self.critic_pool or self)._digest("critic")

    def commit_parts(self, method: str, rows, extra, out, manifest: Manifest, schema: str, summarize=None) -> Manifest:
        """Each rank turns its contiguous slice of `rows` into its own part of the output,
        `method(rows_slice, slice_start, *extra(slice), uri, part_name, format)`, and writes it
        straight to `out`; the manifest is committed once every part exists. A rank that dies
        leaves no committed part: its file goes with the uncommitted write. One part per rank.
        With `summarize`, the manifest's metrics are `summarize(summaries)` of what the ranks
        reported about their rows (None from a rank without rows)."""
        from rlctl import schemas
        from rlctl.folders import OutputWrite
        from rlctl.manifest import FileEntry
        from rlctl.shards import PART_SUFFIX, filesystem

        if out.format not in PART_SUFFIX:
            raise InputError(f"unknown shard format {out.format!r}; use arrow or parquet")
        fs, path = filesystem(out.uri)
        slices = row_slices(rows.num_rows, self.size)
        with OutputWrite(fs, path, out.uri) as writing:
            names = [writing.expect(writing.part_name(rank, PART_SUFFIX[out.format])) for rank in range(self.size)]
            written = self.call_ranks(
                method, lambda rank: (rows.slice(slices[rank].start, slices[rank].stop - slices[rank].start), slices[rank].start, *extra(slices[rank]), out.uri, names[rank], out.format),
            )
            written = [part for part in written if part is not None]
            spec = schemas.spec(schema)
            manifest.schema, manifest.schema_version, manifest.format = spec.name, spec.version, out.format
            manifest.files = [FileEntry(**part["file"]) for part in written]
            if summarize is not None:
                manifest.metrics = summarize([part["summary"] for part in written])
            return writing.commit(manifest)

    def call_ranks(self, method: str, arguments) -> list:
        """`method(*arguments(rank))` on every rank; results in rank order."""
        return self._call([getattr(actor, method).remote(*arguments(rank)) for rank, actor in enumerate(self.actors)], what=method)

    def save(self, directory: str, manifest: Manifest, pipeline_state: dict | None, *, trainer_state: bool = True) -> Manifest:
        """Rank 0 writes the checkpoint (without the optimizer's state: `trainer_state=False`);
        every rank takes part in gathering the state."""
        if pipeline_state is not None:
            manifest.state = {**manifest.state, "pipeline": pipeline_state}
        critic = None
        if self.critic_pool is not None:  # a reference to what the critic pool's rank 0 holds: the bytes go rank to rank
            critic = next(payload for payload in self.critic_pool._all("critic_payload") if payload is not None)
        return Manifest.from_json(self._all("save", directory, manifest.to_json(), critic, trainer_state)[0])

    def close(self) -> None:
        import ray

        for pool in ("ref_pool", "critic_pool"):
            if getattr(self, pool, None) is not None:
                getattr(self, pool).close()
                setattr(self, pool, None)
        if getattr(self, "log_dir", None) is not None and ray.is_initialized():
            copy_ray_logs(self.log_dir)
        for actor in getattr(self, "actors", []):
            ray.kill(actor)
        self.actors = []
        if getattr(self, "_group", None) is not None:
            from ray.util.placement_group import remove_placement_group

            with contextlib.suppress(Exception):  # the cluster may be gone already
                remove_placement_group(self._group)
            self._group = None
        if getattr(self, "_started_ray", False):
            ray.shutdown()
            self._started_ray = False

    # -- calling ranks --------------------------------------------------------------------

    def _digest(self, name: str) -> str:
        key = (name, self.trainer.step if self.trainer is not None else 0)
        if key not in self._digests:
            self._digests = {k: v for k, v in self._digests.items() if k[0] != name}
            self._digests[key] = self._call([self.actors[0].digest.remote(name)])[0]
        return self._digests[key]

    def _all(self, method: str, *args, per_rank=None) -> list:
        """Call `method` on every rank (with `per_rank(rank)` keywords); results in rank order."""
        refs = [getattr(a, method).remote(*args, **(per_rank(r) if per_rank else {})) for r, a in enumerate(self.actors)]
        return self._call(refs, what=method)

    def _split(self, method: str, columns: list[list], *args) -> list:
        """Row slices of `columns` to ranks (each told where its slice starts); results in row order."""
        slices = row_slices(len(columns[0]), self.size)
        refs = [getattr(actor, method).remote([column[s] for column in columns], s.start, *args) for actor, s in zip(self.actors, slices)]
        return gather(self._call(refs, what=method))

    def _call(self, refs: list, what: str = "setup") -> list:
        """ray.get that fails fast: the first rank to die or raise stops the whole call."""
        import ray
        from ray.exceptions import RayActorError, RayTaskError

        index = {ref: i for i, ref in enumerate(refs)}
        pending = list(refs)
        while pending:
            done, pending = ray.wait(pending, num_returns=1)
            try:
                ray.get(done[0])
            except RayActorError:
                rank = index[done[0]]
                pid = self.pids[rank] if getattr(self, "pids", None) else "?"
                logs = str(self.log_dir) if getattr(self, "log_dir", None) else ray_logs()  # before close(): an embedded Ray's session ends there
                session_logs = ray_logs()
                self.close()
                output = last_output(logs, pid) or last_output(session_logs, pid)
                details = f"rlctl: the last output of worker rank {rank} ({output[0]}):\n" + textwrap.indent(output[1], "  ") if output else ""
                raise WorkerDiedError(
                    f"worker rank {rank} (pid {pid}) died during {what}; nothing of this step was committed" + (f" (Ray's logs: {logs})" if logs else ""),
                    details,
                ) from None
            except RayTaskError as exc:
                self.close()
                cause = getattr(exc, "cause", None)
                if isinstance(cause, RlctlError):
                    raise cause from None  # the worker's own typed error: its exit code holds
                raise RlctlError(f"worker rank {index[done[0]]} failed during {what}: {str(exc).strip().splitlines()[-1]}") from None
        return ray.get(refs)


class _TrainerProxy:
    def __init__(self, workers: RayWorkers) -> None:
        self._workers, self.step = workers, 0

    def train(self, batch) -> dict[str, float]:
        import ray

        shared = ray.put(batch)  # one copy in the object store, read by every rank
        critic_pool = self._workers.critic_pool
        critic_calls = [actor.train.remote(shared) for actor in critic_pool.actors] if critic_pool is not None else []
        metrics = self._workers._all("train", shared)[0]
        if critic_calls:  # the critic trained on its own ranks meanwhile, on the same mini-batches
            critic_metrics = critic_pool._call(critic_calls, what="the critic's train")[0]
            metrics.update({k: v for k, v in critic_metrics.items() if k.startswith("vf_")})
        self.step = int(metrics["step"])
        return metrics


class _PolicyProxy:
    """The rollout engine / a log-prob scorer, spread over the ranks."""

    def __init__(self, workers: RayWorkers, which: str) -> None:
        self._workers, self._which = workers, which
        self.tokenizer, self.pad_id = workers.tokenizer, workers.pad_id
        self.vocab_size, self.context_length = workers.vocab_size, workers.context_length

    def generate(
        self, prompt_ids, params: SamplingParams, *, batch_size: int = 64, on_tokens=None, compute_dtype: str = "fp32", first_row: int = 0, row_ids=None,
    ) -> list[Generation]:
        from rlctl.backends.base import stream_rows

        streams = stream_rows(len(prompt_ids), first_row, row_ids)  # travels with its rows to the ranks
        rows = self._workers._split("generate", [list(prompt_ids), streams], asdict(params), batch_size, compute_dtype)
        if on_tokens:
            on_tokens(sum(len(g[0]) for g in rows))
        return [Generation(list(ids), list(logprobs), reason) for ids, logprobs, reason in rows]

    def logprobs(
        self, prompt_ids, response_ids, *, temperature: float, batch_size: int = 16, compute_dtype: str = "fp32", as_trained: bool = False,
        batch_tokens: int = 0,
    ) -> list[list[float]]:
        """`as_trained` is the rank's to decide: the policy's log-probs always are."""
        return self._workers._split("logprobs", [list(prompt_ids), list(response_ids)], self._which, temperature, batch_size, compute_dtype, batch_tokens)

    def logprobs_with_statistic(
        self, prompt_ids, response_ids, *, statistic: str | None, temperature: float, batch_size: int = 16, compute_dtype: str = "fp32",
        as_trained: bool = False, batch_tokens: int = 0,
    ) -> tuple[list[list[float]], list[list[float]] | None]:
        """`HFPolicy.logprobs_with_statistic` over the ranks: each row comes back as its pair."""
        if statistic is None:
            return self.logprobs(prompt_ids, response_ids, temperature=temperature, batch_size=batch_size, compute_dtype=compute_dtype, batch_tokens=batch_tokens), None
        pairs = self._workers._split(
            "logprobs", [list(prompt_ids), list(response_ids)], self._which, temperature, batch_size, compute_dtype, batch_tokens, statistic,
        )
        return [logp for logp, _ in pairs], [value for _, value in pairs]


class _RewardModelProxy:
    """An `rm:` reward model held by every rank: the samples split over the ranks, each scoring
    its slice with its replica (as `rlctl.rewards.RewardModel` scores in one process), the
    rewards back in sample order."""

    runs_on_workers = True  # called directly by rlctl.rewards: a rank's failure is the group's error, no reward alarm around Ray calls

    def __init__(self, workers: RayWorkers, folder: str) -> None:
        self.workers, self.folder = workers, folder

    def __call__(self, *, prompts: list[str], responses: list[str], messages: list | None = None) -> list[float]:
        chats = messages or [None] * len(responses)
        return self.workers._split("reward_model_scores", [list(prompts), list(responses), list(chats)], self.folder)


class _CriticProxy:
    def __init__(self, workers: RayWorkers) -> None:
        self._workers, self.vocab_size = workers, workers.vocab_size

    def values(self, prompt_ids, response_ids, *, pad_id: int, batch_size: int = 16, compute_dtype: str = "fp32", batch_tokens: int = 0) -> list[list[float]]:
        return self._workers._split("values", [list(prompt_ids), list(response_ids)], pad_id, batch_size, compute_dtype, batch_tokens)


# --- one rank ------------------------------------------------------------------------------------


def agreed_settings(ranks: list[dict]) -> dict:
    """The ranks' compute settings as a stage's manifest records them: a setting's value where
    every rank has the same, else the ranks' values in rank order (hosts of other CPUs)."""
    settings: dict = {}
    for key in dict.fromkeys(k for rank in ranks for k in rank):
        values = [rank.get(key) for rank in ranks]
        settings[key] = values[0] if len(set(map(str, values))) == 1 else values
    return settings


class RankWorker:
    """A Ray actor: one torch.distributed rank holding its models (see the module docstring)."""

    def pid(self) -> int:
        return os.getpid()

    def rendezvous(self) -> tuple[str, int]:
        """This node's address and a free port for the group's torch.distributed store."""
        import ray

        with socket.socket() as s:
            s.bind(("", 0))
            port = s.getsockname()[1]
        return ray.util.get_node_ip_address(), port

    def setup(self, spec: dict, *, rank: int, world: int) -> tuple[int, int, int | None]:
        import copy
        import faulthandler
        from datetime import timedelta

        import torch
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh

        from rlctl.backends.hf import HFPolicy, ValueModel, quiet_transformers, resolve_device
        from rlctl.checkpoint import load_trainer_state
        from rlctl.config import from_dict
        from rlctl.lora import prepare_for_training
        from rlctl.trainer import RankGroup, Trainer

        quiet_transformers()
        faulthandler.enable(all_threads=True)  # a native crash prints every thread's Python stack to the rank's stderr (Ray's: only the crashing one)
        cfg = from_dict({k: v for k, v in spec["config"].items()})
        torch.set_num_threads(cfg.workers.cpus_per_worker)
        gpu = cfg.workers.gpus_per_worker > 0
        device = resolve_device("cuda" if gpu else "cpu")
        if gpu:
            torch.cuda.set_device(0)  # Ray gives each actor its own visible device
        dist.init_process_group("nccl" if gpu else "gloo", init_method=f"tcp://{spec['master']}:{spec['port']}", rank=rank, world_size=world, timeout=timedelta(minutes=10))
        self.rank, self.world, self.cfg = rank, world, cfg
        self.engine = HFPolicy.load(spec["policy"], str(device)) if spec["policy"] else None
        if self.engine is not None and spec["train"]:
            prepare_for_training(self.engine, cfg.update.lora, spec["policy"])
        self.device = device
        self.ref = self.ref_shards = None  # ref_shards: the reference as FSDP2 shards (workers.reference = "sharded"), gathered to score
        if cfg.model.ref:
            self.load_reference(cfg.model.ref)
        self.critic_engine = ValueModel.load(spec["critic"], device) if spec["critic"] else None
        self.trainer = self.train_policy = self.train_critic = None
        self.sft_trainer = None  # made by sft_start (rlctl sft on this group)
        self.supervised = None  # the supervised command's trainer (sft, dpo, reward-model) whose epoch checkpoints this rank takes part in
        self.shared = world == 1  # one rank: nothing to shard; the engine is the trained module
        if spec["train"] and self.shared:
            self.train_policy, self.train_critic = self.engine, self.critic_engine
        elif spec["train"]:
            mesh = init_device_mesh(device.type, (world,))
            if self.engine is not None:  # None in a critic's own pool
                self.train_policy = HFPolicy(_sharded(copy.deepcopy(self.engine.model), mesh), self.engine.tokenizer, device)
            if self.critic_engine is not None:
                self.train_critic = _sharded_critic(copy.deepcopy(self.critic_engine), mesh)
        self.generator = None  # this rank's vLLM engine (rollout.backend = "vllm"), checked against its policy
        if spec["policy"] and cfg.rollout.backend == "vllm":
            from rlctl.workers.local import start_vllm

            self.generator = start_vllm(cfg, spec["policy"], self.engine)
        if spec["train"]:
            self.trainer = Trainer(self.train_policy, cfg.update, critic=self.train_critic, temperature=spec["temperature"], ranks=RankGroup(rank, world))
            source = spec["policy"] or _checkpoint_of(spec["critic"])
            state = load_trainer_state(source) if source else None
            if state is not None:
                self._load_trainer_state(state)
        self.reward_model = self.reward_model_trainer = None  # rlctl reward-model on this group: the model trained, FSDP2-sharded
        if spec.get("reward_model"):
            from rlctl.backends.hf import context_length_of
            from rlctl.reward_model import trainable_scorer

            self.reward_model, self.reward_model_tokenizer = trainable_scorer(
                spec["reward_model"]["path"], device, spec["reward_model"]["settings"], spec["reward_model"].get("resume_from"),
            )
            self.reward_model_device, self.reward_model_path, self.reward_model_settings = device, spec["reward_model"]["path"], spec["reward_model"]["settings"]
            if world > 1:
                _sharded(self.reward_model, init_device_mesh(device.type, (world,)))
            return self.reward_model_tokenizer.pad_token_id, self.reward_model.config.vocab_size, context_length_of(self.reward_model)
        from rlctl.rewards import RewardModel

        self.scorers = {folder: RewardModel(folder, device=str(device), **options) for folder, options in (spec.get("scorers") or {}).items()}
        first = self.engine or self.ref or self.ref_shards
        if first is None and self.critic_engine is None and self.scorers:  # a group that only scores with reward models
            scorer = next(iter(self.scorers.values()))
            return scorer.tokenizer.pad_token_id, scorer.model.config.vocab_size, scorer.context
        if first is None:
            return 0, self.critic_engine.vocab_size, None
        return first.pad_id, first.vocab_size, first.context_length

    def step(self) -> int:
        return self.trainer.step

    def compute_settings(self) -> dict:
        """What this rank's last bits depend on besides its inputs: torch's threads and MKL's
        kernels (chosen by the job's setup hook when this process started)."""
        import torch

        return {"torch_threads": torch.get_num_threads(), "mkl_kernels": mkl_kernels.recorded()}

    def set_pad_id(self, pad_id: int) -> None:
        if self.trainer is not None:
            self.trainer.pad_id = pad_id

    def load_reference(self, uri: str) -> None:
        """Hold the reference at `uri`: a replica, or FSDP2 shards of it (every rank calls this)."""
        from rlctl.backends.hf import HFPolicy

        self.ref = self.ref_shards = None  # the old one freed before the new one loads
        ref = self._load_reference(uri, self.device)
        if self.cfg.workers.reference == "sharded" and self.world > 1:
            from torch.distributed.device_mesh import init_device_mesh

            self.ref_shards = HFPolicy(_sharded(ref.model, init_device_mesh(self.device.type, (self.world,))), ref.tokenizer, self.device)
        else:
            self.ref = ref

    def _load_reference(self, uri: str, device):
        """The reference replica; for a LoRA policy whose base it is, this rank's plain policy
        copy with its adapters disabled (no second copy)."""
        from rlctl.backends.hf import HFPolicy
        from rlctl.checkpoint import same_folder
        from rlctl.lora import AdapterDisabledReference, base_path, is_lora

        if self.engine is not None and is_lora(self.engine.model) and same_folder(uri, base_path(self.engine.model)):
            return AdapterDisabledReference(self.engine)
        return HFPolicy.load(uri, str(device))

    # -- work on rows ----------------------------------------------------------------------

    def generate(self, rows: list, start: int, params: dict, batch_size: int, compute_dtype: str) -> list:
        prompt_ids, streams = rows
        out = (self.generator or self.engine).generate(prompt_ids, SamplingParams(**params), batch_size=batch_size, compute_dtype=compute_dtype, row_ids=streams)
        return [(g.response_ids, g.logprobs, g.finish_reason) for g in out]

    def logprobs(
        self, rows: list, start: int, which: str, temperature: float, batch_size: int, compute_dtype: str, batch_tokens: int = 0, statistic: str | None = None,
    ) -> list:
        """The rows' log-probs; with a policy `statistic`, each row's (log-probs, statistic)."""
        prompt_ids, response_ids = rows
        passes = {"batch_size": batch_size, "batch_tokens": batch_tokens, "compute_dtype": compute_dtype}
        if which == "policy" and statistic is not None:
            logprobs, values = self.engine.logprobs_with_statistic(prompt_ids, response_ids, statistic=statistic, temperature=temperature, as_trained=True, **passes)
            return list(zip(logprobs, values))
        if which == "policy":
            return self.engine.logprobs(prompt_ids, response_ids, temperature=temperature, as_trained=True, **passes)
        with self._reference() as ref:
            return ref.logprobs(prompt_ids, response_ids, temperature=temperature, **passes)

    @contextlib.contextmanager
    def _reference(self):
        """The reference as a plain module: the replica, or the shards' full weights gathered
        (a collective: every rank enters this once per scoring call) and freed after."""
        if self.ref_shards is None:
            yield self.ref
            return
        from rlctl.backends.hf import HFPolicy

        full = full_model_state(self.ref_shards.model)
        model = _plain_copy(self.ref_shards.model, full)
        del full
        try:
            yield HFPolicy(model, self.ref_shards.tokenizer, self.ref_shards.device, bf16_copy=False)
        finally:
            del model

    def reward_model_scores(self, rows: list, start: int, folder: str) -> list[float]:
        """This rank's slice of the samples scored by its replica of the `rm:` model at `folder`."""
        prompts, responses, chats = rows
        return self.scorers[folder](prompts=prompts, responses=responses, messages=chats)

    def values(self, rows: list, start: int, pad_id: int, batch_size: int, compute_dtype: str, batch_tokens: int = 0) -> list:
        prompt_ids, response_ids = rows
        return self.critic_engine.values(prompt_ids, response_ids, pad_id=pad_id, batch_size=batch_size, compute_dtype=compute_dtype, batch_tokens=batch_tokens)

    def rollout_part(self, prompts, start: int, rollout: dict, data: dict, policy_version: int, uri: str, name: str, fmt: str) -> dict | None:
        """Generate for this rank's prompts (from prompt `start`) as part `name` of the output at `uri`."""
        from rlctl.config import DataConfig, RolloutConfig
        from rlctl.stages.rollout import rollout_table

        if prompts.num_rows == 0:
            return None
        cfg = RolloutConfig(**rollout)
        from rlctl.sample_stats import rollout_tally

        table = rollout_table(prompts, self.generator or self.engine, cfg, DataConfig(**data), policy_version=policy_version, on_tokens=lambda _: None, first_row=start * cfg.n)
        return self._write_part(table, "rollouts", uri, name, fmt, summary=rollout_tally(table))

    def score_part(
        self, rows, start: int, rewards: list, roles: list, score: dict, ref_logprobs: list | None, values: list | None, uri: str, name: str, fmt: str,
    ) -> dict | None:
        """This rank's rollouts with their rewards (computed by the controller) and the model
        columns of `roles` (ref, policy, critic), as part `name` of the output at `uri`;
        `ref_logprobs` / `values` when the reference / critic is in a pool of its own."""
        from rlctl.config import section_from_dict
        from rlctl.stages.score import ScoringModels, with_model_columns

        with self._reference() if "ref" in roles else contextlib.nullcontext() as ref:  # every rank gathers, even one with no rows
            if rows.num_rows == 0:
                return None
            models = ScoringModels(ref=ref, policy=self.engine if "policy" in roles else None, critic=self.critic_engine if "critic" in roles else None)
            table = with_model_columns(rows, rewards, models, section_from_dict("score", score), ref_logprobs=ref_logprobs, values=values)
        return self._write_part(table, "scores", uri, name, fmt)

    def _write_part(self, table, schema: str, uri: str, name: str, fmt: str, summary: dict | None = None) -> dict:
        """The part's file entry, and `summary` of its rows for the controller's manifest."""
        from rlctl import schemas
        from rlctl.folders import PartSink
        from rlctl.shards import filesystem, write_part

        table = schemas.validate(table, schema, source=f"worker rank {self.rank}")
        fs, path = filesystem(uri)
        entry = write_part(PartSink(fs, path), name, table.to_batches(), table.schema, fmt)
        faults.point(f"rank-{self.rank}:{schema}-part-written")
        return {"file": asdict(entry), "summary": summary}

    def train(self, batch) -> dict:
        return self.trainer.train(batch)

    # -- supervised fine-tuning (rlctl sft) ---------------------------------------------------

    def sft_start(self, cfg, total_steps: int) -> None:
        """The sft trainer made (before a resumed run loads its optimizer's state into it)."""
        self._sft_trainer(cfg, total_steps)

    def sft_steps(self, examples, cfg, total_steps: int, epoch: int, first: int, last: int) -> dict:
        """Optimizer steps `first` to `last` of an epoch of `rlctl sft`, this rank's share of each (rlctl.sft.SftTrainer)."""
        return self._sft_trainer(cfg, total_steps).train_steps(examples, epoch, first, last)

    def sft_loss(self, examples, cfg, total_steps: int) -> float:
        """The held-out examples' mean NLL per response token, summed over the ranks' shares."""
        return self._sft_trainer(cfg, total_steps).mean_loss(examples)

    def _sft_trainer(self, cfg, total_steps: int):
        from rlctl.sft import SftTrainer
        from rlctl.trainer import RankGroup

        if self.sft_trainer is None:
            self.sft_trainer = self.supervised = SftTrainer(self.train_policy, cfg, total_steps=total_steps, ranks=RankGroup(self.rank, self.world))
        return self.sft_trainer

    # -- a supervised command's epoch checkpoints (rlctl.epoch_checkpoints) ---------------------

    def save_progress(self, directory: str, manifest_json: str, files: dict | None) -> str:
        """Gather the trained weights and the supervised trainer's optimizer state (all ranks);
        rank 0 writes the epoch checkpoint."""
        from rlctl.checkpoint import save_checkpoint
        from rlctl.epoch_checkpoints import STATE_DIR

        state = self.supervised.state_dict()
        if self.reward_model is not None:  # rlctl reward-model: the model as trained (a LoRA model's adapters and head, not merged)
            held = self._gathered_reward_model()
        else:
            self._gather()
            held = self.engine
        if self.rank != 0:
            return manifest_json
        manifest = save_checkpoint(directory, policy=held, trainer_state=state, manifest=Manifest.from_json(manifest_json), state_dir=STATE_DIR, files=files)
        return manifest.to_json()

    def load_progress(self, directory: str) -> None:
        """The supervised trainer's optimizer state from the epoch checkpoint this rank's weights came from."""
        from rlctl import trainer_state
        from rlctl.epoch_checkpoints import STATE_DIR

        self.supervised.load_state_dict(trainer_state.load(Path(directory) / STATE_DIR))

    # -- preference training against the starting weights (rlctl dpo, rlctl kto) -------------

    def referenced_start(self, command: str, shared, cfg, total_steps: int, kept_in: str | None = None):
        """`command`'s trainer made, and the reference's log-probabilities of the (training,
        held-out) rows in `shared` computed with the starting weights (unless they carry them:
        a resumed run's, whose moving reference this rank restores from the epoch checkpoint
        `kept_in`), kept on this rank and returned."""
        from safetensors.torch import load_file

        from rlctl.dpo import DpoTrainer
        from rlctl.epoch_checkpoints import KEPT_FILE
        from rlctl.kto import KtoTrainer
        from rlctl.referenced import restore_moving_reference
        from rlctl.trainer import RankGroup

        rows, held_out = shared
        trainer = {"dpo": DpoTrainer, "kto": KtoTrainer}[command]
        self.referenced = self.supervised = trainer(self.train_policy, cfg, total_steps=total_steps, ranks=RankGroup(self.rank, self.world))
        if kept_in is not None:
            restore_moving_reference(self.referenced, load_file(str(Path(kept_in) / KEPT_FILE)))
        self.referenced_rows = self.referenced.with_reference(rows)
        self.referenced_held_out = self.referenced.with_reference(held_out) if held_out is not None else None
        return self.referenced_rows, self.referenced_held_out

    def referenced_steps(self, epoch: int, first: int, last: int) -> dict:
        """Optimizer steps `first` to `last` of an epoch, this rank's share of each step's rows."""
        return self.referenced.train_steps(self.referenced_rows, epoch, first, last)

    def referenced_save_progress(self, directory: str, manifest_json: str, files: dict | None) -> str:
        """The epoch checkpoint with what is kept beside the weights as of now (the reference's
        log-probabilities, a moving reference's weights gathered: every rank calls this)."""
        from rlctl.referenced import kept_file, kept_tensors

        kept = kept_tensors(self.referenced, self.referenced_rows, self.referenced_held_out)  # every rank: the gather
        return self.save_progress(directory, manifest_json, {**(files or {}), **kept_file(kept)} if self.rank == 0 else None)  # rank 0 writes

    def referenced_evaluate(self) -> tuple:
        """The held-out rows' figures (mean loss, and accuracy or margin), summed over the ranks' shares."""
        return self.referenced.evaluate(self.referenced_held_out)

    # -- reward-model training (rlctl reward-model) ------------------------------------------

    def reward_model_start(self, total_steps: int) -> None:
        """The reward model's trainer made (before a resumed run loads its optimizer's state into it)."""
        self._reward_model_trainer(total_steps)

    def reward_model_steps(self, pairs, total_steps: int, epoch: int, first: int, last: int) -> dict:
        """Optimizer steps `first` to `last` of an epoch of `rlctl reward-model`, this rank's share of each step's pairs."""
        return self._reward_model_trainer(total_steps).train_steps(pairs, epoch, first, last)

    def reward_model_evaluate(self, pairs, total_steps: int) -> tuple[float, float]:
        """The held-out pairs' mean loss and accuracy, summed over the ranks' shares."""
        return self._reward_model_trainer(total_steps).evaluate(pairs)

    def _reward_model_adapter(self, plain):
        """`plain` (a plain copy of the reward model's base) with its adapters, as on this rank."""
        from rlctl.lora import add_adapter
        from rlctl.reward_model import LORA_TRAINED_WHOLE

        settings = self.reward_model_settings
        return add_adapter(plain, settings.lora, base_path=self.reward_model_path, trained_whole=LORA_TRAINED_WHOLE) if settings.lora.r else plain

    def _reward_model_trainer(self, total_steps: int):
        from rlctl.reward_model import RewardModelTrainer
        from rlctl.trainer import RankGroup

        if self.reward_model_trainer is None:
            self.reward_model_trainer = self.supervised = RewardModelTrainer(
                self.reward_model, self.reward_model_tokenizer.pad_token_id, self.reward_model_settings, device=self.reward_model_device, total_steps=total_steps,
                ranks=RankGroup(self.rank, self.world),
            )
        return self.reward_model_trainer

    def _gathered_reward_model(self):
        """The trained reward model whole (a collective), with its tokenizer, on rank 0 (None elsewhere)."""
        from types import SimpleNamespace

        from transformers import AutoModelForSequenceClassification

        model = self.reward_model
        if self.world > 1:
            state = full_model_state(model)
            if self.rank != 0:
                return None
            model = _plain_copy(model, state, AutoModelForSequenceClassification, adapted=self._reward_model_adapter)
        return SimpleNamespace(model=model, tokenizer=self.reward_model_tokenizer)

    def save_reward_model(self, directory: str, manifest_json: str) -> str:
        """Gather the trained reward model (all ranks); rank 0 writes it, weights and tokenizer."""
        from types import SimpleNamespace

        from rlctl.checkpoint import save_checkpoint
        from rlctl.reward_model import as_saved

        held = self._gathered_reward_model()
        if self.rank != 0:
            return manifest_json
        manifest = save_checkpoint(
            directory, policy=SimpleNamespace(model=as_saved(held.model), tokenizer=held.tokenizer), trainer_state=None,
            manifest=Manifest.from_json(manifest_json),
        )
        return manifest.to_json()

    # -- weights -----------------------------------------------------------------------------

    def hand_over(self) -> dict:
        """Gather the trained weights into this rank's engine copy, then push them into its
        vLLM engine and probe it (out of sync raises: exit 1). Seconds and the check."""
        from rlctl.workers.local import push_and_check

        started = time.perf_counter()
        self._gather()
        record = push_and_check(self.generator, self.engine.model, self.trainer.step) if self.generator is not None else {}
        return {"seconds": time.perf_counter() - started, **record}

    def pause_engine(self) -> None:
        if self.generator is not None:
            self.generator.sleep()

    def _gather(self) -> None:
        """Every rank gathers the full trained parameters into its plain engine copy."""
        if self.shared:
            return  # the engine is the trained module
        if self.train_policy is not None:
            self.engine.model.load_state_dict(full_model_state(self.train_policy.model))
        if self.train_critic is not None:
            self.critic_engine.load_state_dict(full_model_state(self.train_critic))

    def digest(self, which: str, stream: bool = False) -> str:
        from rlctl.digests import module_digest, stream_digest

        module = self.engine.model if which == "policy" else self.critic_engine
        return stream_digest(module) if stream else module_digest(module)

    def save(self, directory: str, manifest_json: str, critic: list | None = None, trainer_state: bool = True) -> str:
        """Gather the trained weights and the full optimizer state (all ranks); rank 0 writes
        the checkpoint. The gather happens here too, so a save never depends on a hand-over.
        `critic`: [a reference to the critic pool's `critic_payload`], written beside.
        `trainer_state=False`: the weights alone (rlctl sft: weights to start RL from)."""
        import ray

        from rlctl.checkpoint import save_checkpoint

        state = self._full_trainer_state() if trainer_state else self._gather()
        if self.rank != 0:
            return manifest_json
        critic_files = None
        if critic is not None:
            payload = ray.get(critic[0])
            state["critic_optimizer"], critic_files = payload["optimizer"], payload["files"]
        manifest = save_checkpoint(
            directory, policy=self.engine, trainer_state=state if trainer_state else None, manifest=Manifest.from_json(manifest_json),
            critic=self.critic_engine, critic_files=critic_files,
        )
        return manifest.to_json()

    def critic_payload(self) -> list | None:
        """In a critic's own pool: gather the critic and its optimizer state (all ranks); rank 0
        returns [a reference to] its checkpoint files and optimizer state, for the policy's rank 0
        to write into the checkpoint."""
        import tempfile

        import ray

        state = self._full_trainer_state()
        if self.rank != 0:
            return None
        with tempfile.TemporaryDirectory() as folder:
            self.critic_engine.save(folder)
            files = {str(p.relative_to(folder)): p.read_bytes() for p in sorted(Path(folder).rglob("*")) if p.is_file()}
        return [ray.put({"files": files, "optimizer": state["critic_optimizer"]})]

    def _full_trainer_state(self) -> dict:
        self._gather()
        if self.shared:
            return self.trainer.state_dict()
        return {
            "step": self.trainer.step,
            "optimizer": full_optimizer_state(self.train_policy.model, self.trainer.optimizer) if self.train_policy is not None else None,
            "critic_optimizer": full_optimizer_state(self.train_critic, self.trainer.critic_optimizer) if self.train_critic is not None else None,
            "entropy_control": self.trainer.entropy_control_state(),
        }

    def _load_trainer_state(self, state: dict) -> None:
        import torch

        if self.shared:
            self.trainer.load_state_dict(state)
        else:
            self.trainer.step = int(state["step"])
            self.trainer.load_entropy_control(state.get("entropy_control"))
            if self.train_policy is not None:
                set_full_optimizer_state(self.train_policy.model, self.trainer.optimizer, state.get("optimizer"))
            if self.train_critic is not None:
                set_full_optimizer_state(self.train_critic, self.trainer.critic_optimizer, state.get("critic_optimizer"))
        if state.get("rng") is not None:
            torch.set_rng_state(state["rng"])


def _checkpoint_of(critic_uri: str | None) -> str | None:
    """The checkpoint a critic folder belongs to (CKPT/critic → CKPT), whose trainer state
    holds the critic's optimizer; None for a critic that is a plain model folder."""
    from rlctl.checkpoint import CRITIC_DIR

    if critic_uri and Path(critic_uri).name == CRITIC_DIR:
        return str(Path(critic_uri).parent)
    return None


def _sharded(model, mesh):
    """FSDP2 over each decoder layer, then the whole model (a LoRA policy: its base's layers;
    FSDP2 keeps frozen base weights and trained adapters in one group)."""
    from torch.distributed.fsdp import fully_shard

    from rlctl.lora import transformers_model

    for layer in transformers_model(model).model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def _plain_copy(sharded, state: dict, auto_class=None, adapted=None):
    """A plain (unsharded) module like the FSDP2 module `sharded` (a causal LM, or
    `auto_class`'s kind; `adapted(model)` adds the adapters a LoRA module has), holding its full
    `state` and its buffers (FSDP2 keeps buffers whole on every rank; rotary tables are not in
    the state dict)."""
    import torch
    from transformers import AutoModelForCausalLM

    from rlctl.lora import transformers_model

    with torch.device("meta"):
        model = (auto_class or AutoModelForCausalLM).from_config(transformers_model(sharded).config)
    device = next(iter(state.values())).device
    model = model.to_empty(device=device)
    if adapted is not None:
        model = adapted(model)
    model.load_state_dict(state)
    for name, buffer in sharded.named_buffers():
        model.get_buffer(name).copy_(buffer)
    model.tie_weights()
    return model.eval()


def _sharded_critic(critic, mesh):
    from torch.distributed.fsdp import fully_shard

    for layer in critic.lm.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(critic, mesh=mesh)
    return critic
