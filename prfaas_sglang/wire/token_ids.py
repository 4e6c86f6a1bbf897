"""Token ids left in their JSON text: checked without parsing, parsed only as far as a reader needs (pure).

A 32K-token ``input_ids`` body is about 200 KB of JSON. Parsing it into Python ints
costs the router about 1.2 ms, checking the ints another 1 ms and packing them for the
block hashes 0.4 ms, on every request, although routing needs only the prompt's length
and the ids of the pages a prefix match reads (one page when the prompt is new). The
router forwards the client's bytes unchanged, so it never needs the rest.

:func:`split_ids` cuts the one top-level id array out of a raw body, checks it with a
few vectorised passes over its bytes, and parses everything else (small) with
``orjson``. The result, :class:`JsonIds`, knows its length at once and parses its ids
front to back on demand. Both are exact or absent: whatever they accept, the full
parse (``orjson.loads`` + ``protocol._int_list``) accepts with the same ids; whatever
they are unsure of (other whitespace, ids of 10 digits, escapes in the rest of the
body, a key written twice) returns None, and the caller takes the full parse, which
also words the error for a bad body.

"""

from __future__ import annotations

from array import array
from collections.abc import Iterator, Sequence

import numpy as np
import orjson

_COMMA, _ZERO, _NINE = np.uint8(ord(",")), np.uint8(ord("0")), np.uint8(ord("9"))
_WHITESPACE = np.zeros(256, dtype=bool)
_WHITESPACE[[ord(" "), ord("\t"), ord("\n"), ord("\r")]] = True
MAX_DIGITS = 9  # every id of at most 9 digits is <= MAX_TOKEN_ID (2**31 - 1); 10 digits go to the full parse


