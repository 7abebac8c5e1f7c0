"""The unpadded forward computes transformers' log-probs, entropies and gradients for every model
class it takes, runs the products on real tokens only, and leaves every other model to
transformers' forward."""

import pytest
import torch

from rlctl.backends import grouped_attention, unpadded
from rlctl.backends.hf import HFPolicy, pack, training_forward
from rlctl.errors import InputError
from tests.conftest import model_folder

PROMPTS = ["hello there", "12 + 3 =", "a", "The answer is, after a long think,"]
RESPONSE_LENGTHS = [5, 1, 9, 3, 7, 2, 8, 4, 6, 9, 1, 5]  # three rows per prompt, each ending elsewhere


@pytest.fixture(scope="module", params=["qwen2", "llama", "mistral", "qwen3"])
def policy(request, tmp_path_factory, tiny_model):
    folder = tiny_model if request.param == "qwen2" else model_folder(tmp_path_factory, tiny_model, request.param)
    return HFPolicy.load(folder, "cpu")


def rows(policy) -> tuple[list[list[int]], list[list[int]]]:
    """Twelve rows, three per prompt (GRPO's groups), responses of different lengths."""
    prompts = [policy.tokenizer(t)["input_ids"] for t in PROMPTS for _ in range(3)]
    g = torch.Generator().manual_seed(3)
    responses = [torch.randint(4, policy.vocab_size, (n,), generator=g).tolist() for n in RESPONSE_LENGTHS]
    return prompts, responses


def forward_and_gradients(monkeypatch, policy, choice: str, *, shared: bool, bf16: bool = False):
    """(log-probs, entropy, the mask, every trained parameter's gradient) of one training forward."""
    monkeypatch.setenv(unpadded.OVERRIDE_ENV, choice)
    prompts, responses = rows(policy)
    model = policy.model
    model.train()
    model.zero_grad(set_to_none=True)
    try:
        batch = pack(prompts, responses, policy.pad_id, policy.device)
        with training_forward(model, policy.device, bf16, rows=len(prompts), length=batch.input_ids.shape[1]):
            if shared:
                logp, entropy = policy.forward_sharing_prompts(prompts, responses, temperature=0.7, statistic="entropy")
            else:
                logp, entropy = policy.forward(batch, temperature=0.7, statistic="entropy")
        m = batch.response_mask
        weights = torch.linspace(-1.0, 1.0, m.numel()).view(m.shape)
        (torch.where(m, logp * weights + 0.1 * entropy, 0).sum()).backward()
        grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.requires_grad}
    finally:
        model.eval()
        model.zero_grad(set_to_none=True)
    return logp.detach(), entropy.detach(), m, grads


def assert_same_gradient(ours: torch.Tensor, theirs: torch.Tensor, name: str) -> None:
    """Equal up to fp32 summation order: within 1e-5 of the gradient's own size."""
    assert float(torch.linalg.norm(ours - theirs)) <= 1e-5 * float(torch.linalg.norm(theirs)) + 1e-7, name


@pytest.mark.parametrize("long_sequences", [False, True], ids=["grouped-eager", "sdpa-grouped-queries"])
@pytest.mark.parametrize("shared", [False, True], ids=["one-forward-per-row", "prompts-once"])
def test_log_probs_entropy_and_gradients_are_transformers_in_fp32(monkeypatch, policy, shared, long_sequences):
    if long_sequences:  # scores past the grouped eager attention's bound: SDPA with its own grouped queries
        monkeypatch.setattr(grouped_attention, "MAX_FP32_SCORES", 0)
    ours = forward_and_gradients(monkeypatch, policy, "rlctl", shared=shared)
    theirs = forward_and_gradients(monkeypatch, policy, "transformers", shared=shared)
    m = ours[2]
    assert torch.equal(m, theirs[2])
    torch.testing.assert_close(ours[0][m], theirs[0][m], rtol=0, atol=2e-5)
    torch.testing.assert_close(ours[1][m], theirs[1][m], rtol=0, atol=2e-5)
    assert ours[3].keys() == theirs[3].keys()
    for name, grad in ours[3].items():
        assert_same_gradient(grad, theirs[3][name], name)


