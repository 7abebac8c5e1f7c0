"""fp32 linear layers in oneDNN where MKL leaves AVX-512 unused (non-Intel x86 with AVX-512, MKL's
Intel kernels not loaded), the gated MLP's projections weight-first for few rows where MKL is slow
at x·Wᵀ (non-Intel x86 with AVX2 only, MKL's own kernels): the same forward and gradients as nn.Linear to fp32 rounding, chosen from the
CPU, and nothing changes under autocast, in bf16, for training, or where the choice is BLAS."""

from __future__ import annotations

import copy

import pytest
import torch

from rlctl import cpu_linear
from rlctl.cpu_linear import (
    WEIGHT_FIRST_MAX_ROWS,
    OneDNNLinear,
    WeightFirstLinear,
    install,
    prefers_onednn,
    prefers_weight_first,
)

AMD_ZEN5 = "processor\t: 0\nvendor_id\t: AuthenticAMD\nflags\t\t: fpu sse2 avx2 avx512f avx512_bf16\n"
AMD_ZEN3 = "processor\t: 0\nvendor_id\t: AuthenticAMD\nflags\t\t: fpu sse2 avx2 fma\n"
INTEL_XEON = "processor\t: 0\nvendor_id\t: GenuineIntel\nflags\t\t: fpu sse2 avx2 avx512f avx512_vnni\n"
GRAVITON3 = "processor\t: 0\nFeatures\t: fp asimd sve bf16 i8mm\n"

needs_onednn = pytest.mark.skipif(not cpu_linear._available(), reason="this torch build has no oneDNN linear")


def test_onednn_is_chosen_only_for_non_intel_x86_with_avx512():
    assert prefers_onednn(AMD_ZEN5)  # where MKL runs its own choice there: AVX2 kernels
    assert not prefers_onednn(AMD_ZEN3)  # AVX2 only: measured on a Zen 3, oneDNN no faster end to end
    assert not prefers_onednn(INTEL_XEON)  # MKL already runs AVX-512 there
    assert not prefers_onednn(GRAVITON3) and not prefers_onednn("")


def test_onednn_is_not_chosen_where_mkl_runs_its_intel_kernels():
    # measured on the Zen 5 with MKL's Intel AVX-512 kernels (rlctl.mkl_kernels): an fp32 update 37% faster than oneDNN's
    assert not prefers_onednn(AMD_ZEN5, mkl_intel_kernels=True)


def test_weight_first_is_chosen_only_for_non_intel_x86_with_avx2_and_no_avx512():
    assert prefers_weight_first(AMD_ZEN3)  # measured: 4–10% less per generation there
    assert not prefers_weight_first(AMD_ZEN5)  # oneDNN there
    assert not prefers_weight_first(INTEL_XEON.replace(" avx512f", ""))  # MKL's own kernels: not measured
    assert not prefers_weight_first(GRAVITON3) and not prefers_weight_first("")


def test_weight_first_is_not_chosen_where_mkl_runs_its_intel_kernels():
    # measured on the Zen 3 with MKL's Intel kernels (rlctl.mkl_kernels): x·Wᵀ as fast, weight-first 8% slower
    assert not prefers_weight_first(AMD_ZEN3, mkl_intel_kernels=True)


@pytest.fixture
def choice(monkeypatch):
    """Set RLCTL_CPU_LINEAR for one test (the choice is cached per process)."""

    def choose(value: str) -> None:
        monkeypatch.setenv("RLCTL_CPU_LINEAR", value)
        cpu_linear.linear_path.cache_clear()

    yield choose
    cpu_linear.linear_path.cache_clear()


def pair(bias: bool, kind: type = OneDNNLinear, features: tuple[int, int] = (96, 160)) -> tuple[torch.nn.Linear, torch.nn.Linear]:
    """An nn.Linear and a copy of it whose class is `kind`."""
    torch.manual_seed(0)
    plain = torch.nn.Linear(*features, bias=bias)
    fast = copy.deepcopy(plain)
    fast.__class__ = kind
    return plain, fast


@needs_onednn
@pytest.mark.parametrize("bias", [True, False])
def test_forward_and_both_gradients_match_nn_linear(bias):
    plain, fast = pair(bias)
    x = torch.randn(3, 17, 96)
    grad_out = torch.randn(3, 17, 160)
    results = []
    for layer in (plain, fast):
        xi = x.clone().requires_grad_(True)
        y = layer(xi)
        y.backward(grad_out)
        results.append((y.detach(), xi.grad, layer.weight.grad, layer.bias.grad if bias else None))
    for ours, theirs in zip(results[1], results[0]):
        if theirs is not None:
            assert torch.allclose(ours, theirs, rtol=1e-5, atol=1e-5)


