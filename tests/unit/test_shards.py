"""The shard store: committed folders, single files, streams; the manifest is the commit point."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from rlctl import schemas, shards
from rlctl.errors import InputError, NotCommittedError
from rlctl.manifest import MANIFEST_NAME, Manifest
from tests.conftest import part_files

ROLLOUT_VALUES = {
    "id": ["a", "a", "b"],
    "prompt": ["hi", "hi", "yo"],
    "sample": pa.array([0, 1, 0], pa.int32()),
    "prompt_ids": pa.array([[1, 2], [1, 2], [7]], pa.list_(pa.int32())),
    "response_ids": pa.array([[3, 4, 5], [6], [8, 9]], pa.list_(pa.int32())),
    "response": ["abc", "d", "é✓"],
    "rollout_logprobs": pa.array([[-1.0, -2.0, -3.5], [-0.5], [-0.25, -1e-7]], pa.list_(pa.float32())),
    "finish_reason": ["length", "stop", "stop"],
    "policy_version": pa.array([3, 3, 3], pa.int64()),
}


def table():
    return pa.table(ROLLOUT_VALUES)


@pytest.mark.parametrize("where", ["local", "file", "memory"])
def test_round_trip_preserves_values_and_schema_metadata(tmp_path, where):
    uri = {"local": str(tmp_path / "out"), "file": f"file://{tmp_path}/out", "memory": f"memory://rt-{os.getpid()}"}[where]
    manifest = shards.write(table(), uri, Manifest(stage="test", seed=7), schema="rollouts", rows_per_part=2)
    assert [f.rows for f in manifest.files] == [2, 1]
    back = shards.read(uri, "rollouts")
    assert back.table.to_pylist() == shards.read(uri).table.to_pylist()
    assert back.table.select(list(ROLLOUT_VALUES)).to_pydict() == table().to_pydict()
    assert back.table.schema.metadata[b"rlctl.schema"] == b"rollouts"
    assert back.manifest.seed == 7 and back.manifest.schema == "rollouts"


def test_manifest_records_files_with_rows_bytes_and_sha256(tmp_path):
    import hashlib

    out = tmp_path / "out"
    manifest = shards.write(table(), str(out), Manifest(stage="test"), schema="rollouts", rows_per_part=1)
    recorded = json.loads((out / MANIFEST_NAME).read_text())
    assert recorded["schema_version"] == schemas.spec("rollouts").version and recorded["rlctl_version"]
    for entry in manifest.files:
        data = (out / entry.path).read_bytes()
        assert entry.bytes == len(data) and entry.sha256 == hashlib.sha256(data).hexdigest()
    assert recorded["timings"]["seconds"] >= 0


def test_single_parquet_file_round_trip_keeps_values_and_metadata(tmp_path):
    from rlctl import schemas

    path = tmp_path / "one.parquet"
    pq.write_table(schemas.validate(table(), "rollouts"), path)
    raw = shards.read(str(path)).table  # no validation: what the file itself carries
    assert raw.schema.metadata[b"rlctl.schema"] == b"rollouts" and raw.schema.metadata[b"rlctl.schema_version"] == schemas.spec("rollouts").version.encode()
    assert raw.select(list(ROLLOUT_VALUES)).to_pydict() == table().to_pydict()


def test_parquet_parts_keep_schema_metadata(tmp_path):
    shards.write(table(), str(tmp_path / "pq"), Manifest(stage="t"), schema="rollouts", format="parquet")
    assert [p.suffix for p in part_files(tmp_path / "pq")] == [".parquet"]
    assert shards.read(str(tmp_path / "pq")).table.schema.metadata[b"rlctl.schema"] == b"rollouts"


def test_folder_without_manifest_is_refused(tmp_path):
    out = tmp_path / "out"
    shards.write(table(), str(out), Manifest(stage="t"), schema="rollouts")
    (out / MANIFEST_NAME).unlink()
    with pytest.raises(NotCommittedError, match="no _manifest.json"):
        shards.read(str(out))


def test_truncated_arrow_file_is_refused(tmp_path):
    shards.write(table(), str(tmp_path / "out"), Manifest(stage="t"), schema="rollouts")
    part = part_files(tmp_path / "out")[0]
    single = tmp_path / "single.arrow"
    single.write_bytes(part.read_bytes()[:-100])
    with pytest.raises(InputError, match="single.arrow: not a readable Arrow IPC file"):
        shards.read(str(single))
    part.write_bytes(part.read_bytes()[:-100])
    with pytest.raises(InputError, match="truncated"):
        shards.read(str(tmp_path / "out"))


def test_rewrite_replaces_a_committed_output_cleanly(tmp_path):
    out = tmp_path / "out"
    shards.write(table(), str(out), Manifest(stage="t"), schema="rollouts", rows_per_part=1)
    shards.write(table().slice(0, 1), str(out), Manifest(stage="t"), schema="rollouts")
    assert sorted(p.name for p in out.iterdir()) == sorted([MANIFEST_NAME, part_files(out)[0].name])
    assert shards.read(str(out)).table.num_rows == 1


def test_streaming_write_of_batches(tmp_path):
    def batches():
        for i in range(5):
            yield table().slice(i % 3, 1).to_batches()[0]

    manifest = shards.write(batches(), str(tmp_path / "out"), Manifest(stage="t"), schema="rollouts", rows_per_part=2)
    assert [f.rows for f in manifest.files] == [2, 2, 1]


def test_jsonl_prompts_with_mixed_keys_and_no_ids(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text('{"prompt": "a"}\n\n{"messages": [{"role": "user", "content": "b"}]}\n')
    t = shards.read(str(path), "prompts").table
    assert t.column("id").to_pylist() == ["0", "1"]
    assert t.column("messages").to_pylist()[1] == [{"role": "user", "content": "b"}]


def test_malformed_jsonl_names_the_line(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text('{"prompt": "a"}\n{"prompt": "b"}\n{"prompt": oops}\n')
    with pytest.raises(InputError, match=r"p.jsonl line 3: invalid JSON"):
        shards.read(str(path), "prompts")


def test_a_json_file_may_hold_one_array_of_prompts(tmp_path):
    path = tmp_path / "p.json"
    path.write_text(json.dumps([{"prompt": "a"}, {"messages": [{"role": "user", "content": "b"}]}], indent=2))
    t = shards.read(str(path), "prompts").table
    assert t.column("id").to_pylist() == ["0", "1"] and t.column("prompt").to_pylist()[0] == "a"
    lines = tmp_path / "lines.json"
    lines.write_text('{"prompt": "a"}\n{"prompt": "b"}\n')  # JSON Lines under .json, as before
    assert shards.read(str(lines), "prompts").table.num_rows == 2


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ('[{"prompt": "a"}, "b"]', r"p.json item 1: expected a JSON object, got str"),
        ('[{"prompt": "a", "w": NaN}]', r"p.json: NaN is not a number JSON allows"),
        ('[\n{"prompt": "a"},\n{"prompt": oops}\n]', r"p.json line 3: invalid JSON"),
        ('{\n  "prompt": "a"\n}\n', r"p.json line 1: invalid JSON: .*one object per line, or a .json file holding one array"),
        ("[]", r"p.json: no rows"),
    ],
)
def test_a_bad_json_file_is_one_clear_error(tmp_path, text, message):
    path = tmp_path / "p.json"
    path.write_text(text)
    with pytest.raises(InputError, match=message):
        shards.read(str(path), "prompts")


def test_verl_style_prompt_parquet(tmp_path):
    verl = pa.table({
        "data_source": ["openai/gsm8k"],
        "prompt": [[{"role": "user", "content": "1+1?"}]],
        "ability": ["math"],
        "reward_model": [{"style": "rule", "ground_truth": "2"}],
        "extra_info": [{"index": 0, "split": "train"}],
    })
    path = tmp_path / "train.parquet"
    pq.write_table(verl, path)
    t = shards.read(str(path), "prompts").table
    assert t.column("messages").to_pylist() == [[{"role": "user", "content": "1+1?"}]]
    assert t.column("ground_truth").to_pylist() == ["2"] and t.column("id").to_pylist() == ["0"]


def test_missing_input_is_named():
    with pytest.raises(InputError, match="'/no/such/place' does not exist"):
        shards.read("/no/such/place")


WRITER = """
import sys, time, pyarrow as pa
from rlctl import shards
from rlctl.manifest import Manifest
def batches():
    for i in range(int(sys.argv[2])):
        yield pa.record_batch({"id": [str(i)], "prompt": ["x" * 10]})
        time.sleep(float(sys.argv[3]))
