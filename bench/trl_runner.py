"""TRL's side of bench/trl_bench.py: a GRPOTrainer run, timed by phase, in TRL's own venv.

Run by the harness with the TRL venv's Python (rlctl is not importable there):

    python trl_runner.py SPEC.json OUT.json

SPEC holds the model folder, the prompt file (JSON lines: prompt, ground_truth), the reward
file and function, the workload shape and the dtype. OUT gets one record per optimizer step:
its wall time and the seconds spent in generation, the reference forward, the reward and the
policy's own forward passes (the rest of the step is backward + AdamW + TRL's bookkeeping);
on a GPU each phase waits for its kernels before its clock stops.
"""

from __future__ import annotations

import importlib.util
import json
import sys
import time
from collections import defaultdict
from pathlib import Path


def main(spec_path: str, out_path: str) -> None:
    spec = json.loads(Path(spec_path).read_text())
    import torch
    import transformers
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    reward = _load_function(spec["reward_file"], spec["reward_function"])
    rows = [json.loads(line) for line in Path(spec["prompts"]).read_text().splitlines() if line.strip()]
    dataset = Dataset.from_list([{"prompt": r["prompt"], "ground_truth": r["ground_truth"]} for r in rows])

    spent: dict[str, float] = defaultdict(float)
    on_gpu = spec.get("device", "cpu") == "cuda"

    def settle() -> None:
        """On a GPU, wait for the queued kernels, so that each phase's time is its own."""
        if on_gpu:
            torch.cuda.synchronize()

    def timed(name, fn):
        def wrapper(*args, **kwargs):
            settle()
            began = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                settle()
                spent[name] += time.perf_counter() - began

        wrapper.__name__ = getattr(fn, "__name__", name)
        return wrapper

    transformers.GenerationMixin.generate = timed("generate", transformers.GenerationMixin.generate)
    timed_reward = timed("reward", reward)
    timed_reward.__name__ = spec["reward_function"]

    batch = spec["prompts_per_step"] * spec["samples"]
    args = GRPOConfig(
        output_dir=str(Path(out_path).parent / "trl-out"),
        per_device_train_batch_size=batch,
        gradient_accumulation_steps=1,
        num_generations=spec["samples"],
        max_completion_length=spec["max_new_tokens"],
        temperature=1.0,
        top_p=1.0,
        learning_rate=spec["lr"],
        beta=spec["kl_coef"],
        num_iterations=1,
        loss_type="dapo",  # token-level mean over the batch: rlctl's token-mean
        max_steps=spec["steps"],
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        use_cpu=spec.get("device", "cpu") == "cpu",
        bf16=spec["dtype"] == "bf16",
        # GRPOConfig's default is True (activations recomputed in the backward: one more forward);
        # the harness turns it off unless asked, since rlctl keeps them: the same work on both sides
        gradient_checkpointing=spec.get("gradient_checkpointing", False),
        seed=spec["seed"],
        disable_tqdm=True,
        shuffle_dataset=True,
    )
    trainer = GRPOTrainer(model=spec["model"], reward_funcs=timed_reward, args=args, train_dataset=dataset)
    original_logps = trainer._get_per_token_logps_and_entropies

    def logps(model, *a, **kw):
        name = "reference" if model is trainer.ref_model else "policy_forward"
        settle()
        began = time.perf_counter()
        try:
            return original_logps(model, *a, **kw)
        finally:
            settle()
            spent[name] += time.perf_counter() - began

    trainer._get_per_token_logps_and_entropies = logps
    steps: list[dict] = []

    class StepTimer(TrainerCallback):
        def on_step_begin(self, *_, **__):
            settle()
            spent.clear()
            self.began = time.perf_counter()

        def on_step_end(self, *_, **__):
            settle()
            steps.append({"step_s": time.perf_counter() - self.began, **spent})

    trainer.add_callback(StepTimer())
    trainer.train()
    record = {
        "steps": steps, "torch_threads": torch.get_num_threads(), "trl": __import__("trl").__version__, "torch": torch.__version__,
        "mkl_cpu_type": _mkl_cpu_type(torch), "gradient_checkpointing": getattr(trainer.model, "is_gradient_checkpointing", None),
    }
    Path(out_path).write_text(json.dumps(record, indent=1))


def _mkl_cpu_type(torch) -> int | None:
    """The CPU type MKL dispatches its kernels by in this process (0: its generic path on a
    CPU it does not take for Intel's); None where torch was built without MKL."""
    import ctypes
    import os

    try:
        return int(ctypes.CDLL(os.path.join(os.path.dirname(torch.__file__), "lib", "libtorch_cpu.so")).mkl_serv_cpu_detect())
    except (OSError, AttributeError):
        return None


def _load_function(path: str, name: str):
    module_spec = importlib.util.spec_from_file_location("bench_reward", path)
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    return getattr(module, name)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
