"""Nothing read from a run folder, a checkpoint or a shard runs code: the package never calls
what could (pickle, eval, remote model code, a shell), so no file a user receives reaches it."""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SOURCES = sorted(p for folder in ("rlctl", "stages", "schemas") for p in (ROOT / folder).rglob("*.py"))
UNSAFE = {
    "pickle": re.compile(r"\bimport pickle\b|\bpickle\.loads?\(|\bcPickle\b|\bdill\b|\bjoblib\.load\("),
    "torch.load": re.compile(r"\btorch\.load\(|weights_only\s*=\s*False"),
    "numpy pickles": re.compile(r"allow_pickle\s*=\s*True"),
    "remote model code": re.compile(r"trust_remote_code\s*=\s*True"),
    "eval/exec": re.compile(r"(?<![\w.])(eval|exec)\("),
    "a shell": re.compile(r"shell\s*=\s*True|\bos\.system\(|\bos\.popen\("),
    "yaml objects": re.compile(r"yaml\.(unsafe_)?load\((?![^)]*SafeLoader)"),
}


def test_there_are_sources_to_check():
    assert len(SOURCES) > 20


@pytest.mark.parametrize("what", list(UNSAFE))
def test_the_package_never_calls(what):
    found = [
        f"{path.relative_to(ROOT)}:{number}: {line.strip()}"
        for path in SOURCES
        for number, line in enumerate(path.read_text().splitlines(), start=1)
        if UNSAFE[what].search(line) and not line.lstrip().startswith("#")
    ]
    assert not found, "\n".join(found)


def test_models_load_without_remote_code_and_from_safetensors_only():
    source = (ROOT / "rlctl" / "backends" / "hf.py").read_text()
    assert "trust_remote_code=False" in source and "use_safetensors=True" in source
