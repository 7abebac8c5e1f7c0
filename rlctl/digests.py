"""The weights' digest: what names the weights a stage ran with (the policy and critic inputs of
every stage manifest, each iteration's hand-over record) and what `rlctl replay --check`
compares after replaying an update.

sha256 over the module's state entries in name order, each entry's name then its bytes' digest;
an entry's bytes are hashed in chunks of `CHUNK_BYTES` (its digest: sha256 over its chunks'
sha256s), so the chunks are hashed on as many threads as this process runs torch on (hashlib
leaves the GIL while it hashes), and an entry that shares its memory with one before it (an
LM head tied to the embedding) reuses that one's digest. The bytes are read where the tensors
hold them. Medium preset (Qwen2.5-0.5B's shape, 2.5 GB of state, 2 threads): 0.7 s, against
1.7 s for the one-stream digest below (bench/RESULTS.md, "The weights' digest on threads").

Runs recorded before this digest named their weights by `weights_sha256`: sha256 over each
entry's name and raw bytes in one stream (`stream_digest`); replay checks such a run with that.
"""

from __future__ import annotations

import hashlib
from concurrent.futures import ThreadPoolExecutor

import torch

CHUNK_BYTES = 64 << 20


def module_digest(module: torch.nn.Module, threads: int | None = None) -> str:
    """The digest of `module.state_dict()` (see the module's text); `threads`: None for
    torch's thread count. The same value for any thread count."""
    entries = sorted(module.state_dict().items())
    distinct: dict[tuple, int] = {}  # a tensor's memory and layout → its index among `flats`
    flats: list[torch.Tensor] = []  # each distinct tensor's bytes, flat, where it lives
    owner = []  # each entry's index among `flats`
    for _, tensor in entries:
        key = (tensor.device, tensor.dtype, tensor.data_ptr(), tuple(tensor.shape), tensor.stride())
        if key not in distinct:
            distinct[key] = len(flats)
            flats.append(tensor.detach().contiguous().reshape(-1).view(torch.uint8))
        owner.append(distinct[key])
    chunks = [(i, start) for i, flat in enumerate(flats) for start in range(0, max(flat.numel(), 1), CHUNK_BYTES)]

    def chunk_digest(chunk: tuple[int, int]) -> bytes:  # a GPU tensor's chunk comes to the CPU here, one at a time
        i, start = chunk
        return hashlib.sha256(tensor_bytes(flats[i][start : start + CHUNK_BYTES])).digest()

    with ThreadPoolExecutor(max(1, threads or torch.get_num_threads())) as pool:
        chunk_digests = list(pool.map(chunk_digest, chunks))
    flat_digests = [hashlib.sha256() for _ in flats]
    for (i, _), digest_of_chunk in zip(chunks, chunk_digests):
        flat_digests[i].update(digest_of_chunk)
    digest = hashlib.sha256()
    for (name, _), i in zip(entries, owner):
        digest.update(name.encode())
        digest.update(flat_digests[i].digest())
    return digest.hexdigest()


def stream_digest(module: torch.nn.Module) -> str:
    """The digest runs recorded before `module_digest` (`weights_sha256`): sha256 over each
    entry's name and then its bytes, in name order, as one stream."""
    digest = hashlib.sha256()
    for name, tensor in sorted(module.state_dict().items()):
        digest.update(name.encode())
        digest.update(tensor_bytes(tensor))
    return digest.hexdigest()


def tensor_bytes(tensor: torch.Tensor) -> memoryview:
    """A tensor's bytes in row-major order as a buffer over its own memory (copied only where
    it is not contiguous or not on the CPU); any dtype, bf16 included."""
    flat = tensor.detach().cpu().contiguous().reshape(-1)
    return memoryview(flat.view(torch.uint8).numpy())
