"""Incremental detokenization and stop strings, one `SequenceText` per generated sequence.

Text grows only by complete characters: a token that ends inside a multi-byte character (the
decoded text ends in U+FFFD) is held until the character completes; `flush()` at the end of the
sequence releases what is still held, so the streamed pieces always join to the full decode. A
few prompt tokens serve as left context so tokenizers that drop a leading space on the first
token still decode right.

Held ids are re-decoded every step, so their number is bounded: past `_MAX_HELD_IDS` (only an
output that stops making text does that: bytes that never complete a character, ids that
decode to nothing) ids that make no text are left out of the window, and the settled part is
committed, keeping the last `_OPEN_IDS` ids held (enough bytes to end any incomplete
character), each step only when the decode of the window is unchanged by it, so the text
stays the full decode.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

_CONTEXT_TOKENS = 5
_REPLACEMENT = "\ufffd"
_MAX_HELD_IDS = 16  # held ids (not yet in `text`) re-decoded each step before bounding them
_OPEN_IDS = 4  # trailing ids kept held when bounding: a character spans at most 4 bytes


class SequenceText:
    """Text of one sequence's output, stop-string aware.

    `append(new_ids)` returns the newly visible text; `flush()` the held rest once no more ids
    come. After a stop string matched, `stopped_by` holds it and `text` ends right before it
    (or after it with include_stop_str_in_output). `text` is everything decoded so far; what
    `append` returns may lag it: while stop strings are set (and not included in the output),
    the last (longest stop string - 1) characters are held back, since a stop string starting
    there would cut them; a match returns only the text before it, `flush()` the held rest.
    Stop strings are looked for only once more than `min_tokens` ids were appended (a match
    must end in text decoded after the first `min_tokens` ids, as vLLM). The returned pieces
    always join to the final `text`.
    """

    def __init__(
        self,
        tokenizer: Any,
        prompt_ids: Sequence[int],
        stop: Sequence[str] = (),
        include_stop_str: bool = False,
        skip_special_tokens: bool = True,
        min_tokens: int = 0,
    ) -> None:
        self._tokenizer = tokenizer
        self._ids = list(prompt_ids[-_CONTEXT_TOKENS:])
        self._prefix = 0  # first id of the decode window
        self._read = len(self._ids)  # ids before this are already in `text`
        self._stop = tuple(s for s in stop if s)
        self._include_stop = include_stop_str
        self._skip_special = skip_special_tokens
        self._min_tokens = min_tokens
        self._generated = 0  # ids appended so far
        self._longest = max((len(s) for s in self._stop), default=0)
        self._hold = 0 if include_stop_str else max(0, self._longest - 1)
        self._sent = 0  # characters of `text` returned so far
        self.text = ""
        self.stopped_by: str | None = None

    def append(self, new_ids: Sequence[int]) -> str:
        """Add generated ids; return the text they made visible (possibly empty)."""
        if self._tokenizer is None or self.stopped_by is not None:
            return ""
        self._ids.extend(new_ids)
        self._generated += len(new_ids)
        self._advance(final=False)
        return self._release(final=False)

    def flush(self) -> str:
        """The text still held at the end of the sequence (an incomplete character shows as
        U+FFFD, held-back characters come out); afterwards `text` is the full decode (up to a
        stop string) and every piece returned joins to it."""
        if self._tokenizer is None or self.stopped_by is not None:
            return ""
        self._advance(final=True)
        return self._release(final=True)

    def _advance(self, final: bool) -> None:
        """Decode what the new ids complete into `text`, then look for stop strings."""
        before = self._decode(self._ids[self._prefix : self._read])
        after = self._decode(self._ids[self._prefix :])
        if len(after) <= len(before) or (after.endswith(_REPLACEMENT) and not final):
            if not final and len(self._ids) - self._read > _MAX_HELD_IDS:
                self._bound_held(before, after)
            return
        self._commit(before, after, len(self._ids))

    def _commit(self, before: str, after: str, read: int) -> None:
        """`text` grows by `after` (the decode of the window up to `read`) past `before`."""
        self._prefix, self._read = self._read, read
        start = len(self.text)
        self.text += after[len(before) :]
        if self._stop and self._generated > self._min_tokens:
            self._find_stop(max(0, start - self._longest + 1))

    def _bound_held(self, before: str, after: str) -> None:
        """Bound the held ids (re-decoded each step): leave out those that make no text, then
        commit what the ids before the last `_OPEN_IDS` decode to; each only when the
        window's decode `after` shows it changes nothing (else they stay held, as before)."""
        held = self._ids[self._read :]
        kept = [i for i in held if self._decode([i])]
        if len(kept) < len(held):
            trimmed = [*self._ids[: self._read], *kept]
            if self._decode(trimmed[self._prefix :]) == after:
                self._ids = trimmed
        split = len(self._ids) - _OPEN_IDS
        if split - self._read <= _MAX_HELD_IDS - _OPEN_IDS:
            return
        tail = self._ids[split:]
        if not all(self._decode([i]) for i in tail):
            return  # fewer than _OPEN_IDS bytes after the split: a character may still end
        settled = self._decode(self._ids[self._prefix : split])
        if (
            len(settled) > len(before)
            and settled.startswith(before)
            and settled + self._decode(tail) == after
        ):
            self._commit(before, settled, split)

    def _find_stop(self, search_from: int) -> None:
        """The earliest stop string found from `search_from` ends `text` (before it, or after
        it when included)."""
        hits = [(self.text.find(s, search_from), s) for s in self._stop]
        hits = [(pos, s) for pos, s in hits if pos >= 0]
        if not hits:
            return
        pos, stop = min(hits)
        self.stopped_by = stop
        self.text = self.text[: pos + len(stop)] if self._include_stop else self.text[:pos]

    def _release(self, final: bool) -> str:
        """The text not returned yet, less the held-back tail unless `final` or stopped."""
        end = len(self.text)
        if not final and self.stopped_by is None:
            end = max(self._sent, end - self._hold)
        piece = self.text[self._sent : end]
        self._sent = end
        return piece

    def _decode(self, ids: Sequence[int]) -> str:
        return str(self._tokenizer.decode(ids, skip_special_tokens=self._skip_special))
