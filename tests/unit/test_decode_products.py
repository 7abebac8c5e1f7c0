"""A decode step's products from packed weights: one product per stacked group (q/k/v, gate/up),
the modules' own for one row, packed by the library that computes the products where measured to
pay; oneDNN's the modules' products bit for bit, MKL's to float rounding for any row count (padded
or repacked), and generation's tokens and log-probs unchanged (MKL: to ~2e-6)."""

from __future__ import annotations

import pytest
import torch

from rlctl import cpu_linear, mkl_kernels
from rlctl.backends import decode_products
from rlctl.backends.base import SamplingParams
from rlctl.backends.decode_products import (
    DecodeProducts,
    MKLPackedProduct,
    OneDNNPackedProduct,
    packing,
)
from rlctl.backends.hf import HFPolicy, decoding_attention
from rlctl.errors import InputError
from tests.conftest import model_folder

CPU = torch.device("cpu")


@pytest.fixture
def linear_path(monkeypatch):
    """Make rlctl's fp32 linear layers run as `path` says for one test."""

    def choose(path: str) -> None:
        monkeypatch.setenv(cpu_linear.OVERRIDE_ENV, path)
        cpu_linear.linear_path.cache_clear()

    yield choose
    cpu_linear.linear_path.cache_clear()


def head_only(dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    """What `packing` reads of a model: its LM head's dtype and its parameters' bytes."""
    model = torch.nn.Module()
    model.lm_head = torch.nn.Linear(4, 4, dtype=dtype)
    return model


def packed_here(dtype: torch.dtype) -> bool:
    """Does rlctl pack `dtype` decode products with oneDNN on this CPU where its fp32 layers run
    in oneDNN (bf16: where oneDNN has native bf16; fp32: where this torch has oneDNN's layers)?"""
    if dtype == torch.float32:
        return cpu_linear._available() and decode_products._available("onednn", dtype)
    return packing(head_only(dtype), CPU, rows=64) == "onednn"


def needs_packing(dtype: torch.dtype):
    return pytest.mark.skipif(not packed_here(dtype), reason=f"rlctl does not pack {dtype} decode products with oneDNN on this CPU")


@pytest.fixture(scope="module")
def qwen2_onednn(tmp_path_factory, tiny_model):
    """The qwen2 test model with rlctl's fp32 layers in oneDNN, as an AMD CPU with AVX-512 holds it
    where MKL's Intel kernels could not be loaded (tests that decode with it choose that path too:
    the `linear_path` fixture)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(cpu_linear.OVERRIDE_ENV, "onednn")
        cpu_linear.linear_path.cache_clear()
        policy = HFPolicy.load(model_folder(tmp_path_factory, tiny_model, "qwen2"), "cpu")
    cpu_linear.linear_path.cache_clear()
    return policy


needs_mkl = pytest.mark.skipif(not decode_products._available("mkl", torch.float32), reason="this torch build has no MKL packed products")


@pytest.fixture(scope="module")
def qwen2(tmp_path_factory, tiny_model):
    return HFPolicy.load(model_folder(tmp_path_factory, tiny_model, "qwen2"), "cpu")  # q/k/v with biases, GQA


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_packed_product_is_the_stacked_modules_products_bit_for_bit(dtype, linear_path):
    if not packed_here(dtype):
        pytest.skip(f"rlctl does not pack {dtype} decode products on this CPU")
    linear_path("onednn")
    torch.manual_seed(0)
    layers = torch.nn.ModuleList(torch.nn.Linear(64, n, bias=bias, dtype=dtype) for n, bias in ((64, True), (32, True), (32, False)))
    q, k, v = cpu_linear.install(layers)  # as rlctl's models hold them
    product = OneDNNPackedProduct([q, k, v], rows=16)
    for rows in (2, 3, 16, 64):
        x = torch.randn(rows, 64, dtype=dtype)
        with torch.no_grad():
            got = product(x)
            assert got.shape == (rows, 128)
            assert torch.equal(got, torch.cat([q(x), k(x), v(x)], dim=-1))


def test_packing_is_chosen_where_it_was_measured_to_pay(monkeypatch, linear_path):
    model = head_only()
    linear_path("onednn")  # non-Intel x86 CPUs with AVX-512 where MKL's Intel kernels could not be loaded
    assert packing(model, CPU, rows=64) == ("onednn" if decode_products._available("onednn", torch.float32) else None)
    assert packing(model, CPU, rows=1) is None  # one row: the modules
    assert packing(model, torch.device("meta"), rows=64) is None  # GPUs: the modules
    linear_path("blas")  # MKL's fp32 products: packed where it runs its Intel kernels (Intel CPUs, AMD CPUs with the library)
    monkeypatch.setattr(mkl_kernels, "runs_intel_kernels", lambda cpuinfo: True)
    assert packing(model, CPU, rows=64) == ("mkl" if decode_products._available("mkl", torch.float32) else None)
    monkeypatch.setattr(mkl_kernels, "runs_intel_kernels", lambda cpuinfo: False)
    assert packing(model, CPU, rows=64) is None  # MKL's generic kernels: measured no faster packed
    linear_path("weight-first")
    assert packing(model, CPU, rows=64) is None


def test_the_override_keeps_the_modules_or_names_the_library(monkeypatch, linear_path):
    model = head_only()
    linear_path("onednn")
    monkeypatch.setenv(decode_products.OVERRIDE_ENV, "modules")
    assert packing(model, CPU, rows=64) is None
    for library in ("onednn", "mkl"):
        monkeypatch.setenv(decode_products.OVERRIDE_ENV, library)
        assert packing(model, CPU, rows=64) == (library if decode_products._available(library, torch.float32) else None)
    monkeypatch.setenv(decode_products.OVERRIDE_ENV, "mkl")
    assert packing(head_only(torch.bfloat16), CPU, rows=64) is None  # MKL packs fp32 only
    monkeypatch.setenv(decode_products.OVERRIDE_ENV, "prepacked")
    with pytest.raises(InputError, match=decode_products.OVERRIDE_ENV):
        packing(model, CPU, rows=64)


def test_a_packed_copy_is_made_only_where_it_leaves_most_memory_free(monkeypatch):
    gib = 2**30
    assert decode_products.fits_in_memory(2 * gib, available=16 * gib)
    assert not decode_products.fits_in_memory(8 * gib, available=16 * gib)  # a 2B-parameter fp32 model on a 16 GiB machine
    monkeypatch.setattr(decode_products, "_available_memory", lambda: None)
    assert decode_products.fits_in_memory(8 * gib)  # no /proc/meminfo: nothing to go by
    monkeypatch.setattr(decode_products, "_available_memory", lambda: 1024)
    model = torch.nn.Module()
    model.lm_head = torch.nn.Linear(64, 64)
    assert packing(model, CPU, rows=64) is None
    bytes_ = sum(p.numel() * p.element_size() for p in model.parameters())
    monkeypatch.setattr(decode_products, "_available_memory", lambda: int(1.5 * bytes_ / decode_products.MEMORY_SHARE))
    monkeypatch.setenv(decode_products.OVERRIDE_ENV, "mkl")  # MKL holds the stacked weights too: two copies
    assert packing(model, CPU, rows=64) is None
    monkeypatch.setenv(decode_products.OVERRIDE_ENV, "onednn")
    assert packing(model, CPU, rows=64) == ("onednn" if decode_products._available("onednn", torch.float32) else None)


@needs_packing(torch.float32)
def test_a_layers_products_are_the_modules_for_one_row_or_many(qwen2_onednn):
    model = qwen2_onednn.model
    packed, modules = DecodeProducts(model, packing="onednn", rows=8), DecodeProducts(model)
    hidden = model.config.hidden_size
    with torch.no_grad():
        for rows in (1, 2, 8):
            x = torch.randn(rows, hidden)
            for a, b in zip(packed.layers, modules.layers):
                assert torch.equal(a.qkv(x), b.qkv(x))
                assert torch.equal(a.o(x), b.o(x)) and torch.equal(a.mlp(x), b.mlp(x))
            assert torch.equal(packed.lm_head(x), modules.lm_head(x))


@needs_packing(torch.float32)
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_generation_from_packed_products_gives_the_modules_tokens_and_logprobs(monkeypatch, linear_path, qwen2_onednn, dtype):
    qwen2 = qwen2_onednn
    linear_path("onednn")
    texts = ["hello there", "12 + 3 =", "a"]
    batch = [qwen2.tokenizer(t)["input_ids"] for t in texts for _ in range(3)]
    qwen2.stop_ids = list(range(0, 512, 29))  # rows finish early: steps of fewer rows, down to one
    calls = []
    monkeypatch.setattr(OneDNNPackedProduct, "__call__", _counting(OneDNNPackedProduct.__call__, calls))
    results = {}
    for choice in ("modules", "packed"):
        monkeypatch.setenv(decode_products.OVERRIDE_ENV, choice)
        results[choice] = qwen2.generate(batch, SamplingParams(max_new_tokens=20, seed=3), batch_size=4, compute_dtype=dtype)
        assert bool(calls) == (choice == "packed" and (dtype == "fp32" or packed_here(torch.bfloat16)))
    for a, b in zip(results["modules"], results["packed"]):
        assert (a.response_ids, a.logprobs, a.finish_reason) == (b.response_ids, b.logprobs, b.finish_reason)


@needs_mkl
def test_an_mkl_packed_product_is_the_modules_products_to_rounding_as_rows_leave_and_return():
    torch.manual_seed(0)
    layers = [torch.nn.Linear(96, n, bias=bias) for n, bias in ((64, True), (32, False))]
    product = MKLPackedProduct(layers, rows=16)
    for rows, packed_for in ((16, 16), (13, 16), (12, 12), (10, 12), (9, 9), (2, 2), (16, 16), (40, 40)):
        x = torch.randn(rows, 96)
        with torch.no_grad():
            got = product(x)
            expected = torch.cat([layer(x) for layer in layers], dim=-1)
        assert got.shape == (rows, 96) and product.rows == packed_for  # fewer rows padded, a quarter fewer or more repacked
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)


@needs_mkl
def test_generation_from_mkl_packed_products_gives_the_modules_tokens_and_logprobs_to_rounding(monkeypatch, qwen2):
    texts = ["hello there", "12 + 3 =", "a"]
    batch = [qwen2.tokenizer(t)["input_ids"] for t in texts for _ in range(3)]
    qwen2.stop_ids = list(range(0, 512, 29))  # rows finish early: padded steps, repacks, one row
    calls = []
    monkeypatch.setattr(MKLPackedProduct, "__call__", _counting(MKLPackedProduct.__call__, calls))
    results = {}
    for choice in ("modules", "mkl"):
        monkeypatch.setenv(decode_products.OVERRIDE_ENV, choice)
        results[choice] = qwen2.generate(batch, SamplingParams(max_new_tokens=20, seed=3), batch_size=9, compute_dtype="fp32")
        assert bool(calls) == (choice == "mkl")
    for a, b in zip(results["modules"], results["mkl"]):
        assert (a.response_ids, a.finish_reason) == (b.response_ids, b.finish_reason)
        torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs), rtol=0, atol=1e-5)


def test_nothing_is_packed_where_the_direct_step_does_not_run(monkeypatch, qwen2):
    monkeypatch.setenv("RLCTL_DECODE_STEP", "transformers")
    with decoding_attention(qwen2.model, CPU):
        assert qwen2._decode_products(qwen2.model, rows=64) is None


def _counting(call, calls: list):
    def counted(self, *args):
        calls.append(1)
        return call(self, *args)

    return counted
