"""rollout: prompts + policy weights → rollouts (token ids, text, behaviour log-probs).

Reads the prompts schema (a shard folder, JSON Lines, verl-style parquet or `-`) and writes
the rollouts schema, one row per (prompt, sample), samples of a prompt adjacent.

    rlctl rollout --prompts examples/prompts.jsonl --model models/tiny --out runs/r --n 4
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import replace

import pyarrow as pa

from rlctl.backends.base import ROLLOUT_BACKENDS, Generation, RolloutEngine, sampling_params
from rlctl.backends.stop_strings import StopStrings
from rlctl.choices import TRUNCATE
from rlctl.config import DataConfig, RolloutConfig, VLLMConfig, WorkersConfig, to_dict
from rlctl.dtypes import compute_dtype, models_device
from rlctl.errors import InputError
from rlctl.lineage import make_manifest, model_ref, shards_ref, up_to_date
from rlctl.manifest import Manifest
from rlctl.progress import progress_bar
from rlctl.sample_stats import merged_rollout_stats, rollout_stats
from rlctl.shards import OutputSpec, read, write
from rlctl.tensors import list_column, set_columns
from rlctl.tool_turns import check_tool

SAMPLING_KEY = b"rlctl.sampling"


def run(
    *, prompts: str, model: str, out: OutputSpec, cfg: RolloutConfig, data: DataConfig, device: str = "auto", force: bool = False,
    workers: WorkersConfig = WorkersConfig(), engine: VLLMConfig = VLLMConfig(),
) -> Manifest:
    """Generate and commit; `workers.backend = "ray"` spreads the rows over a worker group
    (the same rows as one process: each row samples from its own random stream). `engine`
    holds the vLLM settings when `cfg.backend` is vllm. An "auto" dtype is decided here, for
    the device the models run on, and the manifest records the decision."""
    check_tool(cfg.tool, cfg.stop)
    cfg = replace(cfg, dtype=compute_dtype(cfg.dtype, models_device(device, workers)))
    source = read(prompts, "prompts")
    from rlctl.backends.hf import check_model_dir, read_trainer_step

    check_model_dir(model)
    manifest = make_manifest("rollout", stage_config(cfg, data, engine), [shards_ref(source), model_ref(model)], seed=cfg.seed)
    if (existing := up_to_date(out.uri, manifest, force)) is not None:
        return existing
    version = read_trainer_step(model)
    manifest.state = {**manifest.state, "workers": to_dict(workers)}
    if workers.backend == "ray":
        from rlctl.workers import worker_group

        with worker_group(workers, policy=model, rollout=cfg, engine=engine) as group:
            if out.uri != "-":  # the ranks' slices of the prompts that fit: each row's random stream as in one process
                kept, _ = fitting_prompts(source.table, group.engine.tokenizer, data, context_length=group.engine.context_length, max_new_tokens=cfg.max_new_tokens)
                return rollout_parts_on_workers(group, kept, cfg, data, version, out, manifest)
            table = rollout_table(source.table, group.engine, cfg, data, policy_version=version)
    else:
        generator = ROLLOUT_BACKENDS.get(cfg.backend)(model, device, cfg, engine)
        try:
            table = rollout_table(source.table, generator, cfg, data, policy_version=version)
        finally:
            if hasattr(generator, "close"):
                generator.close()
    manifest.metrics = rollout_stats(table)
    return write(table, out.uri, manifest, schema="rollouts", format=out.format, rows_per_part=out.rows_per_part)


def stage_config(cfg: RolloutConfig, data: DataConfig, engine: VLLMConfig) -> dict:
    """What decides a rollout's rows: its key in manifests (the vLLM settings only for vLLM)."""
    config = {"rollout": to_dict(cfg), "data": to_dict(data)}
    if cfg.backend == "vllm":
        config["vllm"] = to_dict(engine)
    return config


def prompt_limit(data: DataConfig, context_length: int | None, max_new_tokens: int) -> tuple[int, str]:
    """The most tokens a prompt may have, and the words for why: `max_prompt_tokens`, or less
    where the model's context must also hold `max_new_tokens`."""
    limit = data.max_prompt_tokens
    if context_length is not None:
        if max_new_tokens >= context_length:
            raise InputError(f"max_new_tokens={max_new_tokens} leaves no room for a prompt in the model's context of {context_length} tokens")
        limit = min(limit, context_length - max_new_tokens)
    if limit == data.max_prompt_tokens:
        return limit, f"max_prompt_tokens={data.max_prompt_tokens}"
    return limit, f"the model's context of {context_length} tokens less max_new_tokens={max_new_tokens}"


