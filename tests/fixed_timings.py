"""Fixed timings for tests of code that measures itself: a fake clock, and a runner and a
drafter that "take" a fixed number of its seconds per call, so what fits a time budget and
what a latency fit sees are known exactly, whatever the machine's load."""


class FakeClock:
    """A seconds clock (pass it where ``time.perf_counter`` is the default) that moves by
    ``tick`` seconds at each read and by what it is told to (``advance``), nothing else."""

    def __init__(self, tick: float = 0.0):
        self.now, self.tick = 0.0, tick

    def __call__(self) -> float:
        now = self.now
        self.now += self.tick
        return now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def forward_seconds(tokens: int, context: int) -> float:
    """What a ``TimedRunner`` forward of ``tokens`` tokens over ``context`` KV positions
    takes: 2 ms + 10 us per token + 10 ns per context position."""
    return 2e-3 + 1e-5 * tokens + 1e-8 * context


def draft_seconds(batch: int, depth: int, nodes: int) -> float:
    """What a ``TimedDrafter`` call drafting ``nodes`` nodes for ``batch`` sequences to
    ``depth`` takes: 100 us + 100 us per step of depth and sequence + 10 us per node."""
    return 1e-4 + 1e-4 * depth * batch + 1e-5 * nodes


class TimedRunner:
    """``runner`` (a ``ModelRunner``) whose ``run`` advances ``clock`` by ``forward_seconds``
    of its batch (``scale`` times that); it counts its forwards in ``calls``."""

    def __init__(self, runner, clock: FakeClock, scale: float = 1.0):
        self.runner, self.clock, self.scale, self.calls = runner, clock, scale, 0

    def run(self, entries, blocks):
        out = self.runner.run(entries, blocks)
        tokens = sum(e.num_new + (e.tree.num_nodes if e.tree else 0) for e in entries)
        context = sum(e.seq.num_cached for e in entries)
        self.clock.advance(self.scale * forward_seconds(tokens, context))
        self.calls += 1
        return out


class TimedDrafter:
    """``drafter`` (a ``Drafter``) whose ``propose`` advances ``clock`` by ``draft_seconds``
    of the trees drafted (``scale`` times that); the rest is the drafter's own."""

    def __init__(self, drafter, clock: FakeClock, scale: float = 1.0):
        self.drafter, self.clock, self.scale = drafter, clock, scale

    def __getattr__(self, name):
        return getattr(self.drafter, name)

    def propose(self, seqs, strategy):
        trees = self.drafter.propose(seqs, strategy)
        nodes = sum(t.num_nodes for t in trees if t is not None)
        self.clock.advance(self.scale * draft_seconds(len(seqs), strategy.depth, nodes))
        return trees
