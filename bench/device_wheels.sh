#!/usr/bin/env bash
# Wheels that the lent GPU machine lacks, fetched here for its Python, into .whl/ (in
# .gitignore) for bench/gpu_check.sh, which installs them there (the device has no package index):
#   bash bench/device_wheels.sh      # then: device run, carry [".whl"], bash bench/gpu_check.sh
# Its image (the device tool's KINDS.md) has Python 3.12, torch, transformers, pyarrow, fsspec,
# typer, rich, peft, accelerate, msgpack, protobuf, aiohttp's family and the other needs of Ray
# but not Ray, TRL, datasets or jsonschema. One call carries 64 MiB at most, and Ray's wheel is
# ~76 MiB, ~31 of them the jar of Ray's Java workers: the wheel is repacked without it (rlctl
# starts Python workers only). vLLM is not carried: its wheel is several hundred MiB and pins
# its own torch.
set -euo pipefail
cd "$(dirname "$0")/.."
PY_VERSION=${PY_VERSION:-3.12}
RAY_VERSION=${RAY_VERSION:-$(python -c "import ray; print(ray.__version__)" 2>/dev/null || echo 2.60.0)}
TRL_VERSION=$(python -c "from bench.trl_bench import TRL_VERSION; print(TRL_VERSION)")
OUT=${WHEEL_DIR:-.whl}
rm -rf "$OUT" && mkdir -p "$OUT"
tag=${PY_VERSION/./}
python -m pip download -q --no-deps --only-binary=:all: --python-version "$PY_VERSION" --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d "$OUT" \
  "ray==$RAY_VERSION" jsonschema jsonschema-specifications referencing rpds-py \
  "trl==$TRL_VERSION" datasets dill multiprocess
# datasets' newest wants pyarrow >= 24; gpu_check.sh takes this one where the device's pyarrow is older
python -m pip download -q --no-deps --only-binary=:all: -d "$OUT/older" "datasets==4.8.0"

python - "$OUT" <<'PY'
"""Repack Ray's wheel without ray/jars/ (and its RECORD lines), so that it fits one carry."""
import sys, zipfile
from pathlib import Path

(wheel,) = Path(sys.argv[1]).glob("ray-*.whl")
slim = wheel.with_suffix(".slim")
with zipfile.ZipFile(wheel) as src, zipfile.ZipFile(slim, "w", zipfile.ZIP_DEFLATED) as dst:
    for item in src.infolist():
        if item.filename.startswith("ray/jars/"):
            continue
        data = src.read(item)
        if item.filename.endswith(".dist-info/RECORD"):
            data = b"".join(line for line in data.splitlines(keepends=True) if not line.startswith(b"ray/jars/"))
        dst.writestr(item, data)
slim.replace(wheel)
PY
ls -la "$OUT"
echo "total: $(du -sm "$OUT" | cut -f1) MiB in $OUT (cp$tag)"
