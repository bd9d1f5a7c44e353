"""Training the EAGLE drafter from the target's own hidden states (EAGLE, arXiv 2401.15077).

- ``harvest``: the training data, finished sequences' token ids and target features
  (``SequenceFeatures``, ``HiddenBuffer``), harvested while the engine decodes (``Harvester``,
  ``harvest``) or from one teacher-forced forward (``teacher_force``);
- ``fit``: the loss, evaluation and optimizer steps (``TrainConfig``, ``drafter_loss``,
  ``evaluate``, ``Fitter``, ``fit``) and the reduced draft vocabulary (``reduced_vocab``);
- ``online``: training while the engine serves, publishing drafter versions that the engine
  swaps in between steps (``DrafterTrainer``);
- ``distill``: the offline self-distillation job of ``specengine train-drafter``.
"""
