"""The decoder-layer layout Llama, Mistral, Qwen2 and Qwen3 share (RMSNorm, q/k/v products
(Qwen3: q/k norms), rotary q/k, grouped-query attention, o product, residual, RMSNorm, gated
MLP, residual), for code that runs those layers itself instead of through transformers' model
forward: rlctl.backends.decode_step part by part for decoding, rlctl.backends.unpadded layer by
layer for scoring and training."""

from __future__ import annotations

from dataclasses import dataclass

import torch

# The causal LMs whose decoder layers have this layout in their transformers code
MODEL_CLASSES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")
# the same decoders under a sequence-classification head (`score`): reward models
SCORER_CLASSES = tuple(name.replace("ForCausalLM", "ForSequenceClassification") for name in MODEL_CLASSES)


@dataclass(frozen=True)
class Layer:
    """One decoder layer's parts, looked up once per call instead of once per layer run."""

    attention: torch.nn.Module  # what transformers' attention functions take as `module`
    input_norm: torch.nn.Module
    q_proj: torch.nn.Module
    k_proj: torch.nn.Module
    v_proj: torch.nn.Module
    q_norm: torch.nn.Module | None
    k_norm: torch.nn.Module | None
    o_proj: torch.nn.Module
    head_dim: int
    scaling: float
    post_norm: torch.nn.Module
    mlp: torch.nn.Module


def layer_parts(layer) -> Layer:
    attention = layer.self_attn
    return Layer(
        attention, layer.input_layernorm, attention.q_proj, attention.k_proj, attention.v_proj,
        getattr(attention, "q_norm", None), getattr(attention, "k_norm", None), attention.o_proj, attention.head_dim, attention.scaling,
        layer.post_attention_layernorm, layer.mlp,
    )


def llama_layout(model, classes: tuple[str, ...] = MODEL_CLASSES) -> bool:
    """Whether `model` is one of `classes` with every layer full attention (no sliding window)."""
    config = model.config
    if layout_class(model, classes) is None:
        return False
    if any(kind != "full_attention" for kind in getattr(config, "layer_types", None) or ()):
        return False
    return getattr(config, "sliding_window", None) is None or not getattr(config, "use_sliding_window", True)


def layout_class(model, classes: tuple[str, ...] = MODEL_CLASSES) -> type | None:
    """`model`'s class if it is one of `classes` (not a subclass that may change them), seen
    through the subclass FSDP2 makes of a module it shards (FSDP<class>)."""
    cls = next(c for c in type(model).__mro__ if not c.__name__.startswith("FSDP"))
    return cls if cls.__name__ in classes else None


def plain_layers(model) -> bool:
    """Whether `model` has the Llama layout (`llama_layout`) in plain modules: no hooks (FSDP's,
    a user's), only the LM head and the seven products per layer as linear layers (not LoRA's),
    so its parts can be run directly (`call`)."""
    if not llama_layout(model):
        return False
    linear = 0
    for module in model.modules():
        if module._forward_hooks or module._forward_pre_hooks:
            return False
        linear += isinstance(module, torch.nn.Linear)
    return linear == 1 + 7 * len(model.model.layers)  # the LM head, and q, k, v, o, gate, up, down per layer


def call(module: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The module's forward without `nn.Module.__call__`'s hook handling (none are registered:
    `plain_layers`)."""
    return type(module).forward(module, x)
