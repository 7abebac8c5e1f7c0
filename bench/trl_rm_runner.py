"""TRL's side of bench/rm_bench.py: a RewardTrainer run, each optimizer step's end timed, in
TRL's own venv (bench/trl_trainer_run.py):

    python trl_rm_runner.py SPEC.json OUT.json

SPEC holds the model folder, the pairs (JSON lines: prompt, chosen, rejected), the batch shape,
the epochs and the dtype.
"""

from __future__ import annotations

import sys

from trl_trainer_run import run_timed


def trainer_of(spec: dict, dataset, settings: dict, callbacks: list):
    from trl import RewardConfig, RewardTrainer

    config = RewardConfig(**settings, logging_steps=spec["steps_per_epoch"])
    return RewardTrainer(model=spec["model"], args=config, train_dataset=dataset, callbacks=callbacks)


if __name__ == "__main__":
    run_timed(*sys.argv[1:3], "pairs", ("prompt", "chosen", "rejected"), trainer_of)
