"""LoRA adapters on the policy (peft): train a few million numbers instead of every weight.

With `update.lora.r > 0` the policy becomes a peft model whose base weights are frozen; the
optimizer holds only the adapters. A reference model that is the base itself is not loaded a
second time: reference log-probs are the same module's forward with the adapters disabled.
Checkpoints hold the adapter (peft's `adapter_config.json` + `adapter_model.safetensors`, the
base recorded by its absolute path) and the tokenizer; `rlctl reshard --merge-lora` writes the
merged HF folder that transformers and vLLM load, and the vLLM engine of a hybrid run is given
the merged tensors (`merged_state_dict`: W + B·A·alpha/r for every adapted layer).
"""

from __future__ import annotations

import json
import warnings
from contextlib import contextmanager
from pathlib import Path

import torch

from rlctl.config import LoraConfig
from rlctl.errors import InputError

ADAPTER_CONFIG = "adapter_config.json"

# peft calls transformers APIs that transformers 5 marks deprecated; not the user's business
warnings.filterwarnings("ignore", message=r".*is_gradient_checkpointing.*", category=FutureWarning)
warnings.filterwarnings("ignore", message=r".*`past_key_values` is deprecated.*", category=FutureWarning)
# an adapter on lm_head of a model with tied embeddings adapts the output projection only; the
# merged model unties them (`untie_if_adapted`), which is what we want, not a complication
warnings.filterwarnings("ignore", message=r".*tie_word_embeddings=True. and a tied layer is part of the adapter.*", category=UserWarning)


def require_peft() -> None:
    try:
        import peft  # noqa: F401
    except ImportError:
        raise InputError("update.lora needs the peft package: pip install 'rlctl[lora]'") from None


def is_adapter_dir(uri: str | Path) -> bool:
    return (Path(uri) / ADAPTER_CONFIG).is_file()


def adapter_base(uri: str | Path) -> str:
    """The base model folder an adapter checkpoint was trained on (it must still be there)."""
    try:
        base = json.loads((Path(uri) / ADAPTER_CONFIG).read_text())["base_model_name_or_path"]
    except (ValueError, KeyError, TypeError) as exc:
        raise InputError(f"{uri}: {ADAPTER_CONFIG} names no base model ({exc})") from None
    if not base or not Path(base).is_dir():
        raise InputError(f"{uri}: a LoRA adapter of the base model {base!r}, which is not there; put the base back at that path")
    return base


def transformers_model(model: torch.nn.Module) -> torch.nn.Module:
    """The transformers model itself: a peft model's base (its LoRA layers in place), else `model`."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def is_lora(model: torch.nn.Module) -> bool:
    try:
        from peft import PeftModel
    except ImportError:
        return False
    return isinstance(model, PeftModel)


def add_adapter(model: torch.nn.Module, cfg: LoraConfig, base_path: str, trained_whole: tuple[str, ...] = (), setting: str = "update.lora") -> torch.nn.Module:
    """`model` with fresh LoRA adapters (B = 0: the same function as before), base frozen but
    for the modules `trained_whole` (a reward model's new head). The adapters' initial A is
    drawn from torch's generator, seeded here for reproducibility."""
    require_peft()
    from peft import LoraConfig as PeftLoraConfig
    from peft import get_peft_model

    names = {name.rpartition(".")[2] for name, _ in model.named_modules()}
    missing = [m for m in cfg.target_modules if m not in names]
    if missing:
        raise InputError(f"{setting}.target_modules: the model has no module named {missing[0]!r}")
    config = PeftLoraConfig(
        r=cfg.r, lora_alpha=cfg.alpha, lora_dropout=cfg.dropout, target_modules=list(cfg.target_modules), bias="none", modules_to_save=list(trained_whole) or None,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        peft_model = get_peft_model(model, config)
    peft_model.peft_config[peft_model.active_adapter].base_model_name_or_path = str(Path(base_path).resolve())
    return peft_model


def load_adapter(model: torch.nn.Module, uri: str) -> torch.nn.Module:
    """The base `model` with the adapter saved at `uri`, trainable."""
    require_peft()
    from peft import PeftModel

    return PeftModel.from_pretrained(model, uri, is_trainable=True)


def check_matches(model: torch.nn.Module, cfg: LoraConfig, uri: str) -> None:
    """An adapter checkpoint trains on with the adapter it holds: asking for another is exit 2."""
    if not cfg.r:
        return
    saved = model.peft_config[model.active_adapter]
    if saved.r != cfg.r or set(saved.target_modules) != set(cfg.target_modules) or float(saved.lora_alpha) != cfg.alpha:
        raise InputError(
            f"{uri} holds a LoRA adapter with r={saved.r}, alpha={saved.lora_alpha}, target_modules={sorted(saved.target_modules)}; "
            f"update.lora asks for r={cfg.r}, alpha={cfg.alpha}, target_modules={sorted(cfg.target_modules)}"
        )


def merged_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The base model's state dict under its own names, every adapted weight replaced by
    W + B·A·scaling: what an HF folder of the trained policy holds. The model is not changed."""
    from peft.tuners.lora import LoraLayer

    base = model.get_base_model()
    adapter = model.active_adapter
    merged = {key.replace(".base_layer.", "."): tensor for key, tensor in base.state_dict().items() if ".lora_" not in key}
    with torch.no_grad():
        for name, layer in base.named_modules():
            if isinstance(layer, LoraLayer) and adapter in layer.lora_A:
                delta = layer.lora_B[adapter].weight @ layer.lora_A[adapter].weight * layer.scaling[adapter]
                merged[f"{name}.weight"] = layer.get_base_layer().weight + delta.to(layer.get_base_layer().weight.dtype)
    return merged


def adapts_tied_output(model: torch.nn.Module) -> bool:
    """Whether the adapter changes lm_head of a model whose lm_head is its input embedding:
    merged, the two differ, so the merged model must not tie them."""
    config = model.get_base_model().config
    targets = model.peft_config[model.active_adapter].target_modules or ()
    return bool(getattr(config, "tie_word_embeddings", False)) and "lm_head" in targets


@contextmanager
def adapters_disabled(model: torch.nn.Module):
    """The base model's forward: the reference of a LoRA run, without a second copy."""
    with model.disable_adapter():
        yield




def prepare_for_training(policy, cfg: LoraConfig, source: str) -> None:
    """`update.lora` applied to a just-loaded policy (`policy.model` replaced): fresh adapters
    on a plain model, or the checkpoint's own adapter checked against the config."""
    if is_lora(policy.model):
        check_matches(policy.model, cfg, source)
    elif cfg.r:
        policy.model = add_adapter(policy.model, cfg, base_path=source)


def base_path(model: torch.nn.Module) -> str:
    """The folder of a LoRA policy's base weights."""
    return model.peft_config[model.active_adapter].base_model_name_or_path


def hf_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The policy's weights under the HF names an engine loads (merged for a LoRA policy)."""
    return merged_state_dict(model) if is_lora(model) else model.state_dict()


class AdapterDisabledReference:
    """The reference of a LoRA run whose reference is the base model: the policy's own module
    with its adapters disabled, so the base is in memory once."""

    def __init__(self, policy) -> None:
        self.policy = policy

    def logprobs(self, *args, **kwargs):
        with adapters_disabled(self.policy.model):  # on the module itself: never a copy, which keeps its adapters
            return self.policy.logprobs(*args, **{**kwargs, "as_trained": True})

    def __getattr__(self, name: str):
        return getattr(self.policy, name)
