"""The weights' digest that names the weights of every stage's inputs and each hand-over, and
that `rlctl replay --check` compares: sha256 over each state entry's name and its bytes' digest
(sha256 over the sha256s of its 64 MiB chunks), the same for any thread count, tied entries
hashed once to the same value; runs recorded with the one-stream digest stay checkable."""

from __future__ import annotations

import hashlib

import torch

from rlctl import digests
from rlctl.manifest import Manifest
from rlctl.replay import recorded_weights


def spelled_out_digest(module: torch.nn.Module, chunk_bytes: int) -> str:
    """The definition, written out with a copy of every tensor's bytes."""
    digest = hashlib.sha256()
    for name, tensor in sorted(module.state_dict().items()):
        data = tensor.detach().contiguous().numpy().tobytes()
        chunks = [data[start : start + chunk_bytes] for start in range(0, max(len(data), 1), chunk_bytes)]
        entry = hashlib.sha256(b"".join(hashlib.sha256(chunk).digest() for chunk in chunks))
        digest.update(name.encode())
        digest.update(entry.digest())
    return digest.hexdigest()


def stream_of_bytes_digest(module: torch.nn.Module) -> str:
    """Runs recorded before: sha256 over names and raw bytes, one stream."""
    digest = hashlib.sha256()
    for name, tensor in sorted(module.state_dict().items()):
        digest.update(name.encode())
        digest.update(tensor.detach().contiguous().numpy().tobytes())
    return digest.hexdigest()


class TiedLM(torch.nn.Module):
    """An embedding, a norm and an output layer that may share the embedding's weight."""

    def __init__(self, tied: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = torch.nn.Embedding(11, 6)
        self.norm = torch.nn.LayerNorm(6)
        self.head = torch.nn.Linear(6, 11, bias=False)
        if tied:
            self.head.weight = self.embed.weight
        else:
            with torch.no_grad():
                self.head.weight.copy_(self.embed.weight)


def test_the_digest_is_sha256_over_names_and_the_digests_of_each_entrys_chunks(monkeypatch):
    monkeypatch.setattr(digests, "CHUNK_BYTES", 40)  # the embedding's 264 bytes: 7 chunks
    model = TiedLM(tied=False)
    assert digests.module_digest(model, threads=1) == spelled_out_digest(model, 40)
    assert digests.module_digest(model, threads=3) == spelled_out_digest(model, 40)


def test_a_tied_entry_is_hashed_once_and_digests_as_an_untied_copy_would():
    assert digests.module_digest(TiedLM(tied=True)) == digests.module_digest(TiedLM(tied=False))


def test_one_changed_weight_changes_the_digest():
    model = TiedLM(tied=True)
    before = digests.module_digest(model)
    with torch.no_grad():
        weight = model.norm.weight
        weight[2] = torch.nextafter(weight[2], torch.tensor(float("inf")))
    assert digests.module_digest(model) != before


def test_runs_recorded_before_are_checked_with_the_one_stream_digest():
    model = TiedLM(tied=True)
    assert digests.stream_digest(model) == stream_of_bytes_digest(model)
    legacy = Manifest(stage="update", state={"handover": {"weights_sha256": "abc"}})
    current = Manifest(stage="update", state={"handover": {"weights_digest": "def"}})
    assert recorded_weights(legacy) == ("weights_sha256", "abc")
    assert recorded_weights(current) == ("weights_digest", "def")


def test_a_tensors_bytes_are_its_row_major_bytes_whatever_its_layout_or_dtype():
    matrix = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    assert bytes(digests.tensor_bytes(matrix)) == matrix.numpy().tobytes()
    transposed = matrix.t()  # not contiguous: hashed as its row-major copy
    assert bytes(digests.tensor_bytes(transposed)) == transposed.contiguous().numpy().tobytes()
    halves = matrix.to(torch.bfloat16)  # no numpy dtype: its raw 2-byte values
    assert bytes(digests.tensor_bytes(halves)) == halves.view(torch.int16).numpy().tobytes()
    assert bytes(digests.tensor_bytes(torch.tensor(2.5))) == torch.tensor(2.5).numpy().tobytes()  # a scalar entry
