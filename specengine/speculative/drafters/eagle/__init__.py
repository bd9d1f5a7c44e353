"""EAGLE feature drafter (EAGLE arXiv 2401.15077, EAGLE-2 arXiv 2406.16858, EAGLE-3 arXiv
2503.01840, FR-Spec arXiv 2502.14856), in three parts:

- ``model``: the network (``EagleConfig``, ``EagleModel``) and the target identity a drafter
  records (``target_identity``, ``tokenizer_hash``);
- ``checkpoint``: checkpoint directories (``save_drafter``, ``read_config``, ``load_drafter``,
  ``load_state``, ``shipped_drafter``);
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
)
from specengine.speculative.drafters.eagle.drafter import EagleDrafter, make_eagle
from specengine.speculative.drafters.eagle.model import (
    LAYER_KEYS,
    EagleConfig,
    EagleModel,
    target_identity,
    tokenizer_hash,
)

__all__ = ["DRAFTERS_DIR", "FORMAT", "LAYER_KEYS", "EagleConfig", "EagleDrafter", "EagleModel",
           "load_drafter", "load_state", "make_eagle", "read_config", "save_drafter",
           "shipped_drafter", "target_identity", "tokenizer_hash"]
