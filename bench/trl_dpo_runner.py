"""TRL's side of bench/dpo_bench.py: a DPOTrainer run, each optimizer step's end timed, in TRL's
own venv (bench/trl_trainer_run.py):

    python trl_dpo_runner.py SPEC.json OUT.json

SPEC holds the model folder, the pairs (JSON lines: prompt, chosen, rejected), the batch shape,
beta, the epochs, the dtype and whether the reference's log-probs are computed once before
training.
"""

from __future__ import annotations

import sys

from trl_trainer_run import run_timed


def trainer_of(spec: dict, dataset, settings: dict, callbacks: list):
    from trl import DPOConfig, DPOTrainer

    config = DPOConfig(**settings, beta=spec["beta"], logging_steps=spec["steps_per_epoch"], precompute_ref_log_probs=spec["precompute_ref_log_probs"])
    return DPOTrainer(model=spec["model"], args=config, train_dataset=dataset, callbacks=callbacks)


if __name__ == "__main__":
    run_timed(*sys.argv[1:3], "pairs", ("prompt", "chosen", "rejected"), trainer_of)
