"""Constrained decoding: a reply that must follow a grammar, token by token (llguidance).

Two grammars, both written here as llguidance's Lark:
- `tool_call_grammar(tools)`: free text, then optionally Kimi K3's tool-call block (`<|open|>tools<|sep|>` ...,
  the format tqbench.tokenizer's chat template writes and mlx-lm's kimi_k3 parser reads), where each call names an
  offered tool and its arguments follow that tool's JSON schema: the properties in the schema's order, the required
  ones present, each value of a type the schema allows (a string raw, anything else as JSON under that schema).
  `required=True` (OpenAI's `tool_choice` "required" or a named function) leaves out the free text: a call must come.
- `json_grammar(schema)`: the reply is one JSON value under `schema` (OpenAI's `response_format`).

`Constrained` wraps a sampler: before each token it asks the matcher which tokens the grammar allows there, sets
the others' log-probabilities to -inf, samples, and tells the matcher the token. It waits for each token (one
`.item()`), like ToolCallsGreedy. Building llguidance's view of a tokenizer costs ~1 s on a large vocabulary, so it
is kept per tokenizer."""

from __future__ import annotations

import json
import time
import weakref
from typing import Any, Callable

import mlx.core as mx
import numpy as np

from tqbench.errors import TqbenchError

# The K3 tool-call format's markers (tqbench.tokenizer.CHAT_TEMPLATE): special tokens, and the tokenizer's own
# `tool_call_start` when it has K3's format.
OPEN, SEP, CLOSE = "<|open|>", "<|sep|>", "<|close|>"
K3_TOOL_CALL_START = f"{OPEN}tools{SEP}"
# A JSON-schema type -> the `type` attribute K3's template writes for such a value (integers are "number").
ATTR_TYPE = {"string": "string", "integer": "number", "number": "number", "boolean": "boolean", "null": "null",
             "array": "array", "object": "object"}


def _lit(s: str) -> str:
    return json.dumps(s)  # a Lark string literal: JSON's escapes are Lark's


def _attr(s: str) -> str:
    """A value as the template writes it inside an attribute's quotes."""
    return s.replace("&", "&amp;").replace('"', "&quot;")


def _value_rules(rule: str, schema: dict[str, Any]) -> list[str]:
    """Lark rules for an argument's ` type="T"<|sep|>VALUE`: one alternative per type the schema allows (those of its
    `enum` values, or every kind of JSON value, when it names none)."""
    kinds = schema.get("type")
    if not kinds and "enum" in schema:
        kinds = [_kind(v) for v in schema["enum"]]
    every = (k for k in ATTR_TYPE if k != "integer")  # a number covers an integer
    kinds = [kinds] if isinstance(kinds, str) else list(dict.fromkeys(kinds or every))
    alts, rules = [], []
    for i, kind in enumerate(kinds):
        if kind not in ATTR_TYPE:
            raise TqbenchError(f"tool schema type {kind!r}: not a JSON-schema type")
        if kind == "string":
            body = _raw_string(schema)
        else:
            sub = {k: v for k, v in schema.items() if k not in ("type", "description", "title")}
            sub["type"] = kind
            if "enum" in sub:  # this type's values (an integer is a number too)
                sub["enum"] = [v for v in sub["enum"] if _kind(v) in (kind, "integer" if kind == "number" else kind)]
            rules.append(f"{rule}_{i}: %json {json.dumps(sub)}")
            body = f"{rule}_{i}"
        head = _lit(' type="%s"' % ATTR_TYPE[kind])
        alts.append(f"{head} {SEP} {body}")
    rules.insert(0, f"{rule}: " + " | ".join(alts))
    return rules


def _raw_string(schema: dict[str, Any]) -> str:
    """A string argument's value (written raw, up to `<|close|>`): one of its `enum`, its `pattern`, or any text of
    its minLength..maxLength characters."""
    enum = [v for v in schema.get("enum", ()) if isinstance(v, str)]
    if enum:
        return f"({' | '.join(_lit(v) for v in enum)})"
    pattern = schema.get("pattern")
    if isinstance(pattern, str) and "/" not in pattern:
        return f"/{pattern.removeprefix('^').removesuffix('$')}/"
    low, high = schema.get("minLength"), schema.get("maxLength")
    if isinstance(low, int) or isinstance(high, int):
        return f"/(.|\\n){{{low if isinstance(low, int) else 0},{high if isinstance(high, int) else ''}}}/"
    return "RAW"


