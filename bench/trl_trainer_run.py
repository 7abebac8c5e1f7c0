"""What the TRL runner scripts of bench/sft_bench.py, rm_bench.py, dpo_bench.py and kto_bench.py share. They
run in TRL's own venv, as scripts from this folder (rlctl is not importable there): a trainer
built on the same base settings from SPEC.json, each optimizer step's end timed, and OUT.json
written with those times, what the trainer logged, torch's threads and whether the model
recomputed its activations."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path


def base_settings(spec: dict, out_path: str) -> dict:
    """The TrainingArguments every runner's config takes from SPEC: the batch shape, a constant
    lr, the epochs, the dtype, CPU or not, checkpointing, no saving or reporting, seed 0."""
    return {
        "output_dir": str(Path(out_path).parent / "trl-out"),
        "per_device_train_batch_size": spec["micro_batch_size"],
        "gradient_accumulation_steps": spec["batch_size"] // spec["micro_batch_size"],
        "learning_rate": spec["lr"],
        "lr_scheduler_type": "constant",
        "num_train_epochs": spec["epochs"],
        "save_strategy": "no",
        "report_to": [],
        "use_cpu": spec["device"] == "cpu",
        "bf16": spec["dtype"] == "bf16",
        "gradient_checkpointing": spec["gradient_checkpointing"],
        "dataloader_num_workers": 0,
        "seed": 0,
    }


def run_timed(spec_path: str, out_path: str, data_key: str, columns: tuple[str, ...], trainer_of: Callable) -> None:
    """`trainer_of(spec, dataset, settings, callbacks)` built on the rows at `spec[data_key]`
    (JSON lines, `columns` of each), trained, and its record written to `out_path`."""
    spec = json.loads(Path(spec_path).read_text())
    import torch
    from datasets import Dataset
    from transformers import TrainerCallback

    rows = [json.loads(line) for line in Path(spec[data_key]).read_text().splitlines() if line.strip()]
    dataset = Dataset.from_list([{column: row[column] for column in columns} for row in rows])
    ends: list[dict] = []
    logged: list[dict] = []

    class StepClock(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            ends.append({"step": state.global_step, "epoch": state.epoch, "time": time.perf_counter()})

        def on_log(self, args, state, control, logs=None, **kwargs):
            logged.append(dict(logs or {}))

    trainer = trainer_of(spec, dataset, base_settings(spec, out_path), [StepClock()])
    trainer.train()
    Path(out_path).write_text(json.dumps({
        "ends": ends, "logged": logged, "torch_threads": torch.get_num_threads(),
        "gradient_checkpointing": getattr(trainer.model, "is_gradient_checkpointing", None),
    }))
