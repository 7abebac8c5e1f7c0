#!/usr/bin/env bash
# The GPU checks of issues 7 and 12 as one run on a lent CUDA machine (the device tool), from
# the repository root; it prints Markdown for bench/RESULTS.md:
#   bash bench/device_wheels.sh                    # here, first: Ray, TRL and their needs in .whl/
#   set -o pipefail; bash bench/gpu_check.sh 2>&1 | tee $OUT/gpu_check.md   # there (device run, carry [".whl"], timeout_s 600)
#   DEVICE=cpu PRESET=tiny TOKENS=16 bash bench/gpu_check.sh   # the same steps on a CPU, to try it
#   STEPS=tests,engines,trl bash bench/gpu_check.sh            # some of the steps (names: STEPS below)
# Needs torch, transformers, pyarrow, fsspec, typer and rich (the device's image has them);
# wheels in .whl/ are installed first, then rlctl itself (no index needed), all under $SITE.
# Ray, vLLM and TRL are measured where they import. The steps run in order of what matters most,
# each under its own time limit and all within $BUDGET seconds (one device call); a failed step
# does not stop the rest.
set -uo pipefail
REPO=$(cd "$(dirname "$0")/.." && pwd)
export HF_HUB_OFFLINE=1 RAY_AUTH_MODE=disabled TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1
DEVICE=${DEVICE:-cuda}
PRESET=${PRESET:-medium}
TOKENS=${TOKENS:-128}
BUDGET=${BUDGET:-570}
STEPS=${STEPS:-all}  # or some of: nccl,tests,trl,engines,grpo,remax,ray,local,scorebatch,unpadded,sharing
SHARING_PROMPTS=${SHARING_PROMPTS:-12,200}
PY=${PY:-$(command -v python3 || command -v python)}
WHEELS=${WHEELS:-$REPO/.whl}
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
SITE=${SITE:-$WORK/site}
MODEL=$WORK/$PRESET
LOGS=${OUT:-$WORK}  # the device tool brings back what lands in $OUT
DEADLINE=$((SECONDS + BUDGET))

step() { echo; echo "## $1"; echo; }
# run a step for at most $1 seconds, less when the budget is nearly spent
within() {
  local limit=$1 left=$((DEADLINE - SECONDS - 5))
  shift
  [ "$left" -lt 20 ] && { echo "(skipped: the time budget is spent)"; return 1; }
  [ "$limit" -gt "$left" ] && limit=$left
  timeout "$limit" "$@"
  local rc=$?
  [ "$rc" -ne 0 ] && echo "(step ended with exit $rc; its limit was ${limit} s)"
  return "$rc"
}
imports() { "$PY" -c "import $1" 2>/dev/null; }
want() { [ "$STEPS" = all ] || [[ ",$STEPS," == *",$1,"* ]]; }