def _kind(v: Any) -> str:
    if isinstance(v, bool):
        return "boolean"
    if isinstance(v, int):
        return "integer"
    return {float: "number", str: "string", list: "array", dict: "object", type(None): "null"}.get(type(v), "string")


def _call_rules(i: int, tool: dict[str, Any]) -> list[str]:
    fn = tool.get("function", tool)
    name = fn.get("name")
    if not isinstance(name, str) or not name:
        raise TqbenchError(f"tools[{i}]: no function name to constrain a call to")
    params = fn.get("parameters") or {"type": "object", "properties": {}}
    props = params.get("properties") or {}
    required = set(params.get("required") or ())
    if not isinstance(props, dict):
        raise TqbenchError(f"tools[{i}] ({name}): parameters.properties must be an object")
    rules, parts = [], []
    for j, (key, schema) in enumerate(props.items()):
        arg = f"t{i}_a{j}"
        head = _lit('argument key="%s"' % _attr(key))
        rules.append(f'{arg}: {OPEN} {head} {arg}_v {CLOSE} "argument" {SEP}')
        rules += _value_rules(f"{arg}_v", schema if isinstance(schema, dict) else {})
        parts.append(arg if key in required else f"{arg}?")
    head = _lit(f'call tool="{_attr(name)}" index="')
    quote = _lit('"')
    rules.insert(0, f'''t{i}: {OPEN} {head} INDEX {quote} {SEP} {' '.join(parts)} {CLOSE} "call" {SEP}''')
    return rules


def tool_call_grammar(tools: list[dict[str, Any]], required: bool = False, only: str | None = None,
                      parallel: bool = True) -> str:
    """The Lark grammar of a reply to a request offering `tools` (OpenAI's shape: {"type": "function",
    "function": {"name", "parameters"}}): free text, then at most one tool-call block whose calls follow the tools'
    schemas. `required`: the block must come, with no text before it; `only`: calls to this tool alone; `parallel`
    False: one call in the block."""
    chosen = [(i, t) for i, t in enumerate(tools) if only is None or t.get("function", t).get("name") == only]
    if not chosen:
        raise TqbenchError(f"tool_choice names {only!r}, which the request's tools do not offer")
    rules = []
    for i, tool in chosen:
        rules += _call_rules(i, tool)
    calls = " | ".join(f"t{i}" for i, _ in chosen)
    start = "block" if required else "TEXT block?"
    return "\n".join([
        "%llguidance {}",
        f"start: {start}",
        f"block: {OPEN} \"tools\" {SEP} call{'+' if parallel else ''} {CLOSE} \"tools\" {SEP}",
        f"call: {calls}",
        *rules,
        "INDEX: /[1-9][0-9]*/",
        "RAW: /(.|\\n)*/",
        "TEXT: /(.|\\n)*/",
    ]) + "\n"


def json_grammar(schema: dict[str, Any] | None) -> str:
    """The Lark grammar of a reply that is one JSON value under `schema` (None: any JSON object)."""
    return f"%llguidance {{}}\nstart: %json {json.dumps(schema if schema is not None else {'type': 'object'})}\n"


def text_grammar() -> str:
    """A reply of text alone: no tool-call block (its markers are special tokens, which text never holds)."""
    return "%llguidance {}\nstart: TEXT\nTEXT: /(.|\\n)*/\n"


def reply_grammar(*, tools: list[dict[str, Any]] | None, tool_choice: str = "auto", tool_syntax: str = "sample",
                  response_schema: dict[str, Any] | None = None, parallel: bool = True) -> str | None:
    """The grammar a reply is held to (None: none): one JSON value for `response_schema`; with tools, text alone for
    tool_choice "none", a call for "required" or a tool's name, else the calls' schemas when `tool_syntax` is
    "schema" or only one call may come (`parallel` False: OpenAI's parallel_tool_calls)."""
    if response_schema is not None:
        return json_grammar(response_schema)
    if not tools:
        return None
    if tool_choice == "none":
        return text_grammar()
    if tool_choice != "auto":
        return tool_call_grammar(tools, required=True, only=None if tool_choice == "required" else tool_choice,
                                 parallel=parallel)
    return tool_call_grammar(tools, parallel=parallel) if tool_syntax == "schema" or not parallel else None


def check_tool_format(tokenizer: Any) -> None:
    """Raise TqbenchError unless the tokenizer writes tool calls in K3's format, the only one the tool grammars know
    (another model's calls could be plain text, which no grammar here would hold)."""
    start = getattr(tokenizer, "tool_call_start", None)
    if start != K3_TOOL_CALL_START:
        raise TqbenchError(f"constrained tool calls (tool_choice, parallel_tool_calls, --tool-syntax schema) know Kimi "
                           f"K3's tool-call format only; this model's tokenizer starts its calls with {start!r}")


