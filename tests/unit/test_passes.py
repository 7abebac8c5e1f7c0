"""Passes of the update capped by padded tokens: how they are cut, what auto decides where,
and how a run keeps the decision."""

import json

from transformers import AutoModelForCausalLM

from rlctl.config import Config, WorkersConfig, load_config
from rlctl.modelinit import preset_fields
from rlctl.passes import (
    CPU_MICRO_BATCH_TOKENS,
    MEMORY_SHARE,
    REFERENCE_BYTES_PER_PARAMETER,
    TOKEN_STEP,
    TRAINING_BYTES_PER_PARAMETER,
    ModelShape,
    cut_passes,
    decided_micro_batch_tokens,
    machine_memory,
    memory_cap,
    ranks_at_once,
    token_cap,
)
from rlctl.pipeline import resolve_pass_tokens


def test_passes_hold_at_most_micro_batch_tokens_padded_tokens():
    """A pass takes rows in order until it has micro_batch_size of them or one more would pad
    it past the token cap (rows × its longest row); a row longer than the cap gets its own."""
    lengths = [10, 20, 30, 40, 50, 300]
    rows = list(range(6))
    assert cut_passes(rows, 4, lengths) == [[0, 1, 2, 3], [4, 5]]  # no cap: by rows only
    capped = cut_passes(rows, 4, lengths, max_tokens=100)
    assert capped == [[0, 1, 2], [3, 4], [5]]
    assert all(len(p) * max(lengths[r] for r in p) <= 100 for p in capped[:-1])
    assert cut_passes(rows, 2, lengths, max_tokens=10_000) == [[0, 1], [2, 3], [4, 5]]  # the row limit still holds


def test_auto_caps_a_pass_by_tokens_on_the_cpu_only():
    assert token_cap("auto", "cpu") == CPU_MICRO_BATCH_TOKENS
    assert token_cap("auto", "cuda") == 0  # a GPU takes its passes as large as memory allows
    assert token_cap("2048", "cuda") == 2048 and token_cap("0", "cpu") == 0  # what the user wrote wins
    assert decided_micro_batch_tokens("auto", "cpu") == str(CPU_MICRO_BATCH_TOKENS)


def test_a_run_decides_auto_once_and_a_resumed_run_keeps_the_decision():
    on_cpu = load_config(data={"model": {"device": "cpu"}})
    started = resolve_pass_tokens(on_cpu, recorded=None)
    assert started.update.micro_batch_tokens == str(CPU_MICRO_BATCH_TOKENS)  # models on this CPU
    on_gpus = load_config(data={"workers": {"backend": "ray", "gpus_per_worker": 1.0}})
    assert resolve_pass_tokens(on_gpus, recorded=None).update.micro_batch_tokens == "0"
    assert resolve_pass_tokens(on_cpu, recorded=load_config(overrides=["update.micro_batch_tokens=1024"])).update.micro_batch_tokens == "1024"
    assert resolve_pass_tokens(on_cpu, recorded=Config()).update.micro_batch_tokens == "0"  # started before the key: no cap, as it ran
    pinned = load_config(overrides=["update.micro_batch_tokens=512"])
    assert resolve_pass_tokens(pinned, recorded=started).update.micro_batch_tokens == "512"  # what the user wrote wins


def test_replay_cuts_passes_as_the_recorded_update_did():
    """An update manifest records the decided cap; one written before the key existed ran
    without a cap, and a replay of it does too."""
    from rlctl.lineage import make_manifest
    from rlctl.replay import _recorded_config

    def replayed(update_section):
        return _recorded_config(Config(), make_manifest("update", {"update": update_section}, []), []).update.micro_batch_tokens

    assert replayed({"lr": 1e-3, "micro_batch_tokens": "4096"}) == "4096"
    assert replayed({"lr": 1e-3}) == "0"


GIB = 2**30
# Qwen2.5-0.5B's shape (the medium preset): 494M parameters, a 151,936-row tied embedding
QWEN_0_5B = ModelShape(vocab=151_936, hidden=896, intermediate=4864, layers=24, kv_width=128, tied=True)


