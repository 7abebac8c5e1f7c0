"""The training forward's decoder layers compiled by torch.compile (inductor), for the update
(`update.compile = true`).

Around its products a training pass runs norms, rotary embeddings, the gated MLP's SiLU, bias
and residual adds, each forward and backward, each a pass over memory of its own in eager
PyTorch: at the small preset ~0.7 s of a 2.1 s fp32 update and more than half of a bf16 one,
whose products AMX runs 4× faster. Inductor fuses them into a few loops per layer and leaves the
products to the same BLAS calls. The attention stays eager (`torch.compiler.disable`): its
packing (rlctl.backends.unpadded) changes with every batch, so the compiled code reads it from
here rather than taking it as an argument, and one graph serves every layer and every batch
(dynamic shapes). Only forwards under autograd run compiled: the score stage's no-grad forwards
stay eager (another graph to compile, for less work). Results equal the eager layers' to float
rounding (tests/unit/test_compiled_layers.py).

Measured on a 2-core Xeon, eager and compiled alternating in one process (`python -m
bench.compile_bench`, bench/RESULTS.md "Grouped attention and compiled decoder layers"): the
small preset's update fp32 0.93×, bf16 0.87×; Qwen2.5-0.5B's shape fp32 0.98×, bf16 1.02× (its
products dominate, and under autocast the compiled graph casts the weights in each pass where
eager autocast casts them once). A first compile takes ~15–20 s (~5 s with inductor's on-disk
cache warm), so it pays after ~25–150 small-preset updates: an option for long runs of small
models, off by default.
"""

from __future__ import annotations

import shutil
import threading
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch

from rlctl.backends.llama_layers import plain_layers
from rlctl.errors import InputError

_compiled: weakref.WeakKeyDictionary[torch.nn.Module, Callable] = weakref.WeakKeyDictionary()
_current = threading.local()  # the packing the compiled layers' attention reads (`attending`)


def cxx_compiler() -> str | None:
    """The C++ compiler inductor builds its CPU kernels with, where it is found: the one its
    config names ($CXX when torch loaded, else g++; clang++ on macOS)."""
    from torch._inductor import config

    names = config.cpp.cxx if isinstance(config.cpp.cxx, (list, tuple)) else (config.cpp.cxx,)
    return next((found for name in names if name and (found := shutil.which(name))), None)


def check_compile(compile: bool, device: str) -> None:
    """`update.compile = true` on the CPU needs a C++ compiler: an InputError before any work
    where there is none."""
    if compile and device == "cpu" and cxx_compiler() is None:
        raise InputError("update.compile = true: torch.compile needs a C++ compiler on the CPU (none found: install g++, or set $CXX)")


def enable(model: torch.nn.Module) -> bool:
    """Compile `model`'s decoder layers for its training forwards, where they are plain modules
    of the Llama layout; returns whether they will run compiled."""
    if not plain_layers(model):
        return False
    if model not in _compiled:
        _compiled[model] = torch.compile(_layer_forward, dynamic=True)
    return True


def compiled_forward(model: torch.nn.Module) -> Callable | None:
    """The compiled layer forward `model`'s current forward runs (`enable`d, under autograd), or
    None: run the layers as they are."""
    return _compiled.get(model) if torch.is_grad_enabled() else None


def _layer_forward(layer: torch.nn.Module, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    return layer(hidden, attention_mask=None, position_embeddings=(cos, sin))


@contextmanager
def attending(packing) -> Iterator[None]:
    """Make `packing` the one the compiled layers' attention reads for a while."""
    before = getattr(_current, "packing", None)
    _current.packing = packing
    try:
        yield
    finally:
        _current.packing = before


def current_packing():
    """The packing set by `attending`, or None."""
    return getattr(_current, "packing", None)
