"""The FSDP2 gathers of rlctl's Ray ranks (rlctl.workers.gather): blocking all-gathers that give
every rank what torch's full state dicts give, bit for bit, shards of uneven and empty rows
included. Three gloo ranks in plain processes (no Ray)."""

import socket

import torch
import torch.multiprocessing as mp

RANKS = 3  # the tiny model's 128 and 512 rows and the value head's 1 row split unevenly over 3


def _rank(rank: int, port: int, model_dir: str) -> None:
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
    )
    from torch.distributed.device_mesh import init_device_mesh

    from rlctl.backends.hf import HFPolicy, ValueModel
    from rlctl.trainer import adamw
    from rlctl.workers.gather import full_model_state, full_optimizer_state
    from rlctl.workers.ray import _sharded, _sharded_critic

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=RANKS)
    mesh = init_device_mesh("cpu", (RANKS,))
    full = StateDictOptions(full_state_dict=True)
    for model in (_sharded(HFPolicy.load(model_dir, "cpu").model, mesh), _sharded_critic(ValueModel.load(model_dir, torch.device("cpu")), mesh)):
        trained = [p for p in model.parameters() if p.requires_grad]
        optimizer = adamw(trained, lr=1e-3, weight_decay=0.0)
        for p in trained:  # gradients sharded as FSDP2 leaves them (each rank its rows)
            p.grad = p.detach() * 0.5 + 0.01
        optimizer.step()

        theirs, ours = get_model_state_dict(model, options=full), full_model_state(model)
        assert list(ours) == list(theirs)
        assert all(ours[k].dtype == theirs[k].dtype and torch.equal(ours[k], theirs[k]) for k in theirs)

        torch_state = get_optimizer_state_dict(model, optimizer, options=full)
        index = {name: i for i, (name, p) in enumerate((n, p) for n, p in model.named_parameters() if p.requires_grad)}
        state = full_optimizer_state(model, optimizer)
        assert state["param_groups"] == [{**g, "params": [index[n] for n in g["params"]]} for g in torch_state["param_groups"]]
        assert list(state["state"]) == [index[n] for n in torch_state["state"]]
        for name, values in torch_state["state"].items():
            mine = state["state"][index[name]]
            assert list(mine) == list(values)
            assert all(type(mine[k]) is type(v) and mine[k].dtype == v.dtype and torch.equal(mine[k], v) for k, v in values.items())
    dist.destroy_process_group()
    _exit_without_finalizing()


def _exit_without_finalizing() -> None:
    """End a rank that passed without Python's interpreter finalization. A gloo worker thread
    frees a collective's work object after the waiting Python thread has moved on; when that
    free releases a tensor Python has seen, it takes the GIL, and if the process is finalizing by
    then, CPython ends the thread inside a destructor and C++ aborts ("terminate called without
    an active exception": 3 of ~45 runs of this test on 2 cores, a core dump's gloo thread in
    ~AsyncAllgatherWork; bench/RESULTS.md; upstream: pytorch/pytorch#179291). rlctl's Ray ranks
    are killed, never finalized."""
    import os
    import sys

    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def test_blocking_gathers_give_every_rank_what_torchs_full_state_dicts_give(tiny_model):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_rank, args=(port, tiny_model), nprocs=RANKS)  # a failed assertion on any rank fails here
