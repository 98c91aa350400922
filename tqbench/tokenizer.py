"""The Kimi tokenizer files: a tiktoken BPE vocabulary, 256 special tokens after it, a config and a chat template.

Layout of a Kimi tokenizer directory:
- `tiktoken.model`: one line per mergeable token, `base64(bytes) rank`, ranks 0..base-1.
- `tokenizer_config.json`: the 256 special tokens at ids base..base+255 (`added_tokens_decoder`), the bos/eos/pad/unk
  names and the chat template. transformers 5.x reads `tiktoken.model` by name and converts it to a fast tokenizer
  without remote code, splitting text with its TikTokenConverter default regex; `PAT_STR` is that same regex.

Special-token order (offsets from base; K3 base 163584): 0 `[BOS]`, 1 `[EOS]`, 2 `<|end_of_msg|>` (the eos a chat turn
ends with), 3 `<|open|>`, 4 `<|close|>`, 5 `<|sep|>`, 254 `[UNK]`, 255 `[PAD]`; the rest are `<|reserved_token_ID|>`
with ID the absolute token id (the naming Kimi's tokenizer and transformers both use).
"""

from __future__ import annotations

import base64
import heapq
import json
from collections import Counter, defaultdict
from pathlib import Path
from typing import TYPE_CHECKING

import regex

if TYPE_CHECKING:
    import tiktoken

NUM_SPECIAL = 256
NAMED_SPECIAL = {0: "[BOS]", 1: "[EOS]", 2: "<|end_of_msg|>", 3: "<|open|>", 4: "<|close|>", 5: "<|sep|>",
                 254: "[UNK]", 255: "[PAD]"}  # fmt: skip
BOS, EOS, PAD, UNK = "[BOS]", "<|end_of_msg|>", "[PAD]", "[UNK]"

