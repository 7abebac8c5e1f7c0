"""The whole of an FSDP2-sharded model's weights and optimizer state on every rank, gathered
with blocking all-gathers over the mesh's process group.

torch's `get_model_state_dict` / `get_optimizer_state_dict(full_state_dict=True)` gather
through DTensor's functional collectives: each all-gather is issued, handed back as a tensor
still being written by gloo's worker thread, and waited on when it is first read. Two-rank
runs on the CPU aborted in native code in the middle of such a gather, now and then (glibc's
"double free or corruption", "unaligned tcache chunk"; bench/RESULTS.md, "Native aborts in
the two-rank gathers"). The gathers here call `dist.all_gather_single` and wait before the
buffers are touched, as FSDP2's own forward and backward do; each rank's shard goes into a
buffer this code holds until the collective has returned. The results are the same tensors,
bit for bit (tests/e2e/test_fsdp_gather.py holds them to torch's).

FSDP2 shards a parameter along dim 0 as `torch.chunk` does: rank r holds rows
[r·c, min((r+1)·c, n)) with c = ceil(n / ranks), so only trailing ranks hold fewer rows (or
none). Each rank pads its shard to c rows; the gathered rows past n are that padding.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch is imported where a rank uses it (the controller imports this module too)
    import torch


def full_tensor(value: torch.Tensor) -> torch.Tensor:
    """The whole of `value`: a DTensor sharded along dim 0 over a 1-D mesh (FSDP2's layout),
    gathered into a plain tensor on every rank (a collective: every rank calls it, in the same
    order); a plain tensor as it is."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor, Shard

    if not isinstance(value, DTensor):
        return value
    if value.device_mesh.ndim != 1 or list(value.placements) != [Shard(0)]:
        raise ValueError(f"expected a DTensor sharded along dim 0 over a 1-D mesh (FSDP2), got {value.placements} on {value.device_mesh}")
    group = value.device_mesh.get_group()
    ranks = dist.get_world_size(group)
    rows = value.shape[0]
    chunk = -(-rows // ranks)
    local = value.to_local()
    padded = local.new_zeros((chunk, *local.shape[1:]))
    padded[: local.shape[0]].copy_(local)
    gathered = local.new_empty((chunk * ranks, *local.shape[1:]))
    dist.all_gather_single(gathered, padded, group=group)
    return gathered[:rows]


def full_model_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """`model.state_dict()` with every sharded tensor gathered whole (a tensor shared by
    several names, a tied embedding, gathered once)."""
    whole: dict[int, torch.Tensor] = {}
    state = {}
    for name, value in model.state_dict().items():
        if id(value) not in whole:
            whole[id(value)] = full_tensor(value.detach())
        state[name] = whole[id(value)]
    return state


def full_optimizer_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    """The optimizer's whole state as a single-process optimizer of `model`'s trained
    parameters holds it: {"state": {index: {name: tensor}}, "param_groups": [...]}, parameters
    numbered in `model.parameters()` order (those that require grad); `step` and other
    plain tensors as they are, moments gathered."""
    import torch

    from rlctl.trainer import trainable

    sharded_registered(model)
    trained = trainable(model)
    index = {id(p): i for i, p in enumerate(trained)}
    state = {}
    for param in trained:  # every rank gathers the same tensors in the same order
        values = optimizer.state.get(param)
        if values:
            state[index[id(param)]] = {name: full_tensor(v) if isinstance(v, torch.Tensor) else v for name, v in values.items()}
    groups = [{**{k: v for k, v in g.items() if k != "params"}, "params": [index[id(p)] for p in g["params"]]} for g in optimizer.param_groups]
    return {"state": state, "param_groups": groups}


def set_full_optimizer_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer, state: dict | None) -> None:
    """Load `full_optimizer_state`'s layout into the optimizer of an FSDP2-sharded `model`
    (each rank keeps its shards of the moments)."""
    if not state:
        return
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

    sharded_registered(model)
    names = [name for name, p in model.named_parameters() if p.requires_grad]  # a single-process AdamW numbers its state in this order
    keyed = {
        "state": {names[i]: values for i, values in state["state"].items()},
        "param_groups": [{**g, "params": [names[i] for i in g["params"]]} for g in state["param_groups"]],
    }
    set_optimizer_state_dict(model, optimizer, keyed, options=StateDictOptions(full_state_dict=True))


def sharded_registered(model: torch.nn.Module) -> None:
    """The sharded parameters (the optimizer's) registered on `model` again: after a forward
    without a backward (a held-out evaluation) FSDP2's root module keeps the unsharded ones
    registered in their place until the next backward, so the optimizer's parameters would not
    be found by name or identity."""
    from torch.distributed.fsdp import FSDPModule

    if isinstance(model, FSDPModule):
        model.reshard()
