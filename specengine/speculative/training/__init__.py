"""Training the EAGLE drafter from the target's own hidden states (EAGLE, arXiv 2401.15077).

Harvest hidden states while the engine decodes, fit the drafter offline or online while it
serves, publish a new drafter version that the engine swaps in between steps.
"""
