"""Llama-style causal language models built from named presets (Hugging Face `transformers`).

Embeddings are untied, as in the paper. The vocabulary size always comes from the
tokenizer, so a preset only fixes the shape of the network.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from isoloco.errors import ConfigError

if TYPE_CHECKING:
    from transformers import LlamaConfig, LlamaForCausalLM


@dataclass(frozen=True)
class ModelShape:
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    ffn: int
    note: str


#: Named model shapes. `178m` and `512m` are the paper's; `1b` is the Llama-3.2-1B shape
#: (hidden 2048, 16 layers, 32 heads with 8 KV heads, FFN 8192), about 1.1B parameters with
#: a 32k vocabulary and untied embeddings.
MODEL_PRESETS: dict[str, ModelShape] = {
    "tiny": ModelShape(64, 4, 4, 4, 192, "about 1.3M parameters at vocab 8192; CPU tests and demos"),
    "small": ModelShape(256, 6, 4, 4, 688, "about 9M parameters at vocab 8192; CPU experiments"),
    "178m": ModelShape(1024, 9, 8, 8, 2688, "the paper's 178M model (vocab 32000)"),
    "512m": ModelShape(1536, 12, 12, 12, 5440, "the paper's 512M model (vocab 32000)"),
    "1b": ModelShape(2048, 16, 32, 8, 8192, "Llama-3.2-1B shape, about 1.1B parameters at vocab 32000"),
}


def check_model_name(name: str) -> ModelShape:
    if name not in MODEL_PRESETS:
        raise ConfigError(f"model={name!r} is not allowed: choose one of {', '.join(MODEL_PRESETS)}")
    return MODEL_PRESETS[name]


def llama_config(name: str, vocab_size: int, max_positions: int) -> LlamaConfig:
    from transformers import LlamaConfig  # seconds to import: only when a model is built

    shape = check_model_name(name)
    return LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=shape.hidden,
        intermediate_size=shape.ffn,
        num_hidden_layers=shape.layers,
        num_attention_heads=shape.heads,
        num_key_value_heads=shape.kv_heads,
        max_position_embeddings=max_positions,
        tie_word_embeddings=False,
        attn_implementation="sdpa",
    )


def build_model(name: str, vocab_size: int, max_positions: int, seed: int) -> LlamaForCausalLM:
    """Build the preset with weights drawn from a generator seeded by `seed` (fp32)."""
    config = llama_config(name, vocab_size, max_positions)
    # Initialisation draws from the global RNG; fork it so building a model leaves the
    # caller's RNG untouched and the weights depend on `seed` alone.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        from transformers import LlamaForCausalLM  # deferred as in llama_config

        model = LlamaForCausalLM(config)
    return model


def count_parameters(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())
