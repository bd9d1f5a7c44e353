"""The RL lifecycle around the engine: weight updates, sleep / wake, migration of samples."""
