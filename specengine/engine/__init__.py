"""The runtime: the step loop (``engine.Engine``), what it schedules, runs and returns."""
