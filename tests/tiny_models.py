"""The tiny random causal LMs the unit tests build: Qwen2, Llama, Qwen3 and Mistral of one shape (2 layers,
hidden 32, grouped-query attention 4q/2kv unless a test overrides it), and a GPT-2 and a Phi of the same size."""

from pathlib import Path

import torch
from transformers import (
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    PhiConfig,
    PhiForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)


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


def tiny_qwen3(vocab_size: int, seed: int = 0, max_position_embeddings: int = 64, **config) -> Qwen3ForCausalLM:
    """A seeded tiny Qwen3 (per-head q/k RMSNorm, head_dim from the config) in eval mode."""
    torch.manual_seed(seed)
    shape = {**tiny_shape(vocab_size, max_position_embeddings), "head_dim": 16}
    return Qwen3ForCausalLM(Qwen3Config(**{**shape, **config})).eval()


def tiny_mistral(vocab_size: int, seed: int = 0, max_position_embeddings: int = 64, **config) -> MistralForCausalLM:
    """A seeded tiny Mistral without a sliding window (unless `config` sets one) in eval mode."""
    torch.manual_seed(seed)
    shape = {**tiny_shape(vocab_size, max_position_embeddings), "sliding_window": None}
    return MistralForCausalLM(MistralConfig(**{**shape, **config})).eval()


def tiny_gpt2(vocab_size: int, seed: int = 0, max_position_embeddings: int = 64) -> GPT2LMHeadModel:
    """A seeded tiny GPT-2 (learned positions, LayerNorm, GELU: not a Llama-family model) in eval mode."""
    torch.manual_seed(seed)
    config = GPT2Config(
        vocab_size=vocab_size,
        n_embd=32,
        n_layer=2,
        n_head=4,
        n_positions=max_position_embeddings,
        bos_token_id=0,
        eos_token_id=0,
    )
    return GPT2LMHeadModel(config).eval()


def tiny_phi(vocab_size: int, seed: int = 0, max_position_embeddings: int = 64) -> PhiForCausalLM:
    """A seeded tiny Phi (LayerNorm, GELU, parallel attention and MLP, rotary on half of each head, biased
    nn.Linear layers and head: not a Llama-family model) in eval mode."""
    torch.manual_seed(seed)
    shape = tiny_shape(vocab_size, max_position_embeddings)
    return PhiForCausalLM(PhiConfig(**shape, partial_rotary_factor=0.5)).eval()


def save_tiny_pair(folder: Path) -> tuple[Path, Path]:
    """A tiny random Qwen2 over the arithmetic tokenizer and a random drafter on it, saved as tlt reads them:
    (folder/model, folder/drafter)."""
    from tlt_cli.drafter.model import EagleDrafter, save_drafter
    from tlt_cli.models.tiny import build_tiny_model, save_model_folder, tiny_model_config, tiny_tokenizer

    tokenizer = tiny_tokenizer()
    config = tiny_model_config(
        tokenizer, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=64
    )
    target = build_tiny_model(0, config)
    save_model_folder(target, tokenizer, folder / "model")
    save_drafter(EagleDrafter(target, seed=0), folder / "drafter")
    return folder / "model", folder / "drafter"
