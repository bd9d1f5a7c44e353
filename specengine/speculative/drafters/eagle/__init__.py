"""EAGLE feature drafter (EAGLE arXiv 2401.15077, EAGLE-2 arXiv 2406.16858, EAGLE-3 arXiv
2503.01840, FR-Spec arXiv 2502.14856), in three parts:

- ``model``: the network (``EagleConfig``, ``EagleModel``);
- ``identity``: the target identity a drafter records and how it is matched
  (``target_identity``, ``tokenizer_hash``, ``weight_sketch``, ``match_target``);
- ``checkpoint``: checkpoint directories (``save_drafter``, ``read_config``, ``load_drafter``,
  ``load_state``, ``shipped_drafter(s)``);
- ``drafter``: drafting in the engine (``EagleDrafter``, ``make_eagle``).

Training lives in ``specengine.speculative.training``.
"""

from specengine.speculative.drafters.eagle.checkpoint import (
    DRAFTERS_DIR,
    FORMAT,
    load_drafter,
    load_state,
    read_config,
    save_drafter,
    shipped_drafter,
    shipped_drafters,
)
from specengine.speculative.drafters.eagle.drafter import EagleDrafter, make_eagle
from specengine.speculative.drafters.eagle.identity import (
    match_target,
    target_identity,
    tokenizer_hash,
    weight_sketch,
)
from specengine.speculative.drafters.eagle.model import LAYER_KEYS, EagleConfig, EagleModel

__all__ = ["DRAFTERS_DIR", "FORMAT", "LAYER_KEYS", "EagleConfig", "EagleDrafter", "EagleModel",
           "load_drafter", "load_state", "make_eagle", "read_config", "save_drafter",
           "match_target", "shipped_drafter", "shipped_drafters", "target_identity",
           "tokenizer_hash", "weight_sketch"]
