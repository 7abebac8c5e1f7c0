"""What is read is what was committed: parts verified against the manifest, overwrites that a
reader never sees half-done, one writer per folder, and folders rlctl did not make left alone."""

import json
import os
import socket
import threading
import time

import pyarrow as pa
import pytest

from rlctl import shards
from rlctl.errors import InputError, SchemaError, SchemaVersionError
from rlctl.folders import NO_VERIFY_ENV
from rlctl.locks import FolderLock, LockedError
from rlctl.manifest import LOCK_NAME, MANIFEST_NAME, Manifest
from tests.conftest import part_files
from tests.unit.test_shards import ROLLOUT_VALUES, table


def committed(tmp_path, name="out", rows_per_part=2) -> str:
    uri = str(tmp_path / name)
    shards.write(table(), uri, Manifest(stage="t"), schema="rollouts", rows_per_part=rows_per_part)
    return uri


def edit_manifest(uri: str, change) -> None:
    path = os.path.join(uri, MANIFEST_NAME)
    raw = json.loads(open(path).read())
    change(raw)
    with open(path, "w") as f:
        f.write(json.dumps(raw))


# --- verified reads ---------------------------------------------------------------------------


def test_a_part_changed_after_commit_is_refused_by_its_sha256(tmp_path):
    uri = committed(tmp_path)
    part = part_files(uri)[0]
    data = bytearray(part.read_bytes())
    data[-40] ^= 0xFF  # same size, different bytes
    part.write_bytes(bytes(data))
    with pytest.raises(InputError, match=rf"{part.name} does not match its manifest .*changed after commit"):
        shards.read(uri)


def test_no_verify_skips_the_hash_but_not_the_size(tmp_path, monkeypatch):
    uri = committed(tmp_path)
    part = part_files(uri)[0]  # rows 0-1: responses "abc" and "d"
    changed = part.read_bytes().replace(b"abc", b"abX")
    part.write_bytes(changed)
    with pytest.raises(InputError, match="does not match its manifest"):
        shards.read(uri)
    monkeypatch.setenv(NO_VERIFY_ENV, "1")
    assert shards.read(uri).table.column("response").to_pylist()[0] == "abX"  # the escape hatch trusts the bytes
    part.write_bytes(changed[:-8])
    with pytest.raises(InputError, match="truncated or changed after commit"):
        shards.read(uri)


@pytest.mark.parametrize("path", ["../outside.arrow", "/etc/passwd", "s3://bucket/part.arrow", "a/../../b.arrow", "_manifest.json", "", "c:part.arrow"])
def test_a_manifest_entry_that_leaves_the_folder_is_refused(tmp_path, path):
    uri = committed(tmp_path)
    edit_manifest(uri, lambda m: m["files"][0].update(path=path))
    with pytest.raises(InputError, match="leaves the folder"):
        shards.read(uri)


def test_a_manifest_that_lists_a_part_twice_is_refused(tmp_path):
    uri = committed(tmp_path)
    edit_manifest(uri, lambda m: m["files"].append(m["files"][0]))
    with pytest.raises(InputError, match="listed twice"):
        shards.read(uri)


@pytest.mark.parametrize("change,fragment", [
    (lambda m: m.update(manifest_version=99), "manifest_version 99 is newer than this rlctl reads"),
    (lambda m: m["files"][0].update(rows=-1), "non-negative integer"),
    (lambda m: m.pop("stage"), "not an rlctl manifest"),
    (lambda m: m["files"][0].update(bytes="12"), "non-negative integer"),
    (lambda m: m.update(state=[1, 2]), "state must be a JSON object"),
    (lambda m: m.update(config="x"), "config must be a JSON object"),
    (lambda m: m.update(seed="7"), "seed must be an integer"),
    (lambda m: m.update(files={"a": 1}), "malformed entry"),
    (lambda m: m.update(key=5), "key must be a string"),
])
def test_a_malformed_manifest_is_refused(tmp_path, change, fragment):
    uri = committed(tmp_path)
    edit_manifest(uri, change)
    with pytest.raises(InputError, match=fragment):
        shards.read(uri)


def test_manifests_are_strict_json_both_ways(tmp_path):
    uri = str(tmp_path / "out")
    shards.write(table(), uri, Manifest(stage="t", metrics={"kl": float("nan"), "grad_norm": float("inf")}), schema="rollouts")
    text = open(os.path.join(uri, MANIFEST_NAME)).read()
    assert "NaN" not in text and "Infinity" not in text and json.loads(text)["metrics"] == {"kl": None, "grad_norm": None}
    with open(os.path.join(uri, MANIFEST_NAME), "w") as f:
        f.write(text.replace('"kl": null', '"kl": NaN'))
    with pytest.raises(InputError, match="NaN is not valid JSON"):
        shards.read(uri)


def test_a_manifest_of_a_newer_schema_major_version_is_refused(tmp_path):
    uri = committed(tmp_path)
    edit_manifest(uri, lambda m: m.update(schema_version="7.0"))
    with pytest.raises(SchemaVersionError, match="7.0 is newer than this rlctl reads"):
        shards.read(uri)