step "setup"
mkdir -p "$SITE"
wheels=()
compgen -G "$WHEELS/*.whl" >/dev/null && wheels=("$WHEELS"/*.whl)
# datasets' newest wheel wants pyarrow >= 24: on an older pyarrow take the older one fetched beside it
pyarrow_major=$("$PY" -c "import pyarrow; print(pyarrow.__version__.split('.')[0])" 2>/dev/null || echo 0)
if [ "$pyarrow_major" -lt 24 ] && compgen -G "$WHEELS/older/datasets-*.whl" >/dev/null; then
  kept=()
  for w in "${wheels[@]}"; do [[ $(basename "$w") == datasets-* ]] || kept+=("$w"); done
  wheels=("${kept[@]}" "$WHEELS"/older/*.whl)
  echo "pyarrow $pyarrow_major: datasets from $WHEELS/older"
fi
"$PY" -m pip install -q --no-index --no-deps --no-build-isolation --no-compile --no-cache-dir --target "$SITE" "$REPO" "${wheels[@]}" \
  || { echo "rlctl (and the wheels in $WHEELS) did not install"; exit 1; }
# out of the source tree, so that `import rlctl` finds the installed package (its stages and schemas)
export PYTHONPATH="$SITE:$REPO${PYTHONPATH:+:$PYTHONPATH}"
cd "$WORK"
"$PY" - <<'PY'
import importlib, platform
import torch, transformers
print("Python", platform.python_version(), "| torch", torch.__version__, "CUDA", torch.version.cuda, "| transformers", transformers.__version__)
for name in ("pyarrow", "fsspec", "ray", "vllm", "trl", "datasets"):
    try:
        print(f"{name}:", importlib.import_module(name).__version__)
    except Exception as exc:  # absent, or broken by the image's versions
        print(f"{name}: not importable ({type(exc).__name__}: {str(exc)[:120]})")
PY

step "machine"
if [ "$DEVICE" = cuda ]; then nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader; fi
echo "$(nproc) CPUs"

if want nccl && [ "$DEVICE" = cuda ]; then
  step "NCCL (one rank: the backend initialises and reduces)"
  within 60 "$PY" - <<'PY'
import os, torch, torch.distributed as dist
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29511")
dist.init_process_group("nccl", rank=0, world_size=1)
x = torch.ones(1 << 20, device="cuda")
dist.all_reduce(x)
torch.cuda.synchronize()
print("all_reduce ok:", bool(x[0].item() == 1.0), "| NCCL", ".".join(map(str, torch.cuda.nccl.version())))
dist.destroy_process_group()
PY
fi

if want tests; then
  step "the tests that take a GPU where there is one (CUDA graphs, grouped attention, dtypes)"
  # from outside the source tree and with the tests' folder appended to the path, not put first:
  # the installed rlctl must be the one imported (the source tree's lacks rlctl.stages and
  # rlctl.schemas, which only an install maps). The whole log comes back in $LOGS; its failures'
  # lines are printed.
  within 120 "$PY" -m pytest -q -p no:cacheprovider -p no:syrupy --tb=short -rfE --rootdir "$REPO" -c "$REPO/pyproject.toml" \
    --import-mode=append "$REPO"/tests/unit/test_cuda_graphs.py "$REPO"/tests/unit/test_grouped_attention.py \
    "$REPO"/tests/unit/test_dtypes.py >"$LOGS/gpu_tests.log" 2>&1
  grep -E "^(E  |FAILED|ERROR)" "$LOGS/gpu_tests.log" | cut -c1-240 | head -n 40
  tail -n 3 "$LOGS/gpu_tests.log"
fi

step "model: rlctl model init --preset $PRESET"
within 90 "$PY" -m rlctl model init "$MODEL" --preset "$PRESET" || exit 1

if want trl && imports "trl, datasets"; then
  step "side by side with TRL's GRPOTrainer ($PRESET preset, $TOKENS tokens, dtype auto)"
  within 240 "$PY" -m bench.trl_bench --device "$DEVICE" --preset "$PRESET" --tokens "$TOKENS" --rounds 1 --steps 4 --python "$PY"
fi

if want engines; then
  engines=hf
  imports vllm && engines=hf,vllm
  if [ "$DEVICE" = cuda ]; then
    step "generation tokens/s (64 sequences × $TOKENS new tokens, bf16), RLCTL_CUDA_GRAPHS=off: one launch per kernel"
    RLCTL_CUDA_GRAPHS=off within 120 "$PY" -m bench.engines_bench --device "$DEVICE" --model "$MODEL" --dtype bf16 --engines hf --rounds 3 --sequences 64 --tokens "$TOKENS"
  fi
  step "generation tokens/s (64 sequences × $TOKENS new tokens, bf16)"
  within 120 "$PY" -m bench.engines_bench --device "$DEVICE" --model "$MODEL" --dtype bf16 --engines "$engines" --rounds 3 --sequences 64 --tokens "$TOKENS"
fi

if want grpo; then
  step "the GRPO example on $DEVICE (does it learn; engine vs trainer log-probs)"
  within 120 "$PY" -m rlctl pipeline "$REPO/examples/grpo.toml" --run-dir "$WORK/grpo" --set model.device="$DEVICE" --quiet >"$LOGS/grpo.log" 2>&1 \
    || tail -n 30 "$LOGS/grpo.log"
  "$PY" - "$WORK/grpo/metrics.jsonl" <<'PY'
import json, sys
rows = [json.loads(line) for line in open(sys.argv[1])]
first, last = rows[:3], rows[-3:]
mean = lambda rs, k: sum(r[k] for r in rs) / len(rs)
print(f"{len(rows)} iterations; reward, first three {mean(first, 'reward_mean'):.3f} → last three {mean(last, 'reward_mean'):.3f} (the example states a margin of 0.5)")
measured = [r["logprob_mismatch"] for r in rows[:: max(1, len(rows) // 6)] if r.get("logprob_mismatch") is not None]
print("logprob_mismatch (engine vs trainer, mean |Δ| per token):", ", ".join(f"{m:.2e}" for m in measured) if measured
      else "not measured (score.old_logprobs = auto took the engine's own: engine and trainer both fp32)")
PY
fi

if want remax; then
  engine=hf
  [ "$DEVICE" = cuda ] && imports vllm && engine=vllm
  step "ReMax on $DEVICE: a greedy response a prompt beside the samples ($engine engine, 3 iterations of the GRPO example)"
  within 90 "$PY" -m rlctl pipeline "$REPO/examples/grpo.toml" --run-dir "$WORK/remax" --iterations 3 --set model.device="$DEVICE" \
    --set rollout.backend="$engine" --set advantage.estimator=remax --set rollout.greedy_baseline=true --quiet >"$LOGS/remax.log" 2>&1 \
    || tail -n 30 "$LOGS/remax.log"
  "$PY" - "$WORK/remax/metrics.jsonl" <<'PY'
import json, sys
rows = [json.loads(line) for line in open(sys.argv[1])]
print("iteration, reward_mean, baseline_reward_mean (the greedy responses'), seconds/rollout:")
for r in rows:
    print(f"  {r['iteration']}: {r['reward_mean']:.3f}, {r['baseline_reward_mean']:.3f}, {r['seconds/rollout']:.2f} s")
PY
fi

if want ray && imports ray; then
  gpus=$([ "$DEVICE" = cuda ] && echo 1 || echo 0)
  step "pipeline, one Ray worker (gpus_per_worker = $gpus; NCCL on a GPU)"
  within 150 "$PY" "$REPO/bench/pipeline_bench.py" --model "$MODEL" --preset "$PRESET" --set model.device="$DEVICE" --set workers.backend=ray --set workers.gpus_per_worker="$gpus" --runs 1 --iterations 3 --batch 16 --n 4 --tokens "$TOKENS"
fi

if want local; then
  step "pipeline, local workers (16 prompts × 4 samples × $TOKENS tokens, GRPO + reference, dtype auto)"
  within 150 "$PY" "$REPO/bench/pipeline_bench.py" --model "$MODEL" --preset "$PRESET" --set model.device="$DEVICE" --runs 1 --iterations 3 --batch 16 --n 4 --tokens "$TOKENS"
fi

if want scorebatch; then
  # score.batch_size (16) was sized on a CPU; on the H200 the score stage took 0.5-0.7 s of a
  # 3 s iteration where TRL's reference forward took 0.04 s: one pass of all 64 rows against four
  step "pipeline, local workers, score.batch_size = 64 (one pass per stage; the step above ran 16)"
  within 150 "$PY" "$REPO/bench/pipeline_bench.py" --model "$MODEL" --preset "$PRESET" --set model.device="$DEVICE" --set score.batch_size=64 --runs 1 --iterations 3 --batch 16 --n 4 --tokens "$TOKENS"
fi

if want unpadded; then
  step "forwards over real tokens vs transformers' padded forward (64 rows, responses of ≤ $TOKENS tokens, bf16)"
  within 90 "$PY" -m bench.unpadded_bench --device "$DEVICE" --model "$MODEL" --dtype bf16 --tokens "$TOKENS" --spreads 1,0 --rounds 2
fi

if want sharing; then
  step "the update with each prompt once per pass vs one forward per row (calibrates the GPU's threshold)"
  within 90 "$PY" -m bench.prompt_sharing_bench --device "$DEVICE" --model "$MODEL" --prompt-tokens "$SHARING_PROMPTS" --response-tokens "$TOKENS" --rounds 2
fi
echo
echo "(gpu_check: $SECONDS s)"