class JsonIds(Sequence[int]):
    """A checked JSON id array, parsed front to back as it is read; immutable.

    ``len()`` is free. :meth:`packed_prefix` parses just enough ids (the prefix match
    hashes page by page and stops at the first page no worker holds); indexing and
    iteration parse all of them, once. Built only by :func:`scan_ids`.
    """

    __slots__ = ("_text", "_count", "_parsed", "_parsed_end", "_compact", "_commas")

    def __init__(self, text: bytes, count: int, compact: bool = False):
        self._text = text
        self._count = count
        self._parsed = array("I")
        self._parsed_end = 0  # text[:_parsed_end] holds the parsed ids; it ends before a comma or at the end
        self._compact = compact  # digits and commas only (no whitespace): id k's text is found by its commas
        self._commas: np.ndarray | None = None

    @property
    def compact(self) -> bool:
        """Whether the text is digits and commas only, so :meth:`text_between` can cut it."""
        return self._compact

    def text_between(self, start: int, stop: int) -> memoryview | None:
        """The JSON text of ids ``start .. stop - 1`` (``0 <= start < stop <= len(self)``), read-only
        and uncopied, without parsing them; None unless the text is compact (digits and commas, as
        orjson and most clients write it)::

            text:   12,7,431,9,88        commas at 2, 4, 8, 10
            ids 1..3 -> text[3:10] = "7,431,9"   (after comma 0, up to comma 3)
        """
        if not self._compact:
            return None
        commas = self._commas
        need = max(start, stop if stop < self._count else 0)  # commas start - 1 and stop - 1 are read
        if need and (commas is None or len(commas) < need):
            # The first time, commas in a prefix of the text (a new prompt's first page reads a few
            # KB, not the whole body); after that, in all of it (one pass: finding commas costs by
            # the comma, so passes over growing prefixes would cost more).
            scanned = 8 * need + 64 if commas is None else len(self._text)
            text = np.frombuffer(self._text, dtype=np.uint8, count=min(scanned, len(self._text)))
            commas = np.flatnonzero(text == _COMMA)
            if len(commas) < need:
                commas = np.flatnonzero(np.frombuffer(self._text, dtype=np.uint8) == _COMMA)
            self._commas = commas
        begin = 0 if start == 0 else int(commas[start - 1]) + 1
        end = len(self._text) if stop == self._count else int(commas[stop - 1])
        return memoryview(self._text)[begin:end]

    def __len__(self) -> int:
        return self._count

    @property
    def num_parsed(self) -> int:
        """How many leading ids have been parsed so far (for tests and diagnostics)."""
        return len(self._parsed)

    def packed_prefix(self, num_tokens: int) -> bytes:
        """The first ``min(num_tokens, len(self))`` ids or more, as little-endian uint32 bytes
        (what SGLang's block hash reads). Parses only what no earlier call parsed, and at least
        doubles what it has, so reading page by page parses the prompt about once.

        The text is cut at a comma past the estimated end (average bytes per id so far)::

            text:  | parsed ids | , next ids ... estimate , | rest |
                   0       _parsed_end              cut
        """
        text, want = self._text, min(self._count, max(num_tokens, 2 * len(self._parsed)))
        while len(self._parsed) < want:
            start = self._parsed_end + (1 if self._parsed_end else 0)  # past the comma
            guess = start + (want - len(self._parsed)) * (len(text) // self._count + 1) + 16
            cut = text.find(b",", guess)
            cut = len(text) if cut < 0 else cut
            self._parsed.extend(orjson.loads(b"[" + text[start:cut] + b"]"))
            self._parsed_end = cut
        return self._parsed.tobytes()

    def _all(self) -> array:
        if len(self._parsed) < self._count:
            self.packed_prefix(self._count)
        return self._parsed

    def __getitem__(self, index):
        return self._all()[index]

    def __iter__(self) -> Iterator[int]:
        return iter(self._all())

    def __repr__(self) -> str:
        return f"JsonIds({self._count} ids)"


def scan_ids(text: bytes) -> JsonIds | None:
    """``text`` (an array's bytes between the brackets) as ids if it is a non-empty list of
    non-negative integers of at most :data:`MAX_DIGITS` digits in JSON's grammar (no leading
    zeros, whitespace only around commas); else None. Vectorised: a dozen passes over the bytes,
    no Python loop over the ids, no index arrays."""
    if not text:
        return None
    b = np.frombuffer(text, dtype=np.uint8)
    digit = (b >= _ZERO) & (b <= _NINE)  # comparisons with uint8 scalars: one fast pass each
    comma = b == _COMMA
    if not (digit | comma).all():
        space = _WHITESPACE[b]
        if not (digit | comma | space).all():
            return None  # a sign, a fraction, true/false/null, a nested array: the full parse decides
        runs = int(np.count_nonzero(digit[1:] & ~digit[:-1])) + int(digit[0])
        if runs != int(np.count_nonzero(comma)) + 1:
            return None  # two numbers with only whitespace between them, or an empty element
        keep = ~space
        b, digit, comma = b[keep], digit[keep], comma[keep]
    if not _numbers_between_commas(b, digit, comma):
        return None
    return JsonIds(text, int(np.count_nonzero(comma)) + 1, compact=len(b) == len(text))


def _numbers_between_commas(b: np.ndarray, digit: np.ndarray, comma: np.ndarray) -> bool:
    """Whether ``b`` (digits and commas only) is ``number(,number)*``, each number 1 to
    MAX_DIGITS digits without a leading zero."""
    n = len(b)
    if n == 0 or comma[0] or comma[-1] or (n > 1 and (comma[1:] & comma[:-1]).any()):
        return False  # an empty element
    if n > MAX_DIGITS and _has_run(digit, MAX_DIGITS + 1):
        return False  # MAX_DIGITS + 1 digits in a row somewhere
    if n > 1 and b[0] == _ZERO and digit[1]:
        return False  # the first number has a leading zero
    if n > 2 and ((b[1:-1] == _ZERO) & comma[:-2] & digit[2:]).any():
        return False  # a later one does
    return True


def _has_run(mask: np.ndarray, length: int) -> bool:
    """Whether ``mask`` holds ``length`` (>= 1) true values in a row. By doubling: ``runs[i]`` says
    whether ``mask[i : i + w]`` is all true, for ``w`` = 1, 2, 4, ... and then ``length``, so it
    costs about log2(length) passes rather than ``length``::

        runs_w:   i ... i+w-1            (w true in a row from i)
        runs_2w:  runs_w[i] & runs_w[i + w]
        runs_len: runs_w[i] & runs_w[i + length - w]   (w <= length <= 2w: the windows overlap)
    """
    runs, width = mask, 1
    while 2 * width <= length:
        runs = runs[:-width] & runs[width:] if width < len(runs) else runs[:0]
        width *= 2
    if width < length:
        shift = length - width
        runs = runs[:-shift] & runs[shift:] if shift < len(runs) else runs[:0]
    return bool(runs.any())


def _skip_whitespace(raw: bytes, i: int) -> int:
    while raw[i : i + 1] in (b" ", b"\t", b"\n", b"\r"):
        i += 1
    return i


def split_ids(raw: bytes, key: str) -> tuple[dict, JsonIds] | None:
    """The JSON object ``raw`` with its top-level ``key`` holding a :class:`JsonIds`, or None.

    Exact (the object equals ``orjson.loads(raw)`` with the ids in place) or None: the key's
    spelling must occur once in ``raw`` (so no nested or repeated key was cut), the rest must
    parse with an empty list in the cut's place at the top level, and hold no ``\\u`` escape
    (which could spell the key another way). Costs one vectorised scan of the array and an
    ``orjson`` parse of everything else.
    """
    pattern = b'"' + key.encode() + b'"'
    at = raw.find(pattern)
    if at < 0 or raw.find(pattern, at + 1) >= 0:
        return None
    colon = _skip_whitespace(raw, at + len(pattern))
    if raw[colon : colon + 1] != b":":
        return None
    opening = _skip_whitespace(raw, colon + 1)
    if raw[opening : opening + 1] != b"[":
        return None
    closing = raw.find(b"]", opening + 1)
    if closing < 0:
        return None
    ids = scan_ids(raw[opening + 1 : closing])
    if ids is None:
        return None
    rest = raw[:opening] + b"[]" + raw[closing + 1 :]
    if b"\\u" in rest:
        return None
    try:
        obj = orjson.loads(rest)
    except orjson.JSONDecodeError:
        return None
    if not isinstance(obj, dict) or obj.get(key) != []:
        return None
    obj[key] = ids
    return obj, ids
