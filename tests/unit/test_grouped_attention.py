"""The packed forwards' grouped attention computes transformers' eager attention and SDPA's, to
float rounding, without repeating keys and values, and runs on the CPU only: in place of eager
attention always, of SDPA while a layer's scores stay small, SDPA's own grouped queries beyond."""

import pytest
import torch
import torch.nn.functional as F

from rlctl.backends import grouped_attention


class Attention(torch.nn.Module):
    """What transformers' attention functions read from their `module`."""

    def __init__(self, groups: int) -> None:
        super().__init__()
        self.num_key_value_groups = groups


def inputs(heads: int, kv_heads: int, dtype: torch.dtype, past: int = 3):
    g = torch.Generator().manual_seed(heads * 10 + kv_heads)
    rows, length, width = 3, 6, 8
    keys = past + length
    q = torch.randn(rows, heads, length, width, generator=g).to(dtype)
    k, v = (torch.randn(rows, kv_heads, keys, width, generator=g).to(dtype) for _ in range(2))
    valid = torch.rand(rows, keys, generator=g) > 0.3
    allowed = torch.ones(length, keys, dtype=torch.bool).tril(past) & valid[:, None]
    allowed |= torch.ones(length, keys, dtype=torch.bool).tril(past).triu(past)  # each query attends to itself
    allowed = allowed[:, None]
    additive = torch.zeros(allowed.shape, dtype=dtype).masked_fill_(~allowed, torch.finfo(dtype).min)
    return q, k, v, allowed, additive


@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (4, 2), (14, 2)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grouped_attention_is_transformers_eager_attention(heads, kv_heads, dtype):
    from transformers.models.qwen2.modeling_qwen2 import eager_attention_forward

    q, k, v, _, additive = inputs(heads, kv_heads, dtype)
    module = Attention(heads // kv_heads).eval()
    ours, _ = grouped_attention.attend(module, q, k, v, additive, scaling=0.3)
    theirs, _ = eager_attention_forward(module, q, k, v, additive, scaling=0.3)
    assert ours.shape == theirs.shape == (3, 6, heads, 8)
    if kv_heads == heads or dtype == torch.bfloat16:  # the same products (bf16's: rounded once from fp32 sums)
        assert torch.equal(ours, theirs)
    else:  # a taller block of queries per product: another summation order
        assert torch.allclose(ours, theirs, atol=1e-6, rtol=0)


@pytest.mark.parametrize("heads,kv_heads", [(4, 2), (14, 2)])
def test_grouped_attention_and_its_gradients_are_sdpas_to_float_rounding(heads, kv_heads):
    q, k, v, allowed, additive = inputs(heads, kv_heads, torch.float32)
    grads = {}
    for name in ("grouped", "sdpa"):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        if name == "grouped":
            out, _ = grouped_attention.attend(Attention(heads // kv_heads).train(), *leaves, additive, scaling=0.3)
        else:
            out = F.scaled_dot_product_attention(*leaves, attn_mask=allowed, scale=0.3, enable_gqa=True).transpose(1, 2)
        (out * torch.linspace(-1, 1, out.numel()).view(out.shape)).sum().backward()
        grads[name] = [out.detach()] + [t.grad for t in leaves]
    for ours, theirs in zip(grads["grouped"], grads["sdpa"]):
        assert torch.allclose(ours, theirs, atol=1e-5, rtol=1e-5)


def test_on_the_cpu_it_replaces_eager_attention_always_and_sdpa_while_the_scores_are_small():
    cpu, gpu = torch.device("cpu"), torch.device("cuda")
    small, large = grouped_attention.MAX_FP32_SCORES, grouped_attention.MAX_FP32_SCORES + 1
    assert grouped_attention.for_forward("eager", cpu, large) == (grouped_attention.attend, True)
    assert grouped_attention.for_forward("sdpa", cpu, small) == (grouped_attention.attend, True)
    assert grouped_attention.for_forward("sdpa", cpu, large) == (grouped_attention.sdpa, False)  # the flash kernel, its own GQA
    assert grouped_attention.for_forward("eager", gpu, 1) is None and grouped_attention.for_forward("sdpa", gpu, 1) is None


@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (14, 2)])
def test_sdpa_with_its_grouped_queries_is_sdpa_over_repeated_keys_and_values(heads, kv_heads):
    q, k, v, allowed, _ = inputs(heads, kv_heads, torch.float32)
    ours, _ = grouped_attention.sdpa(Attention(heads // kv_heads).eval(), q, k, v, allowed, scaling=0.3)
    group = heads // kv_heads
    theirs = F.scaled_dot_product_attention(q, k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1), attn_mask=allowed, scale=0.3)
    assert torch.allclose(ours, theirs.transpose(1, 2), atol=1e-6, rtol=0)