def test_parts_with_different_schemas_are_one_clear_error(tmp_path):
    uri = committed(tmp_path)
    other = str(tmp_path / "other")
    changed = pa.table({**ROLLOUT_VALUES, "finish_reason": pa.array([1, 2, 3], pa.int64())})
    shards.write(changed, other, Manifest(stage="t"), rows_per_part=2)
    second = part_files(other)[1]
    os.replace(second, part_files(uri)[1])  # a part of another output, under this one's name
    edit_manifest(uri, lambda m: m["files"][1].update(bytes=os.path.getsize(part_files(uri)[1]), sha256=json.loads(open(os.path.join(other, MANIFEST_NAME)).read())["files"][1]["sha256"]))
    with pytest.raises(SchemaError, match=r"does not have the schema of .*column 'finish_reason' is int64, not string") as caught:
        shards.read(uri)
    assert "\n" not in str(caught.value)


# --- overwrites ---------------------------------------------------------------------------


def test_an_overwrite_uses_new_part_names_and_deletes_the_old_ones_only_after_commit(tmp_path, monkeypatch):
    uri = committed(tmp_path)
    old_parts = part_files(uri)
    seen_during_write = []

    def rows():
        for batch in table().slice(0, 2).to_batches(max_chunksize=1):
            seen_during_write.append((all(p.exists() for p in old_parts), shards.read(uri).table.num_rows))
            yield batch

    shards.write(rows(), uri, Manifest(stage="t"), schema="rollouts", rows_per_part=1)
    assert seen_during_write == [(True, 3), (True, 3)]  # the old output stayed whole and readable
    new_parts = part_files(uri)
    assert not set(new_parts) & set(old_parts) and not any(p.exists() for p in old_parts)
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == sorted([MANIFEST_NAME, *(p.name for p in new_parts)])


def test_a_failed_overwrite_leaves_the_previous_output_committed_and_intact(tmp_path):
    uri = committed(tmp_path)
    before = shards.read(uri).table

    def failing():
        yield table().to_batches()[0]
        raise RuntimeError("the writer crashed")

    with pytest.raises(RuntimeError):
        shards.write(failing(), uri, Manifest(stage="t"), schema="rollouts", rows_per_part=1)
    assert shards.read(uri).table.equals(before)
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == sorted([MANIFEST_NAME, *(p.name for p in part_files(uri))])


def race(uri: str, versions: list[pa.Table], rounds: int = 30) -> tuple[int, list[str]]:
    """A writer rewrites `uri` with alternating versions while a reader reads it; returns
    (reads that saw one whole version, error messages)."""
    shards.write(versions[0], uri, Manifest(stage="t"), rows_per_part=1)
    done = threading.Event()
    errors: list[str] = []
    whole = [0]

    def reader():
        while not done.is_set():
            try:
                got = shards.read(uri).table
            except InputError as exc:
                errors.append(str(exc))
                continue
            assert any(got.equals(v) for v in versions), got.to_pydict()
            whole[0] += 1

    thread = threading.Thread(target=reader)
    thread.start()
    try:
        for i in range(rounds):
            shards.write(versions[i % 2], uri, Manifest(stage="t"), rows_per_part=1)
    finally:
        done.set()
        thread.join()
    return whole[0], errors


def test_a_reader_racing_a_writer_on_memory_never_sees_a_mix():
    versions = [pa.table({"id": [f"a{i}" for i in range(6)], "v": list(range(6))}), pa.table({"id": [f"b{i}" for i in range(6)], "v": list(range(10, 16))})]
    whole, errors = race(f"memory://race-{os.getpid()}", versions)
    assert whole > 0
    assert all("changed under me" in e for e in errors), errors[:3]


# --- one writer at a time ------------------------------------------------------------------


def test_a_second_writer_fails_naming_the_holder_and_leaves_the_output_alone(tmp_path):
    uri = committed(tmp_path)
    before = shards.read(uri).table
    with FolderLock.acquire(shards.filesystem(uri)[0], uri, what="output"):
        with pytest.raises(LockedError, match=rf"being written by pid {os.getpid()} on {socket.gethostname()}") as caught:
            shards.write(table().slice(0, 1), uri, Manifest(stage="t"), schema="rollouts")
        assert caught.value.exit_code == 2
    assert shards.read(uri).table.equals(before)
    assert not (tmp_path / "out" / LOCK_NAME).exists()


