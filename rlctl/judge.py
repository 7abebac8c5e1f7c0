"""`judge:MODEL_URI`: a causal language model as the reward's judge (a generative verifier,
RLAIF with a local model). Each sample is put into a question to the judge — the prompt, the
response and the ground truth in `score.judge_template` —, and its reward is the judge's
probability of saying yes rather than no as its next token: p(yes) / (p(yes) + p(no)), one
forward pass per sample, no sampling, so the same judge gives the same reward every time.

The question goes through the judge tokenizer's chat template as a user turn, with the
assistant's turn opened, where it has one; otherwise it ends with "Answer:" and the verdicts
are read with a leading space (" Yes"), as a base model would continue."""

from __future__ import annotations

from dataclasses import dataclass

from rlctl.errors import InputError

DEFAULT_TEMPLATE = (
    "Question:\n{prompt}\n\nReference answer:\n{ground_truth}\n\nResponse:\n{response}\n\n"
    "Is the response a correct answer to the question? Answer Yes or No."
)
FIELDS = ("prompt", "response", "ground_truth")


@dataclass(frozen=True)
class JudgeSettings:
    """What `score.judge_*` say: the question and the two verdicts."""

    template: str = DEFAULT_TEMPLATE  # {prompt}, {response}, {ground_truth} are filled in
    yes: str = "Yes"
    no: str = "No"


def check_template(template: str, key: str = "score.judge_template", error: type[InputError] = InputError) -> None:
    """A template must place the response, and may name only the fields a sample has."""
    import string

    try:
        names = {name for _, name, _, _ in string.Formatter().parse(template) if name is not None}
    except ValueError as exc:
        raise error(f"{key} is not a template: {exc} (a literal brace is written {{{{ or }}}})") from None
    unknown = sorted(names - set(FIELDS))
    if unknown:
        raise error(f"{key} names {{{unknown[0]}}}; it may use {{prompt}}, {{response}} and {{ground_truth}}")
    if "response" not in names:
        raise error(f"{key} must say where the response goes with {{response}}")


def verdict_tokens(tokenizer, settings: JudgeSettings, *, chat: bool) -> tuple[int, int]:
    """The token ids whose probabilities are the verdicts: each word's first token, with a
    leading space after "Answer:" (no chat template), as it is at the start of a turn."""
    ids = []
    for word in (settings.yes, settings.no):
        tokens = tokenizer((word if chat else " " + word), add_special_tokens=False)["input_ids"]
        if not tokens:
            raise InputError(f"judge: the verdict {word!r} is no token of the judge's tokenizer")
        ids.append(tokens[0])
    if ids[0] == ids[1]:
        raise InputError(f"judge: the verdicts {settings.yes!r} and {settings.no!r} start with the same token; choose words the judge tells apart")
    return ids[0], ids[1]


class JudgeReward:
    """The reward of a local judge model (see the module's docstring); `dtype` as score.dtype
    (bf16: under autocast); batches of similar lengths, left-padded."""

    def __init__(self, uri: str, *, device: str = "cpu", batch_size: int = 16, dtype: str = "fp32", settings: JudgeSettings | None = None) -> None:
        from rlctl import cpu_linear
        from rlctl.backends.hf import context_length_of, load_causal_lm, resolve_device
        from rlctl.dtypes import compute_dtype

        self.settings = settings or JudgeSettings()
        check_template(self.settings.template)
        self.device = resolve_device(device)
        model, self.tokenizer = load_causal_lm(uri, self.device)
        self.model = cpu_linear.install(model)
        if self.tokenizer.pad_token_id is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token
        self.chat = bool(getattr(self.tokenizer, "chat_template", None))
        self.yes, self.no = verdict_tokens(self.tokenizer, self.settings, chat=self.chat)
        self.context = context_length_of(self.model)
        self.batch_size = batch_size
        self.bf16 = compute_dtype(dtype, self.device.type) == "bf16"

    def question_ids(self, prompt: str | None, response: str, ground_truth: str | None) -> list[int]:
        """The tokens the judge reads for one sample, ending where its verdict would begin."""
        text = self.settings.template.format(prompt=prompt or "", response=response, ground_truth="" if ground_truth is None else ground_truth)
        if self.chat:
            rendered = self.tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True)
            ids = self.tokenizer(rendered, add_special_tokens=False)["input_ids"]
        else:
            ids = self.tokenizer(text + "\nAnswer:")["input_ids"]
        return ids[-self.context :] if self.context else ids

    def __call__(self, *, prompts: list[str], responses: list[str], ground_truths: list[str | None]) -> list[float]:
        import torch

        sequences = [self.question_ids(p, r, g) for p, r, g in zip(prompts, responses, ground_truths)]
        order = sorted(range(len(sequences)), key=lambda i: len(sequences[i]))
        scores: list[float] = [0.0] * len(sequences)
        with torch.no_grad(), torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.bf16):
            for start in range(0, len(order), self.batch_size):
                batch = order[start : start + self.batch_size]
                for i, value in zip(batch, self._yes_shares([sequences[i] for i in batch])):
                    scores[i] = value
        return scores

    def _yes_shares(self, sequences: list[list[int]]) -> list[float]:
        """p(yes) / (p(yes) + p(no)) at the next token of each sequence (left-padded, the
        positions counted from each sequence's own start)."""
        import torch

        width = max(len(s) for s in sequences)
        pad = self.tokenizer.pad_token_id
        input_ids = torch.tensor([[pad] * (width - len(s)) + s for s in sequences], device=self.device)
        mask = torch.tensor([[0] * (width - len(s)) + [1] * len(s) for s in sequences], device=self.device)
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        logits = self.model(input_ids=input_ids, attention_mask=mask, position_ids=positions).logits[:, -1].float()
        pair = torch.log_softmax(logits, -1)[:, [self.yes, self.no]]
        return torch.softmax(pair, -1)[:, 0].tolist()
