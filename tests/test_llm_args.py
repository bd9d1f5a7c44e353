"""``LLM(...)`` with the vLLM engine arguments RL frameworks pass (``specengine.llm_args``):
honoured, accepted as no-ops, or refused with a ValueError that says why; never a bare
TypeError."""

import pytest
import torch

from specengine import LLM, SamplingParams
from specengine.llm_args import NAMES, parse_engine_args
from specengine.models.loader import iter_safetensors, safetensors_files, save_random_model

KW = {"block_size": 8, "kv_cache_memory_bytes": 8 << 20}
GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return save_random_model(tmp_path_factory.mktemp("a"), {"num_hidden_layers": 2}, seed=1)


def ids(llm, prompts=([5, 6, 7], [9, 9])):
    return [o.outputs[0].token_ids for o in llm.generate(list(prompts), GREEDY,
                                                           use_tqdm=False)]


def test_what_trl_and_verl_pass_is_accepted(tiny):
    want = ids(LLM(str(tiny), dtype="float32", **KW))
    trl = dict(tensor_parallel_size=1, gpu_memory_utilization=0.3, max_model_len=512,
               max_num_seqs=64, enable_sleep_mode=True, model_impl="vllm",
               distributed_executor_backend="external_launcher", seed=0,
               max_num_batched_tokens=4096, logprobs_mode="processed_logprobs",
               quantization=None, trust_remote_code=True)
    verl = dict(enable_sleep_mode=True, tensor_parallel_size=1, distributed_executor_backend=None,
                enforce_eager=True, disable_custom_all_reduce=True, skip_tokenizer_init=False,
                enable_chunked_prefill=False, enable_prefix_caching=True, disable_log_stats=True,
                max_logprobs=1, swap_space=0, load_format="safetensors", kv_cache_dtype="auto",
                pipeline_parallel_size=1, data_parallel_size=1, max_seq_len_to_capture=8192,
                cpu_offload_gb=0, enable_lora=False, revision=None, worker_extension_cls=None)
    for extra in (trl, verl):
        kw = {**KW, **extra}
        llm = LLM(str(tiny), dtype="float32", **kw)
        assert ids(llm) == want
    assert llm.enable_prefix_caching is True
    assert LLM(str(tiny), dtype="float32", enable_prefix_caching=False,
               **KW).enable_prefix_caching is False
    assert LLM(str(tiny), dtype="float32", **KW).enable_prefix_caching is True  # the default


@pytest.mark.parametrize("kw, msg", [
    ({"tensor_parallel_size": 2}, r"tensor_parallel_size=2\): specengine runs the whole model "
                                  r"in one process"),
    ({"pipeline_parallel_size": 4}, "only 1 is supported"),
    ({"tensor_parallel_size": 0}, "must be an int >= 1"),
    ({"gpu_memory_utilization": 1.5}, r"must be a fraction in \(0, 1\]"),
    ({"enable_sleep_mode": "yes"}, "must be True or False"),
    ({"distributed_executor_backend": "ray"}, "runs in the calling process"),
    ({"distributed_executor_backend": "mp"}, "multiprocessing executor is not available"),
    ({"quantization": "awq"}, "quantized kernels are not supported"),
    ({"worker_extension_cls": "trl.scripts.vllm_serve.WeightSyncWorkerExtension"},
     "no worker processes to extend"),
    ({"model_impl": "transformers"}, "specengine's own decoder runs the model"),
    ({"load_format": "pt"}, r"use one of \['auto', 'safetensors', 'dummy'\]"),
    ({"kv_cache_dtype": "fp8"}, "KV cache is kept in the model dtype"),
    ({"cpu_offload_gb": 4}, "weight offloading during generation is not supported"),
    ({"enable_lora": True}, "LoRA adapters are not supported"),
    ({"revision": "main"}, "no revision to choose"),
    ({"max_logprobs": -2}, "must be an int >= -1"),
    ({"swap_space": -1}, "must be a number >= 0"),
    ({"offload_dir": "/nonexistent/dir"}, "not an existing directory"),
])
def test_refused_with_a_reason(tiny, kw, msg):
    with pytest.raises(ValueError, match=msg):
        LLM(str(tiny), dtype="float32", **KW, **kw)


def test_unknown_keyword_lists_the_accepted_ones(tiny):
    with pytest.raises(ValueError, match=r"unknown keyword arguments \['gpu_mem_util', 'zzz'\]; "
                                         r"accepted: the LLM parameters \(model, dtype.*"
                                         r"'tensor_parallel_size'.*'enable_sleep_mode'"):
        LLM(str(tiny), zzz=1, gpu_mem_util=0.5)
    assert "enable_prefix_caching" in NAMES
    assert parse_engine_args({}).max_logprobs == 20


def test_max_logprobs(tiny):
    llm = LLM(str(tiny), dtype="float32", **KW)
    with pytest.raises(ValueError, match=r"prompt 1: logprobs=21 is above max_logprobs=20"):
        llm.generate([[1, 2], [3, 4]], [GREEDY, SamplingParams(max_tokens=2, logprobs=21)],
                     use_tqdm=False)
    out = LLM(str(tiny), dtype="float32", max_logprobs=-1, **KW).generate(
        [[1, 2]], SamplingParams(max_tokens=2, logprobs=30), use_tqdm=False)
    assert len(out[0].outputs[0].logprobs[0]) >= 30


def test_load_format_dummy_then_push_the_real_weights(tiny):
    real = LLM(str(tiny), dtype="float32", **KW)
    dummy = LLM(str(tiny), dtype="float32", load_format="dummy", **KW)
    a = real.engine.runner.model.hf_parameters()
    b = dummy.engine.runner.model.hf_parameters()
    assert set(a) == set(b) and not torch.equal(a["model.norm.weight"], b["model.norm.weight"])
    dummy.update_weights(dict(iter_safetensors(safetensors_files(tiny))))
    assert ids(dummy) == ids(real)


def test_skip_tokenizer_init(tiny_llama_tok_dir):
    with_tok = LLM(str(tiny_llama_tok_dir), dtype="float32", **KW)
    llm = LLM(str(tiny_llama_tok_dir), dtype="float32", skip_tokenizer_init=True, **KW)
    assert llm.get_tokenizer() is None and with_tok.get_tokenizer() is not None
    assert llm.engine.output.eos_token_ids == with_tok.engine.output.eos_token_ids
    with pytest.raises(ValueError, match="prompt 0 is text but the model has no tokenizer"):
        llm.generate("hello", use_tqdm=False)
    prompt = with_tok.get_tokenizer()("hello there").input_ids
    a = llm.generate([prompt], GREEDY, use_tqdm=False)[0].outputs[0]
    b = with_tok.generate([prompt], GREEDY, use_tqdm=False)[0].outputs[0]
    assert a.token_ids == b.token_ids and a.text == "" and b.text


def test_vllm_dtype_names(tiny, tmp_path):
    assert LLM(str(tiny), dtype="auto", **KW).engine.runner.model.dtype == torch.bfloat16
    assert LLM(str(tiny), dtype="float", **KW).engine.runner.model.dtype == torch.float32
    half = save_random_model(tmp_path / "h", {"num_hidden_layers": 1, "torch_dtype": "float16"})
    assert LLM(str(half), dtype="auto", **KW).engine.runner.model.dtype == torch.float16
    with pytest.raises(ValueError, match="dtype 'fp64' is not supported"):
        LLM(str(tiny), dtype="fp64", **KW)
