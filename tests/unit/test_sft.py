"""Supervised fine-tuning: examples become the tokens a rollout would make, the loss is the
responses' mean NLL with passes that sum to one batch's gradient, and it learns its demonstrations."""

import json

import pyarrow as pa
import pytest
import torch

from rlctl.backends.base import SamplingParams
from rlctl.backends.hf import HFPolicy
from rlctl.config import DataConfig, SftConfig, load_config
from rlctl.errors import InputError
from rlctl.sft import Examples, SftTrainer, encode_examples, run
from rlctl.shards import read
from rlctl.stages.rollout import encode_prompts


@pytest.fixture(scope="module")
def policy(tiny_model):
    return HFPolicy.load(tiny_model, "cpu")


def read_rows(tmp_path, rows) -> pa.Table:
    path = tmp_path / "examples.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return read(str(path), "prompts").table


def encode(policy, table, data=DataConfig(), cfg=SftConfig()) -> Examples:
    return encode_examples(table, policy.tokenizer, data, cfg, end_ids=policy.stop_ids, context_length=policy.context_length, source="test")


def test_a_plain_example_is_the_rollouts_prompt_then_the_response_and_the_end_token(policy, tmp_path):
    table = read_rows(tmp_path, [{"prompt": "3+4=", "response": "7"}])
    got = encode(policy, table)
    tok = policy.tokenizer
    assert got.prompt_ids == encode_prompts(table, tok, DataConfig())
    assert got.response_ids == [tok("7", add_special_tokens=False)["input_ids"] + [tok.eos_token_id]]
    assert got.ids == ["0"] and got.response_tokens == len(got.response_ids[0])


def test_a_chat_example_trains_on_the_assistants_turn_up_to_its_end_token(policy, tmp_path):
    chat = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "2+2"}, {"role": "assistant", "content": "4"}]
    got = encode(policy, read_rows(tmp_path, [{"messages": chat}]))
    tok = policy.tokenizer
    assert tok.decode(got.prompt_ids[0]) == tok.apply_chat_template(chat[:2], tokenize=False, add_generation_prompt=True)
    whole = tok.apply_chat_template(chat, tokenize=False)
    assert whole.endswith("<|im_end|>\n")  # the template's newline after the turn's end is never sampled
    assert tok.decode(got.prompt_ids[0] + got.response_ids[0]) == whole[: -len("\n")]
    assert got.response_ids[0][-1] == tok.eos_token_id


def test_a_system_prompt_and_a_prompt_template_shape_an_examples_prompt_as_the_rollout_shapes_it(policy, tmp_path):
    """data.system_prompt before a conversation without one, data.prompt_template around a plain
    prompt: the prompt's tokens are the rollout's, and the response's follow them in the template."""
    data = DataConfig(chat_template=True, system_prompt="be brief", prompt_template="Q: {prompt}")
    tok = policy.tokenizer
    plain = read_rows(tmp_path, [{"prompt": "2+2", "response": "4"}])
    chat = read_rows(tmp_path, [{"messages": [{"role": "user", "content": "3+3"}, {"role": "assistant", "content": "6"}]}])
    spelled = [[{"role": "system", "content": "be brief"}, {"role": "user", "content": "Q: 2+2"}, {"role": "assistant", "content": "4"}],
               [{"role": "system", "content": "be brief"}, {"role": "user", "content": "3+3"}, {"role": "assistant", "content": "6"}]]
    for table, whole in zip((plain, chat), spelled):
        got = encode(policy, table, data=data)
        assert tok.decode(got.prompt_ids[0]) == tok.apply_chat_template(whole[:2], tokenize=False, add_generation_prompt=True)
        assert tok.decode(got.prompt_ids[0] + got.response_ids[0]) == tok.apply_chat_template(whole, tokenize=False)[: -len("\n")]
    assert encode(policy, plain, data=data).prompt_ids == encode_prompts(plain, tok, data)
    own = read_rows(tmp_path, [{"messages": [{"role": "system", "content": "be long"}, {"role": "user", "content": "3+3"}, {"role": "assistant", "content": "6"}]}])
    assert tok.decode(encode(policy, own, data=data).prompt_ids[0]).startswith("<|im_start|>system\nbe long<|im_end|>")  # its own system message stays