def test_a_model_shape_counts_the_weights_of_the_model_it_describes(tmp_path):
    """From config.json, or from a preset before its model exists: the weights' count within
    1% of the model's own (norms and biases left out)."""
    import torch

    from rlctl.modelinit import init_model

    folder = init_model(tmp_path / "m", "tiny", seed=0)
    shape = ModelShape.of_folder(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    assert abs(shape.parameters - model.num_parameters()) / model.num_parameters() < 0.01
    assert ModelShape.of_model(model) == shape
    assert ModelShape.of(preset_fields("tiny")).parameters >= shape.parameters  # the preset's vocabulary at most
    assert abs(ModelShape.of(preset_fields("medium")).parameters - 494e6) / 494e6 < 0.01
    assert ModelShape.of_folder(tmp_path / "none") is None and ModelShape.of({"hidden_size": 8}) is None and preset_fields("") == {}


def test_auto_lowers_the_cpu_cap_to_what_fits_in_the_machines_memory():
    """Training state (weights, gradients, AdamW's moments, a reference) plus one pass's
    activations within 3/4 of the memory; small models keep the CPU's cap, a model that does
    not fit at all gets the smallest cap rather than none."""
    assert memory_cap(QWEN_0_5B, 24 * GIB) == 2560  # at 4096 its pipeline held 24.1 GB of a 24 GB machine
    assert memory_cap(QWEN_0_5B, 64 * GIB) == CPU_MICRO_BATCH_TOKENS
    assert memory_cap(QWEN_0_5B, 8 * GIB) == TOKEN_STEP
    state = (TRAINING_BYTES_PER_PARAMETER + REFERENCE_BYTES_PER_PARAMETER) * QWEN_0_5B.parameters
    fitted = memory_cap(QWEN_0_5B, 24 * GIB)
    assert state + fitted * QWEN_0_5B.pass_bytes_per_token <= MEMORY_SHARE * 24 * GIB < state + (fitted + TOKEN_STEP) * QWEN_0_5B.pass_bytes_per_token
    small = ModelShape.of(preset_fields("small"))
    assert memory_cap(small, 8 * GIB) == CPU_MICRO_BATCH_TOKENS
    assert memory_cap(QWEN_0_5B, 24 * GIB, critic=QWEN_0_5B) < fitted  # a critic's state beside the policy's
    assert memory_cap(QWEN_0_5B, 24 * GIB, ranks=2) < fitted  # two ranks' passes at once


def test_auto_is_decided_from_the_model_and_memory_on_the_cpu_only():
    assert decided_micro_batch_tokens("auto", "cpu", QWEN_0_5B, memory=24 * GIB) == "2560"
    assert decided_micro_batch_tokens("auto", "cuda", QWEN_0_5B, memory=24 * GIB) == "0"
    assert decided_micro_batch_tokens("1024", "cpu", QWEN_0_5B, memory=8 * GIB) == "1024"  # what the user wrote wins
    assert decided_micro_batch_tokens("auto", "cpu", None, memory=8 * GIB) == str(CPU_MICRO_BATCH_TOKENS)  # no shape: no estimate
    assert decided_micro_batch_tokens("auto", "cpu", None, critic=QWEN_0_5B, memory=24 * GIB) == "2560"  # a critic trained alone
    assert ranks_at_once(WorkersConfig(backend="ray", num_workers=3)) == 3 and ranks_at_once(WorkersConfig(num_workers=3)) == 1


def test_machine_memory_is_the_physical_memory_capped_by_a_cgroup_limit(tmp_path):
    import os

    physical = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    assert machine_memory(tmp_path) == physical  # no cgroup files
    v1, v2, unlimited = tmp_path / "v1", tmp_path / "v2", tmp_path / "unlimited"
    (v1 / "memory").mkdir(parents=True)
    (v1 / "memory" / "memory.limit_in_bytes").write_text(f"{2 * GIB}\n")
    assert machine_memory(v1) == min(physical, 2 * GIB)
    v2.mkdir()
    (v2 / "memory.max").write_text(f"{GIB}\n")
    assert machine_memory(v2) == min(physical, GIB)
    unlimited.mkdir()
    (unlimited / "memory.max").write_text("max\n")
    assert machine_memory(unlimited) == physical


def test_a_run_decides_auto_for_its_models_shape(tmp_path):
    """The pipeline reads the policy's config.json (a preset's shape where the model is made
    later) and this machine's memory."""
    folder = tmp_path / "qwen"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(dict(preset_fields("medium"), model_type="qwen2")))
    on_cpu = load_config(data={"model": {"device": "cpu", "path": str(folder)}})
    expected = memory_cap(QWEN_0_5B, machine_memory())
    assert resolve_pass_tokens(on_cpu, recorded=None).update.micro_batch_tokens == str(expected)
    made_later = load_config(data={"model": {"device": "cpu", "path": str(tmp_path / "new"), "init_preset": "medium"}})
    assert resolve_pass_tokens(made_later, recorded=None).update.micro_batch_tokens == str(expected)


def test_a_replay_scores_in_passes_as_the_recorded_score_stage_did():
    """A score manifest records `batch_tokens`; one written before the key existed cut its passes
    by rows alone, and its replay does too."""
    from rlctl.lineage import make_manifest
    from rlctl.replay import _recorded_config

    def replayed(score_section):
        return _recorded_config(Config(), make_manifest("score", {"score": score_section}, []), []).score.batch_tokens

    assert replayed({"batch_size": 16, "batch_tokens": 4096}) == 4096
    assert replayed({"batch_size": 16}) == 0
