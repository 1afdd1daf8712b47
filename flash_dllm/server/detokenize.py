"""Incremental detokenisation of a growing committed prefix, never splitting a UTF-8 character."""
from __future__ import annotations

from typing import Callable

REPLACEMENT = "\ufffd"   # what decoders emit for an incomplete UTF-8 sequence


class IncrementalDetokenizer:
    """Turns successive committed-prefix id lists into text deltas.

    Each call decodes the whole prefix and emits only the text past what was already emitted. A
    trailing U+FFFD (byte-level BPE tokens that end inside a multi-byte character) is held back
    until a later token completes the character, or until the final call.

    NOTE: the id lists must only grow (the engine's committed prefix never changes once emitted), so
    with a prefix-stable decoder the deltas concatenate exactly to ``decode(final ids)``. If a
    decoder ever rewrites earlier text, emitted text still never changes: only the part past the
    emitted length is sent.
    """

    def __init__(self, decode: Callable[[list[int]], str]) -> None:
        self._decode = decode
        self._n_ids = 0
        self.text = ""        # everything emitted so far

    def step(self, ids: list[int], final: bool = False) -> str:
        """New text for the prefix ``ids`` (which extends the previous call's ids)."""
        if len(ids) < self._n_ids:
            raise ValueError(f"committed prefix shrank from {self._n_ids} to {len(ids)} ids")
        if len(ids) == self._n_ids and not final:
            return ""
        self._n_ids = len(ids)
        full = self._decode(list(ids))
        if not final:
            full = full.rstrip(REPLACEMENT)
        if len(full) <= len(self.text):
            return ""
        delta = full[len(self.text):]
        self.text += delta
        return delta
