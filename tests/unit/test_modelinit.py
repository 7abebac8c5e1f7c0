"""`rlctl model init`: offline, deterministic, and loadable by transformers as is."""

import hashlib
from pathlib import Path

import pytest

from rlctl.modelinit import PRESETS, init_model, train_tokenizer

TEXT = "Hello world, 12 + 34 = 46. The answer: <answer>3 * 4</answer> #### 1,234 é"


def digest(folder: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir())}


@pytest.mark.parametrize("preset,low,high", [("tiny", 0.5e6, 1.5e6), ("small", 20e6, 30e6)])
def test_presets_load_back_and_generate(tmp_path, preset, low, high):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = init_model(tmp_path / preset, preset, seed=0)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder)
    assert low < sum(p.numel() for p in model.parameters()) < high
    assert type(tokenizer).__name__ == "Qwen2Tokenizer"
    assert tokenizer.padding_side == "left"
    assert None not in (tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id)
    # ids survive the save/load round trip exactly
    assert tokenizer(TEXT)["input_ids"] == train_tokenizer(PRESETS[preset].vocab_size, 0)(TEXT)["input_ids"]
    assert model.config.vocab_size == len(tokenizer)  # every id the model can sample decodes
    assert tokenizer.decode(tokenizer(TEXT)["input_ids"]) == TEXT
    chat = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert chat == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    out = model.generate(**tokenizer(["hi there"], return_tensors="pt"), max_new_tokens=4, do_sample=False)
    assert out.shape == (1, len(tokenizer("hi there")["input_ids"]) + 4)


def test_the_medium_preset_has_the_shape_of_qwen2_5_0_5b():
    import torch
    from transformers import Qwen2ForCausalLM

    from rlctl.modelinit import model_config

    config = model_config(PRESETS["medium"], train_tokenizer(PRESETS["medium"].vocab_size, 0))
    with torch.device("meta"):  # the shape only: 494M random parameters take a minute to write
        model = Qwen2ForCausalLM(config)
    assert 490e6 < sum(p.numel() for p in model.parameters()) < 500e6
    assert (config.vocab_size, config.hidden_size, config.num_hidden_layers, config.num_attention_heads, config.num_key_value_heads, config.intermediate_size) == (
        151_936, 896, 24, 14, 2, 4864,
    )


def test_token_ids_match_the_tokenizer_that_wrote_them(tmp_path):
    from transformers import AutoTokenizer

    writer = train_tokenizer(512, seed=3)
    writer.save_pretrained(tmp_path)
    loaded = AutoTokenizer.from_pretrained(tmp_path)
    for text in [TEXT, "  leading spaces\n\nnew lines\ttabs", "<|im_start|>user\nx<|im_end|>"]:
        assert loaded(text)["input_ids"] == writer(text)["input_ids"]


def test_same_seed_same_files_other_seed_other_weights(tmp_path):
    a, b, c = (init_model(tmp_path / n, "tiny", seed=s) for n, s in [("a", 1), ("b", 1), ("c", 2)])
    assert digest(a) == digest(b)
    assert digest(a)["model.safetensors"] != digest(c)["model.safetensors"]


def test_model_init_command(cli, tmp_path):
    result = cli("model", "init", tmp_path / "m", "--preset", "tiny", "--seed", "1")
    assert result.exit_code == 0, result.stderr
    assert (tmp_path / "m" / "model.safetensors").exists()
    assert cli("model", "init", tmp_path / "x", "--preset", "huge").exit_code == 2


def test_model_init_never_overwrites_a_model_unless_forced(cli, tmp_path):
    folder = tmp_path / "m"
    init_model(folder, "tiny", seed=1)
    before = digest(folder)
    again = cli("model", "init", folder, "--preset", "tiny", "--seed", "2")
    assert again.exit_code == 2 and "holds a model already" in again.stderr
    assert digest(folder) == before
    assert cli("model", "init", folder, "--preset", "tiny", "--seed", "2", "--force").exit_code == 0
    assert digest(folder)["model.safetensors"] != before["model.safetensors"]
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "a.txt").write_text("mine")
    refused = cli("model", "init", tmp_path / "notes", "--force")
    assert refused.exit_code == 2 and "not a model folder" in refused.stderr and not (tmp_path / "notes" / "config.json").exists()
