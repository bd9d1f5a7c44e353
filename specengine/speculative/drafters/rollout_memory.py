"""Rollout memory: per prompt group, the tokens RL rollouts produce, indexed for suffix matching.

A *group* is every sample of one prompt: the ``n`` samples of one request and separate
requests with the same prompt token ids (as verl and TRL send a GRPO group), keyed by a hash
of the prompt's tokens. A group holds *documents* (token arrays):

- the prompt itself (once per group);
- one *live* document per in-flight sample: its response so far, caught up incrementally
  (``sync``); the sample's own document is one of them;
- *history*: responses of earlier calls that finished (``stop``/``length``), tagged with the
  weight version that produced them. Each weight update (``set_version``) weighs them down by
  ``decay`` per version of age and drops those older than ``max_age`` versions.

Index (the lookup never scans a group): for each n in ``INDEX_NS`` a dict from the hash of an
n-gram to the position code of its most recent occurrence, and per document an int64 array
``prev[j, pos]`` with the previous occurrence of the same n-gram (a linked chain, most recent
first). Appending a token costs O(len(INDEX_NS)); a lookup walks at most ``max_matches``
occurrences (up to 4x that many chain links) of the longest indexed n-gram that ends the query
and, backing off, of the shorter ones. Hash collisions between
different n-grams only make a draft worse, never an output different (verification is exact).

Memory (bytes, accounted as allocated, never above ``cap_bytes`` once a call returns):
numpy ``nbytes`` of each document's arrays (capacity, not length) plus ``DOC_BYTES`` per
document, ``sys.getsizeof`` of each index dict plus ``KEY_BYTES`` per key (its int key and int
value objects), plus ``GROUP_BYTES`` per group. Not counted: the map from in-flight samples to
their documents (one entry per running sample, not growing with the memory). Groups are
evicted least-recently-used (touched when a sample starts or looks up in them); a live sample
of an evicted group is detached (it drafts nothing more and adds nothing). At the default
indexing (n in 1, 2, 4) a finished response costs ~200-230 bytes per token, so 256 MiB hold
about a million tokens.

SuffixDecoding (Oliaro et al., arXiv 2411.04975) keeps a suffix tree per request plus a global
one over earlier outputs; this memory keeps the same sources per prompt group, and adds the
in-flight siblings and the weight version tags that RL rollouts need.
"""

from __future__ import annotations

import sys
from collections import OrderedDict

import numpy as np

# n-gram lengths indexed; a lookup tries the longest first. Adding 8 (or 3, 6, 16) drafted no
# better on recorded T = 1 GSM rollouts of the default model and cost 35-150% more memory.
INDEX_NS = (1, 2, 4)
CONTEXT = max(INDEX_NS) - 1  # prompt tokens kept before a response (n-grams spanning both)
KEY_BYTES = 72  # per index key: its int key object and int value object (36 bytes each)
DOC_BYTES = 320  # per document: the object (slots), two numpy array headers, list slot
GROUP_BYTES = 1024  # per group: the object, its lists and dicts when empty, the LRU entry
_SHIFT = 32
_MASK = (1 << _SHIFT) - 1


class Doc:
    """One document of a group: ``tokens[:length]`` int32, n-grams indexed from ``start``.

    ``version`` is None while live (a sample in flight), else the weight version that
    produced it; ``weight`` is its continuation weight (0: dead, skipped until compaction).
    """

    __slots__ = ("idx", "tokens", "prev", "length", "start", "version", "weight")

    def __init__(self, idx: int, capacity: int, start: int):
        self.idx = idx
        self.tokens = np.empty(capacity, dtype=np.int32)
        self.prev = np.empty((len(INDEX_NS), capacity), dtype=np.int64)
        self.length = 0
        self.start = start
        self.version: int | None = None
        self.weight = 1.0

    @property
    def nbytes(self) -> int:
        """Bytes held by this document (arrays by capacity, plus ``DOC_BYTES``)."""
        return self.tokens.nbytes + self.prev.nbytes + DOC_BYTES

    def trim(self) -> None:
        """Shrink the arrays to ``length`` (a finished document no longer grows)."""
        if len(self.tokens) > self.length:
            self.tokens = self.tokens[:self.length].copy()
            self.prev = self.prev[:, :self.length].copy()

    def reserve(self, n: int) -> None:
        """Room for ``n`` tokens in all (capacity doubles)."""
        cap = len(self.tokens)
        if n <= cap:
            return
        cap = max(n, 2 * cap)
        tokens = np.empty(cap, dtype=np.int32)
        tokens[:self.length] = self.tokens[:self.length]
        prev = np.empty((len(INDEX_NS), cap), dtype=np.int64)
        prev[:, :self.length] = self.prev[:, :self.length]
        self.tokens, self.prev = tokens, prev


