"""TRL's side of bench/dpo_bench.py: a DPOTrainer run, each optimizer step's end timed, in TRL's
own venv (rlctl is not importable there):

    python trl_dpo_runner.py SPEC.json OUT.json

SPEC holds the model folder, the pairs (JSON lines: prompt, chosen, rejected), the batch shape,
beta, the epochs, the dtype and whether the reference's log-probs are computed once before
training; OUT gets the wall-clock time at the end of every optimizer step and what was logged.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path


def main(spec_path: str, out_path: str) -> None:
    spec = json.loads(Path(spec_path).read_text())
    import torch
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import DPOConfig, DPOTrainer

    rows = [json.loads(line) for line in Path(spec["pairs"]).read_text().splitlines() if line.strip()]
    dataset = Dataset.from_list([{"prompt": r["prompt"], "chosen": r["chosen"], "rejected": r["rejected"]} for r in rows])
    ends: list[dict] = []
    logged: list[dict] = []

    class StepClock(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            ends.append({"step": state.global_step, "epoch": state.epoch, "time": time.perf_counter()})

        def on_log(self, args, state, control, logs=None, **kwargs):
            logged.append(dict(logs or {}))

    config = DPOConfig(
        output_dir=str(Path(out_path).parent / "trl-out"),
        per_device_train_batch_size=spec["micro_batch_size"],
        gradient_accumulation_steps=spec["batch_size"] // spec["micro_batch_size"],
        learning_rate=spec["lr"],
        lr_scheduler_type="constant",
        beta=spec["beta"],
        num_train_epochs=spec["epochs"],
        logging_steps=spec["steps_per_epoch"],
        save_strategy="no",
        report_to=[],
        use_cpu=spec["device"] == "cpu",
        bf16=spec["dtype"] == "bf16",
        gradient_checkpointing=spec["gradient_checkpointing"],
        precompute_ref_log_probs=spec["precompute_ref_log_probs"],
        dataloader_num_workers=0,
        seed=0,
    )
    trainer = DPOTrainer(model=spec["model"], args=config, train_dataset=dataset, callbacks=[StepClock()])
    trainer.train()
    Path(out_path).write_text(json.dumps({
        "ends": ends, "logged": logged, "torch_threads": torch.get_num_threads(),
        "gradient_checkpointing": getattr(trainer.model, "is_gradient_checkpointing", None),
    }))


if __name__ == "__main__":
    main(*sys.argv[1:3])
