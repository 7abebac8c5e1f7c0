#!/usr/bin/env bash
# The GPU checks of issues 7 and 12 as one run on a lent CUDA machine (the device tool), from
# the repository root; it prints Markdown for bench/RESULTS.md:
#   bash bench/gpu_check.sh                        # medium preset (Qwen2.5-0.5B's shape) on cuda
#   DEVICE=cpu PRESET=tiny bash bench/gpu_check.sh # the same steps on a CPU, to try the script
# Needs torch, transformers, pyarrow, fsspec, typer and rich; vLLM and Ray are measured where
# they are installed. Each step has its own time limit (600 s in all: one device call) and a
# failed step does not stop the rest.
set -uo pipefail
cd "$(dirname "$0")/.."
export HF_HUB_OFFLINE=1 RAY_AUTH_MODE=disabled
DEVICE=${DEVICE:-cuda}
PRESET=${PRESET:-medium}
TOKENS=${TOKENS:-128}
MODEL=$(mktemp -d)/$PRESET

step() { echo; echo "## $1"; echo; }

step "machine"
if [ "$DEVICE" = cuda ]; then nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader; fi
python -c "import torch, transformers; print('torch', torch.__version__, 'CUDA', torch.version.cuda, '| transformers', transformers.__version__)"

if [ "$DEVICE" = cuda ]; then
  step "NCCL (one rank: the backend initialises and reduces)"
  timeout 60 python - <<'PY'
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

step "model: rlctl model init --preset $PRESET"
timeout 90 python -m rlctl model init "$MODEL" --preset "$PRESET" || exit 1

step "generation tokens/s (64 sequences × $TOKENS new tokens, bf16)"
engines=hf
python -c "import vllm" 2>/dev/null && engines=hf,vllm
timeout 150 python -m bench.engines_bench --device "$DEVICE" --model "$MODEL" --dtype bf16 --engines "$engines" --rounds 3 --sequences 64 --tokens "$TOKENS"

step "pipeline, local workers (16 prompts × 4 samples × $TOKENS tokens, GRPO + reference, dtype auto)"
timeout 150 python bench/pipeline_bench.py --model "$MODEL" --preset "$PRESET" --set model.device="$DEVICE" --runs 1 --iterations 3 --batch 16 --n 4 --tokens "$TOKENS"

if python -c "import ray" 2>/dev/null; then
  step "pipeline, one Ray worker$([ "$DEVICE" = cuda ] && echo ' with gpus_per_worker = 1')"
  gpus=$([ "$DEVICE" = cuda ] && echo 1 || echo 0)
  timeout 150 python bench/pipeline_bench.py --model "$MODEL" --preset "$PRESET" --set model.device="$DEVICE" --set workers.backend=ray --set workers.gpus_per_worker="$gpus" --runs 1 --iterations 3 --batch 16 --n 4 --tokens "$TOKENS"
fi