class Group:
    """The documents of one prompt and their n-gram index (see the module docstring)."""

    def __init__(self, prompt: list[int]):
        self.docs: list[Doc] = []
        self.heads: list[dict[int, int]] = [{} for _ in INDEX_NS]
        self.num_keys = 0
        self.num_live = 0
        self.dead_tokens = 0
        self.doc_bytes = 0
        self.bytes = 0
        self.prompt = self.add_doc(prompt, start=0, capacity=max(len(prompt), 1))
        self.prompt.version = -1  # never live, never aged
        self.recount()

    @property
    def num_tokens(self) -> int:
        """Tokens held in all documents (a response's prompt context included)."""
        return sum(d.length for d in self.docs)

    def add_doc(self, tokens: list[int], start: int, capacity: int | None = None) -> Doc:
        """A new live document holding ``tokens`` (n-grams ending at ``>= start`` indexed),
        with room for ``capacity`` tokens (default: twice as many, at least 64)."""
        doc = Doc(len(self.docs), capacity or max(64, 2 * len(tokens)), start)
        self.docs.append(doc)
        self.doc_bytes += doc.nbytes
        self.append(doc, tokens)
        return doc

    def append(self, doc: Doc, new: list[int]) -> None:
        """Append ``new`` tokens to ``doc`` and index the n-grams they end (O(len(new) *
        len(INDEX_NS)) dict and array operations)."""
        k = len(new)
        if not k:
            return
        length = doc.length
        before = doc.nbytes
        doc.reserve(length + k)
        self.doc_bytes += doc.nbytes - before
        doc.tokens[length:length + k] = new
        lead = min(length, CONTEXT)
        window = doc.tokens[length - lead:length].tolist() + list(new)
        base = doc.idx << _SHIFT
        prev, heads, start = doc.prev, self.heads, doc.start
        for i in range(k):
            p = length + i
            w = lead + i  # index of token p in window
            if p < start:
                prev[:, p] = -1
                continue
            for j, n in enumerate(INDEX_NS):
                if n > w + 1:
                    prev[j:, p] = -1
                    break
                key = window[w] if n == 1 else hash(tuple(window[w - n + 1:w + 1]))
                head = heads[j]
                old = head.get(key)
                if old is None:
                    self.num_keys += 1
                    old = -1
                prev[j, p] = old
                head[key] = base | p
        doc.length = length + k
        self.recount()

    def recount(self) -> None:
        self.bytes = (GROUP_BYTES + self.doc_bytes + KEY_BYTES * self.num_keys
                      + sum(sys.getsizeof(h) for h in self.heads))

    def continuations(self, tail: list[int], depth: int, max_matches: int,
                      backoff: float = 0.0) -> tuple[int, list[tuple[float, list[int]]]]:
        """Continuations of the most recent occurrences of the longest indexed n-gram
        (``n`` in ``INDEX_NS``) that ends ``tail``; with ``backoff`` > 0, also those of the
        shorter indexed n-grams (occurrences not already taken), their weights multiplied by
        ``backoff`` per level shorter.

        Returns:
            ``(n, [(weight, tokens), ...])``: the longest match length and up to
            ``max_matches`` continuations (each 1..``depth`` tokens, longest match first, then
            most recent first, weighted by their document's weight); ``(0, [])`` when nothing
            matches.
        """
        out: list[tuple[float, list[int]]] = []
        seen: set[int] = set()
        found, scale = 0, 1.0
        docs, limit = self.docs, 4 * max_matches
        for j in range(len(INDEX_NS) - 1, -1, -1):
            n = INDEX_NS[j]
            if n > len(tail):
                continue
            key = tail[-1] if n == 1 else hash(tuple(tail[-n:]))
            code = self.heads[j].get(key, -1)
            steps = 0
            while code >= 0 and len(out) < max_matches and steps < limit:
                steps += 1
                doc = docs[code >> _SHIFT]
                pos = code & _MASK
                length = doc.length
                if doc.weight > 0.0 and pos + 1 < length and code not in seen:
                    seen.add(code)
                    end = pos + 1 + depth
                    out.append((doc.weight * scale,
                                doc.tokens[pos + 1:end if end < length else length].tolist()))
                code = doc.prev.item(j, pos)
            if out and not found:
                found = n
            if found:
                if backoff <= 0.0 or len(out) >= max_matches:
                    break
                scale *= backoff
        return found, out

    def compact(self) -> None:
        """Drop dead documents and rebuild the index from the others (O(tokens kept)); the
        kept ``Doc`` objects stay the same objects (live handles keep pointing at them)."""
        keep = [d for d in self.docs if d.weight > 0.0 or d.version is None]
        self.docs, self.heads, self.num_keys = [], [{} for _ in INDEX_NS], 0
        self.dead_tokens = 0
        for d in keep:
            tokens = d.tokens[:d.length].tolist()
            d.idx, d.length = len(self.docs), 0
            self.docs.append(d)
            self.append(d, tokens)
        self.doc_bytes = sum(d.nbytes for d in self.docs)
        self.recount()


