#!/usr/bin/env bash
# Online (iterative) DPO out of the stage commands: each round samples 8 responses a prompt from
# the current policy, scores them with the rule reward, and trains DPO on each prompt's best and
# worst sample (a score stage's output is preference data: rlctl.scored_pairs), against the
# round's starting weights as the reference. The task is examples/grpo.toml's: a response's
# share of digits.
#
#   bash examples/iterative_dpo.sh            # writes runs/iterative_dpo/
#   ROUNDS=2 WORK=/tmp/x bash examples/iterative_dpo.sh
#
# Expected: the digit share of 8 samples a held-out prompt (rlctl eval, temperature 1) rises
# from about 0.01 (the random tiny model) round by round. Measured on a 2-core Zen 3: see
# bench/RESULTS.md ("Online DPO from scored rollouts"); tests/e2e/test_examples.py checks it.
set -euo pipefail
cd "$(dirname "$0")/.."
WORK=${WORK:-runs/iterative_dpo}
ROUNDS=${ROUNDS:-4}
REWARD=examples/rewards.py:digit_share

[ -f "$WORK/model/config.json" ] || rlctl model init "$WORK/model" --preset tiny --seed 0
policy=$WORK/model
for round in $(seq 1 "$ROUNDS"); do
  d=$WORK/round-$round
  rlctl rollout --prompts examples/digits.jsonl --model "$policy" --out "$d/rollout" --n 8 --max-new-tokens 16 --seed "$round"
  rlctl score   --rollouts "$d/rollout" --out "$d/score" --reward "$REWARD"
  rlctl dpo     --data "$d/score" --model "$policy" --out "$d/policy" --epochs 2 --lr 1e-3 --batch-size 16
  policy=$d/policy
done
rlctl eval --model "$policy" --prompts examples/digits_val.jsonl --reward "$REWARD" --n 8 --max-new-tokens 16
