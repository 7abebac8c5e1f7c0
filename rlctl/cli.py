"""The `rlctl` command line (typer). Thin: parse flags, build typed config, call a stage
function, print. `main()` is the one place that maps typed errors to exit codes.

    rlctl rollout --prompts examples/prompts.jsonl --model models/tiny --out - | rlctl show -
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import sys
from pathlib import Path
from typing import Annotated, Optional

import typer

from rlctl import __version__, choices
from rlctl.errors import InputError, RlctlError

app = typer.Typer(
    name="rlctl",
    help="RL post-training of language models as stage commands over Arrow shards.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
)
model_app = typer.Typer(help="Make and inspect local models.", no_args_is_help=True)
app.add_typer(model_app, name="model")
config_app = typer.Typer(help="Explain the config: every key, its type, default and meaning.", no_args_is_help=True)
app.add_typer(config_app, name="config")

# --- options shared by the stage commands ---------------------------------------------------


def _default(dotted: str) -> str:
    """The `[default: ...]` note of a flag that overrides config key `dotted`: the value a run
    has without --config (the flag's own default is None, so that a config file can set it)."""
    from rlctl.config import SECTIONS, _toml_value

    section, key = dotted.split(".")
    value = getattr(SECTIONS[section](), key)
    return f"  [default: {value if isinstance(value, str) and value else _toml_value(value)}]"


def _choices(values: tuple[str, ...]) -> str:
    """The metavar of a choice flag, `[a|b|c]`: --help shows the allowed values, and the
    shell completions read them from it (rlctl.completion)."""
    return "[" + "|".join(values) + "]"


ConfigOpt = Annotated[Optional[Path], typer.Option("--config", help="TOML file whose sections give defaults; flags override it.")]
SetOpt = Annotated[Optional[list[str]], typer.Option("--set", help="Override a config key: section.key=value (repeatable).")]
JsonOpt = Annotated[bool, typer.Option("--json", help="Print the manifest of what was written to stdout.")]
ForceOpt = Annotated[bool, typer.Option("--force", help="Run even if the output is up to date.")]
FormatOpt = Annotated[str, typer.Option("--format", help="Shard file format.", metavar=_choices(choices.SHARD_FORMATS))]
RowsOpt = Annotated[int, typer.Option("--rows-per-part", help="Rows per part file.", min=1)]
DeviceOpt = Annotated[Optional[str], typer.Option("--device", help="auto, cpu, cuda or cuda:N." + _default("model.device"))]
OutOpt = Annotated[str, typer.Option("--out", help="Output folder URI, or - for an Arrow stream on stdout.")]
WorkersBackendOpt = Annotated[Optional[str], typer.Option("--workers-backend", help="Who holds the models: local (this process) or ray (a worker group)." + _default("workers.backend"), metavar=_choices(choices.WORKER_BACKENDS))]
WorkersOpt = Annotated[Optional[int], typer.Option("--workers", help="Ranks of the Ray worker group (data-parallel, FSDP2 for training)." + _default("workers.num_workers"))]
AddressOpt = Annotated[Optional[str], typer.Option("--address", help="Ray cluster to join: auto or HOST:PORT; empty starts one for this command.")]
ChatTemplateOpt = Annotated[Optional[bool], typer.Option("--chat-template/--no-chat-template", help="Render plain prompts with the chat template." + _default("data.chat_template"))]
PromptTemplateOpt = Annotated[Optional[str], typer.Option("--prompt-template", help="Put each plain prompt into this text where it says {prompt}, before any chat template.")]
SystemPromptOpt = Annotated[Optional[str], typer.Option("--system-prompt", help="A system message first in every chat prompt that has none.")]


def _workers_config(cfg, backend: str | None, workers: int | None, address: str | None):
    from rlctl.config import override_section

    return override_section(cfg.workers, backend=backend, num_workers=workers, address=address)


def _version_callback(value: bool) -> None:
    if value:
        typer.echo(f"rlctl {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: Annotated[bool, typer.Option("--version", callback=_version_callback, is_eager=True, help="Print the version and exit.")] = False,
    no_verify: Annotated[bool, typer.Option("--no-verify", help="Skip the sha256 check of committed parts (sizes are still checked); for very large trusted data.")] = False,
    verbose: Annotated[bool, typer.Option("--verbose", help="Say more on stderr: where worker (Ray) logs are written, which MKL kernels run.")] = False,
) -> None:
    """RL post-training of language models as stage commands over Arrow shards."""
    if verbose:
        os.environ["RLCTL_VERBOSE"] = "1"
        _say_mkl_kernels()
    if no_verify:
        from rlctl.folders import NO_VERIFY_ENV

        os.environ[NO_VERIFY_ENV] = "1"


def _stage_config(config: Path | None, overrides: list[str] | None):
    """The config of a stage command: `--config`'s file (its reward, tool and data files relative
    to its folder, as a pipeline's), then `--set`."""
    from rlctl.config import load_config, paths_relative_to

    return paths_relative_to(load_config(config, overrides or []), Path(config).parent if config else None)


def _output(uri: str, fmt: str, rows_per_part: int, as_json: bool):
    from rlctl.shards import OutputSpec

    if as_json and uri == "-":
        raise InputError("--json prints the manifest to stdout, which --out - already uses for data")
    if uri == "-" and sys.stdout.isatty():
        raise InputError("--out - writes an Arrow stream to stdout, which is a terminal: pipe it into a command (| rlctl score --rollouts - ...) or redirect it (> file.arrow)")
    return OutputSpec(uri=uri, format=fmt, rows_per_part=rows_per_part)


def _report(manifest, as_json: bool) -> None:
    if manifest is None:
        return
    if as_json:
        typer.echo(manifest.to_json(), nl=False)
    elif manifest.state.get("skipped"):
        _err(f"{manifest.stage}: up to date, skipped (use --force to re-run)")
    elif manifest.metrics and manifest.stage == "update":
        shown = ("step", "pg_loss", "vf_loss", "entropy", "grad_norm", "tokens_per_s")
        _err("update: " + "  ".join(f"{k} {manifest.metrics[k]:.4g}" for k in shown if k in manifest.metrics))
    elif "streamed_rows" in manifest.state:
        _err(f"{manifest.stage}: streamed {manifest.state['streamed_rows']} rows to stdout in {manifest.timings.get('seconds', 0):.2f}s")
    else:
        what = f"{manifest.rows} rows" if manifest.schema else f"{len(manifest.files)} files"
        _err(f"{manifest.stage}: wrote {what} in {manifest.timings.get('seconds', 0):.2f}s")


def _say_mkl_kernels() -> None:
    """Where MKL could run its Intel kernels (rlctl.mkl_kernels), whether it does, and if not why."""
    from rlctl import mkl_kernels

    why_not = {
        mkl_kernels.NO_COMPILER: "no C compiler (cc, gcc or clang) to build rlctl's library",
        mkl_kernels.BUILD_FAILED: "the C compiler could not build rlctl's library",
        mkl_kernels.TOO_LATE: "torch was loaded first",
    }
    state = mkl_kernels.state()
    if state == mkl_kernels.INTEL:
        _err("rlctl: MKL runs its Intel kernels on this CPU (RLCTL_MKL_KERNELS=default: its own choice)")
    elif state in why_not:
        _err(f"rlctl: MKL runs its generic kernels on this CPU, not its faster Intel ones: {why_not[state]}")


def _err(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


# --- stage commands -------------------------------------------------------------------------


@app.command()
def rollout(
    prompts: Annotated[str, typer.Option("--prompts", help="Prompts: shard folder, .jsonl, .json (JSON Lines or one array), .parquet or -.")],
    model: Annotated[str, typer.Option("--model", help="Policy weights: HF folder or rlctl checkpoint.")],
    out: OutOpt,
    n: Annotated[Optional[int], typer.Option("--n", help="Samples per prompt." + _default("rollout.n"))] = None,
    max_new_tokens: Annotated[Optional[int], typer.Option("--max-new-tokens", help="Longest response in tokens." + _default("rollout.max_new_tokens"))] = None,
    temperature: Annotated[Optional[float], typer.Option("--temperature", help="Sampling temperature; 0 is greedy." + _default("rollout.temperature"))] = None,
    top_p: Annotated[Optional[float], typer.Option("--top-p", help="Nucleus sampling mass." + _default("rollout.top_p"))] = None,
    top_k: Annotated[Optional[int], typer.Option("--top-k", help="Sample from the k most likely tokens; 0 = all." + _default("rollout.top_k"))] = None,
    min_p: Annotated[Optional[float], typer.Option("--min-p", help="Leave out tokens less likely than min-p × the likeliest one; 0 = off." + _default("rollout.min_p"))] = None,
    repetition_penalty: Annotated[Optional[float], typer.Option("--repetition-penalty", help="Above 1: tokens already in the prompt or response are drawn less often (the log-probs stay the policy's); 1 = off." + _default("rollout.repetition_penalty"))] = None,
    seed: Annotated[Optional[int], typer.Option("--seed", help="Sampling seed." + _default("rollout.seed"))] = None,
    stop: Annotated[Optional[list[str]], typer.Option("--stop", help="A stop string: a response ends with the token that completes it, and keeps it (repeat for several).")] = None,
    greedy_baseline: Annotated[Optional[bool], typer.Option("--greedy-baseline/--no-greedy-baseline", help="Also decode each prompt's greedy response, never trained on: ReMax's baseline (advantage --estimator remax)." + _default("rollout.greedy_baseline"))] = None,
    backend: Annotated[Optional[str], typer.Option("--backend", help="Rollout engine: transformers (hf) or vLLM." + _default("rollout.backend"), metavar=_choices(choices.ROLLOUT_BACKENDS))] = None,
    dtype: Annotated[Optional[str], typer.Option("--dtype", help="Compute dtype of generation." + _default("rollout.dtype"), metavar=_choices(choices.COMPUTE_DTYPES))] = None,
    max_prompt_tokens: Annotated[Optional[int], typer.Option("--max-prompt-tokens", help="Longest prompt in tokens." + _default("data.max_prompt_tokens"))] = None,
    truncate: Annotated[Optional[str], typer.Option("--truncate", help="A too-long prompt is an error, left-truncated (left), or left out (drop)." + _default("data.truncate"), metavar=_choices(choices.TRUNCATE))] = None,
    chat_template: ChatTemplateOpt = None,
    prompt_template: PromptTemplateOpt = None,
    system_prompt: SystemPromptOpt = None,
    workers_backend: WorkersBackendOpt = None,
    workers: WorkersOpt = None,
    address: AddressOpt = None,
    device: DeviceOpt = None,
    config: ConfigOpt = None,
    set_: SetOpt = None,
    fmt: FormatOpt = "arrow",
    rows_per_part: RowsOpt = 65536,
    as_json: JsonOpt = False,
    force: ForceOpt = False,
) -> None:
    """Sample responses from the policy for each prompt (writes the rollouts schema)."""
    from rlctl.config import override_section
    from rlctl.stages import rollout as stage

    cfg = _stage_config(config, set_)
    rollout_cfg = override_section(cfg.rollout, n=n, max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p, top_k=top_k, min_p=min_p, repetition_penalty=repetition_penalty, seed=seed, backend=backend, dtype=dtype, stop=stop or None,
        greedy_baseline=greedy_baseline,
    )
    data_cfg = override_section(cfg.data, max_prompt_tokens=max_prompt_tokens, truncate=truncate, chat_template=chat_template, prompt_template=prompt_template, system_prompt=system_prompt)
    device = device or cfg.model.device
    manifest = stage.run(
        prompts=prompts, model=model, out=_output(out, fmt, rows_per_part, as_json), cfg=rollout_cfg, data=data_cfg, device=device, force=force,
        workers=_workers_config(cfg, workers_backend, workers, address), engine=cfg.vllm,
    )
    _report(manifest, as_json)


@app.command()
def score(
    rollouts: Annotated[str, typer.Option("--rollouts", help="Rollouts: shard folder, file or -.")],
    out: OutOpt,
    reward: Annotated[Optional[str], typer.Option("--reward", help=f"file.py:fn, module:fn, builtin:NAME ({', '.join(choices.BUILTIN_REWARDS)}), rm:MODEL_URI, judge:MODEL_URI or an http(s):// endpoint." + _default("score.reward"))] = None,
    ref: Annotated[Optional[str], typer.Option("--ref", help="Reference model → ref_logprobs.")] = None,
    critic: Annotated[Optional[str], typer.Option("--critic", help="Critic (causal LM + value head) → values.")] = None,
    policy: Annotated[Optional[str], typer.Option("--policy", help="Policy model → old_logprobs.")] = None,
    sum_pi_squared: Annotated[Optional[bool], typer.Option("--sum-pi-squared/--no-sum-pi-squared", help="With --policy: each token's Σπ² too (the optimal_token_baseline estimator's)." + _default("score.sum_pi_squared"))] = None,
    reward_timeout: Annotated[Optional[float], typer.Option("--reward-timeout", help="Seconds a reward call may take." + _default("score.reward_timeout"))] = None,
    batch_size: Annotated[Optional[int], typer.Option("--batch-size", help="Sequences per forward pass at most (fewer where score.batch_tokens caps its tokens)." + _default("score.batch_size"))] = None,
    dtype: Annotated[Optional[str], typer.Option("--dtype", help="Compute dtype of the forward passes." + _default("score.dtype"), metavar=_choices(choices.COMPUTE_DTYPES))] = None,
    workers_backend: WorkersBackendOpt = None,
    workers: WorkersOpt = None,
    address: AddressOpt = None,
    device: DeviceOpt = None,
    config: ConfigOpt = None,
    set_: SetOpt = None,
    fmt: FormatOpt = "arrow",
    rows_per_part: RowsOpt = 65536,
    as_json: JsonOpt = False,
    force: ForceOpt = False,
) -> None:
    """Score rollouts with a reward; optionally add ref/old log-probs and critic values."""
    from rlctl.config import override_section
    from rlctl.stages import score as stage

    cfg = _stage_config(config, set_)
    score_cfg = override_section(cfg.score, reward=reward, reward_timeout=reward_timeout, batch_size=batch_size, dtype=dtype, sum_pi_squared=sum_pi_squared)
    manifest = stage.run(
        rollouts=rollouts, out=_output(out, fmt, rows_per_part, as_json), cfg=score_cfg,
        ref=ref, critic=critic, policy=policy, device=device or cfg.model.device, force=force,
        workers=_workers_config(cfg, workers_backend, workers, address),
    )
    _report(manifest, as_json)


@app.command()
def advantage(
    scores: Annotated[str, typer.Option("--scores", help="Scores: shard folder, file or -.")],
    out: OutOpt,
    estimator: Annotated[Optional[str], typer.Option("--estimator", help="Advantage estimator (docs/algorithms.md)." + _default("advantage.estimator"), metavar=_choices(choices.ESTIMATORS))] = None,
    gamma: Annotated[Optional[float], typer.Option("--gamma", help="Discount factor." + _default("advantage.gamma"))] = None,
    lam: Annotated[Optional[float], typer.Option("--lam", help="GAE lambda." + _default("advantage.lam"))] = None,
    kl_coef: Annotated[Optional[float], typer.Option("--kl-coef", help="KL penalty coefficient in the reward." + _default("advantage.kl_coef"))] = None,
    kl_estimator: Annotated[Optional[str], typer.Option("--kl-estimator", help="k1 (kl), k2 (mse), k3 (low_var_kl, bounded) or abs; a + suffix takes k2's gradient." + _default("advantage.kl_estimator"), metavar=_choices(choices.KL_ESTIMATORS))] = None,
    norm_by_std: Annotated[Optional[bool], typer.Option("--norm-by-std/--no-norm-by-std", help="GRPO: divide by the group's std." + _default("advantage.norm_by_std"))] = None,
    std_scope: Annotated[Optional[str], typer.Option("--std-scope", help="GRPO's std with --norm-by-std: the group's or the batch's." + _default("advantage.std_scope"), metavar=_choices(choices.STD_SCOPES))] = None,
    kl_controller: Annotated[Optional[str], typer.Option("--kl-controller", help="KL coefficient: fixed, or adaptive towards a target KL." + _default("advantage.kl_controller"), metavar=_choices(choices.KL_CONTROLLERS))] = None,
    pf_ppo: Annotated[Optional[str], typer.Option("--pf-ppo", help="Policy filtration: redraw the batch by a weight of each reward (PF-PPO)." + _default("advantage.pf_ppo"), metavar=_choices(choices.PF_PPO))] = None,
    kl_state: Annotated[Optional[str], typer.Option("--kl-state", help="A previous advantage output whose KL controller state to continue.")] = None,
    config: ConfigOpt = None,
    set_: SetOpt = None,
    fmt: FormatOpt = "arrow",
    rows_per_part: RowsOpt = 65536,
    as_json: JsonOpt = False,
    force: ForceOpt = False,
) -> None:
    """Turn rewards into per-token rewards, advantages and returns (pure math, no model)."""
    from rlctl.config import override_section, resolve_estimator_inputs
    from rlctl.stages import advantage as stage

    cfg = _stage_config(config, set_)
    adv_cfg = override_section(cfg.advantage, estimator=estimator, gamma=gamma, lam=lam, kl_coef=kl_coef, kl_estimator=kl_estimator, norm_by_std=norm_by_std, std_scope=std_scope, kl_controller=kl_controller, pf_ppo=pf_ppo)
    adv_cfg = resolve_estimator_inputs(dataclasses.replace(cfg, advantage=adv_cfg)).advantage  # otb_rollout_is = auto: the config's [update]
    manifest = stage.run(scores=scores, out=_output(out, fmt, rows_per_part, as_json), cfg=adv_cfg, kl_state=kl_state, force=force)
    _report(manifest, as_json)


@app.command()
def update(
    batch: Annotated[str, typer.Option("--batch", help="Batch: shard folder, file or -.")],
    model: Annotated[str, typer.Option("--model", help="Policy: HF folder or rlctl checkpoint (optimizer state is restored).")],
    out: Annotated[str, typer.Option("--out", help="Checkpoint folder to write.")],
    critic: Annotated[Optional[str], typer.Option("--critic", help="Critic to train too (written to OUT/critic).")] = None,
    lr: Annotated[Optional[float], typer.Option("--lr", help="Policy learning rate." + _default("update.lr"))] = None,
    epochs: Annotated[Optional[int], typer.Option("--epochs", help="PPO epochs over the batch." + _default("update.epochs"))] = None,
    mini_batch_size: Annotated[Optional[int], typer.Option("--mini-batch-size", help="Sequences per optimizer step (0 = all)." + _default("update.mini_batch_size"))] = None,
    micro_batch_size: Annotated[Optional[int], typer.Option("--micro-batch-size", help="Sequences per forward/backward." + _default("update.micro_batch_size"))] = None,
    loss_agg_mode: Annotated[Optional[str], typer.Option("--loss-agg-mode", help="How token losses become the batch loss (docs/algorithms.md)." + _default("update.loss_agg_mode"), metavar=_choices(choices.LOSS_AGG_MODES))] = None,
    bf16: Annotated[Optional[bool], typer.Option("--bf16/--no-bf16", help="bf16 autocast for forward/backward." + _default("update.bf16"))] = None,
    seed: Annotated[Optional[int], typer.Option("--seed", help="Shuffling seed." + _default("update.seed"))] = None,
    workers_backend: WorkersBackendOpt = None,
    workers: WorkersOpt = None,
    address: AddressOpt = None,
    device: DeviceOpt = None,
    config: ConfigOpt = None,
    set_: SetOpt = None,
    as_json: JsonOpt = False,
    force: ForceOpt = False,
) -> None:
    """Train the policy (and critic) on a batch with the PPO/GRPO loss; write a checkpoint."""
    from rlctl.config import override_section
    from rlctl.stages import update as stage

    if out == "-":
        raise InputError("update writes a checkpoint folder; --out - is not possible")
    cfg = _stage_config(config, set_)
    update_cfg = override_section(cfg.update, lr=lr, epochs=epochs, mini_batch_size=mini_batch_size, micro_batch_size=micro_batch_size, loss_agg_mode=loss_agg_mode, bf16=bf16, seed=seed)
    manifest = stage.run(
        batch=batch, model=model, out=out, cfg=update_cfg, critic=critic, device=device or cfg.model.device, force=force,
        workers=_workers_config(cfg, workers_backend, workers, address),
    )
    _report(manifest, as_json)


@app.command()
def reshard(
    checkpoint: Annotated[str, typer.Option("--checkpoint", help="Training checkpoint folder.")],
    out: Annotated[str, typer.Option("--out", help="Folder for rollout-layout weights.")],
    to: Annotated[Optional[str], typer.Option("--to", help="hf: one HF folder that transformers and vLLM load (the one target)." + _default("reshard.to"), metavar=_choices(choices.RESHARD_TARGETS))] = None,
    dtype: Annotated[Optional[str], typer.Option("--dtype", help="dtype of the written weights." + _default("reshard.dtype"), metavar=_choices(choices.RESHARD_DTYPES))] = None,
    check: Annotated[bool, typer.Option("--check", help="Reload the written weights and require them equal to the cast source.")] = False,
    merge_lora: Annotated[Optional[bool], typer.Option("--merge-lora", help="A LoRA checkpoint: merge the adapter into its base (W + B·A·alpha/r)." + _default("reshard.merge_lora"))] = None,
    config: ConfigOpt = None,
    set_: SetOpt = None,
    as_json: JsonOpt = False,
    force: ForceOpt = False,
) -> None:
    """Turn a training checkpoint into rollout weights (an HF folder, cast to a dtype; a LoRA
    checkpoint's adapter merged into its base with --merge-lora)."""
    from rlctl.config import override_section
    from rlctl.stages import reshard as stage

    cfg = _stage_config(config, set_)
    reshard_cfg = override_section(cfg.reshard, to=to, dtype=dtype, merge_lora=merge_lora)
    manifest = stage.run(checkpoint=checkpoint, out=out, cfg=reshard_cfg, check=check, force=force)
    _report(manifest, as_json)


# --- controller commands --------------------------------------------------------------------


@app.command()
def pipeline(
    config: Annotated[Path, typer.Argument(help="Pipeline TOML config.")],
    iterations: Annotated[Optional[int], typer.Option("--iterations", help="Iterations to run in total." + _default("pipeline.iterations"))] = None,
    resume: Annotated[bool, typer.Option("--resume", help="Continue an existing run folder (the default when one exists).")] = False,
    resume_with_changes: Annotated[bool, typer.Option("--resume-with-changes", help="Continue a run whose training keys (reward, model, lr, ...) you changed; the change is recorded.")] = False,
    from_stage: Annotated[Optional[str], typer.Option("--from", help="First stage to run in each iteration.", metavar=_choices(choices.PIPELINE_STAGES))] = None,
    until_stage: Annotated[Optional[str], typer.Option("--until", help="Last stage to run in each iteration.", metavar=_choices(choices.PIPELINE_STAGES))] = None,
    set_: SetOpt = None,
    run_dir: Annotated[Optional[str], typer.Option("--run-dir", help="Where the run's outputs go." + _default("pipeline.run_dir"))] = None,
    workers_backend: WorkersBackendOpt = None,
    workers: WorkersOpt = None,
    address: AddressOpt = None,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Print the plan and exit.")] = False,
    quiet: Annotated[bool, typer.Option("--quiet", help="One plain line per iteration.")] = False,
) -> None:
    """Run rollout → score → advantage → update → reshard for N iterations, models resident."""
    from rlctl.pipeline import run_pipeline_command

    flags = {"workers.backend": workers_backend, "workers.num_workers": workers, "workers.address": address}
    overrides = [*(set_ or []), *(f"{key}={value}" if key != "workers.address" else f'{key}="{value}"' for key, value in flags.items() if value is not None)]
    run_pipeline_command(
        config=config, overrides=overrides, iterations=iterations, resume=resume, resume_with_changes=resume_with_changes,
        from_stage=from_stage, until_stage=until_stage, run_dir=run_dir, dry_run=dry_run, quiet=quiet,
    )


@app.command("eval")
def eval_(
    model: Annotated[str, typer.Option("--model", help="Model to evaluate: HF folder or rlctl checkpoint.")],
    prompts: Annotated[str, typer.Option("--prompts", help="Held-out prompts: shard folder, .jsonl, .json or .parquet.")],
    reward: Annotated[Optional[str], typer.Option("--reward", help=f"file.py:fn, module:fn, builtin:NAME ({', '.join(choices.BUILTIN_REWARDS)}), rm:MODEL_URI, judge:MODEL_URI or an http(s):// endpoint." + _default("score.reward"))] = None,
    n: Annotated[Optional[int], typer.Option("--n", help="Samples per prompt." + _default("rollout.n"))] = None,
    temperature: Annotated[Optional[float], typer.Option("--temperature", help="Sampling temperature; 0 is greedy." + _default("rollout.temperature"))] = None,
    max_new_tokens: Annotated[Optional[int], typer.Option("--max-new-tokens", help="Longest response in tokens." + _default("rollout.max_new_tokens"))] = None,
    pass_threshold: Annotated[float, typer.Option("--pass-threshold", help="A sample passes (pass@k) when its reward is at least this.")] = 1.0,
    out: Annotated[Optional[str], typer.Option("--out", help="Also commit the scored samples here, the summary in their manifest.")] = None,
    chat_template: ChatTemplateOpt = None,
    prompt_template: PromptTemplateOpt = None,
    system_prompt: SystemPromptOpt = None,
    device: DeviceOpt = None,
    config: ConfigOpt = None,
    set_: SetOpt = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print the summary as JSON.")] = False,
    keep_prompts: Annotated[Optional[str], typer.Option("--keep-prompts", help="Also commit here (a shard folder, data.prompts of a run) the prompts whose pass rate lies in [--min-pass-rate, --max-pass-rate]: offline difficulty filtering.")] = None,
    min_pass_rate: Annotated[Optional[float], typer.Option("--min-pass-rate", help="With --keep-prompts: leave out the prompts that pass less often (e.g. 0.1 drops the never solved).  [default: 0]")] = None,
    max_pass_rate: Annotated[Optional[float], typer.Option("--max-pass-rate", help="With --keep-prompts: leave out the prompts that pass more often (e.g. 0.9 drops the always solved).  [default: 1]")] = None,
) -> None:
    """Evaluate a model on held-out prompts: mean@n, best@n, pass@k (and maj@n) per data_source;
    with --keep-prompts, keep the prompts of a pass rate in range (difficulty filtering)."""
    import json as json_module
    from dataclasses import asdict, replace

    from rlctl.config import override_section
    from rlctl.evaluate import PromptFilter, run

    keep = None
    if keep_prompts is None and (min_pass_rate is not None or max_pass_rate is not None):
        raise InputError("--min-pass-rate and --max-pass-rate choose the prompts --keep-prompts writes: give --keep-prompts OUT")
    if keep_prompts is not None:
        low, high = 0.0 if min_pass_rate is None else min_pass_rate, 1.0 if max_pass_rate is None else max_pass_rate
        if not 0 <= low <= high <= 1:
            raise InputError(f"--min-pass-rate and --max-pass-rate must satisfy 0 ≤ min ≤ max ≤ 1, got {low:g} and {high:g}")
        if keep_prompts == "-":
            raise InputError("--keep-prompts writes a prompts folder; stdout is the summary's: give a folder")
        if out is not None and keep_prompts.rstrip("/") == out.rstrip("/"):
            raise InputError(f"--keep-prompts and --out are both {out}: give each its own folder")
        keep = PromptFilter(_output(keep_prompts, "arrow", 65536, False), low, high)
    cfg = _stage_config(config, set_)
    cfg = replace(
        cfg, rollout=override_section(cfg.rollout, n=n, temperature=temperature, max_new_tokens=max_new_tokens),
        score=override_section(cfg.score, reward=reward),
        data=override_section(cfg.data, chat_template=chat_template, prompt_template=prompt_template, system_prompt=system_prompt),
    )
    rows, _ = run(
        model=model, prompts=prompts, cfg=cfg, threshold=pass_threshold, device=device or cfg.model.device, out=_output(out, "arrow", 65536, False) if out else None,
        keep=keep,
    )
    if as_json:
        typer.echo(json_module.dumps([asdict(row) for row in rows]))
        return
    from rich.console import Console
    from rich.table import Table

    ks = list(rows[0].pass_at)
    majority = [f"maj@{rows[0].samples}"] if rows[0].majority is not None else []
    table = Table(title=f"{model}: {rows[0].prompts} prompts × {rows[0].samples} samples, pass = reward ≥ {pass_threshold:g}", title_justify="left")
    for name in ("data_source", "prompts", f"mean@{rows[0].samples}", f"best@{rows[0].samples}", *(f"pass@{k}" for k in ks), *majority):
        table.add_column(name, justify="left" if name == "data_source" else "right")
    for row in rows:
        table.add_row(
            row.source, str(row.prompts), f"{row.mean:.4g}", f"{row.best:.4g}", *(f"{row.pass_at[k]:.4g}" for k in ks),
            *([f"{row.majority:.4g}"] if majority else []),
        )
    Console().print(table)


@app.command()
def sft(
    data: Annotated[str, typer.Option("--data", help="Examples: prompt (or messages) with response (or completion), or messages ending in the assistant's turn; .jsonl, .json, .parquet or a shard folder.")],
    model: Annotated[str, typer.Option("--model", help="Model to fine-tune: HF folder or rlctl checkpoint.")],
    out: Annotated[Optional[str], typer.Option("--out", help="Checkpoint folder to write (a pipeline's model.path can start from it).")] = None,
    val_data: Annotated[Optional[str], typer.Option("--val-data", help="Held-out examples: their loss before training and after each epoch.")] = None,
    evaluate: Annotated[bool, typer.Option("--eval", help="Train nothing: the loss (NLL per response token) and perplexity of --model on the examples --data, over all and per data_source (no --out).")] = False,
    epochs: Annotated[Optional[int], typer.Option("--epochs", help="Passes over the examples." + _default("sft.epochs"))] = None,
    lr: Annotated[Optional[float], typer.Option("--lr", help="Learning rate." + _default("sft.lr"))] = None,
    batch_size: Annotated[Optional[int], typer.Option("--batch-size", help="Examples per optimizer step." + _default("sft.batch_size"))] = None,
    device: DeviceOpt = None,
    config: ConfigOpt = None,
    set_: SetOpt = None,
    as_json: JsonOpt = False,
    force: ForceOpt = False,
) -> None:
    """Supervised fine-tuning on demonstrations: the warm start before RL (loss on responses
    only); or, with --eval, measure a model on held-out examples."""
    from dataclasses import replace

    from rlctl.config import override_section
    from rlctl.sft import run
    from rlctl.supervised import describe_epoch

    cfg = _stage_config(config, set_)
    cfg = replace(cfg, sft=override_section(cfg.sft, epochs=epochs, lr=lr, batch_size=batch_size))
    if evaluate:
        if out or val_data:
            raise InputError("sft --eval trains nothing and writes nothing: give the examples as --data, without --out or --val-data")
        _evaluate_sft(data, model, cfg, device or cfg.model.device, as_json)
        return
    if not out:
        raise InputError("sft needs --out, the folder to write the fine-tuned checkpoint to (or --eval to measure --model on --data)")

    def report(row: dict) -> None:
        if not as_json:
            _err(describe_epoch(row))

    manifest = run(data=data, model=model, out=out, cfg=cfg, val_data=val_data, device=device or cfg.model.device, force=force, report=report)
    _report(manifest, as_json)


@app.command("reward-model")
def reward_model(
    data: Annotated[str, typer.Option("--data", help="Preference pairs: chosen and rejected (text or messages) with prompt or messages, or whole chosen/rejected conversations; an optional margin column; .jsonl, .json, .parquet or a shard folder.")],
    model: Annotated[str, typer.Option("--model", help="Model to start from: a causal LM folder (a new one-output head) or a reward model.")],
    out: Annotated[Optional[str], typer.Option("--out", help="Reward model folder to write (score with rm:OUT).")] = None,
    val_data: Annotated[Optional[str], typer.Option("--val-data", help="Held-out pairs: their loss and accuracy before training and after each epoch.")] = None,
    evaluate: Annotated[bool, typer.Option("--eval", help="Train nothing: the loss, accuracy and margin of the reward model --model on the pairs --data, over all and per data_source (no --out).")] = False,
    epochs: Annotated[Optional[int], typer.Option("--epochs", help="Passes over the pairs." + _default("reward_model.epochs"))] = None,
    lr: Annotated[Optional[float], typer.Option("--lr", help="Learning rate." + _default("reward_model.lr"))] = None,
    batch_size: Annotated[Optional[int], typer.Option("--batch-size", help="Pairs per optimizer step." + _default("reward_model.batch_size"))] = None,
    device: DeviceOpt = None,
    config: ConfigOpt = None,
    set_: SetOpt = None,
    as_json: JsonOpt = False,
    force: ForceOpt = False,
) -> None:
    """Train a reward model on preference pairs (Bradley-Terry), for score's rm:FOLDER; or, with
    --eval, measure one on held-out pairs."""
    from dataclasses import replace

    from rlctl.config import override_section
    from rlctl.reward_model import run
    from rlctl.supervised import describe_epoch

    cfg = _stage_config(config, set_)
    cfg = replace(cfg, reward_model=override_section(cfg.reward_model, epochs=epochs, lr=lr, batch_size=batch_size))
    if evaluate:
        if out or val_data:
            raise InputError("reward-model --eval trains nothing and writes nothing: give the pairs as --data, without --out or --val-data")
        _evaluate_reward_model(data, model, cfg, device or cfg.model.device, as_json)
        return
    if not out:
        raise InputError("reward-model needs --out, the folder to write the reward model to (or --eval to measure --model on --data)")

    def report(row: dict) -> None:
        if not as_json:
            _err(describe_epoch(row, "reward-model"))

    manifest = run(data=data, model=model, out=out, cfg=cfg, val_data=val_data, device=device or cfg.model.device, force=force, report=report)
    _report(manifest, as_json)


@app.command()
def dpo(
    data: Annotated[str, typer.Option("--data", help="Preference pairs: chosen and rejected (text or messages) with prompt or messages, or whole chosen/rejected conversations; .jsonl, .json, .parquet or a shard folder.")],
    model: Annotated[str, typer.Option("--model", help="Policy to train (and the reference it is held to): HF folder or rlctl checkpoint.")],
    out: Annotated[Optional[str], typer.Option("--out", help="Checkpoint folder to write (a pipeline's model.path can start from it).")] = None,
    val_data: Annotated[Optional[str], typer.Option("--val-data", help="Held-out pairs: their loss and accuracy before training and after each epoch.")] = None,
    evaluate: Annotated[bool, typer.Option("--eval", help="Train nothing: the loss, accuracy, margin and rewards of the policy --model against --ref on the pairs --data, over all and per data_source (no --out).")] = False,
    ref: Annotated[Optional[str], typer.Option("--ref", help="With --eval: the reference (default: the weights a dpo checkpoint --model started from).")] = None,
    epochs: Annotated[Optional[int], typer.Option("--epochs", help="Passes over the pairs." + _default("dpo.epochs"))] = None,
    lr: Annotated[Optional[float], typer.Option("--lr", help="Learning rate." + _default("dpo.lr"))] = None,
    batch_size: Annotated[Optional[int], typer.Option("--batch-size", help="Pairs per optimizer step." + _default("dpo.batch_size"))] = None,
    beta: Annotated[Optional[float], typer.Option("--beta", help="Strength of the pull towards the reference." + _default("dpo.beta"))] = None,
    loss: Annotated[Optional[str], typer.Option("--loss", help="Preference loss: DPO's sigmoid, robust DPO, IPO, hinge, SimPO and ORPO (no reference), or TRL's further losses by their names (docs/algorithms.md); several, comma-separated, are summed (dpo.loss_weights)." + _default("dpo.loss"), metavar=_choices(choices.DPO_LOSSES))] = None,
    device: DeviceOpt = None,
    config: ConfigOpt = None,
    set_: SetOpt = None,
    as_json: JsonOpt = False,
    force: ForceOpt = False,
) -> None:
    """Direct preference optimization: train the policy on preference pairs, no reward model; or,
    with --eval, measure a trained one against its reference on held-out pairs."""
    from dataclasses import replace

    from rlctl.config import override_section
    from rlctl.dpo import run

    # --loss before the --set items too, so that `--loss a,b --set dpo.loss_weights=[...]` is checked as one
    cfg = _stage_config(config, [*([f"dpo.loss={json.dumps(loss)}"] if loss is not None else []), *(set_ or [])])
    cfg = replace(cfg, dpo=override_section(cfg.dpo, epochs=epochs, lr=lr, batch_size=batch_size, beta=beta, loss=loss))
    _train_against_reference_or_measure(
        "dpo", "pairs", run, _evaluate_dpo, data=data, model=model, out=out, val_data=val_data, evaluate=evaluate, ref=ref, cfg=cfg,
        device=device or cfg.model.device, as_json=as_json, force=force,
    )


@app.command()
def kto(
    data: Annotated[str, typer.Option("--data", help="Examples: prompt (or messages) with completion (or response) and a boolean label (true: desirable), or preference pairs (chosen/rejected, taken as two examples); .jsonl, .json, .parquet or a shard folder.")],
    model: Annotated[str, typer.Option("--model", help="Policy to train (and the reference it is held to): HF folder or rlctl checkpoint.")],
    out: Annotated[Optional[str], typer.Option("--out", help="Checkpoint folder to write (a pipeline's model.path can start from it).")] = None,
    val_data: Annotated[Optional[str], typer.Option("--val-data", help="Held-out examples: their loss and reward margin before training and after each epoch.")] = None,
    evaluate: Annotated[bool, typer.Option("--eval", help="Train nothing: the loss, reference point and rewards of the policy --model against --ref on the examples --data, over all and per data_source (no --out).")] = False,
    ref: Annotated[Optional[str], typer.Option("--ref", help="With --eval: the reference (default: the weights a kto checkpoint --model started from).")] = None,
    epochs: Annotated[Optional[int], typer.Option("--epochs", help="Passes over the examples." + _default("kto.epochs"))] = None,
    lr: Annotated[Optional[float], typer.Option("--lr", help="Learning rate." + _default("kto.lr"))] = None,
    batch_size: Annotated[Optional[int], typer.Option("--batch-size", help="Examples per optimizer step." + _default("kto.batch_size"))] = None,
    beta: Annotated[Optional[float], typer.Option("--beta", help="Strength of the pull towards the reference." + _default("kto.beta"))] = None,
    loss: Annotated[Optional[str], typer.Option("--loss", help="KTO's loss against the reference point, or APO-zero on single responses (no reference point) (docs/algorithms.md)." + _default("kto.loss"), metavar=_choices(choices.KTO_LOSSES))] = None,
    device: DeviceOpt = None,
    config: ConfigOpt = None,
    set_: SetOpt = None,
    as_json: JsonOpt = False,
    force: ForceOpt = False,
) -> None:
    """Kahneman-Tversky optimization: train the policy on responses labelled desirable or
    undesirable, no pairs needed; or, with --eval, measure a trained one against its reference."""
    from dataclasses import replace

    from rlctl.config import override_section
    from rlctl.kto import run

    cfg = _stage_config(config, set_)
    cfg = replace(cfg, kto=override_section(cfg.kto, epochs=epochs, lr=lr, batch_size=batch_size, beta=beta, loss=loss))
    _train_against_reference_or_measure(
        "kto", "examples", run, _evaluate_kto, data=data, model=model, out=out, val_data=val_data, evaluate=evaluate, ref=ref, cfg=cfg,
        device=device or cfg.model.device, as_json=as_json, force=force,
    )


def _train_against_reference_or_measure(
    name: str, noun: str, run, measure, *, data: str, model: str, out: str | None, val_data: str | None, evaluate: bool, ref: str | None, cfg,
    device: str, as_json: bool, force: bool,
) -> None:
    """`rlctl dpo` and `rlctl kto`: with --eval, `measure` --model against --ref on --data;
    otherwise `run` the training into --out, each epoch's line on stderr."""
    from rlctl.supervised import describe_epoch

    if evaluate:
        if out or val_data:
            raise InputError(f"{name} --eval trains nothing and writes nothing: give the {noun} as --data, without --out or --val-data")
        measure(data, model, ref, cfg, device, as_json)
        return
    if ref:
        raise InputError(f"{name} --ref names the reference of --eval; training's reference is --model's starting weights")
    if not out:
        raise InputError(f"{name} needs --out, the folder to write the trained policy to (or --eval to measure --model on --data)")

    def report(row: dict) -> None:
        if not as_json:
            _err(describe_epoch(row, name))

    _report(run(data=data, model=model, out=out, cfg=cfg, val_data=val_data, device=device, force=force, report=report), as_json)


def _evaluate_sft(data: str, model: str, cfg, device: str, as_json: bool) -> None:
    """`rlctl sft --eval`: the table (or JSON) of rlctl.sft.evaluate's rows."""
    from rlctl.sft import evaluate

    rows = evaluate(data=data, model=model, cfg=cfg, device=device)
    _sources_table(rows, f"{model} on {data}: {rows[0].examples} examples, {rows[0].tokens} response tokens", ("examples", "tokens", "loss", "perplexity"), as_json)


def _evaluate_reward_model(data: str, model: str, cfg, device: str, as_json: bool) -> None:
    """`rlctl reward-model --eval`: the table (or JSON) of rlctl.reward_model.evaluate's rows."""
    from rlctl.reward_model import evaluate

    rows, dropped = evaluate(data=data, model=model, cfg=cfg, device=device)
    left_out = f", {dropped} left out as too long" if dropped else ""
    _sources_table(rows, f"{model} on {data}: {rows[0].pairs} pairs{left_out}", ("pairs", "accuracy", "margin", "loss"), as_json, dropped=dropped)


def _evaluate_dpo(data: str, model: str, ref: str | None, cfg, device: str, as_json: bool) -> None:
    """`rlctl dpo --eval`: the table (or JSON) of rlctl.dpo.evaluate's rows."""
    from rlctl.dpo import evaluate

    rows = evaluate(data=data, model=model, ref=ref, cfg=cfg, device=device)
    columns = ("pairs", "accuracy", "margin", "chosen_reward", "rejected_reward", "loss")
    _sources_table(rows, f"{model} on {data}: {rows[0].pairs} pairs, {cfg.dpo.loss} loss, beta {cfg.dpo.beta:g}", columns, as_json)


def _evaluate_kto(data: str, model: str, ref: str | None, cfg, device: str, as_json: bool) -> None:
    """`rlctl kto --eval`: the table (or JSON) of rlctl.kto.evaluate's rows."""
    from rlctl.kto import evaluate

    rows = evaluate(data=data, model=model, ref=ref, cfg=cfg, device=device)
    columns = ("examples", "desirable_reward", "undesirable_reward", "margin", "kl", "loss")
    _sources_table(rows, f"{model} on {data}: {rows[0].examples} examples, beta {cfg.kto.beta:g}", columns, as_json)


def _figure(value) -> str:
    """A table cell: a count whole, a figure to 4 significant digits, none as a dash."""
    return "—" if value is None else str(value) if isinstance(value, int) else f"{value:.4g}"


def _sources_table(rows: list, title: str, columns: tuple[str, ...], as_json: bool, **extra) -> None:
    """Rows of figures, one over all and one per data_source (`row.source`): a table, or JSON (`extra` beside the rows)."""
    import json as json_module
    from dataclasses import asdict

    if as_json:
        typer.echo(json_module.dumps({"rows": [asdict(row) for row in rows], **extra}))
        return
    from rich.console import Console
    from rich.table import Table

    table = Table(title=title, title_justify="left")
    for name in ("data_source", *columns):
        table.add_column(name, justify="left" if name == "data_source" else "right")
    for row in rows:
        table.add_row(row.source, *(_figure(getattr(row, name)) for name in columns))
    Console().print(table)


@app.command()
def replay(
    stage_dir: Annotated[str, typer.Argument(help="RUN/iter-NNNN/STAGE of a recorded run.")],
    check: Annotated[bool, typer.Option("--check", help="Compare with the recorded output.")] = False,
    out: Annotated[Optional[str], typer.Option("--out", help="Where the replay writes (default: a scratch folder).")] = None,
    set_: SetOpt = None,
    reward: Annotated[Optional[str], typer.Option("--reward", help="Reward to score with (instead of the one the run folder names).")] = None,
    trust_run_code: Annotated[bool, typer.Option("--trust-run-code", help="Run the reward or tool code the run folder names (file.py:fn, module:fn).")] = False,
) -> None:
    """Re-run one recorded stage from its recorded inputs, config, seed and RNG state."""
    from rlctl.replay import replay_stage

    result = replay_stage(stage_dir, check=check, out=out, overrides=set_ or [], reward=reward, trust_run_code=trust_run_code)
    typer.echo(result)


@app.command()
def show(
    uri: Annotated[str, typer.Argument(help="A shard folder or file, a manifest, a checkpoint, a run folder, one of its iteration folders, or -.")],
    rows: Annotated[Optional[int], typer.Option("--rows", help="Rows to show: a shard's first (10 unless given), a run's last iterations (all unless given).", min=0)] = None,
    width: Annotated[Optional[int], typer.Option("--width", help="Longest cell shown, in characters (default: 40 in a table, the terminal's line in records).", min=4)] = None,
    columns: Annotated[Optional[str], typer.Option("--columns", help="Comma-separated columns to show: a shard's, or a run's metrics (any in metrics.jsonl).")] = None,
    sort: Annotated[Optional[str], typer.Option("--sort", help="Show a shard's rows ordered by COLUMN, or -COLUMN for descending (a list column by its mean): --sort reward for the worst samples.")] = None,
    where: Annotated[Optional[list[str]], typer.Option("--where", help="Only a shard's rows where COLUMN OP VALUE holds (OP: = != < <= > >=; a list column by its mean), e.g. --where 'reward < 0.5'; repeat: all hold.")] = None,
    layout: Annotated[str, typer.Option("--layout", help="A shard's rows as a table, or as records (a line per column); auto: records where the table's columns would be too narrow to read.", metavar=_choices(choices.SHOW_LAYOUTS))] = "auto",
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON for machines.")] = False,
) -> None:
    """Print a shard, a manifest, a checkpoint, a run or one of its iterations as a table."""
    from rlctl.show import show as show_uri

    show_uri(uri, rows=rows, width=width, as_json=as_json, columns=columns.split(",") if columns else None, layout=layout, sort=sort, where=where)


@app.command()
def verify(
    path: Annotated[str, typer.Argument(help="A run folder, a committed output or checkpoint, or any folder holding them (any fsspec URL).")],
    sizes_only: Annotated[bool, typer.Option("--sizes-only", help="Check the files' sizes, not their sha256: fast, but a changed byte goes unseen.")] = False,
    show_all: Annotated[bool, typer.Option("--all", help="List the intact folders too (by default only those that need a look, and the totals).")] = False,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON for machines: every folder's finding and the counts.")] = False,
) -> None:
    """Check every committed output under PATH against its manifest and find half-written ones; exit 1 if any is damaged or stale."""
    from rlctl.folders import verify_enabled
    from rlctl.verify import FAILING, summary, verify_tree

    digests = verify_enabled() and not sizes_only
    findings = verify_tree(path, digests=digests)
    if as_json:
        import json

        counts = {status: sum(1 for f in findings if f.status == status) for status in sorted({f.status for f in findings})}
        typer.echo(json.dumps({"path": path, "digests": digests, "findings": [f.to_dict() for f in findings], "counts": counts}))
    else:
        from rich.console import Console
        from rich.table import Table

        shown = [f for f in findings if show_all or f.status != "ok"]
        if shown:
            table = Table(title_justify="left")
            for name in ("folder", "stage", "status", "detail"):
                table.add_column(name, overflow="fold")
            for f in shown:
                table.add_row(f.folder, f.stage or "—", f.status, f.detail or "")
            Console().print(table)
        typer.echo(summary(findings, digests))
    if any(f.status in FAILING for f in findings):
        raise typer.Exit(1)


@app.command()
def plot(
    run_dirs: Annotated[list[str], typer.Argument(help="Run folders written by rlctl pipeline; several share the panels, a line each.")],
    out: Annotated[Optional[str], typer.Option("--out", help="PNG file to write (default RUN/metrics.png; for several runs, compare.png in their common folder).")] = None,
    metrics: Annotated[Optional[str], typer.Option("--metrics", help="Comma-separated metrics of metrics.jsonl, a panel each, instead of the usual panels.")] = None,
) -> None:
    """Plot reward, KL, entropy, response length and validation score by iteration."""
    from rlctl.plot import plot_runs

    typer.echo(plot_runs(run_dirs, out, metrics.split(",") if metrics else None))


@model_app.command("init")
def model_init(
    directory: Annotated[Path, typer.Argument(help="Folder to write the model into.")],
    preset: Annotated[str, typer.Option("--preset", help="tiny (≈0.85M params), small (≈25M) or medium (≈494M, Qwen2.5-0.5B's shape).", metavar=_choices(choices.PRESETS))] = "tiny",
    seed: Annotated[int, typer.Option("--seed", help="Seed for weights and tokenizer text.")] = 0,
    force: Annotated[bool, typer.Option("--force", help="Replace the model a folder holds already (never a folder of other files).")] = False,
) -> None:
    """Write a random Qwen2-style model + byte-level BPE tokenizer, fully offline."""
    from rlctl.backends.hf import quiet_transformers
    from rlctl.modelinit import init_model

    quiet_transformers()
    path = init_model(directory, preset=preset, seed=seed, replace=force)
    typer.echo(str(path))


@config_app.command("show")
def config_show(
    config: Annotated[Optional[Path], typer.Argument(help="A TOML config file (default: every default).")] = None,
    set_: SetOpt = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print a JSON list of {key, type, default, value, description}.")] = False,
) -> None:
    """Print every config key with its type, default, current value and meaning."""
    import json

    from rlctl import config_doc

    cfg = _stage_config(config, set_)
    typer.echo(json.dumps(config_doc.as_json(cfg), indent=1) if as_json else config_doc.show(cfg))


@config_app.command("diff")
def config_diff(
    first: Annotated[str, typer.Argument(help="A TOML config file, or a run folder (the config it ran with).")],
    second: Annotated[str, typer.Argument(help="Another one.")],
    as_json: Annotated[bool, typer.Option("--json", help="Print a JSON list of {key, first, second}.")] = False,
) -> None:
    """Print the keys two configs or runs differ in, defaults filled in (values as written)."""
    import json

    from rich.console import Console
    from rich.table import Table

    from rlctl.config import _toml_value
    from rlctl.config_doc import config_of, differences

    found = differences(config_of(first), config_of(second))
    if as_json:
        typer.echo(json.dumps([{"key": k, "first": a, "second": b} for k, a, b in found], indent=1, default=str))
        return
    if not found:
        typer.echo(f"{first} and {second}: the same config")
        return
    table = Table("key", first, second, title=f"{len(found)} keys differ", title_justify="left")
    for key, a, b in found:
        table.add_row(key, _toml_value(a), _toml_value(b))
    Console(soft_wrap=False).print(table)


# --- the one place errors become exit codes -------------------------------------------------


def _map_errors(command):
    """Run `command`; typed errors become one stderr line and their exit code (2 or 1)."""

    @functools.wraps(command)
    def wrapper(*args, **kwargs):
        try:
            return command(*args, **kwargs)
        except RlctlError as exc:
            if getattr(exc, "details", ""):  # what a dead worker printed last, above the one error line
                _err(exc.details)
            _err(f"rlctl: error: {exc}")
            raise typer.Exit(exc.exit_code) from None
        except KeyboardInterrupt:
            _err("rlctl: interrupted")
            raise typer.Exit(130) from None
        except (typer.Exit, SystemExit):
            raise
        except Exception as exc:  # an rlctl bug or an environment failure
            if os.environ.get("RLCTL_DEBUG"):
                raise
            _err(f"rlctl: error: {type(exc).__name__}: {exc} (set RLCTL_DEBUG=1 for the traceback)")
            raise typer.Exit(1) from None

    return wrapper


for _info in [*app.registered_commands, *model_app.registered_commands, *config_app.registered_commands]:
    _info.callback = _map_errors(_info.callback)


def main() -> None:
    """Console entry point."""
    from rlctl import process_setup
    from rlctl.threads import configure_openmp

    configure_openmp()  # before any command imports torch
    try:
        process_setup.prepare()  # likewise: MKL's kernels are chosen when torch loads it
    except InputError as exc:
        _err(f"rlctl: error: {exc}")
        sys.exit(2)
    try:
        app()
    except BrokenPipeError:  # `rlctl ... --out - | head`: the reader left; not an error of ours
        sys.stdout = None
        sys.exit(1)