def prompt_key(prompt: list[int]) -> tuple[int, int]:
    """Group key of a prompt: ``(length, hash of its token ids)``."""
    return len(prompt), hash(tuple(prompt))


class RolloutMemory:
    """Prompt groups of rollout tokens under a byte cap (see the module docstring).

    Samples are named by a hashable ``handle`` (the engine's ``seq_id``).

    Args:
        cap_bytes: most bytes held (>= 1); LRU groups are evicted beyond it.
        decay: weight factor per weight version of age of a history response, in (0, 1].
        max_age: history older than this many weight versions is dropped (>= 0).
        max_matches: most occurrences whose continuations one lookup returns (>= 1).
        backoff: weight factor per level for the occurrences of shorter indexed n-grams, in
            [0, 1] (0: the longest match only, as SuffixDecoding; see ``Group.continuations``).

    Raises:
        ValueError: an argument out of range, naming it.
    """

    def __init__(self, cap_bytes: int = 256 << 20, decay: float = 0.5, max_age: int = 4,
                 max_matches: int = 32, backoff: float = 0.5):
        if not isinstance(cap_bytes, int) or cap_bytes < 1:
            raise ValueError(f"RolloutMemory.cap_bytes={cap_bytes!r}: must be an int >= 1")
        if not 0.0 < decay <= 1.0:
            raise ValueError(f"RolloutMemory.decay={decay!r}: must be in (0, 1]")
        if not isinstance(max_age, int) or max_age < 0:
            raise ValueError(f"RolloutMemory.max_age={max_age!r}: must be an int >= 0")
        if not isinstance(max_matches, int) or max_matches < 1:
            raise ValueError(f"RolloutMemory.max_matches={max_matches!r}: must be an int >= 1")
        if not 0.0 <= backoff <= 1.0:
            raise ValueError(f"RolloutMemory.backoff={backoff!r}: must be in [0, 1]")
        self.cap_bytes, self.decay, self.max_age = cap_bytes, decay, max_age
        self.max_matches, self.backoff = max_matches, backoff
        self.version = 0
        self.groups: OrderedDict[tuple[int, int], Group] = OrderedDict()
        self.bytes = 0
        self.evictions = 0  # groups evicted for room
        self._live: dict[object, tuple[tuple[int, int], Doc]] = {}
        self._detached: set[object] = set()

    # ---- groups -----------------------------------------------------------------------------
    def _group(self, prompt: list[int], create: bool) -> tuple[tuple[int, int], Group | None]:
        key = prompt_key(prompt)
        g = self.groups.get(key)
        if g is not None:
            p = g.prompt
            if p.length != len(prompt) or not np.array_equal(p.tokens[:p.length], prompt):
                return key, None  # a hash collision: this prompt gets no group
            self.groups.move_to_end(key)
        elif create:
            g = self.groups[key] = Group(list(prompt))
            self.bytes += g.bytes
        return key, g

    def _grow(self, g: Group, doc: Doc, new: list[int]) -> None:
        before = g.bytes
        g.append(doc, new)
        self.bytes += g.bytes - before

    def _evict(self) -> None:
        """Evict least-recently-used groups until the bytes held fit the cap."""
        while self.bytes > self.cap_bytes and self.groups:
            key, g = self.groups.popitem(last=False)
            self.bytes -= g.bytes
            self.evictions += 1
            if g.num_live:
                for h in [h for h, (k, _) in self._live.items() if k == key]:
                    del self._live[h]
                    self._detached.add(h)

    def group_of(self, prompt: list[int]) -> Group | None:
        """The group of ``prompt`` if held (does not count as a use)."""
        g = self.groups.get(prompt_key(prompt))
        if g is None or g.prompt.length != len(prompt):
            return None
        return g

    # ---- samples ----------------------------------------------------------------------------
    def is_tracked(self, handle: object) -> bool:
        """True while ``handle`` has a live document (False after detaching or finishing)."""
        return handle in self._live

    def start(self, handle: object, token_ids: list[int], num_prompt: int) -> bool:
        """Open a live document for sample ``handle`` of prompt ``token_ids[:num_prompt]``
        holding its output so far ``token_ids[num_prompt:]``. Returns False (nothing added)
        when ``handle`` is already tracked or was detached by an eviction."""
        if handle in self._live or handle in self._detached:
            return False
        key, g = self._group(token_ids[:num_prompt], create=True)
        if g is None:
            self._detached.add(handle)
            return False
        ctx = min(num_prompt, CONTEXT)
        before = g.bytes
        doc = g.add_doc(token_ids[num_prompt - ctx:], start=ctx)
        self.bytes += g.bytes - before
        g.num_live += 1
        self._live[handle] = (key, doc)
        self._evict()
        return True

    def sync(self, handle: object, token_ids: list[int]) -> None:
        """Catch ``handle``'s live document up with ``token_ids`` (its prompt + output):
        append the tokens it does not hold yet (O(new tokens))."""
        entry = self._live.get(handle)
        if entry is None:
            return
        key, doc = entry
        g = self.groups[key]
        held = g.prompt.length - doc.start + doc.length  # prompt + output tokens held
        if len(token_ids) > held:
            self._grow(g, doc, token_ids[held:])
            self._evict()

    def finish(self, handle: object, keep: bool) -> None:
        """``handle``'s sample finished: with ``keep``, its document becomes history tagged
        with the current weight version (its arrays trimmed to its length); otherwise
        (aborted) it is dropped: skipped at once, its memory freed when more than half of the
        group's tokens are dead (compaction), and the group dropped when it holds no live or
        finished response any more."""
        self._detached.discard(handle)
        entry = self._live.pop(handle, None)
        if entry is None:
            return
        key, doc = entry
        g = self.groups[key]
        g.num_live -= 1
        if keep:
            doc.version, doc.weight = self.version, 1.0
            before = doc.nbytes
            doc.trim()
            g.doc_bytes += doc.nbytes - before
            self.bytes -= g.bytes
            g.recount()
            self.bytes += g.bytes
            return
        doc.version, doc.weight = -2, 0.0  # dead: skipped, then compacted away
        g.dead_tokens += doc.length
        if not g.num_live and all(d.version is not None and d.version < 0 for d in g.docs):
            del self.groups[key]  # no response left, only the prompt: not worth keeping
            self.bytes -= g.bytes
        elif 2 * g.dead_tokens > g.num_tokens:
            before = g.bytes
            g.compact()
            self.bytes += g.bytes - before

    def add_finished(self, token_ids: list[int], num_prompt: int) -> None:
        """Add a finished response that was never tracked live as history of the current
        weight version."""
        if self.start(_Once, token_ids, num_prompt):
            self.finish(_Once, keep=True)

    def lookup(self, handle: object, tail: list[int], depth: int
               ) -> tuple[int, list[tuple[float, list[int]]]]:
        """``Group.continuations`` of ``tail`` (the sample's last tokens, up to
        ``max(INDEX_NS)``) in ``handle``'s group; ``(0, [])`` when untracked."""
        entry = self._live.get(handle)
        if entry is None:
            return 0, []
        self.groups.move_to_end(entry[0])
        return self.groups[entry[0]].continuations(tail, depth, self.max_matches,
                                                  self.backoff)

    # ---- weight versions ----------------------------------------------------------------------
    def set_version(self, version: int) -> None:
        """The target's weights are now ``version``: history is reweighted to
        ``decay ** (version - its version)`` and history older than ``max_age`` versions is
        dropped (its groups compacted; a group left with only its prompt is dropped)."""
        self.version = version
        for key in list(self.groups):
            g = self.groups[key]
            dropped = False
            for d in g.docs:
                if d.version is None or d.version < 0:
                    continue
                age = max(version - d.version, 0)
                if age > self.max_age:
                    d.weight, d.version, dropped = 0.0, -2, True
                else:
                    d.weight = self.decay ** age
            if not dropped:
                continue
            if len(g.docs) == 1 + sum(d.version == -2 for d in g.docs) and not g.num_live:
                del self.groups[key]
                self.bytes -= g.bytes
                continue
            before = g.bytes
            g.compact()
            self.bytes += g.bytes - before

    # ---- metrics ----------------------------------------------------------------------------
    def stats(self) -> dict:
        """``rollout_memory_bytes`` / ``_cap_bytes`` / ``_groups`` / ``_tokens`` /
        ``_history`` (finished responses held) / ``_live`` / ``_evictions``."""
        return {"rollout_memory_bytes": self.bytes,
                "rollout_memory_cap_bytes": self.cap_bytes,
                "rollout_memory_groups": len(self.groups),
                "rollout_memory_tokens": sum(g.num_tokens for g in self.groups.values()),
                "rollout_memory_history": sum(d.version is not None and d.version >= 0
                                              for g in self.groups.values() for d in g.docs),
                "rollout_memory_live": len(self._live),
                "rollout_memory_evictions": self.evictions}


_Once = object()  # handle of a response added at once by ``add_finished``
