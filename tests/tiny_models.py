"""The tiny random causal LMs the unit tests build: Qwen2 and Llama of one shape (2 layers, hidden 32,
grouped-query attention 4q/2kv unless a test overrides it)."""

import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM


def tiny_shape(vocab_size: int, max_position_embeddings: int) -> dict:
    """The config fields both tiny models share."""
    return dict(
        vocab_size=vocab_size,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=max_position_embeddings,
    )


def tiny_qwen2(vocab_size: int, seed: int = 0, max_position_embeddings: int = 64, **config) -> Qwen2ForCausalLM:
    """A seeded tiny Qwen2 in eval mode; `config` overrides further Qwen2Config fields (e.g. hidden_size)."""
    torch.manual_seed(seed)
    shape = tiny_shape(vocab_size, max_position_embeddings)
    return Qwen2ForCausalLM(Qwen2Config(**{**shape, **config})).eval()


def tiny_llama(vocab_size: int, seed: int = 0, max_position_embeddings: int = 64, **config) -> LlamaForCausalLM:
    """A seeded tiny Llama in eval mode; `config` overrides further LlamaConfig fields (e.g. tie_word_embeddings)."""
    torch.manual_seed(seed)
    shape = tiny_shape(vocab_size, max_position_embeddings)
    return LlamaForCausalLM(LlamaConfig(**{**shape, **config})).eval()
