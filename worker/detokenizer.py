"""Incremental detokenizer: turns a growing stream of token ids into text deltas.

A token is a run of bytes, not of characters: a byte-level BPE token can end inside a multi-byte UTF-8
sequence (an emoji is often 2-4 tokens). So bytes go through Python's incremental UTF-8 decoder, which
holds back an incomplete tail until the next bytes complete it and replaces with U+FFFD only bytes that
can no longer start or continue a valid sequence. It replaces exactly as bytes.decode(errors="replace")
does on the whole stream, so the deltas concatenate to tokenizer.decode(all ids). Cost per push is
O(bytes of the new tokens); no history is re-decoded.
"""

from __future__ import annotations

import codecs
from typing import Iterable

from worker.tokenizer import Tokenizer


class IncrementalDetokenizer:
    """push(ids) -> newly completed text; flush() -> whatever the end of the stream leaves.

    skip_special: hide control/unknown tokens (as tokenizer.decode(skip_special=True)).
    strip_space_prefix: the ids start the text (not a continuation of a prompt), so for SPM vocabularies
    with a space prefix the first non-special token loses one leading space, as in tokenizer.decode.
    Leave it False when streaming a completion: its first token's leading space is real text.
    """

    def __init__(self, tokenizer: Tokenizer, *, skip_special: bool = True, strip_space_prefix: bool = False):
        self._tok = tokenizer
        self._skip_special = skip_special
        self._strip_pending = strip_space_prefix and tokenizer.add_space_prefix
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def push(self, ids: Iterable[int]) -> str:
        tok = self._tok
        chunks = []
        for i in ids:
            if self._skip_special and tok.is_special(i):
                continue
            b = tok.token_bytes(i)     # range-checks the id
            if self._strip_pending and not tok.is_special(i):
                self._strip_pending = False
                if b.startswith(b" "):
                    b = b[1:]
            chunks.append(b)
        if not chunks:
            return ""
        return self._decoder.decode(b"".join(chunks))

    def flush(self) -> str:
        """End of stream: an incomplete UTF-8 tail becomes U+FFFD. The detokenizer can be reused after."""
        return self._decoder.decode(b"", final=True)