def test_a_response_column_beside_messages_or_a_plain_prompt_under_the_chat_template_is_the_assistants_turn(policy, tmp_path):
    question = [{"role": "user", "content": "2+2"}]
    beside = encode(policy, read_rows(tmp_path, [{"messages": question, "completion": "4"}]))
    templated = encode(policy, read_rows(tmp_path, [{"prompt": "2+2", "response": "4"}]), data=DataConfig(chat_template=True))
    whole = encode(policy, read_rows(tmp_path, [{"messages": [*question, {"role": "assistant", "content": "4"}]}]))
    assert beside.prompt_ids == templated.prompt_ids == whole.prompt_ids
    assert beside.response_ids == templated.response_ids == whole.response_ids


def test_several_trailing_assistant_turns_are_all_the_response(policy, tmp_path):
    chat = [{"role": "user", "content": "count"}, {"role": "assistant", "content": "one"}, {"role": "assistant", "content": "two"}]
    got = encode(policy, read_rows(tmp_path, [{"messages": chat}]))
    text = policy.tokenizer.decode(got.response_ids[0])
    assert "one" in text and "two" in text and text.count("<|im_end|>") == 2


TOOL_CHAT = [
    {"role": "user", "content": "weather in Oslo?"}, {"role": "assistant", "content": "<call>weather Oslo</call>"},
    {"role": "tool", "content": "rain, 4 degrees"}, {"role": "assistant", "content": "Rain and 4 degrees."},
]


def trained_text(tokenizer, ex: Examples, row: int = 0) -> list[str]:
    """The trained runs of a response's tokens, decoded."""
    runs, current = [], []
    for token, trained in zip(ex.response_ids[row], ex.trained[row] if ex.trained else [True] * len(ex.response_ids[row])):
        if trained:
            current.append(token)
        elif current:
            runs, current = runs + [tokenizer.decode(current)], []
    return runs + ([tokenizer.decode(current)] if current else [])


def test_every_assistant_turn_is_trained_and_the_tool_turns_between_are_context(policy, tmp_path):
    tok = policy.tokenizer
    got = encode(policy, read_rows(tmp_path, [{"messages": TOOL_CHAT}]), cfg=SftConfig(assistant_turns="all"))
    assert tok.decode(got.prompt_ids[0]) == tok.apply_chat_template(TOOL_CHAT[:1], tokenize=False, add_generation_prompt=True)
    assert tok.decode(got.prompt_ids[0] + got.response_ids[0]) == tok.apply_chat_template(TOOL_CHAT, tokenize=False)[: -len("\n")]
    # each assistant turn as the rollout samples it after its generation prompt: its header, the tool's turn and newlines are context
    assert trained_text(tok, got) == ["<call>weather Oslo</call><|im_end|>", "Rain and 4 degrees.<|im_end|>"]
    assert got.response_tokens == sum(got.trained[0]) < len(got.response_ids[0])


def test_by_default_only_the_trailing_assistant_turns_are_the_response(policy, tmp_path):
    tok = policy.tokenizer
    got = encode(policy, read_rows(tmp_path, [{"messages": TOOL_CHAT}]))
    assert tok.decode(got.prompt_ids[0]) == tok.apply_chat_template(TOOL_CHAT[:3], tokenize=False, add_generation_prompt=True)
    assert got.trained is None and trained_text(tok, got) == ["Rain and 4 degrees.<|im_end|>"]


def test_a_multi_turn_completion_trains_on_its_assistant_turns_alone(policy, tmp_path):
    tok = policy.tokenizer
    row = {"messages": TOOL_CHAT[:1], "completion": TOOL_CHAT[1:]}
    got = encode(policy, read_rows(tmp_path, [row]))
    assert trained_text(tok, got) == ["<call>weather Oslo</call><|im_end|>", "Rain and 4 degrees.<|im_end|>"]
    with pytest.raises(InputError, match="example '0': its response starts with a 'tool' turn"):
        encode(policy, read_rows(tmp_path, [{"messages": TOOL_CHAT[:1], "completion": TOOL_CHAT[2:3]}]))