def prompt_chat(prompt_id, prompt: str | None, chat: list[dict] | None, data: DataConfig) -> tuple[str | None, list[dict] | None]:
    """(plain text, conversation) a prompt is rendered from — one of them None: a plain prompt
    put into `data.prompt_template`, and under `chat_template` made the user's message; a
    conversation with `data.system_prompt` first where it has no system message. The rollout,
    validation, eval and the supervised commands' prompts all read prompts through this."""
    if chat is None and prompt is None:
        raise InputError(f"prompt {prompt_id!r} has neither prompt nor messages")
    if chat is None and data.prompt_template:
        prompt = data.prompt_template.replace("{prompt}", prompt)
    if chat is None and data.chat_template:
        chat = [{"role": "user", "content": prompt}]
    if chat is None:
        if data.system_prompt:
            raise InputError(f"prompt {prompt_id!r} is plain text, and data.system_prompt is a chat message: set data.chat_template = true (or give messages)")
        return prompt, None
    if data.system_prompt and not (chat and chat[0].get("role") == "system"):
        chat = [{"role": "system", "content": data.system_prompt}, *chat]
    return None, chat


def shaped_prompts(table: pa.Table, data: DataConfig) -> list[tuple[str, str | None, list[dict] | None]]:
    """(id, plain text, conversation) of every prompt row, as `prompt_chat` shapes it. A
    pipeline calls this on its prompt files before any work, so a shape that cannot apply is
    refused first."""
    ids = table.column("id").to_pylist()
    prompts = table.column("prompt").to_pylist() if "prompt" in table.column_names else [None] * len(ids)
    messages = table.column("messages").to_pylist() if "messages" in table.column_names else [None] * len(ids)
    return [(prompt_id, *prompt_chat(prompt_id, prompt, chat, data)) for prompt_id, prompt, chat in zip(ids, prompts, messages)]


def prompt_tokens(table: pa.Table, tokenizer, data: DataConfig) -> list[tuple[str, list[int]]]:
    """(id, token ids) of every prompt as `prompt_chat` makes it: a conversation through the
    chat template with its generation prompt, plain text as it is."""
    encoded = []
    for prompt_id, prompt, chat in shaped_prompts(table, data):
        text = tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=True, **data.chat_template_kwargs) if chat is not None else prompt
        tokens = tokenizer(text, add_special_tokens=False)["input_ids"]
        if not tokens:
            raise InputError(f"prompt {prompt_id!r} is empty after tokenization")
        encoded.append((prompt_id, tokens))
    return encoded


def encode_prompts(
    table: pa.Table, tokenizer, data: DataConfig, *, context_length: int | None = None, max_new_tokens: int = 0,
    tokenized: list[tuple[str, list[int]]] | None = None,
) -> list[list[int]]:
    """Token ids of every prompt (`prompt_tokens`, or `tokenized`: theirs already). Too long for
    `max_prompt_tokens`, or for the model's context with `max_new_tokens` to come → error, or
    left-truncate (a prompt `data.truncate = "drop"` would leave out is an error here:
    `fitting_prompts` drops first)."""
    limit, why = prompt_limit(data, context_length, max_new_tokens)
    encoded = []
    for prompt_id, tokens in tokenized if tokenized is not None else prompt_tokens(table, tokenizer, data):
        if len(tokens) > limit:
            if data.truncate == "drop":  # a caller that samples drops first; others (sft's prompts) cannot leave an example out
                raise InputError(f"prompt {prompt_id!r} has {len(tokens)} tokens, over {why}: data.truncate = drop leaves out only prompts to sample from; cut it with left")
            if data.truncate != "left":
                raise InputError(f"prompt {prompt_id!r} has {len(tokens)} tokens, over {why} (use --truncate left to cut it, or drop to leave it out)")
            tokens = tokens[-limit:]
        encoded.append(tokens)
    return encoded


def fitting_prompts(table: pa.Table, tokenizer, data: DataConfig, *, context_length: int | None = None, max_new_tokens: int = 0) -> tuple[pa.Table, list[str]]:
    """With `data.truncate = "drop"` (verl's filter_overlong_prompts), the rows whose prompt
    fits and the ids of those left out (none left is an error); otherwise the table as it is."""
    kept, dropped, _ = fitting_prompt_tokens(table, tokenizer, data, context_length=context_length, max_new_tokens=max_new_tokens)
    return kept, dropped


