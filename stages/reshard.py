"""reshard: training checkpoint → rollout weights: one HF folder (weights, config, tokenizer;
no optimizer state), cast to a dtype, that transformers and vLLM load as they are. A LoRA
checkpoint (an adapter over its base) is merged with `--merge-lora`.

There is one target, `hf`. A tensor-parallel layout of rlctl's own (`tp=N` rank shards) was
dropped: no engine loaded it. vLLM splits an HF folder over its ranks itself when it loads it
(`vllm.tensor_parallel_size = N`), and its own pre-sharded format holds engine internals
(fused projections, attention scale buffers) that change between vLLM versions.

    rlctl reshard --checkpoint runs/ckpt-1 --out runs/rollout-1 --dtype bf16 --check
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

from rlctl.config import ReshardConfig, to_dict
from rlctl.errors import InputError, RlctlError
from rlctl.folders import OutputWrite, describe_files
from rlctl.lineage import make_manifest, model_ref, up_to_date
from rlctl.manifest import Manifest
from rlctl.shards import filesystem, local_path

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
CONFIG_DTYPE = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}
COPIED = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json", "generation_config.json", "vocab.json", "merges.txt")


def run(*, checkpoint: str, out: str, cfg: ReshardConfig, check: bool = False, force: bool = False) -> Manifest:
    from rlctl.backends.hf import check_model_dir

    source = check_model_dir(checkpoint)
    if cfg.dtype not in DTYPES:
        raise InputError(f"--dtype must be one of {', '.join(DTYPES)}, got {cfg.dtype!r}")
    if cfg.to != "hf":
        raise InputError(
            f"reshard --to {cfg.to!r}: the one target is hf; tp=N shards were dropped (no engine loaded them): "
            "vLLM splits an HF folder itself, set vllm.tensor_parallel_size"
        )
    if local_path(out) is None:
        raise InputError(f"reshard --out {out!r}: rollout weights are written to local (or mounted shared) folders")
    manifest = make_manifest("reshard", {"reshard": to_dict(cfg)}, [model_ref(checkpoint)])
    if (existing := up_to_date(out, manifest, force)) is not None:
        return existing
    config, weights = _source_weights(source, cfg.merge_lora)
    state = cast_state(weights, DTYPES[cfg.dtype])
    fs, path = filesystem(out)
    with OutputWrite(fs, path, out, what="reshard output", fixed_names=True) as writing:
        target = Path(path)
        config["torch_dtype"] = config["dtype"] = CONFIG_DTYPE[cfg.dtype]
        (target / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        names = ["config.json"]
        for name in COPIED:  # the checkpoint's own, else (a LoRA checkpoint) its base's
            found = next((folder / name for folder in _file_sources(source) if (folder / name).exists()), None)
            if found is not None:
                shutil.copy2(found, target / name)
                names.append(name)
        _save(state, target / "model.safetensors")
        names.append("model.safetensors")
        if check:
            check_equal(load_state(target), state)
        manifest.files = describe_files(fs, path, names)
        from rlctl.backends.hf import read_trainer_step

        manifest.state = {"checked": check, "policy_version": read_trainer_step(checkpoint)}
        return writing.commit(manifest)


def _source_weights(source: Path, merge_lora: bool) -> tuple[dict, dict[str, torch.Tensor]]:
    """(config.json, weights) of the checkpoint: its own, or for a LoRA checkpoint its base's
    config and the merged weights (`--merge-lora`, asked for explicitly)."""
    from rlctl.lora import adapter_base, is_adapter_dir

    if not is_adapter_dir(source):
        if merge_lora:
            raise InputError(f"reshard --merge-lora: {source} holds no LoRA adapter (no adapter_config.json); leave the flag out")
        return json.loads((source / "config.json").read_text()), load_state(source)
    if not merge_lora:
        raise InputError(f"{source} is a LoRA checkpoint (an adapter over {adapter_base(source)}): pass --merge-lora to write the merged model")
    from rlctl.backends.hf import HFPolicy
    from rlctl.lora import adapts_tied_output, merged_state_dict

    model = HFPolicy.load(str(source), "cpu").model
    config = json.loads((Path(adapter_base(source)) / "config.json").read_text())
    if adapts_tied_output(model):  # the adapted lm_head is no longer the input embedding
        config["tie_word_embeddings"] = False
    return config, without_shared_storage(merged_state_dict(model))


def _file_sources(source: Path) -> list[Path]:
    from rlctl.lora import adapter_base, is_adapter_dir

    return [source, Path(adapter_base(source))] if is_adapter_dir(source) else [source]


def without_shared_storage(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Tied weights (lm_head = embed_tokens) once, under the first name, as save_pretrained
    writes them (safetensors refuses tensors that share memory)."""
    seen: set[int] = set()
    kept = {}
    for name, tensor in state.items():
        if tensor.data_ptr() not in seen:
            seen.add(tensor.data_ptr())
            kept[name] = tensor
    return kept


def load_state(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    files = sorted(folder.glob("model*.safetensors"))
    if not files:
        raise InputError(f"{folder}: no model*.safetensors weights")
    state: dict[str, torch.Tensor] = {}
    for file in files:
        state.update(load_file(str(file)))
    return state


def cast_state(state: dict[str, torch.Tensor], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    return {k: v.to(dtype) if v.is_floating_point() else v for k, v in state.items()}


def check_equal(written: dict[str, torch.Tensor], source: dict[str, torch.Tensor]) -> None:
    if written.keys() != source.keys():
        raise RlctlError(f"reshard check failed: parameter names differ ({sorted(written.keys() ^ source.keys())[:3]})")
    for name, tensor in source.items():
        if written[name].dtype != tensor.dtype or not torch.equal(written[name], tensor):
            raise RlctlError(f"reshard check failed: {name} does not read back equal to the source")


def _save(state: dict[str, torch.Tensor], path: Path) -> None:
    from safetensors.torch import save_file

    save_file({k: v.contiguous() for k, v in state.items()}, str(path), metadata={"format": "pt"})
