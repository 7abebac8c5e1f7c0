"""The direct decode step gives transformers' tokens and log-probs bit for bit, for every model
class it takes, and leaves every other model to transformers' forward."""

import pytest
import torch

from rlctl.backends import decode_attention, decode_products, decode_step
from rlctl.backends.base import SamplingParams
from rlctl.backends.hf import HFPolicy, decoding_attention
from rlctl.backends.kv_cache import decoding_cache
from rlctl.errors import InputError
from tests.conftest import model_folder


@pytest.fixture(scope="module", params=["qwen2", "llama", "mistral", "qwen3"])
def policy(request, tmp_path_factory, tiny_model):
    folder = tiny_model if request.param == "qwen2" else model_folder(tmp_path_factory, tiny_model, request.param)
    return HFPolicy.load(folder, "cpu")


def generate_with(monkeypatch, policy, choice: str, dtype: str):
    monkeypatch.setenv(decode_step.OVERRIDE_ENV, choice)
    texts = ["hello there", "12 + 3 =", "a", "The answer is, after a long think,"]
    batch = [policy.tokenizer(t)["input_ids"] for t in texts for _ in range(3)]  # shared prompts, left-padded
    return policy.generate(batch, SamplingParams(max_new_tokens=24, temperature=1.0, seed=7), batch_size=5, compute_dtype=dtype)


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_the_direct_step_generates_transformers_tokens_and_logprobs_bit_for_bit(monkeypatch, policy, dtype):
    if decode_products.pays(torch.float32 if dtype == "fp32" else torch.bfloat16) == "mkl":  # its sums: to ~2e-6 (test_decode_products)
        monkeypatch.setenv(decode_products.OVERRIDE_ENV, "modules")
    policy.stop_ids = list(range(0, 512, 29))  # rows finish at different steps and leave the batch
    steps = []
    monkeypatch.setattr(decode_step.DecodeStep, "__call__", _recording(decode_step.DecodeStep.__call__, steps))
    direct = generate_with(monkeypatch, policy, "rlctl", dtype)
    assert steps  # the direct step decoded, not the model's forward
    used = len(steps)
    transformers = generate_with(monkeypatch, policy, "transformers", dtype)
    assert len(steps) == used
    assert {g.finish_reason for g in direct} == {"stop", "length"}
    for d, t in zip(direct, transformers):
        assert (d.response_ids, d.logprobs, d.finish_reason) == (t.response_ids, t.logprobs, t.finish_reason)


def test_the_direct_step_decodes_in_inference_mode_and_leaves_the_model_trainable(monkeypatch, tiny_model):
    policy = HFPolicy.load(tiny_model, "cpu")
    modes = []
    monkeypatch.setattr(decode_step.DecodeStep, "__call__", _recording(decode_step.DecodeStep.__call__, modes))
    generate_with(monkeypatch, policy, "rlctl", "fp32")
    assert modes and all(modes)  # no autograd bookkeeping in the decode loop
    model = policy.model
    assert not any(t.is_inference() for t in [*model.parameters(), *model.buffers()])
    model.train()
    ids = torch.tensor([policy.tokenizer("12 + 3 =")["input_ids"]])
    model(input_ids=ids).logits.float().logsumexp(-1).sum().backward()  # a training step's backward after generation
    assert all(p.grad is not None for p in model.parameters() if p.requires_grad)


def test_a_model_with_hooks_generates_outside_inference_mode(monkeypatch, tiny_model):
    policy = HFPolicy.load(tiny_model, "cpu")
    modes = []
    # a hook (as FSDP's are) may keep what the forward makes: no inference tensors for it
    policy.model.model.layers[0].register_forward_hook(lambda *args: modes.append(torch.is_inference_mode_enabled()))
    generate_with(monkeypatch, policy, "rlctl", "fp32")
    assert modes and not any(modes)


def _recording(call, modes: list):
    """`call`, appending to `modes` whether each call ran in inference mode."""

    def recorded(self, *args):
        modes.append(torch.is_inference_mode_enabled())
        return call(self, *args)

    return recorded


def with_decoding_cache(policy):
    """(model under rlctl's decode attention, a generation cache) as `generate` has them."""
    return policy.model, decoding_cache(policy.model.config)


def test_it_takes_the_model_classes_it_mirrors_under_rlctl_decode_attention(tiny_model):
    policy = HFPolicy.load(tiny_model, "cpu")
    model, cache = with_decoding_cache(policy)
    assert decode_step.for_model(model, cache) is None  # SDPA outside generation: the model's forward
    with decoding_attention(model, policy.device):
        assert model.config._attn_implementation == decode_attention.NAME
        assert isinstance(decode_step.for_model(model, cache), decode_step.DecodeStep)
        model.train()
        assert decode_step.for_model(model, cache) is None  # training mode attends with SDPA
        model.eval()
        handle = model.model.layers[1].mlp.up_proj.register_forward_hook(lambda *args: None)
        assert decode_step.for_model(model, cache) is None  # a hook only the model's forward runs
        handle.remove()
        assert decode_step.for_model(model, cache) is not None


@pytest.mark.filterwarnings("ignore:.*is_gradient_checkpointing.*:FutureWarning")  # peft's call, transformers' warning
def test_lora_layers_and_sliding_windows_keep_the_model_forward(tmp_path_factory, tiny_model):
    from peft import LoraConfig, get_peft_model

    policy = HFPolicy.load(tiny_model, "cpu")
    lora = get_peft_model(policy.model, LoraConfig(r=2, target_modules=["q_proj", "v_proj"])).get_base_model()
    with decoding_attention(lora, policy.device):
        assert not decode_step.supports(lora)
    windowed = HFPolicy.load(model_folder(tmp_path_factory, tiny_model, "mistral"), "cpu").model
    windowed.config.sliding_window = 16
    with decoding_attention(windowed, torch.device("cpu")):
        assert not decode_step.supports(windowed)
        windowed.config.sliding_window = None
        assert decode_step.supports(windowed)


def test_an_unknown_decode_step_choice_is_an_input_error(monkeypatch, tiny_model):
    policy = HFPolicy.load(tiny_model, "cpu")
    monkeypatch.setenv(decode_step.OVERRIDE_ENV, "compiled")
    with pytest.raises(InputError, match=decode_step.OVERRIDE_ENV):
        decode_step.for_model(*with_decoding_cache(policy))
