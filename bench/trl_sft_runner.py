"""TRL's side of bench/sft_bench.py: an SFTTrainer run, each optimizer step's end timed, in
TRL's own venv (bench/trl_trainer_run.py):

    python trl_sft_runner.py SPEC.json OUT.json

SPEC holds the model folder, the examples (JSON lines: prompt, completion), the batch shape,
the epochs and the dtype; the loss is on the completions only, as rlctl's.
"""

from __future__ import annotations

import sys

from trl_trainer_run import run_timed


def trainer_of(spec: dict, dataset, settings: dict, callbacks: list):
    from trl import SFTConfig, SFTTrainer

    config = SFTConfig(**settings, logging_steps=10**6, completion_only_loss=True)
    return SFTTrainer(model=spec["model"], args=config, train_dataset=dataset, callbacks=callbacks)


if __name__ == "__main__":
    run_timed(*sys.argv[1:3], "examples", ("prompt", "completion"), trainer_of)
