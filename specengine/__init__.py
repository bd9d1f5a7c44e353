"""specengine: lossless adaptive speculative decoding for LLM rollouts.

    from specengine import LLM, SamplingParams
    llm = LLM("smollm2-135m-instruct")
    outs = llm.generate(["1+1="], SamplingParams(temperature=0, max_tokens=8))
"""

from specengine.api import LLM
from specengine.engine.outputs import (
           CompletionOutput,
           RequestOutput,
           ScoreOutput,
           continuation_prompts,
)
from specengine.engine.sequence import Logprob
from specengine.sampling.params import SamplingParams

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "ScoreOutput", "Logprob",
           "continuation_prompts"]
__version__ = "0.1.0"