def fitting_prompt_tokens(
    table: pa.Table, tokenizer, data: DataConfig, *, context_length: int | None = None, max_new_tokens: int = 0,
) -> tuple[pa.Table, list[str], list[tuple[str, list[int]]] | None]:
    """`fitting_prompts`, with the kept prompts' (id, tokens) where it tokenized them (with
    `data.truncate = "drop"`; else None), so that they are not tokenized again."""
    if data.truncate != "drop":
        return table, [], None
    limit, why = prompt_limit(data, context_length, max_new_tokens)
    tokenized = prompt_tokens(table, tokenizer, data)
    fits = [len(tokens) <= limit for _, tokens in tokenized]
    dropped = [prompt_id for prompt_id, ok in zip(table.column("id").to_pylist(), fits) if not ok]
    if dropped and len(dropped) == table.num_rows:
        raise InputError(f"every prompt ({table.num_rows}) is over {why}: none left to sample with data.truncate = drop")
    if dropped:
        notice_dropped(dropped, table.num_rows, why)
    kept = [pair for pair, ok in zip(tokenized, fits) if ok]
    return (table.filter(pa.array(fits, pa.bool_())) if dropped else table), dropped, kept


def notice_dropped(dropped: list[str], total: int, why: str) -> None:
    """One stderr line naming the prompts `data.truncate = "drop"` left out (the first few)."""
    import sys

    shown = ", ".join(map(repr, dropped[:5])) + (f", ... ({len(dropped) - 5} more)" if len(dropped) > 5 else "")
    print(f"rlctl: data.truncate = drop: left out {len(dropped)} of {total} prompts over {why}: {shown}", file=sys.stderr, flush=True)


def rollout_table(
    prompts: pa.Table, engine: RolloutEngine, cfg: RolloutConfig, data: DataConfig, *, policy_version: int,
    on_tokens: Callable[[int], None] | None = None, first_row: int = 0,
) -> pa.Table:
    """Generate `cfg.n` samples per prompt row; carry the prompt columns onto each sample.
    Progress goes to `on_tokens` when given (the pipeline's view), else to a progress bar."""
    if data.truncate not in TRUNCATE:
        raise InputError(f"truncate must be one of {', '.join(TRUNCATE)}, got {data.truncate!r}")
    check_tool(cfg.tool, cfg.stop)
    context = {"context_length": getattr(engine, "context_length", None), "max_new_tokens": cfg.max_new_tokens}
    prompts, _, tokenized = fitting_prompt_tokens(prompts, engine.tokenizer, data, **context)
    prompt_ids = encode_prompts(prompts, engine.tokenizer, data, tokenized=tokenized, **context)
    repeated = [ids for ids in prompt_ids for _ in range(cfg.n)]
    rows = pa.array([i for i in range(prompts.num_rows) for _ in range(cfg.n)], pa.int64())
    table = prompts.take(rows)

    def generate(advance: Callable[[int], None]) -> tuple[list[Generation], dict[str, pa.Array], list[Generation]]:
        """The samples (with the tool's columns), then each prompt's greedy response where asked."""
        samples, tool_columns = _generate(engine, table, repeated, cfg, first_row, advance, data.chat_template_kwargs)
        greedy_ones = _generate(engine, prompts, prompt_ids, greedy(cfg), first_row, advance, data.chat_template_kwargs)[0] if cfg.greedy_baseline else []
        return samples, tool_columns, greedy_ones

    if on_tokens is not None:
        generations, tool_columns, baseline = generate(on_tokens)
    else:
        total = (len(repeated) + (len(prompt_ids) if cfg.greedy_baseline else 0)) * cfg.max_new_tokens
        with progress_bar("rollout", total=total, unit="tok") as bar:
            generations, tool_columns, baseline = generate(bar.advance)
    if cfg.greedy_baseline:
        baseline_ids = [g.response_ids for g in baseline for _ in range(cfg.n)]
        tool_columns = {
            **tool_columns,
            "baseline_response_ids": list_column(baseline_ids, pa.int32()),
            "baseline_response": pa.array(engine.tokenizer.batch_decode(baseline_ids, skip_special_tokens=True), pa.string()),
        }
    responses = engine.tokenizer.batch_decode([g.response_ids for g in generations], skip_special_tokens=True)
    columns = {
        "sample": pa.array([s for _ in range(prompts.num_rows) for s in range(cfg.n)], pa.int32()),
        "prompt_ids": list_column(repeated, pa.int32()),
        "response_ids": list_column([g.response_ids for g in generations], pa.int32()),
        "response": pa.array(responses, pa.string()),
        "rollout_logprobs": list_column([g.logprobs for g in generations], pa.float32()),
        "finish_reason": pa.array([g.finish_reason for g in generations], pa.string()),
        "policy_version": pa.array([policy_version] * len(generations), pa.int64()),
        **tool_columns,
    }
    table = set_columns(table, columns)
    sampling = {"temperature": cfg.temperature, "top_p": cfg.top_p, "top_k": cfg.top_k, "max_new_tokens": cfg.max_new_tokens, **({"min_p": cfg.min_p} if cfg.min_p else {}),
                **({"repetition_penalty": cfg.repetition_penalty} if cfg.repetition_penalty != 1.0 else {})}
    metadata = dict(table.schema.metadata or {})
    metadata[SAMPLING_KEY] = json.dumps(sampling, sort_keys=True).encode()
    return table.replace_schema_metadata(metadata)


