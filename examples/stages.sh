#!/usr/bin/env bash
# Two full PPO iterations on a tiny local model, every stage its own process, then the same
# first three stages piped through stdout. Read top to bottom: this is the loop.
#
#   bash examples/stages.sh            # writes runs/stages/
#   WORK=/tmp/x bash examples/stages.sh
set -euo pipefail
cd "$(dirname "$0")/.."
WORK=${WORK:-runs/stages}
MODEL=$WORK/model
PROMPTS=examples/prompts.jsonl
REWARD=examples/rewards.py:length_reward

[ -f "$MODEL/config.json" ] || rlctl model init "$MODEL" --preset tiny --seed 0

weights=$MODEL        # what rollout generates with (rollout layout)
checkpoint=$MODEL     # what update trains from (training layout + optimizer state)
critic=$MODEL         # a fresh critic: the LM with a zero value head
kl_state=()
for it in 1 2; do
  d=$WORK/iter-$it
  rlctl rollout   --prompts "$PROMPTS" --model "$weights" --out "$d/rollout" --n 4 --max-new-tokens 32 --seed "$it"
  rlctl score     --rollouts "$d/rollout" --out "$d/score" --reward "$REWARD" \
                  --ref "$MODEL" --policy "$weights" --critic "$critic"
  rlctl advantage --scores "$d/score" --out "$d/advantage" --estimator gae --gamma 0.99 --lam 0.95 \
                  --kl-coef 0.05 --kl-estimator k1 --kl-controller adaptive "${kl_state[@]}"
  rlctl update    --batch "$d/advantage" --model "$checkpoint" --critic "$critic" --out "$d/update" \
                  --lr 1e-4 --micro-batch-size 8
  rlctl reshard   --checkpoint "$d/update" --out "$d/weights" --dtype fp32 --check
  weights=$d/weights checkpoint=$d/update critic=$d/update/critic
  kl_state=(--kl-state "$d/advantage")
done
rlctl show "$WORK/iter-2/update"

# The same stages as one shell pipeline: Arrow IPC streams between processes.
rlctl rollout --prompts "$PROMPTS" --model "$weights" --out - --n 4 --max-new-tokens 32 --seed 9 \
  | rlctl score --rollouts - --out - --reward "$REWARD" \
  | rlctl advantage --scores - --out "$WORK/piped/advantage" --estimator grpo
rlctl show "$WORK/piped/advantage" --rows 4
