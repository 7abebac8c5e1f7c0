"""A decode step's products from packed weights: the modules' products bit for bit where rlctl
packs them, one product per stacked group (q/k/v, gate/up), the modules' own for one row, packed
only where measured to pay, and generation's tokens and log-probs unchanged."""

from __future__ import annotations

import pytest
import torch

from rlctl import cpu_linear
from rlctl.backends import decode_products
from rlctl.backends.base import SamplingParams
from rlctl.backends.decode_products import DecodeProducts, PackedProduct, packs
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


def packed_here(dtype: torch.dtype) -> bool:
    model = torch.nn.Module()
    model.lm_head = torch.nn.Linear(4, 4, dtype=dtype)
    return packs(model, CPU, rows=64)


def needs_packing(dtype: torch.dtype):
    return pytest.mark.skipif(not packed_here(dtype), reason=f"rlctl does not pack {dtype} decode products on this CPU")


@pytest.fixture(scope="module")
def qwen2(tmp_path_factory, tiny_model):
    return HFPolicy.load(model_folder(tmp_path_factory, tiny_model, "qwen2"), "cpu")  # q/k/v with biases, GQA


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_packed_product_is_the_stacked_modules_products_bit_for_bit(dtype):
    if not packed_here(dtype):
        pytest.skip(f"rlctl does not pack {dtype} decode products on this CPU")
    torch.manual_seed(0)
    layers = torch.nn.ModuleList(torch.nn.Linear(64, n, bias=bias, dtype=dtype) for n, bias in ((64, True), (32, True), (32, False)))
    q, k, v = cpu_linear.install(layers)  # as rlctl's models hold them
    product = PackedProduct([q, k, v], rows=16)
    for rows in (2, 3, 16, 64):
        x = torch.randn(rows, 64, dtype=dtype)
        with torch.no_grad():
            got = product(x)
            assert got.shape == (rows, 128)
            assert torch.equal(got, torch.cat([q(x), k(x), v(x)], dim=-1))


def test_packing_is_chosen_where_it_was_measured_to_pay(monkeypatch, linear_path):
    model = torch.nn.Module()
    model.lm_head = torch.nn.Linear(4, 4)
    linear_path("blas")  # MKL's fp32 products (Intel CPUs, AVX2-only CPUs): not measured packed
    assert not packs(model, CPU, rows=64)
    linear_path("onednn")
    assert packs(model, CPU, rows=64) == decode_products._available()
    assert not packs(model, CPU, rows=1)  # one row: oneDNN's packed kernel sums in another order
    assert not packs(model, torch.device("meta"), rows=64)  # GPUs: the modules
    monkeypatch.setenv(decode_products.OVERRIDE_ENV, "modules")
    assert not packs(model, CPU, rows=64)
    monkeypatch.setenv(decode_products.OVERRIDE_ENV, "prepacked")
    with pytest.raises(InputError, match=decode_products.OVERRIDE_ENV):
        packs(model, CPU, rows=64)


def test_a_packed_copy_is_made_only_where_it_leaves_most_memory_free(monkeypatch):
    gib = 2**30
    assert decode_products.fits_in_memory(2 * gib, available=16 * gib)
    assert not decode_products.fits_in_memory(8 * gib, available=16 * gib)  # a 2B-parameter fp32 model on a 16 GiB machine
    monkeypatch.setattr(decode_products, "_available_memory", lambda: None)
    assert decode_products.fits_in_memory(8 * gib)  # no /proc/meminfo: nothing to go by
    monkeypatch.setattr(decode_products, "_available_memory", lambda: 1024)
    model = torch.nn.Module()
    model.lm_head = torch.nn.Linear(64, 64)
    assert not packs(model, CPU, rows=64)


@needs_packing(torch.float32)
def test_a_layers_products_are_the_modules_for_one_row_or_many(qwen2):
    model = qwen2.model
    packed, modules = DecodeProducts(model, packed=True, rows=8), DecodeProducts(model, packed=False)
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
def test_generation_from_packed_products_gives_the_modules_tokens_and_logprobs(monkeypatch, qwen2, dtype):
    texts = ["hello there", "12 + 3 =", "a"]
    batch = [qwen2.tokenizer(t)["input_ids"] for t in texts for _ in range(3)]
    qwen2.stop_ids = list(range(0, 512, 29))  # rows finish early: steps of fewer rows, down to one
    calls = []
    monkeypatch.setattr(PackedProduct, "__call__", _counting(PackedProduct.__call__, calls))
    results = {}
    for choice in ("modules", "packed"):
        monkeypatch.setenv(decode_products.OVERRIDE_ENV, choice)
        results[choice] = qwen2.generate(batch, SamplingParams(max_new_tokens=20, seed=3), batch_size=4, compute_dtype=dtype)
        assert bool(calls) == (choice == "packed" and (dtype == "fp32" or packed_here(torch.bfloat16)))
    for a, b in zip(results["modules"], results["packed"]):
        assert (a.response_ids, a.logprobs, a.finish_reason) == (b.response_ids, b.logprobs, b.finish_reason)


def test_nothing_is_packed_where_the_direct_step_does_not_run(monkeypatch, qwen2):
    monkeypatch.setenv("RLCTL_DECODE_STEP", "transformers")
    with decoding_attention(qwen2.model, CPU):
        assert qwen2._decode_products(qwen2.model, rows=64) is None


def _counting(call, calls: list):
    def counted(self, *args):
        calls.append(1)
        return call(self, *args)

    return counted