def test_bf16_training_forward_matches_transformers_to_bf16_precision(monkeypatch, tiny_model):
    policy = HFPolicy.load(tiny_model, "cpu")
    for shared in (False, True):
        ours = forward_and_gradients(monkeypatch, policy, "rlctl", shared=shared, bf16=True)
        theirs = forward_and_gradients(monkeypatch, policy, "transformers", shared=shared, bf16=True)
        m = ours[2]
        torch.testing.assert_close(ours[0][m], theirs[0][m], rtol=0, atol=0.05)
        for name, grad in ours[3].items():
            assert torch.nn.functional.cosine_similarity(grad.flatten(), theirs[3][name].flatten(), dim=0) > 0.99, name


def test_scoring_is_the_update_forward_and_padded_slots_are_zero(monkeypatch, tiny_model):
    policy = HFPolicy.load(tiny_model, "cpu")
    prompts, responses = rows(policy)
    monkeypatch.setenv(unpadded.OVERRIDE_ENV, "rlctl")
    ours = policy.logprobs(prompts, responses, temperature=1.0, batch_size=5)
    monkeypatch.setenv(unpadded.OVERRIDE_ENV, "transformers")
    theirs = policy.logprobs(prompts, responses, temperature=1.0, batch_size=5)
    for a, b, r in zip(ours, theirs, responses):
        assert len(a) == len(b) == len(r)
        assert a == pytest.approx(b, abs=2e-5)
    batch = pack(prompts, responses, policy.pad_id, policy.device)
    monkeypatch.setenv(unpadded.OVERRIDE_ENV, "rlctl")
    with torch.no_grad():
        logp, _ = policy.forward(batch, temperature=1.0)
    assert torch.all(logp[~batch.response_mask] == 0)


def test_the_products_run_on_real_tokens_only(monkeypatch, tiny_model):
    policy = HFPolicy.load(tiny_model, "cpu")
    prompts, responses = rows(policy)
    batch = pack(prompts, responses, policy.pad_id, policy.device)
    q_proj = type(policy.model.model.layers[0].self_attn.q_proj)
    seen: list[int] = []
    plain_forward = q_proj.forward

    def counting(self, x):
        if self is policy.model.model.layers[0].self_attn.q_proj:
            seen.append(x.reshape(-1, x.shape[-1]).shape[0])
        return plain_forward(self, x)

    monkeypatch.setattr(q_proj, "forward", counting)
    with torch.no_grad():
        policy.forward(batch, temperature=1.0)
        policy.forward_sharing_prompts(prompts, responses, temperature=1.0)
    real = sum(len(p) + len(r) for p, r in zip(prompts, responses))
    distinct_prompt_tokens = sum(len(policy.tokenizer(t)["input_ids"]) for t in PROMPTS)
    assert seen == [real, distinct_prompt_tokens, sum(RESPONSE_LENGTHS)]
    assert real < batch.input_ids.numel()  # the padded batch is larger


def test_other_models_attention_and_checkpointing_keep_the_transformers_forward(monkeypatch, tiny_model):
    from rlctl.backends.hf import attention_implementation

    policy = HFPolicy.load(tiny_model, "cpu")
    model = policy.model
    assert isinstance(unpadded.for_model(model), unpadded.UnpaddedForward)
    with attention_implementation(model, "eager"):
        assert unpadded.for_model(model) is not None  # the bf16 update's attention on the CPU
    with attention_implementation(model, "flex_attention"):
        assert unpadded.for_model(model) is None
    plain_class = type(model)
    model.__class__ = type("CustomQwen2", (plain_class,), {})  # a subclass may change what its forward does
    assert unpadded.for_model(model) is None
    model.__class__ = plain_class
    newer = hasattr(model, "activation_checkpointing_enable")  # transformers ≥ 5.2x's name for it
    (model.activation_checkpointing_enable if newer else model.gradient_checkpointing_enable)()
    assert unpadded.for_model(model) is None  # a checkpointed layer reruns its attention in the backward
    (model.activation_checkpointing_disable if newer else model.gradient_checkpointing_disable)()
    assert unpadded.for_model(model) is not None
    monkeypatch.setenv(unpadded.OVERRIDE_ENV, "transformers")
    assert unpadded.for_model(model) is None
    monkeypatch.setenv(unpadded.OVERRIDE_ENV, "packed")
    with pytest.raises(InputError, match=unpadded.OVERRIDE_ENV):
        unpadded.for_model(model)