# The regex transformers' TikTokenConverter uses; our tiktoken.Encoding must split text the same way.
PAT_STR = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"""
    r"""|\s+(?!\S)|\s+"""
)

# K3-style (XTML) chat template: every message ends with the eos token, so generation stops where a turn ends. Tools
# as K3's encoder writes them (docs/kimi-k3.md, "Tool calls"): the offered tools' JSON schemas in a system message
# first; an assistant's calls after its text, `<|open|>tools<|sep|>` then per call `<|open|>call tool="NAME"
# index="I"<|sep|>` (1-based in the message) with one `<|open|>argument key="K" type="T"<|sep|>VALUE<|close|>argument
# <|sep|>` per argument (a string raw, any other value as JSON; arguments that are not an object: one
# `<|open|>json type="object"<|sep|>` block), `<|close|>call<|sep|>`, and `<|close|>tools<|sep|>`; each tool result
# as a message of role "tool" naming its call's tool and index. A conversation without tools renders as before.
_ATTR = '| replace("&", "&amp;") | replace(\'"\', "&quot;")'
_TYPE = ("{% if v is string %}string{% elif v is boolean %}boolean{% elif v is number %}number"
         "{% elif v is none %}null{% elif v is mapping %}object{% else %}array{% endif %}")
CHAT_TEMPLATE = (
    "{% if tools %}"
    '<|open|>message role="system" name="tool_declare"<|sep|>{{ tools | tojson }}<|end_of_msg|>'
    "{% endif %}"
    "{% set ns = namespace(calls=[], k=0) %}"
    "{% for m in messages %}"
    "{% if m.role == 'tool' %}"
    "{% set ns.k = ns.k + 1 %}"
    "{% set call = ns.calls[ns.k - 1] if ns.k <= ns.calls | length else none %}"
    '<|open|>message role="tool" tool="{{ (m.name or (call.function.name if call else "")) ' + _ATTR + ' }}" '
    'index="{{ ns.k }}"<|sep|>{{ m.content }}<|end_of_msg|>'
    "{% else %}"
    '<|open|>message role="{{ m.role }}"<|sep|>{{ m.content if m.content is not none else "" }}'
    "{% if m.tool_calls %}"
    "{% set ns.calls = m.tool_calls %}{% set ns.k = 0 %}"
    "<|open|>tools<|sep|>"
    "{% for c in m.tool_calls %}"
    '<|open|>call tool="{{ c.function.name ' + _ATTR + ' }}" index="{{ loop.index }}"<|sep|>'
    "{% if c.function.arguments is mapping %}"
    "{% for key, v in c.function.arguments.items() %}"
    '<|open|>argument key="{{ key ' + _ATTR + ' }}" type="' + _TYPE + '"<|sep|>'
    "{{ v if v is string else v | tojson }}<|close|>argument<|sep|>"
    "{% endfor %}"
    "{% else %}"
    '<|open|>json type="object"<|sep|>{{ c.function.arguments }}<|close|>json<|sep|>'
    "{% endif %}"
    "<|close|>call<|sep|>"
    "{% endfor %}"
    "<|close|>tools<|sep|>"
    "{% endif %}"
    "<|end_of_msg|>"
    "{% endif %}"
    "{% endfor %}"
    '{% if add_generation_prompt %}<|open|>message role="assistant"<|sep|>{% endif %}'
)

TIKTOKEN_FILE = "tiktoken.model"
CONFIG_FILE = "tokenizer_config.json"


def special_tokens(base: int) -> dict[str, int]:
    """The 256 special tokens placed right after a base vocabulary of `base` tokens, name -> id."""
    return {NAMED_SPECIAL.get(i, f"<|reserved_token_{base + i}|>"): base + i for i in range(NUM_SPECIAL)}


def write_tiktoken_model(path: Path, ranks: dict[bytes, int]) -> Path:
    """Write `ranks` as a tiktoken BPE file, in rank order."""
    lines = [f"{base64.b64encode(tok).decode()} {rank}\n" for tok, rank in sorted(ranks.items(), key=lambda kv: kv[1])]
    Path(path).write_text("".join(lines), encoding="ascii")
    return Path(path)


def read_tiktoken_model(path: Path) -> dict[bytes, int]:
    """Read a tiktoken BPE file directly (tiktoken's own loader caches by path in $TIKTOKEN_CACHE_DIR)."""
    ranks: dict[bytes, int] = {}
    for line in Path(path).read_bytes().splitlines():
        if line:
            tok, rank = line.split()
            ranks[base64.b64decode(tok)] = int(rank)
    return ranks


def tokenizer_config(base: int, model_max_length: int = 1048576) -> dict:
    """tokenizer_config.json for a tiktoken vocabulary of `base` tokens plus the 256 specials."""
    return {
        "added_tokens_decoder": {
            str(i): {"content": name, "lstrip": False, "normalized": False, "rstrip": False, "single_word": False,
                     "special": True}  # fmt: skip
            for name, i in special_tokens(base).items()
        },
        "bos_token": BOS,
        "eos_token": EOS,
        "pad_token": PAD,
        "unk_token": UNK,
        "chat_template": CHAT_TEMPLATE,
        "clean_up_tokenization_spaces": False,
        "model_max_length": model_max_length,
        "tokenizer_class": "TokenizersBackend",
    }


def write_tokenizer(dest: Path, ranks: dict[bytes, int], model_max_length: int = 1048576) -> list[Path]:
    """Write `tiktoken.model` and `tokenizer_config.json` into the directory `dest`."""
    dest = Path(dest)
    config = tokenizer_config(len(ranks), model_max_length)
    (dest / CONFIG_FILE).write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    return [write_tiktoken_model(dest / TIKTOKEN_FILE, ranks), dest / CONFIG_FILE]


def load_encoding(directory: Path) -> tiktoken.Encoding:
    """A tiktoken Encoding from a tokenizer directory (`tiktoken.model` + `tokenizer_config.json`)."""
    import tiktoken  # only here: writing tokenizer files needs no tiktoken

    directory = Path(directory)
    ranks = read_tiktoken_model(directory / TIKTOKEN_FILE)
    config = json.loads((directory / CONFIG_FILE).read_text(encoding="utf-8"))
    specials = {
        (v["content"] if isinstance(v, dict) else str(v)): int(k)
        for k, v in config.get("added_tokens_decoder", {}).items()
    }
    return tiktoken.Encoding(directory.name or "kimi", pat_str=PAT_STR, mergeable_ranks=ranks, special_tokens=specials)


def train_bpe(text: bytes, num_merges: int, pattern: str = PAT_STR) -> dict[bytes, int]:
    """Byte-level BPE: the 256 bytes, then up to `num_merges` merges of the most frequent adjacent pair within the
    regex-split chunks of `text` (ties: the lowest pair). Stops early when no new pair is left."""
    chunks = Counter(
        c.encode("utf-8", "surrogateescape") for c in regex.findall(pattern, text.decode("utf-8", "surrogateescape"))
    )
    words = [[bytes([b]) for b in c] for c in chunks]
    freq = list(chunks.values())
    pairs: Counter[tuple[bytes, bytes]] = Counter()
    where: defaultdict[tuple[bytes, bytes], set[int]] = defaultdict(set)  # pair -> words that may contain it
    for i, w in enumerate(words):
        for p in zip(w, w[1:]):
            pairs[p] += freq[i]
            where[p].add(i)
    heap = [(-n, p) for p, n in pairs.items()]
    heapq.heapify(heap)

    ranks = {bytes([b]): b for b in range(256)}
    target = len(ranks) + num_merges
    while len(ranks) < target and heap:
        n, p = heapq.heappop(heap)
        new = p[0] + p[1]
        if pairs.get(p, 0) != -n or new in ranks:
            continue  # a stale heap entry, or these bytes are already a token
        ranks[new] = len(ranks)
        touched = set()
        for i in where.pop(p):
            w, f = words[i], freq[i]
            for q in zip(w, w[1:]):
                pairs[q] -= f
                touched.add(q)
            merged, j = [], 0
            while j < len(w):
                if j + 1 < len(w) and (w[j], w[j + 1]) == p:
                    merged.append(new)
                    j += 2
                else:
                    merged.append(w[j])
                    j += 1
            words[i] = merged
            for q in zip(merged, merged[1:]):
                pairs[q] += f
                where[q].add(i)
                touched.add(q)
        for q in touched:
            if pairs[q] > 0:
                heapq.heappush(heap, (-pairs[q], q))
            else:
                del pairs[q]
                where.pop(q, None)
    return ranks