def greedy(cfg: RolloutConfig) -> RolloutConfig:
    """The settings of the greedy responses beside the samples (ReMax's baselines): one a
    prompt, the most likely token at every step; stop strings and tool turns as the samples'."""
    return replace(cfg, n=1, temperature=0.0, top_p=1.0, top_k=0, min_p=0.0, greedy_baseline=False)


def _generate(
    engine: RolloutEngine, table: pa.Table, prompt_ids: list[list[int]], cfg: RolloutConfig, first_row: int, on_tokens: Callable[[int], None],
    template_kwargs: dict | None = None,
) -> tuple[list[Generation], dict[str, pa.Array]]:
    """Every row's response, cut at its first stop string (one rule for every engine: the
    token that completes one ends the row), and with `rollout.tool` the turns that follow
    (rlctl.tool_turns) with the columns that say whose tokens are whose."""
    params = sampling_params(cfg)
    if cfg.tool and cfg.tool_format == "chat":
        from rlctl.tool_turns import chat_turn_text

        chat_turn_text(engine.tokenizer, "", cfg.tool_role, template_kwargs)  # a template that cannot render the tool's turn: before any work
    generations = engine.generate(prompt_ids, params, batch_size=cfg.batch_size, on_tokens=on_tokens, compute_dtype=cfg.dtype, first_row=first_row)
    stops = StopStrings(engine.tokenizer, params.stop)
    if not stops:
        return generations, {}
    generations, at_stop_string = stops.cut_all(generations)
    if not cfg.tool:
        return generations, {}
    from rlctl.stages.score import reward_samples
    from rlctl.tool_turns import Tool, chat_turn_text, first_turn, take_turns, turn_seed

    samples = reward_samples(table)

    def call_tool(indices: list[int], transcripts) -> list[str | None]:
        texts = engine.tokenizer.batch_decode([t.response_ids for t in transcripts], skip_special_tokens=True)
        return tool(samples.select(indices, responses=texts))

    def tokenize(answer: str) -> list[int]:
        text = chat_turn_text(engine.tokenizer, answer, cfg.tool_role, template_kwargs) if cfg.tool_format == "chat" else answer
        return engine.tokenizer(text, add_special_tokens=False)["input_ids"]

    def generate(prompts: list[list[int]], limit: int, row_ids: list[int], turn: int):
        turn_params = replace(params, max_new_tokens=limit, seed=turn_seed(params.seed, turn))
        return stops.cut_all(engine.generate(prompts, turn_params, batch_size=cfg.batch_size, on_tokens=on_tokens, compute_dtype=cfg.dtype, row_ids=row_ids))

    with Tool.load(cfg.tool, timeout=cfg.tool_timeout) as tool:
        transcripts = take_turns(
            first_turn(generations, at_stop_string, cfg.max_new_tokens), prompt_ids, [first_row + i for i in range(len(prompt_ids))],
            call_tool=call_tool, tokenize=tokenize, generate=generate,
            max_new_tokens=cfg.max_new_tokens, max_tool_calls=cfg.max_tool_calls,
        )
    generations = [Generation(t.response_ids, t.logprobs, t.finish_reason) for t in transcripts]
    return generations, {
        "loss_mask": list_column([t.loss_mask for t in transcripts], pa.bool_()),
        "tool_calls": pa.array([t.tool_calls for t in transcripts], pa.int32()),
    }


def sampling_of(table: pa.Table) -> dict:
    """The sampling parameters recorded by rollout in the table's schema metadata."""
    raw = (table.schema.metadata or {}).get(SAMPLING_KEY)
    return json.loads(raw) if raw else {}


def rollout_parts_on_workers(group, prompts: pa.Table, cfg: RolloutConfig, data: DataConfig, version: int, out: OutputSpec, manifest: Manifest) -> Manifest:
    """Each rank generates for its contiguous slice of the prompts and writes its own part;
    the manifest's sample statistics come from the ranks' tallies of their rows."""
    return group.commit_parts("rollout_part", prompts, lambda _: (to_dict(cfg), to_dict(data), version), out, manifest, "rollouts", summarize=merged_rollout_stats)