@needs_onednn
def test_a_frozen_layer_passes_the_input_gradient_only():
    """LoRA's base layers: weights frozen, the gradient still flows to the input."""
    plain, fast = pair(True)
    for layer in (plain, fast):
        layer.requires_grad_(False)
    x = torch.randn(5, 96, requires_grad=True)
    fast(x).sum().backward()
    expected = plain.weight.sum(0).expand(5, -1)
    assert fast.weight.grad is None and torch.allclose(x.grad, expected, atol=1e-5)


@needs_onednn
def test_inference_bf16_autocast_and_empty_inputs_behave_as_nn_linear():
    plain, fast = pair(True)
    with torch.no_grad():
        x = torch.randn(4, 96)
        assert torch.allclose(fast(x), plain(x), atol=1e-5)
        assert fast(torch.randn(0, 96)).shape == (0, 160)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            assert fast(x).dtype == torch.bfloat16
        assert fast.to(torch.bfloat16)(x.bfloat16()).dtype == torch.bfloat16


def test_install_swaps_plain_linear_layers_only_where_chosen(choice):
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4), torch.nn.Linear(4, 2))
    choice("blas")
    assert all(type(m) is torch.nn.Linear for m in install(model) if isinstance(m, torch.nn.Linear))
    choice("onednn")
    install(model)
    layers = [m for m in model if isinstance(m, torch.nn.Linear)]
    assert all(type(m) is OneDNNLinear for m in layers) is cpu_linear._available()
    assert list(model.state_dict()) == ["0.weight", "0.bias", "1.weight", "1.bias", "2.weight", "2.bias"]


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("shape", [(64, 96), (64, 1, 96), (16, 12, 96), (2 * WEIGHT_FIRST_MAX_ROWS, 96), (0, 96)])
def test_weight_first_inference_matches_nn_linear(bias, shape):
    plain, fast = pair(bias, WeightFirstLinear)
    x = torch.randn(*shape)
    with torch.no_grad():
        ours, theirs = fast(x), plain(x)
    assert ours.shape == theirs.shape and torch.allclose(ours, theirs, rtol=1e-5, atol=1e-6)


def test_weight_first_output_feeds_the_next_projection_without_a_copy():
    """gate/up give column-major views; their product keeps the layout; down reads it as is."""
    plain, fast = pair(False, WeightFirstLinear)
    down_plain, down_fast = pair(False, WeightFirstLinear, (160, 96))
    x = torch.randn(64, 1, 96)
    with torch.no_grad():
        hidden = torch.nn.functional.silu(fast(x)) * fast(x)
        assert not hidden.is_contiguous() and hidden.transpose(0, 2).is_contiguous()
        assert torch.allclose(down_fast(hidden), down_plain(torch.nn.functional.silu(plain(x)) * plain(x)), rtol=1e-5, atol=1e-6)


def test_weight_first_training_bf16_and_autocast_are_nn_linear_exactly():
    plain, fast = pair(True, WeightFirstLinear)
    x = torch.randn(8, 96)
    assert torch.equal(fast(x), plain(x))  # grad enabled: the update computes as before, bit for bit
    fast(x).sum().backward()
    plain(x).sum().backward()
    assert torch.equal(fast.weight.grad, plain.weight.grad)
    with torch.no_grad():
        with torch.autocast("cpu", dtype=torch.bfloat16):
            assert torch.equal(fast(x), plain(x))
        assert torch.equal(copy.deepcopy(fast).bfloat16()(x.bfloat16()), copy.deepcopy(plain).bfloat16()(x.bfloat16()))


def test_install_weight_first_swaps_the_gated_mlp_projections_only(choice, tmp_path):
    from rlctl.backends.base import SamplingParams
    from rlctl.backends.hf import HFPolicy
    from rlctl.modelinit import init_model

    folder = init_model(tmp_path / "tiny", "tiny", seed=0)
    choice("blas")
    stock = HFPolicy.load(str(folder), "cpu")
    choice("weight-first")
    fast = HFPolicy.load(str(folder), "cpu")
    swapped = {name.rpartition(".")[2] for name, m in fast.model.named_modules() if type(m) is WeightFirstLinear}
    assert swapped == {"gate_proj", "up_proj", "down_proj"}
    assert all(type(m) is torch.nn.Linear for name, m in fast.model.named_modules() if name.endswith(("q_proj", "o_proj", "lm_head")))
    assert list(fast.model.state_dict()) == list(stock.model.state_dict())
    prompts = [[5, 6, 7, 8], [9, 10, 11], [5, 6, 7, 8]]
    params = SamplingParams(12, temperature=1.0, seed=3)
    ours = fast.generate(prompts, params, compute_dtype="fp32")
    theirs = stock.generate(prompts, params, compute_dtype="fp32")
    assert [g.response_ids for g in ours] == [g.response_ids for g in theirs]
    assert max(abs(a - b) for g, h in zip(ours, theirs) for a, b in zip(g.logprobs, h.logprobs)) < 1e-5
