"""Benchmarks (results in bench/RESULTS.md). The benches that run rlctl's engines in their own
process choose MKL's kernels before torch loads, as the `rlctl` command does
(rlctl.mkl_kernels), so that they measure the code a user runs."""

from rlctl import mkl_kernels

mkl_kernels.enable()
