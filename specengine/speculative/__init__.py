"""Speculative decoding: draft a token tree per sequence, verify it in one target forward.

Four areas, each a folder or a pair of modules:

- the lossless core: ``tree.py`` (``DraftTree``, the token tree and its attention mask) and
  ``verify.py`` (greedy and sampled verification; accepted path plus bonus token);
- ``drafters/``: who proposes the tree (``Drafter`` in ``base.py``; n-gram prompt lookup, an
  independent draft model, the EAGLE feature drafter);
- ``policy/``: which ``Strategy`` (tree shape, or none) each step runs and which nodes are
  worth verifying (static, auto from online latency/acceptance models, TLT's bandit);
- ``training/``: training the EAGLE drafter from the target's hidden states (harvest, fit,
  online training while the engine serves).

``config.py`` holds ``SpeculativeConfig`` (the user's ``speculative_config`` dict) and
``strategy.py`` the ``Strategy`` shape shared by drafters and policies.
"""