@pytest.mark.parametrize("holder,stale", [
    ({"host": socket.gethostname(), "pid": 2**22 + 12345, "time": time.time()}, True),  # no such process
    ({"host": socket.gethostname(), "pid": os.getpid(), "time": time.time(), "started_process": -1}, True),  # pid reused
    ({"host": "elsewhere", "pid": 1, "time": time.time() - 7 * 3600}, True),  # another host, old
    ({"host": "elsewhere", "pid": 1, "time": time.time()}, False),  # another host, recent
    ({"host": socket.gethostname(), "pid": os.getpid(), "time": time.time()}, False),  # alive
])
def test_a_stale_lock_is_taken_over_and_a_live_one_is_not(tmp_path, holder, stale):
    uri = committed(tmp_path)
    (tmp_path / "out" / LOCK_NAME).write_text(json.dumps(holder))
    if stale:
        shards.write(table().slice(0, 1), uri, Manifest(stage="t"), schema="rollouts")
        assert shards.read(uri).table.num_rows == 1 and not (tmp_path / "out" / LOCK_NAME).exists()
    else:
        with pytest.raises(LockedError):
            shards.write(table().slice(0, 1), uri, Manifest(stage="t"), schema="rollouts")
        assert shards.read(uri).table.num_rows == 3


# --- folders rlctl did not make ---------------------------------------------------------------


def test_an_output_folder_holding_other_files_is_refused_and_left_untouched(tmp_path):
    folder = tmp_path / "mine"
    folder.mkdir()
    (folder / "notes.txt").write_text("my notes")
    with pytest.raises(InputError, match=r"is not an rlctl output folder: it holds 'notes.txt'"):
        shards.write(table(), str(folder), Manifest(stage="t"), schema="rollouts")
    assert sorted(p.name for p in folder.iterdir()) == ["notes.txt"]


def test_a_file_added_beside_a_committed_output_blocks_an_overwrite(tmp_path):
    uri = committed(tmp_path)
    (tmp_path / "out" / "keep-me.csv").write_text("1,2")
    with pytest.raises(InputError, match="keep-me.csv"):
        shards.write(table(), uri, Manifest(stage="t"), schema="rollouts")
    assert (tmp_path / "out" / "keep-me.csv").exists() and shards.read(uri).table.num_rows == 3


def test_a_part_that_is_a_link_out_of_the_folder_is_refused(tmp_path):
    uri = committed(tmp_path)
    outside = tmp_path / "elsewhere.arrow"
    part = part_files(uri)[0]
    os.replace(part, outside)
    os.symlink(outside, part)
    with pytest.raises(InputError, match="is a link that leaves the folder"):
        shards.read(uri)


def test_a_deeply_nested_manifest_is_refused_not_a_crash(tmp_path):
    uri = committed(tmp_path)
    with open(os.path.join(uri, MANIFEST_NAME), "w") as f:
        f.write("[" * 100000 + "]" * 100000)
    with pytest.raises(InputError, match="unreadable _manifest.json"):
        shards.read(uri)


def test_a_shard_write_never_replaces_a_model_folder_and_back(tmp_path):
    from rlctl.folders import OutputWrite, describe_files

    model = tmp_path / "model"
    fs, path = shards.filesystem(str(model))
    with OutputWrite(fs, path, str(model), what="checkpoint", fixed_names=True) as out:
        (model / "model.safetensors").write_bytes(b"weights")
        manifest = Manifest(stage="update")
        manifest.files = describe_files(fs, path, ["model.safetensors"])
        out.commit(manifest)
    with pytest.raises(InputError, match="holds a committed update output \\(a model folder\\)"):
        shards.write(table(), str(model), Manifest(stage="t"), schema="rollouts")
    assert (model / "model.safetensors").read_bytes() == b"weights"
    uri = committed(tmp_path)
    with pytest.raises(InputError, match="holds a committed shard output"):
        with OutputWrite(*shards.filesystem(uri), uri, what="checkpoint", fixed_names=True):
            pass
    assert shards.read(uri).table.num_rows == 3


@pytest.mark.parametrize("cpus", [1, 3])
def test_files_are_hashed_several_at_once_each_to_its_own_sha256(tmp_path, monkeypatch, cpus):
    """A checkpoint's files are described and verified with one hashing thread per CPU, the
    largest first; each entry still gets its own file's sha256, in the listing's order, and the
    first changed file in that order is the one named."""
    import hashlib

    import fsspec

    from rlctl import folders

    monkeypatch.setattr(folders, "available_cpus", lambda: cpus)
    contents = {"a.bin": os.urandom(3 << 20), "b.json": b"{}", "c/d.bin": os.urandom(9 << 20), "e.bin": b""}
    for name, data in contents.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_bytes(data)
    fs = fsspec.filesystem("file")
    entries = folders.describe_files(fs, str(tmp_path), list(contents))
    assert [(e.path, e.bytes, e.sha256) for e in entries] == [(n, len(d), hashlib.sha256(d).hexdigest()) for n, d in sorted(contents.items())]
    manifest = Manifest(stage="checkpoint", files=entries)
    folders.verify_files(fs, str(tmp_path), manifest, "ckpt", verify=True)
    for name in ("a.bin", "c/d.bin"):  # one bit changed in each: c/d.bin is hashed first, a.bin is listed first
        data = contents[name]
        (tmp_path / name).write_bytes(data[:-1] + bytes([data[-1] ^ 1]))
    with pytest.raises(InputError, match=r"ckpt: a.bin does not match its manifest"):
        folders.verify_files(fs, str(tmp_path), manifest, "ckpt", verify=True)
