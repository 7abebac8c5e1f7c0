"""Passes of the update capped by padded tokens: how they are cut, what auto decides where,
and how a run keeps the decision."""

from rlctl.config import Config, load_config
from rlctl.passes import CPU_MICRO_BATCH_TOKENS, cut_passes, decided_micro_batch_tokens, token_cap
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
