"""reshard: training checkpoint → rollout-layout weights: one HF folder, or N tensor-parallel
shards (`rank-NN.safetensors` + `tp_layout.json`), cast to a dtype.

    rlctl reshard --checkpoint runs/ckpt-1 --out runs/rollout-1 --to tp=2 --dtype bf16 --check
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
from rlctl.tp import TPPlan, parse_target, plan_tp

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
CONFIG_DTYPE = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}
LAYOUT_FILE = "tp_layout.json"
COPIED = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json", "generation_config.json", "vocab.json", "merges.txt")


def run(*, checkpoint: str, out: str, cfg: ReshardConfig, check: bool = False, force: bool = False) -> Manifest:
    from rlctl.backends.hf import check_model_dir

    source = check_model_dir(checkpoint)
    if cfg.dtype not in DTYPES:
        raise InputError(f"--dtype must be one of {', '.join(DTYPES)}, got {cfg.dtype!r}")
    tp = parse_target(cfg.to)
    if local_path(out) is None:
        raise InputError(f"reshard --out {out!r}: rollout weights are written to local (or mounted shared) folders")
    manifest = make_manifest("reshard", {"reshard": to_dict(cfg)}, [model_ref(checkpoint)])
    if (existing := up_to_date(out, manifest, force)) is not None:
        return existing
    config = json.loads((source / "config.json").read_text())
    state = cast_state(load_state(source), DTYPES[cfg.dtype])
    plan = None
    if tp is not None:  # planned before anything is written: a bad layout leaves no output
        heads = config["num_attention_heads"]
        plan = plan_tp({k: tuple(v.shape) for k, v in state.items()}, tp, num_heads=heads, num_kv_heads=config.get("num_key_value_heads", heads))
    fs, path = filesystem(out)
    with OutputWrite(fs, path, out, what="reshard output", fixed_names=True) as writing:
        target = Path(path)
        config["torch_dtype"] = config["dtype"] = CONFIG_DTYPE[cfg.dtype]
        (target / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        names = ["config.json"]
        for name in COPIED:
            if (source / name).exists():
                shutil.copy2(source / name, target / name)
                names.append(name)
        if plan is None:
            _save(state, target / "model.safetensors")
            names.append("model.safetensors")
        else:
            for rank, shard in enumerate(plan.split(state)):
                _save(shard, target / f"rank-{rank:02d}.safetensors")
                names.append(f"rank-{rank:02d}.safetensors")
            (target / LAYOUT_FILE).write_text(json.dumps(plan.to_json(), indent=2) + "\n")
            names.append(LAYOUT_FILE)
            if check:
                check_merge(plan, target, state)
        if check and tp is None:
            check_equal(load_state(target), state)
        manifest.files = describe_files(fs, path, names)
        from rlctl.backends.hf import read_trainer_step

        manifest.state = {"checked": check, "tp": tp or 1, "policy_version": read_trainer_step(checkpoint)}
        return writing.commit(manifest)


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


def load_tp_shards(folder: Path) -> tuple[TPPlan, list[dict[str, torch.Tensor]]]:
    from safetensors.torch import load_file

    from rlctl.tp import ParamSplit

    layout = json.loads((folder / LAYOUT_FILE).read_text())
    plan = TPPlan(layout["tp"], tuple(ParamSplit(n, tuple(p["shape"]), p["dim"], p["padded_rows"]) for n, p in sorted(layout["params"].items())))
    shards = [load_file(str(folder / f"rank-{r:02d}.safetensors")) for r in range(plan.tp)]
    return plan, shards


def check_merge(plan: TPPlan, folder: Path, source: dict[str, torch.Tensor]) -> None:
    """Reload the written shards, merge them, and require bit equality with `source`."""
    _, shards = load_tp_shards(folder)
    check_equal(plan.merge(shards), source)


def check_equal(merged: dict[str, torch.Tensor], source: dict[str, torch.Tensor]) -> None:
    if merged.keys() != source.keys():
        raise RlctlError(f"reshard check failed: parameter names differ ({sorted(merged.keys() ^ source.keys())[:3]})")
    for name, tensor in source.items():
        if merged[name].dtype != tensor.dtype or not torch.equal(merged[name], tensor):
            raise RlctlError(f"reshard check failed: {name} does not merge back to the source")


def _save(state: dict[str, torch.Tensor], path: Path) -> None:
    from safetensors.torch import save_file

    save_file({k: v.contiguous() for k, v in state.items()}, str(path), metadata={"format": "pt"})