def test_the_layers_run_as_modules_and_the_model_keeps_its_attention(tiny_model):
    policy = HFPolicy.load(tiny_model, "cpu")
    prompts, responses = rows(policy)
    calls: list[tuple[int, ...]] = []
    handle = policy.model.model.layers[1].mlp.register_forward_hook(lambda module, args, out: calls.append(tuple(out.shape)))
    before = policy.model.config._attn_implementation
    with torch.no_grad():
        policy.forward(pack(prompts, responses, policy.pad_id, policy.device), temperature=1.0)
    handle.remove()
    assert calls == [(1, sum(len(p) + len(r) for p, r in zip(prompts, responses)), policy.model.config.hidden_size)]
    assert policy.model.config._attn_implementation == before


@pytest.mark.filterwarnings("ignore:.*is_gradient_checkpointing.*:FutureWarning")  # peft's call, transformers' warning
@pytest.mark.parametrize("shared", [False, True], ids=["one-forward-per-row", "prompts-once"])
def test_a_lora_adapter_trains_and_scores_as_through_transformers(monkeypatch, tiny_model, shared):
    from peft import LoraConfig, get_peft_model

    policy = HFPolicy.load(tiny_model, "cpu")
    policy.model = get_peft_model(policy.model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"]))
    for name, p in policy.model.named_parameters():
        if "lora_B" in name:  # a fresh adapter adds nothing: give it something to add
            torch.nn.init.normal_(p, std=0.05, generator=torch.Generator().manual_seed(len(name)))
    assert isinstance(unpadded.for_model(policy.model), unpadded.UnpaddedForward)
    ours = forward_and_gradients(monkeypatch, policy, "rlctl", shared=shared)
    theirs = forward_and_gradients(monkeypatch, policy, "transformers", shared=shared)
    m = ours[2]
    torch.testing.assert_close(ours[0][m], theirs[0][m], rtol=0, atol=2e-5)
    trained = {name for name, p in policy.model.named_parameters() if p.requires_grad}
    assert trained and all("lora_" in name for name in trained)
    for name in trained:
        assert_same_gradient(ours[3][name], theirs[3][name], name)
    prompts, responses = rows(policy)
    scores = {}
    with policy.model.disable_adapter():  # a LoRA policy's reference: the base weights
        for choice in ("rlctl", "transformers"):
            monkeypatch.setenv(unpadded.OVERRIDE_ENV, choice)
            scores[choice] = policy.logprobs(prompts, responses, temperature=1.0, batch_size=5)
    for a, b in zip(scores["rlctl"], scores["transformers"]):
        assert a == pytest.approx(b, abs=2e-5)
    monkeypatch.setenv(unpadded.OVERRIDE_ENV, "rlctl")
    assert scores["rlctl"] != policy.logprobs(prompts, responses, temperature=1.0, batch_size=5)  # the adapter's own differ


@pytest.fixture
def one_rank_mesh():
    """A one-rank FSDP2 group in this process (gloo): a Ray rank's sharding without a second rank."""
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield dist.device_mesh.init_device_mesh("cpu", (1,))
    finally:
        dist.destroy_process_group()


def full(grad: torch.Tensor) -> torch.Tensor:
    """An FSDP2 gradient (a DTensor shard) as the whole tensor."""
    assert isinstance(grad, torch.distributed.tensor.DTensor)
    return grad.full_tensor()


@pytest.mark.parametrize("shared", [False, True], ids=["one-forward-per-row", "prompts-once"])
def test_an_fsdp2_model_gathers_trains_and_reduces_as_through_transformers(monkeypatch, tiny_model, shared, one_rank_mesh):
    """The root's parameters (embeddings, final norm, LM head) are gathered by run_as_forward,
    each layer's by its own hooks, and every gradient comes back reduced onto the shards."""
    from rlctl.workers.ray import _sharded

    policy = HFPolicy.load(tiny_model, "cpu")
    plain = forward_and_gradients(monkeypatch, policy, "transformers", shared=shared)
    policy.model = _sharded(policy.model, one_rank_mesh)
    for choice in ("rlctl", "transformers"):
        logp, entropy, m, grads = forward_and_gradients(monkeypatch, policy, choice, shared=shared)
        assert isinstance(unpadded.for_model(policy.model), unpadded.UnpaddedForward) == (choice == "rlctl")
        torch.testing.assert_close(logp[m], plain[0][m], rtol=0, atol=2e-5)
        assert grads.keys() == plain[3].keys()
        for name, grad in grads.items():
            assert_same_gradient(full(grad), plain[3][name], name)


def critic_values_and_gradients(monkeypatch, critic, batch, choice: str):
    monkeypatch.setenv(unpadded.OVERRIDE_ENV, choice)
    critic.zero_grad(set_to_none=True)
    values = critic(batch)
    torch.where(batch.response_mask, values, 0).square().sum().backward()
    return values.detach(), {n: p.grad.clone() for n, p in critic.named_parameters()}


def test_a_critic_values_the_same_states(monkeypatch, tiny_model):
    from rlctl.backends.hf import ValueModel

    critic = ValueModel.load(tiny_model, torch.device("cpu"))
    torch.nn.init.normal_(critic.value_head.weight, std=0.5)  # a fresh critic's head is zero
    batch = pack(*rows(HFPolicy.load(tiny_model, "cpu")), 0, torch.device("cpu"))
    ours, theirs = (critic_values_and_gradients(monkeypatch, critic, batch, choice) for choice in ("rlctl", "transformers"))
    m = batch.response_mask
    torch.testing.assert_close(ours[0][m], theirs[0][m], rtol=0, atol=2e-5)
    for name, grad in ours[1].items():
        assert_same_gradient(grad, theirs[1][name], name)


def test_an_fsdp2_critic_values_and_reduces_as_the_plain_critic(monkeypatch, tiny_model, one_rank_mesh):
    from rlctl.backends.hf import ValueModel
    from rlctl.workers.ray import _sharded_critic

    critic = ValueModel.load(tiny_model, torch.device("cpu"))
    torch.nn.init.normal_(critic.value_head.weight, std=0.5)
    batch = pack(*rows(HFPolicy.load(tiny_model, "cpu")), 0, torch.device("cpu"))
    plain = critic_values_and_gradients(monkeypatch, critic, batch, "transformers")
    critic = _sharded_critic(critic, one_rank_mesh)
    ours = critic_values_and_gradients(monkeypatch, critic, batch, "rlctl")
    assert unpadded.for_model(critic.lm) is not None
    m = batch.response_mask
    torch.testing.assert_close(ours[0][m], plain[0][m], rtol=0, atol=2e-5)
    assert ours[1].keys() == plain[1].keys()
    for name, grad in ours[1].items():
        assert_same_gradient(full(grad), plain[1][name], name)


def test_a_pass_without_response_tokens_adds_nothing(tiny_model):
    policy = HFPolicy.load(tiny_model, "cpu")
    policy.model.train()
    logp, entropy = policy.forward_sharing_prompts([[5, 6, 7], [5, 6, 7]], [[], []], temperature=1.0, statistic="entropy")
    assert logp.shape == entropy.shape == (2, 0)
    (logp.sum() + entropy.sum()).backward()
    assert all(p.grad is None or not p.grad.any() for p in policy.model.parameters())
