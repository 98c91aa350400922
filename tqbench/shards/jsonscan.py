"""Reading one JSON object's members one at a time, for files whose objects hold a member per tensor (shard headers,
`model.safetensors.index.json`): a member is decoded, used and dropped before the next, so the whole object never
exists at once. Malformed text raises ValueError; callers hand the text to `json.loads` for its one-line message."""

from __future__ import annotations

import json
import re
from json.decoder import scanstring
from typing import Iterator

_DECODER = json.JSONDecoder()
_SPACE = re.compile(r"\s*")


def members(text: str, pos: int = 0, whole: bool = False) -> Iterator[tuple[str, object]]:
    """(key, value) of the object starting at `pos` (after optional whitespace). With `whole`, nothing but
    whitespace may follow the object."""
    try:
        pos = _SPACE.match(text, pos).end()
        if text[pos] != "{":
            raise ValueError(f"no object at {pos}")
        pos = _SPACE.match(text, pos + 1).end()
        if text[pos] != "}":
            while True:
                if text[pos] != '"':
                    raise ValueError(f"no key at {pos}")
                key, pos = scanstring(text, pos + 1)
                pos = _SPACE.match(text, pos).end()
                if text[pos] != ":":
                    raise ValueError(f"no ':' at {pos}")
                value, pos = _DECODER.raw_decode(text, _SPACE.match(text, pos + 1).end())
                yield key, value
                pos = _SPACE.match(text, pos).end()
                if text[pos] == "}":
                    break
                if text[pos] != ",":
                    raise ValueError(f"no ',' at {pos}")
                pos = _SPACE.match(text, pos + 1).end()
        if whole and text[_SPACE.match(text, pos + 1).end():]:
            raise ValueError("text after the object")
    except IndexError:
        raise ValueError("the text ends inside the object") from None
