"""What keeps hostile JSON from crashing a process: a nesting-depth cap checked before parsing, a walker
that does not recurse, and Python's recursion limit put back where CPython sets it.

py_ecc (imported by eth-account, through eth-keyfile) raises ``sys.setrecursionlimit`` to 100,000 when it is
imported. With that limit, a recursive walk over a ~40 KB body nested 20,000 levels deep (or ``json.loads``
itself, which recurses in C) runs off the end of the thread's C stack and the process dies with SIGSEGV,
where CPython's default limit would have raised ``RecursionError``. So:

- importing this module imports py_ecc (once: a module runs once per process) and restores the limit it
  found (CPython's 1000 if py_ecc was already in). ``payintent/__init__.py`` and ``backend/__init__.py``
  import it first, so every process (api, worker, relayer, CLI, an agent using this library) goes through it;
- :func:`check_depth` refuses text nested deeper than :data:`MAX_JSON_DEPTH` before any parser sees it:
  one pass over the bytes, no recursion, linear time, whatever the input;
- :func:`iter_strings` visits every string of a decoded value (keys too) with an explicit stack.

Nothing we parse legitimately comes close: our bodies, headers and answers nest fewer than 10 levels, and
web3/eth-abi encode our ABI (static types, no nesting) in a few frames.
"""

from __future__ import annotations

import json
import re
import sys
from array import array
from collections.abc import Iterator
from itertools import accumulate
from typing import Any

__all__ = [
    "DEFAULT_RECURSION_LIMIT",
    "MAX_JSON_DEPTH",
    "JSONTooDeep",
    "LoneSurrogate",
    "check_depth",
    "exceeds_depth",
    "has_lone_surrogate",
    "iter_strings",
    "json_depth",
    "loads",
    "restore_recursion_limit",
]

# Arrays and objects nested deeper than this are refused, everywhere: request bodies, payment headers,
# the answers the client library and the agent read. The one place this number is set.
MAX_JSON_DEPTH = 32
# CPython's own default (sys.getrecursionlimit() in a fresh interpreter).
DEFAULT_RECURSION_LIMIT = 1000

# A JSON string, from its opening quote to its closing one, escapes included; an unterminated one runs to the
# end of the text, so that every match attempt succeeds: linear time, even on text made of quotes and
# backslashes (a pattern that could fail would be retried at every later quote). UTF-8 never puts the bytes
# of '"' or '\' inside a multi-byte character.
_STRING = re.compile(rb'"[^"\\]*+(?:\\.[^"\\]*+)*+(?:"|\\?\Z)', re.DOTALL)
# Openers become +1, closers -1 (0xFF read as a signed byte), every other byte is dropped.
_STEPS = bytes.maketrans(b"[{]}", b"\x01\x01\xff\xff")
_NOT_BRACKETS = bytes(b for b in range(256) if b not in b"[]{}")


class JSONTooDeep(ValueError):
    """JSON text with arrays and objects nested deeper than the cap."""

    def __init__(self, limit: int = MAX_JSON_DEPTH) -> None:
        super().__init__(f"arrays and objects nested deeper than {limit} levels")
        self.limit = limit


def _as_bytes(data: str | bytes | bytearray | memoryview) -> bytes:
    if isinstance(data, str):
        return data.encode("utf-8", "surrogatepass")
    return bytes(data)


def json_depth(data: str | bytes | bytearray | memoryview) -> int:
    """How deep the JSON text nests arrays and objects (0 for a scalar), counted without parsing it.

    Brackets inside strings do not count. For valid JSON this is the depth the parser reaches; for any
    other text it is at least the depth a parser reaches before it finds the error.
    """
    structure = _STRING.sub(b"", _as_bytes(data)).translate(_STEPS, _NOT_BRACKETS)
    return max(accumulate(array("b", structure)), default=0)


def exceeds_depth(data: str | bytes | bytearray | memoryview, limit: int = MAX_JSON_DEPTH) -> bool:
    """Whether the JSON text nests arrays and objects deeper than ``limit`` (cheap when it plainly cannot)."""
    raw = _as_bytes(data)
    if raw.count(b"[") + raw.count(b"{") <= limit:  # the usual case: too few brackets to go that deep
        return False
    return json_depth(raw) > limit


def check_depth(data: str | bytes | bytearray | memoryview, limit: int = MAX_JSON_DEPTH) -> None:
    """:class:`JSONTooDeep` when the text nests deeper than ``limit``; call it before any JSON parser."""
    if exceeds_depth(data, limit):
        raise JSONTooDeep(limit)


class LoneSurrogate(ValueError):
    """JSON text whose string escapes a lone UTF-16 surrogate (``"\\ud800"``): valid JSON, but no character."""

    def __init__(self) -> None:
        super().__init__("a string holds a lone UTF-16 surrogate (\\ud800-\\udfff), which is not a character")


# A \\u escape of a surrogate (D800-DFFF) in the text: only then are the decoded strings searched. Raw surrogate
# bytes are not UTF-8, so decoding refuses them before any parser runs.
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")
_SURROGATE_ESCAPE_BYTES = re.compile(rb"\\u[dD][89a-fA-F]")
_SURROGATE = re.compile("[\ud800-\udfff]")


def has_surrogate(text: str) -> bool:
    """Whether ``text`` holds a surrogate code point: not Unicode text (no UTF-8 encoder, database or JSON
    reader accepts it); e.g. bytes that were not UTF-8, kept by Python's surrogateescape (command lines)."""
    return _SURROGATE.search(text) is not None


def has_lone_surrogate(text: str | bytes, value: Any) -> bool:
    """Whether ``value``, decoded from JSON ``text``, holds a lone surrogate (json pairs the valid ones)."""
    escaped = _SURROGATE_ESCAPE_BYTES.search(text) if isinstance(text, bytes) else _SURROGATE_ESCAPE.search(text)
    return bool(escaped) and any(has_surrogate(s) for s in iter_strings(value))


def loads(data: str | bytes, limit: int = MAX_JSON_DEPTH, **kwargs: Any) -> Any:
    """``json.loads`` of text from someone else (a server's answer, a header) after :func:`check_depth`;
    :class:`LoneSurrogate` (a ``ValueError``) for a string that is not Unicode text."""
    check_depth(data, limit)
    value = json.loads(data, **kwargs)
    if has_lone_surrogate(data, value):
        raise LoneSurrogate()
    return value


def iter_strings(value: Any) -> Iterator[str]:
    """Every string in a decoded JSON value, object keys included, depth first; no recursion."""
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            yield item
        elif isinstance(item, dict):
            for key, child in item.items():
                stack.append(child)
                stack.append(key)
        elif isinstance(item, list | tuple):
            stack.extend(item)


def restore_recursion_limit() -> None:
    """Import py_ecc now and put back the recursion limit it raises (see the module's docstring)."""
    before = DEFAULT_RECURSION_LIMIT if "py_ecc" in sys.modules else sys.getrecursionlimit()
    try:
        import py_ecc  # noqa: F401  (its import raises the limit; a later import of it does nothing)
    except ImportError:  # pragma: no cover - a dependency of eth-account, always installed with it
        return
    if sys.getrecursionlimit() > before:
        sys.setrecursionlimit(before)


restore_recursion_limit()
