"""Chunked log-probs (tlt_cli/training/logprobs.py) against the full-vocabulary formula they replace.

Values and the gradients of every parameter equal log_softmax(lm_head(hidden).float())[token]
within float32 rounding, on tiny models with tied and untied heads and a head with a bias, at
chunk sizes that do not divide the row count; and no tensor of [tokens, V] is ever made.
"""

import pytest
import torch
from tiny_models import tiny_llama, tiny_qwen2
from torch.utils._python_dispatch import TorchDispatchMode

from tlt_cli.training.logprobs import head_logprobs, token_logprobs


def full_vocabulary_logprobs(logits: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
    """What training/grpo.py computed before: log_softmax over [B, T, V] at once, shifted by one, entry 0 zero."""
    logprobs = torch.log_softmax(logits[:, :-1].float(), dim=-1)
    gathered = logprobs.gather(-1, input_ids[:, 1:].unsqueeze(-1)).squeeze(-1)
    return torch.nn.functional.pad(gathered, (1, 0), value=0.0)


def weighted_sum_gradients(model, logprobs_of, input_ids, weights):
    """Gradients of every parameter of sum(weights * logprobs) (a loss of the policy-loss form)."""
    model.zero_grad()
    (logprobs_of(model, input_ids) * weights).sum().backward()
    return {name: parameter.grad.clone() for name, parameter in model.named_parameters()}


def chunked(model, input_ids):
    hidden = model.get_decoder()(input_ids=input_ids).last_hidden_state
    return token_logprobs(hidden, model.lm_head, input_ids, chunk_tokens=5)


def full(model, input_ids):
    return full_vocabulary_logprobs(model(input_ids=input_ids).logits, input_ids)


@pytest.mark.parametrize(
    "model",
    [tiny_qwen2(vocab_size=96, tie_word_embeddings=False), tiny_llama(vocab_size=96, tie_word_embeddings=True)],
    ids=["untied", "tied"],
)
def test_values_and_every_parameter_gradient_equal_the_full_vocabulary_formula(model):
    generator = torch.Generator().manual_seed(0)
    input_ids = torch.randint(0, 96, (3, 9), generator=generator)
    weights = torch.randn(3, 9, generator=generator)
    assert model.config.tie_word_embeddings == (model.lm_head.weight is model.get_input_embeddings().weight)
    with torch.no_grad():
        expected, result = full(model, input_ids), chunked(model, input_ids)
    assert torch.equal(result[:, 0], torch.zeros(3))
    assert torch.allclose(result, expected, atol=1e-5)
    expected_gradients = weighted_sum_gradients(model, full, input_ids, weights)
    gradients = weighted_sum_gradients(model, chunked, input_ids, weights)
    for name, gradient in gradients.items():
        assert torch.allclose(gradient, expected_gradients[name], atol=1e-5, rtol=1e-4), name
    assert model.lm_head.weight.grad.abs().sum() > 0


def test_only_the_needed_entries_are_computed_and_the_rest_are_zero():
    model = tiny_qwen2(vocab_size=64)
    input_ids = torch.randint(0, 64, (2, 7), generator=torch.Generator().manual_seed(1))
    needed = torch.tensor([[0, 0, 0, 1, 1, 1, 0], [0, 0, 1, 1, 1, 1, 1]])
    with torch.no_grad():
        hidden = model.get_decoder()(input_ids=input_ids).last_hidden_state
        result = token_logprobs(hidden, model.lm_head, input_ids, needed=needed, chunk_tokens=3)
        expected = full(model, input_ids)
    mask = needed.bool()
    assert torch.allclose(result[mask], expected[mask], atol=1e-5)
    assert torch.equal(result[~mask], torch.zeros(int((~mask).sum())))


def test_a_head_with_a_bias_at_a_temperature_matches_in_values_and_gradients():
    torch.manual_seed(2)
    head = torch.nn.Linear(16, 40, bias=True)
    hidden = torch.randn(11, 16, requires_grad=True)
    tokens = torch.randint(0, 40, (11,))
    expected = torch.log_softmax(head(hidden).float() / 0.7, dim=-1).gather(1, tokens[:, None]).squeeze(1)
    expected_gradients = torch.autograd.grad(expected.sum(), (hidden, head.weight, head.bias))
    result = head_logprobs(hidden, head, tokens, temperature=0.7, chunk_tokens=4)
    gradients = torch.autograd.grad(result.sum(), (hidden, head.weight, head.bias))
    assert torch.allclose(result, expected, atol=1e-5)
    for gradient, expected_gradient in zip(gradients, expected_gradients):
        assert torch.allclose(gradient, expected_gradient, atol=1e-5)


class LargestTensor(TorchDispatchMode):
    """Records the most elements any operation's output had."""

    def __init__(self):
        super().__init__()
        self.elements = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        output = func(*args, **(kwargs or {}))
        for tensor in output if isinstance(output, (tuple, list)) else (output,):
            if isinstance(tensor, torch.Tensor):
                self.elements = max(self.elements, tensor.numel())
        return output


def test_forward_and_backward_never_make_a_tokens_by_vocabulary_tensor():
    vocab_size, rows, chunk = 512, 64, 8
    head = torch.nn.Linear(16, vocab_size, bias=False)
    hidden = torch.randn(rows, 16, requires_grad=True)
    tokens = torch.randint(0, vocab_size, (rows,))
    largest = LargestTensor()
    with largest:
        head_logprobs(hidden, head, tokens, chunk_tokens=chunk).sum().backward()
    # the head's own weight and its gradient ([V, H]) are the largest; a chunk's logits are [8, V]
    assert largest.elements == max(vocab_size * 16, chunk * vocab_size) < rows * vocab_size
    with largest:
        torch.log_softmax(head(hidden), dim=-1).gather(1, tokens[:, None]).sum().backward()
    assert largest.elements == rows * vocab_size  # the probe: the unchunked formula does make one