def check_grammar(grammar: str, tokenizer: Any = None, n_vocab: int = 0) -> None:
    """Raise TqbenchError (one line) when llguidance refuses `grammar` (a schema it cannot compile). A grammar with
    special tokens (tool calls) needs the tokenizer."""
    import llguidance

    ll = ll_tokenizer(tokenizer, n_vocab) if tokenizer is not None else None
    error = llguidance.LLMatcher.validate_grammar(llguidance.LLMatcher.grammar_from_lark(grammar), ll)
    if error and not error.startswith("WARNING"):
        raise TqbenchError(f"cannot constrain to this schema: {' '.join(error.split())[:300]}")


def logits_size(config: dict[str, Any]) -> int:
    """The model's vocabulary as its logits count it (config.json's vocab_size, also under text_config)."""
    from tqbench.source.config import parse_config

    size = parse_config(config).vocab_size
    if not size:
        raise TqbenchError("constrained decoding needs the model's vocab_size (config.json has none)")
    return int(size)


_LL_TOKENIZERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def ll_tokenizer(tokenizer: Any, n_vocab: int):
    """llguidance's view of an mlx-lm TokenizerWrapper (a fast Hugging Face tokenizer, or one holding a tiktoken
    Encoding as Moonshot's does), kept per tokenizer."""
    key = getattr(tokenizer, "_tokenizer", tokenizer)
    held = _LL_TOKENIZERS.get(key)
    if held is not None and held[0] == n_vocab:
        return held[1]
    import llguidance.hf
    import llguidance.tiktoken

    eos = getattr(tokenizer, "eos_token_id", None)
    encoding = getattr(key, "model", None)
    if hasattr(key, "backend_tokenizer"):
        made = llguidance.hf.from_tokenizer(key, n_vocab=n_vocab, eos_token=eos)
    elif encoding is not None and hasattr(encoding, "_mergeable_ranks"):
        made = llguidance.tiktoken.lltokenizer_from_encoding(encoding, n_vocab=n_vocab, eos_token=eos)
    else:
        raise TqbenchError(f"constrained decoding needs a fast Hugging Face or tiktoken tokenizer, not "
                           f"{type(key).__name__}")
    _LL_TOKENIZERS[key] = (n_vocab, made)
    return made


class Constrained:
    """A sampler that keeps the reply inside a grammar (module docstring). Once the grammar is complete, only an
    end-of-sequence token is allowed. `mask_s` and `masks`: the time spent asking llguidance for masks and how many
    it gave, for the benchmark."""

    def __init__(self, sampler: Callable, matcher: Any, n_vocab: int, eos: list[int]) -> None:
        self.sampler, self.matcher, self.n_vocab = sampler, matcher, n_vocab
        self.eos = np.zeros(n_vocab, bool)
        self.eos[[e for e in eos if 0 <= e < n_vocab]] = True
        self.mask_s, self.masks = 0.0, 0

    @classmethod
    def around(cls, sampler: Callable, tokenizer: Any, grammar: str, n_vocab: int) -> Constrained:
        import llguidance

        compiled = llguidance.LLMatcher.grammar_from_lark(grammar)
        matcher = llguidance.LLMatcher(ll_tokenizer(tokenizer, n_vocab), compiled)
        if matcher.is_error():
            raise TqbenchError(f"cannot constrain to this grammar: {' '.join(matcher.get_error().split())[:300]}")
        eos = list(getattr(tokenizer, "eos_token_ids", None) or [tokenizer.eos_token_id])
        return cls(sampler, matcher, n_vocab, eos)

    def allowed(self) -> np.ndarray:
        """The tokens the grammar allows next, as booleans over the vocabulary (end-of-sequence alone once the
        grammar is complete)."""
        if self.matcher.is_stopped():
            return self.eos
        t0 = time.perf_counter()
        bits = np.frombuffer(self.matcher.compute_bitmask(), np.uint8)
        allowed = np.unpackbits(bits, bitorder="little")[: self.n_vocab].astype(bool)
        self.mask_s += time.perf_counter() - t0
        self.masks += 1
        return allowed

    def __call__(self, logprobs: mx.array) -> mx.array:
        allowed = mx.array(self.allowed())
        token = self.sampler(mx.where(allowed, logprobs, mx.array(-float("inf"), dtype=logprobs.dtype)))
        if not self.matcher.is_stopped():
            self.matcher.consume_token(int(token.reshape(-1)[0].item()))
        return token
