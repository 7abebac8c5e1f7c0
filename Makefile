# Developer shortcuts. The RL loop itself as stage-command targets is examples/Makefile.
.PHONY: test test-fast completions lint example

test:
	python -m pytest -q

test-fast:
	python -m pytest -q -m "not slow"

completions:
	python -m rlctl.completion completions

lint:
	ruff check rlctl stages schemas tests

example:
	bash examples/stages.sh
