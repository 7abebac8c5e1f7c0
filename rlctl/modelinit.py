"""`rlctl model init`: a random Qwen2-architecture causal LM and a byte-level BPE tokenizer,
made offline and deterministically from a seed, saved as a Hugging Face folder.

The tokenizer is trained with exactly the pre-tokenizer pipeline that transformers rebuilds
when it loads a `qwen2` tokenizer (NFC, the Qwen split regex, ByteLevel without its own
regex), so ids survive the save/load round trip. The training text is generated here.

    rlctl model init models/tiny --preset tiny --seed 0
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path

from rlctl.errors import InputError

PAD, BOS, EOS, IM_START = "<|endoftext|>", "<|startoftext|>", "<|im_end|>", "<|im_start|>"
SPECIAL_TOKENS = [PAD, BOS, IM_START, EOS]
# The split regex transformers' Qwen2Tokenizer uses (same pattern, written out here).
QWEN_SPLIT_REGEX = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
    r"""|\s*[\r\n]+|\s+(?!\S)|\s+"""
)
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


@dataclass(frozen=True)
class Preset:
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    intermediate_size: int
    max_positions: int
    padded_vocab: int = 0  # > 0: the embedding has this many rows, beyond the tokenizer's ids


PRESETS = {
    "tiny": Preset(512, 128, 4, 4, 2, 384, 1024),  # ≈ 0.85M parameters
    "small": Preset(4096, 512, 8, 8, 4, 1408, 2048),  # ≈ 25.6M parameters
    # Qwen2.5-0.5B's shape (≈ 494M parameters), for throughput on a GPU: its 151,936-row
    # embedding is kept although the local tokenizer is far smaller, so ids past the
    # tokenizer decode to nothing (a random model samples them): measure speed with it, not text
    "medium": Preset(4096, 896, 24, 14, 2, 4864, 32768, padded_vocab=151_936),
}


def corpus(seed: int, size_chars: int = 24_000) -> list[str]:
    """Training text for the tokenizer: arithmetic, simple English, chat markup, digits."""
    rng = random.Random(seed)
    words = (
        "the a an of to and in is it that for on with as was he she they we you I this be at by "
        "not are from or have had one all there what when your can said which do their if will "
        "each about how up out them then many some so these would other into has more her two "
        "like him see time could no make than first been its who now people my made over did "
        "down only way find use may water long little very after words called just where most "
        "know answer number sum add plus minus times equals reward good bad yes question think "
        "step solve result because therefore final letter word count target list sort reverse"
    ).split()
    lines = []
    total = 0
    while total < size_chars:
        kind = rng.randrange(5)
        if kind == 0:
            a, b = rng.randrange(100), rng.randrange(100)
            line = f"{a} + {b} = {a + b}"
        elif kind == 1:
            line = " ".join(rng.choice(words) for _ in range(rng.randint(4, 14))).capitalize() + "."
        elif kind == 2:
            question = " ".join(rng.choice(words) for _ in range(rng.randint(3, 8)))
            line = f"{IM_START}user\n{question}?{EOS}\n{IM_START}assistant\n"
        elif kind == 3:
            line = f"#### {rng.randrange(10_000)}  <answer>{rng.randrange(50)} * {rng.randrange(9)}</answer>"
        else:
            line = "".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(3, 9)))
        lines.append(line)
        total += len(line) + 1
    return lines


def train_tokenizer(vocab_size: int, seed: int):
    """A `Qwen2Tokenizer` trained on `corpus(seed)` with the Qwen2 pre-tokenizer pipeline."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers import Qwen2Tokenizer

    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN_SPLIT_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus(seed), trainer=trainer)
    vocab = tok.get_vocab()
    merges = _merges(tok)
    return Qwen2Tokenizer(
        vocab=vocab,
        merges=merges,
        unk_token=None,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        padding_side="left",
        chat_template=CHAT_TEMPLATE,
        additional_special_tokens=[IM_START],
    )


def _merges(tok) -> list[tuple[str, str]]:
    import json

    raw = json.loads(tok.to_str())["model"]["merges"]
    return [tuple(m) if isinstance(m, list) else tuple(m.split(" ", 1)) for m in raw]


def preset_fields(preset: str) -> dict:
    """The shape fields of the config.json `init_model` writes for `preset` (its vocabulary at
    most: the tokenizer may come out smaller), for estimates made before the model exists; {}
    for a name that is no preset (or none)."""
    p = PRESETS.get(preset)
    if p is None:
        return {}
    return {
        "vocab_size": max(p.vocab_size, p.padded_vocab), "hidden_size": p.hidden_size, "intermediate_size": p.intermediate_size,
        "num_hidden_layers": p.num_layers, "num_attention_heads": p.num_heads, "num_key_value_heads": p.num_kv_heads,
        "tie_word_embeddings": True,
    }


def init_model(out_dir: str | Path, preset: str = "tiny", seed: int = 0, *, replace: bool = False) -> Path:
    """Write a random model + tokenizer folder to `out_dir`; same seed → same files. A folder
    that holds a model already (perhaps a trained one) is replaced only when `replace` says so;
    any other non-empty folder never."""
    import torch
    from transformers import GenerationConfig, Qwen2ForCausalLM

    from rlctl.backends.hf import quiet_transformers

    quiet_transformers()
    if preset not in PRESETS:
        raise InputError(f"unknown preset {preset!r}; choose one of: {', '.join(PRESETS)}")
    p = PRESETS[preset]
    out = Path(out_dir)
    if out.exists() and any(out.iterdir()):
        if not (out / "config.json").exists():
            raise InputError(f"{out}: exists and is not empty (and not a model folder); choose another DIR")
        if not replace:
            raise InputError(f"{out}: holds a model already; choose another DIR, or --force to replace it with a random one")
    tokenizer = train_tokenizer(p.vocab_size, seed)
    config = model_config(p, tokenizer)
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = Qwen2ForCausalLM(config)
    model.generation_config = GenerationConfig(
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=[tokenizer.eos_token_id, tokenizer.pad_token_id],
        pad_token_id=tokenizer.pad_token_id,
    )
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def model_config(p: Preset, tokenizer):
    """The Qwen2 config of preset `p` for `tokenizer`: the vocabulary is exactly the
    tokenizer's size (but for `padded_vocab`): a padded vocabulary lets a random model sample
    ids that decode to nothing (the BPE may stop short of `p.vocab_size` on the small corpus)."""
    from transformers import Qwen2Config

    return Qwen2Config(
        vocab_size=max(len(tokenizer), p.padded_vocab),
        hidden_size=p.hidden_size,
        intermediate_size=p.intermediate_size,
        num_hidden_layers=p.num_layers,
        num_attention_heads=p.num_heads,
        num_key_value_heads=p.num_kv_heads,
        max_position_embeddings=p.max_positions,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        torch_dtype="float32",
    )