shards.write(batches(), sys.argv[1], Manifest(stage="t"), schema="prompts", rows_per_part=1)
"""


def test_sigkill_mid_write_leaves_an_uncommitted_folder_that_a_rerun_replaces(tmp_path):
    out = tmp_path / "out"
    proc = subprocess.Popen([sys.executable, "-c", WRITER, str(out), "50", "0.05"])
    deadline = time.time() + 60
    while len(list(out.glob("part-*.arrow"))) < 3 and time.time() < deadline:
        time.sleep(0.02)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert list(out.glob("part-*")) and not (out / MANIFEST_NAME).exists()
    with pytest.raises(NotCommittedError):
        shards.read(str(out))
    subprocess.run([sys.executable, "-c", WRITER, str(out), "4", "0"], check=True)
    assert shards.read(str(out), "prompts").table.column("id").to_pylist() == ["0", "1", "2", "3"]
    assert len(list(out.glob("part-*"))) == 4


PIPE_WRITER = """
import pyarrow as pa
from rlctl import shards
from rlctl.manifest import Manifest
from tests.unit.test_shards import table
shards.write(table(), "-", Manifest(stage="rollout", seed=5), schema="rollouts")
"""
PIPE_READER = """
import sys
from rlctl import shards
from rlctl.manifest import Manifest
s = shards.read("-", "rollouts")
assert s.manifest.stage == "rollout" and s.manifest.seed == 5, s.manifest
shards.write(s.table, sys.argv[1], Manifest(stage="copy", inputs=[s.ref()]), schema="rollouts")
"""


def test_stdout_stream_piped_into_a_second_process(tmp_path):
    root = Path(__file__).resolve().parents[2]
    writer = subprocess.Popen([sys.executable, "-c", PIPE_WRITER], stdout=subprocess.PIPE, cwd=root)
    subprocess.run([sys.executable, "-c", PIPE_READER, str(tmp_path / "copy")], stdin=writer.stdout, check=True, cwd=root)
    assert writer.wait() == 0
    back = shards.read(str(tmp_path / "copy"), "rollouts")
    assert back.table.select(list(ROLLOUT_VALUES)).to_pydict() == table().to_pydict()
    assert back.table.schema.metadata[b"rlctl.schema_version"] == schemas.spec("rollouts").version.encode()
    assert back.manifest.inputs[0].uri == "-" and back.manifest.inputs[0].manifest_sha256