def test_the_loss_counts_the_trained_tokens_alone(tiny_model, tmp_path):
    policy = HFPolicy.load(tiny_model, "cpu")
    rows = [{"messages": TOOL_CHAT}, {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello there"}]}]
    ex = encode(policy, read_rows(tmp_path, rows), cfg=SftConfig(assistant_turns="all"))
    want = float(reference_nll(policy.model, ex).detach()) / ex.response_tokens
    for micro in (1, 2):  # a pass of one row, of rows whose masks differ in length
        trainer = SftTrainer(policy, SftConfig(batch_size=2, micro_batch_size=micro, micro_batch_tokens="0", bf16="false"), total_steps=1)
        assert trainer.mean_loss(ex) == pytest.approx(want, rel=1e-5)
    assert ex.response_tokens < sum(len(r) for r in ex.response_ids)


@pytest.mark.parametrize(
    ("rows", "fragment"),
    [
        ([{"prompt": "a"}], "has no response"),
        ([{"messages": [{"role": "user", "content": "hi"}]}], "has no response"),
        ([{"messages": [{"role": "assistant", "content": "hi"}]}], "has no response"),
        ([{"prompt": "a", "response": "b", "completion": "c"}], "both a 'response' and a 'completion'"),
        ([{"prompt": "a", "response": None}, {"prompt": "b", "response": "c"}], "example '0' has no response"),
    ],
)
def test_an_example_without_a_response_is_one_error_naming_it(policy, tmp_path, rows, fragment):
    with pytest.raises(InputError, match=fragment):
        encode(policy, read_rows(tmp_path, rows))


def test_an_example_over_max_tokens_is_an_error_or_has_its_response_cut(policy, tmp_path):
    table = read_rows(tmp_path, [{"prompt": "1+1=", "response": "two plus more words"}])
    whole = encode(policy, table)
    limit = len(whole.prompt_ids[0]) + 2
    with pytest.raises(InputError, match=r"example '0' has \d+ tokens, over .* sft.truncate=right"):
        encode(policy, table, cfg=SftConfig(max_tokens=limit))
    cut = encode(policy, table, cfg=SftConfig(max_tokens=limit, truncate="right"))
    assert cut.response_ids == [whole.response_ids[0][:2]]
    with pytest.raises(InputError, match="prompt leaves no room"):
        encode(policy, table, cfg=SftConfig(max_tokens=len(whole.prompt_ids[0]), truncate="right"))


def reference_nll(model, ex: Examples) -> torch.Tensor:
    """The summed NLL of the trained response tokens from the model's full logits, one row at a time."""
    total = torch.zeros((), dtype=torch.float64)
    for row, (prompt, response) in enumerate(zip(ex.prompt_ids, ex.response_ids)):
        ids = torch.tensor([prompt + response])
        logp = torch.log_softmax(model(input_ids=ids).logits[0].double(), -1)
        positions = torch.arange(len(prompt) - 1, len(prompt) - 1 + len(response))
        trained = torch.tensor(ex.trained[row]) if ex.trained else torch.ones(len(response), dtype=torch.bool)
        total -= logp[positions, torch.tensor(response)][trained].sum()
    return total


def test_the_loss_is_the_responses_mean_nll_and_passes_of_any_size_give_one_batchs_gradient(tiny_model, tmp_path):
    rows = [{"prompt": f"{a}+{b}=", "response": str(a + b) + " is the sum" * (a % 3)} for a, b in [(1, 2), (3, 4), (5, 6), (7, 8), (9, 0)]]
    gradients = []
    for micro, cap in ((1, "0"), (5, "0"), (4, "24")):
        policy = HFPolicy.load(tiny_model, "cpu")
        ex = encode(policy, read_rows(tmp_path, rows))
        cfg = SftConfig(batch_size=5, micro_batch_size=micro, micro_batch_tokens=cap, bf16="false", lr=1e-9, max_grad_norm=0.0)
        trainer = SftTrainer(policy, cfg, total_steps=1)
        assert trainer.mean_loss(ex) == pytest.approx(float(reference_nll(policy.model, ex).detach()) / ex.response_tokens, rel=1e-5)
        trainer.train_epoch(ex, 1)  # one optimizer step of lr 1e-9: the gradient is the one to compare
        gradients.append(torch.cat([p.grad.reshape(-1) for p in policy.model.parameters() if p.grad is not None]))
    assert torch.allclose(gradients[0], gradients[1], atol=1e-6) and torch.allclose(gradients[0], gradients[2], atol=1e-6)
    policy.model.zero_grad()
    (reference_nll(policy.model, ex) / ex.response_tokens).backward()  # the weights moved by lr 1e-9: within float tolerance
    direct = torch.cat([p.grad.reshape(-1) for p in policy.model.parameters() if p.grad is not None]).float()
    assert torch.allclose(gradients[0], direct, atol=1e-5)


def test_the_learning_rate_follows_its_schedule_over_every_optimizer_step(policy):
    trainer = SftTrainer(policy, SftConfig(lr=1.0, warmup_steps=2, lr_schedule="linear", min_lr_ratio=0.0), total_steps=6)
    assert [trainer.lr_at(step) for step in range(6)] == pytest.approx([0.5, 1.0, 1.0, 0.75, 0.5, 0.25])


def addition_examples(count: int, seed: int) -> list[dict]:
    generator = torch.Generator().manual_seed(seed)
    pairs = torch.randint(0, 10, (count, 2), generator=generator).tolist()
    return [{"prompt": f"{a}+{b}=", "response": str(a + b)} for a, b in pairs]


def greedy_accuracy(model_dir: str, rows: list[dict]) -> float:
    policy = HFPolicy.load(model_dir, "cpu")
    prompts = [policy.tokenizer(r["prompt"], add_special_tokens=False)["input_ids"] for r in rows]
    outputs = policy.generate(prompts, SamplingParams(max_new_tokens=4, temperature=0.0))
    texts = [policy.tokenizer.decode(g.response_ids, skip_special_tokens=True) for g in outputs]
    return sum(text == row["response"] for text, row in zip(texts, rows)) / len(rows)


def test_sft_learns_its_demonstrations_and_commits_a_checkpoint_rl_starts_fresh_from(tiny_model, tmp_path):
    rows = addition_examples(32, seed=0)
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = load_config(None, ["sft.epochs=40", "sft.lr=1e-3", "sft.batch_size=8"])
    reported = []
    manifest = run(data=str(data), model=tiny_model, out=str(tmp_path / "ckpt"), cfg=cfg, val_data=str(data), report=reported.append)
    assert greedy_accuracy(tiny_model, rows) == 0.0
    assert greedy_accuracy(str(tmp_path / "ckpt"), rows) >= 0.9  # 1.0 measured
    assert [r["epoch"] for r in reported] == list(range(41)) and "loss" not in reported[0]
    assert reported[-1]["val_loss"] < reported[0]["val_loss"] / 20
    assert manifest.stage == "sft" and manifest.state["optimizer_steps"] == 40 * 4 and manifest.state["epochs"] == reported
    assert not (tmp_path / "ckpt" / "trainer_state").exists()  # RL from it: step 0, a fresh optimizer
    from rlctl.backends.hf import read_trainer_step

    assert read_trainer_step(str(tmp_path / "ckpt")) == 0
    again = run(data=str(data), model=tiny_model, out=str(tmp_path / "ckpt"), cfg=cfg, val_data=str(data))
    assert again.state.get("skipped")


def test_sft_bf16_takes_a_boolean_from_toml_or_set_as_update_bf16_does():
    assert load_config(None, ["sft.bf16=false"]).sft.bf16 == "false" and load_config(None, ["sft.bf16=true"]).sft.bf16 == "true"
    assert load_config(None, ["sft.bf16=auto"]).sft.bf16 == "auto"


NO_THINKING = "{% if enable_thinking is defined and not enable_thinking %}{{ '<think>\n\n</think>\n\n' }}{% endif %}"
QWEN3_LIKE = (  # an empty thinking block opens the assistant's turns where enable_thinking is false, as Qwen3's template does
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' }}"
    "{% if message['role'] == 'assistant' %}" + NO_THINKING + "{% endif %}{{ message['content'] + '<|im_end|>' + '\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}" + NO_THINKING + "{% endif %}"
)


def test_chat_template_kwargs_reach_the_prompts_and_the_examples_turns_as_the_template_reads_them(policy, tmp_path):
    """data.chat_template_kwargs = {enable_thinking = false}: a Qwen3-like template's empty
    thinking block after the generation prompt, in the rollout's prompt tokens and in an SFT
    example's (its response then follows the block); without it, none."""
    from rlctl.tool_turns import chat_turn_text

    tok = policy.tokenizer
    tok.chat_template = QWEN3_LIKE
    chat = [{"role": "user", "content": "2+2"}, {"role": "assistant", "content": "4"}]
    question = read_rows(tmp_path, [{"messages": chat[:1]}])
    quiet = DataConfig(chat_template_kwargs={"enable_thinking": False})
    (prompt,) = encode_prompts(question, tok, quiet)
    assert tok.decode(prompt).endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert tok.decode(encode_prompts(question, tok, DataConfig())[0]).endswith("<|im_start|>assistant\n")
    got = encode(policy, read_rows(tmp_path, [{"messages": chat}]), data=quiet)
    assert got.prompt_ids == [prompt] and tok.decode(got.response_ids[0]) == "4<|im_end|>"
    assert chat_turn_text(tok, "42", "tool", {"enable_thinking": False}).endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
