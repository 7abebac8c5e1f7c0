"""The commit protocol on an S3-compatible store (moto's server on 127.0.0.1): a reader racing
a writer never sees a mix, stage commands read and write s3:// URLs, the lock is a conditional
PUT, and a changed object is refused. Every rlctl here runs in its own process, configured the
way a user would (FSSPEC_S3_ENDPOINT_URL and AWS credentials in the environment)."""

import json
import os
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

pytest.importorskip("s3fs")
pytest.importorskip("moto")  # not moto.server: it imports flask, whose proxies break vLLM's module scan in this process

ROOT = Path(__file__).resolve().parents[2]
CREDENTIALS = {"AWS_ACCESS_KEY_ID": "test", "AWS_SECRET_ACCESS_KEY": "test", "AWS_DEFAULT_REGION": "us-east-1"}


@pytest.fixture(scope="module")
def s3_env():
    """moto's S3 server in its own process on a free local port."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 30
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            break
        except OSError:
            assert time.time() < deadline and server.poll() is None, "moto's server did not start"
            time.sleep(0.2)
    env = {**os.environ, **CREDENTIALS, "FSSPEC_S3_ENDPOINT_URL": f"http://127.0.0.1:{port}"}
    run_python("import fsspec; fsspec.filesystem('s3').mkdir('rlctl-test')", env)
    yield env
    server.terminate()
    server.wait(timeout=10)


def run_python(code: str, env: dict, *args: str) -> str:
    result = subprocess.run([sys.executable, "-c", textwrap.dedent(code), *args], capture_output=True, text=True, env=env, cwd=ROOT, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout


def rlctl(env: dict, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "rlctl", *args], capture_output=True, text=True, env=env, cwd=ROOT, timeout=300)


WRITER = """
import sys, pyarrow as pa
from rlctl import shards
from rlctl.manifest import Manifest
versions = [pa.table({"id": [f"{v}{i}" for i in range(5)], "x": [i * (1 + v) for i in range(5)]}) for v in (0, 1)]
for i in range(int(sys.argv[2])):
    shards.write(versions[i % 2], sys.argv[1], Manifest(stage="t"), rows_per_part=1)
"""

READER = """
import json, sys, time, pyarrow as pa
from rlctl import shards
from rlctl.errors import InputError
versions = [pa.table({"id": [f"{v}{i}" for i in range(5)], "x": [i * (1 + v) for i in range(5)]}) for v in (0, 1)]
whole, errors, deadline = 0, [], time.time() + float(sys.argv[2])
while time.time() < deadline:
    try:
        got = shards.read(sys.argv[1]).table
    except InputError as exc:
        errors.append(str(exc))
        continue
    assert any(got.equals(v) for v in versions), ("a mix of two writes", got.to_pydict())
    whole += 1
print(json.dumps({"whole": whole, "errors": errors}))
"""


def test_a_reader_racing_a_writer_on_s3_sees_whole_outputs_or_a_clean_error(s3_env):
    uri = "s3://rlctl-test/race"
    run_python(WRITER, s3_env, uri, "1")
    writer = subprocess.Popen([sys.executable, "-c", WRITER, uri, "12"], env=s3_env, cwd=ROOT, stderr=subprocess.PIPE, text=True)
    report = json.loads(run_python(READER, s3_env, uri, "8"))
    assert writer.wait(timeout=300) == 0, writer.stderr.read()[-2000:]
    assert report["whole"] > 0
    assert all("changed under me" in e for e in report["errors"]), report["errors"][:3]
    listing = json.loads(run_python("import fsspec, json, sys; print(json.dumps(fsspec.filesystem('s3').ls(sys.argv[1], detail=False)))", s3_env, uri))
    assert len(listing) == 6  # the last write's 5 parts and its manifest: superseded parts are gone


SCORES = """
import sys, pyarrow as pa
from rlctl import shards
from rlctl.manifest import Manifest
from tests.unit.test_shards import ROLLOUT_VALUES
shards.write(pa.table({**ROLLOUT_VALUES, "reward": pa.array([1.0, 0.0, 0.5], pa.float32())}), sys.argv[1], Manifest(stage="score"), schema="scores")
"""


def test_stage_commands_read_and_write_s3_and_refuse_a_changed_object(s3_env):
    run_python(SCORES, s3_env, "s3://rlctl-test/scores")
    first = rlctl(s3_env, "advantage", "--scores", "s3://rlctl-test/scores", "--out", "s3://rlctl-test/batch", "--estimator", "grpo", "--json")
    assert first.returncode == 0, first.stderr
    assert sum(f["rows"] for f in json.loads(first.stdout)["files"]) == 3
    again = rlctl(s3_env, "advantage", "--scores", "s3://rlctl-test/scores", "--out", "s3://rlctl-test/batch", "--estimator", "grpo")
    assert again.returncode == 0 and "up to date" in again.stderr
    shown = rlctl(s3_env, "show", "s3://rlctl-test/batch", "--json", "--rows", "1")
    assert shown.returncode == 0 and json.loads(shown.stdout)["rows"] == 3
    verified = rlctl(s3_env, "verify", "s3://rlctl-test", "--json")
    assert verified.returncode == 0, verified.stderr
    statuses = {f["folder"]: f["status"] for f in json.loads(verified.stdout)["findings"]}
    assert statuses["batch"] == statuses["scores"] == "ok"  # rlctl verify on an s3:// tree

    tamper = """
    import fsspec, json, sys
    fs = fsspec.filesystem("s3")
    part = json.loads(fs.cat_file(sys.argv[1] + "/_manifest.json"))["files"][0]["path"]
    data = bytearray(fs.cat_file(sys.argv[1] + "/" + part))
    data[-40] ^= 0xFF
    fs.pipe_file(sys.argv[1] + "/" + part, bytes(data))
    """
    run_python(tamper, s3_env, "s3://rlctl-test/batch")
    refused = rlctl(s3_env, "show", "s3://rlctl-test/batch")
    assert refused.returncode == 2 and "does not match its manifest" in refused.stderr
    found = rlctl(s3_env, "verify", "s3://rlctl-test", "--json")
    assert found.returncode == 1 and {f["folder"]: f["status"] for f in json.loads(found.stdout)["findings"]}["batch"] == "damaged"
    rerun = rlctl(s3_env, "advantage", "--scores", "s3://rlctl-test/scores", "--out", "s3://rlctl-test/batch", "--estimator", "grpo")
    assert rerun.returncode == 0 and "damaged" in rerun.stderr  # up to date by key, but not intact: recomputed
    assert rlctl(s3_env, "show", "s3://rlctl-test/batch").returncode == 0


def test_a_second_writer_on_s3_fails_naming_the_holder(s3_env):
    run_python(SCORES, s3_env, "s3://rlctl-test/scores2")
    hold = """
    import fsspec, json, sys, time
    fs = fsspec.filesystem("s3")
    fs.pipe_file(sys.argv[1] + "/_lock.json", json.dumps({"host": "trainer-7", "pid": 4242, "time": time.time()}).encode())
    """
    run_python(hold, s3_env, "s3://rlctl-test/batch2")
    result = rlctl(s3_env, "advantage", "--scores", "s3://rlctl-test/scores2", "--out", "s3://rlctl-test/batch2", "--estimator", "grpo")
    assert result.returncode == 2, result.stderr
    assert "being written by pid 4242 on trainer-7" in result.stderr and len(result.stderr.strip().splitlines()) == 1
