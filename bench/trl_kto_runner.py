"""TRL's side of bench/kto_bench.py: a KTOTrainer run, each optimizer step's end timed, in TRL's
own venv (bench/trl_trainer_run.py):

    python trl_kto_runner.py SPEC.json OUT.json

SPEC holds the model folder, the examples (JSON lines: prompt, completion, label), the batch
shape, beta, the epochs, the dtype and whether the reference's log-probs are computed once
before training.
"""

from __future__ import annotations

import sys

from trl_trainer_run import run_timed


def trainer_of(spec: dict, dataset, settings: dict, callbacks: list):
    from trl import KTOConfig, KTOTrainer

    config = KTOConfig(**settings, beta=spec["beta"], logging_steps=spec["steps_per_epoch"], precompute_ref_log_probs=spec["precompute_ref_log_probs"])
    return KTOTrainer(model=spec["model"], args=config, train_dataset=dataset, callbacks=callbacks)


if __name__ == "__main__":
    run_timed(*sys.argv[1:3], "examples", ("prompt", "completion", "label"), trainer_of)
