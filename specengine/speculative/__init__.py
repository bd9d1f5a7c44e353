"""Speculative decoding: draft a token tree per sequence, verify it in one target forward.

Four areas, each a folder or a pair of modules:

- the token tree: ``tree.py`` (``DraftTree``, the tree and its attention mask); the tree is
  verified by ``specengine.sampling.verify`` (accepted path plus bonus token), which
  ``Sampler.verify_trees`` runs;
- ``drafters/``: who proposes the tree (``Drafter`` in ``base.py``; n-gram prompt lookup, an
  independent draft model, the EAGLE feature drafter);
- ``policy/``: which ``Strategy`` (tree shape, or none) each step runs and which nodes are
  worth verifying (static, auto from online latency/acceptance models, TLT's bandit);
- ``training/``: training the EAGLE drafter from the target's hidden states (harvest, fit,
  online training while the engine serves).

``config.py`` holds ``SpeculativeConfig`` (the user's ``speculative_config`` dict) and
``strategy.py`` the ``Strategy`` shape shared by drafters and policies.
"""
