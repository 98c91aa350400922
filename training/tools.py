"""Tool-call conversations made from the Python standard library's own functions (issue 49): the demo learns K3's
tool-call format on them, and `tqbench eval --tools` scores a model on the held-out ones.

Each tool is a real standard-library function (`TOOLS`: pure functions of a few modules, each parameter given a kind
of value to draw). Its schema comes from the function itself: the name `module_function`, the description from its
docstring's first sentence, and one JSON-schema property per parameter of its real signature (`inspect.signature`),
in order, required when it has no default. A conversation is:

- a user request naming the call the way a Python user writes it (`What is textwrap.shorten('a b c', width=4)?`, or
  a phrasing of the same), values drawn by a seeded generator;
- the assistant's tool call (the arguments by the schema's names, JSON-typed);
- the tool's result: the function really called on those values (json; a call that raises is not used);
- a short answer quoting the result.

Every conversation offers the tool among three to five (the others from the same module where it has enough, else
from any), in a seeded order, so the model has to choose. Whole modules (`HELDOUT_MODULES`) and one function in
`HELDOUT_EVERY` of the others (by a hash of its name) are held out for evaluation: no conversation that offers a
held-out tool is in the training set."""

from __future__ import annotations

import hashlib
import importlib
import inspect
import json
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from training.conversations import first_sentence

WORDS = ("alpha", "beta", "gamma", "delta", "river", "stone", "cloud", "paper", "north", "green", "seven", "quiet",
         "maple", "ember", "orbit", "pixel", "tulip", "amber", "coral", "frost")
DIRS = ("usr", "lib", "home", "src", "docs", "tmp", "data", "build", "var", "etc")
EXTS = (".py", ".txt", ".json", ".md", ".csv", ".tar.gz")
HOSTS = ("example.com", "docs.python.org", "localhost:8080", "api.example.org")


def _word(rng) -> str:
    return str(WORDS[rng.integers(len(WORDS))])


def _text(rng) -> str:
    return " ".join(_word(rng) for _ in range(int(rng.integers(3, 9))))


def _path(rng) -> str:
    parts = [str(DIRS[rng.integers(len(DIRS))]) for _ in range(int(rng.integers(1, 4)))]
    name = _word(rng) + str(EXTS[rng.integers(len(EXTS))])
    return ("/" if rng.random() < 0.5 else "") + "/".join(parts + [name])


def _url(rng) -> str:
    path = "/".join(_word(rng) for _ in range(int(rng.integers(1, 3))))
    query = f"?q={_word(rng)}+{_word(rng)}&n={int(rng.integers(1, 50))}" if rng.random() < 0.4 else ""
    return f"https://{HOSTS[rng.integers(len(HOSTS))]}/{path}{query}"


def _markup(rng) -> str:
    return f'<a href="{_url(rng)}">{_word(rng)} & {_word(rng)}</a>'


# A parameter's kind: how its values are drawn and its JSON-schema type.
KINDS: dict[str, tuple[dict[str, Any], Callable[[Any], Any]]] = {
    "int": ({"type": "integer"}, lambda rng: int(rng.integers(2, 100))),
    "small": ({"type": "integer"}, lambda rng: int(rng.integers(1, 12))),
    "year": ({"type": "integer"}, lambda rng: int(rng.integers(1900, 2101))),
    "month": ({"type": "integer"}, lambda rng: int(rng.integers(1, 13))),
    "day": ({"type": "integer"}, lambda rng: int(rng.integers(1, 29))),
    "float": ({"type": "number"}, lambda rng: round(float(rng.uniform(0.5, 50.0)), 2)),
    "unit": ({"type": "number"}, lambda rng: round(float(rng.uniform(0.0, 1.0)), 2)),
    "word": ({"type": "string"}, _word),
    "text": ({"type": "string"}, _text),
    "path": ({"type": "string"}, _path),
    "url": ({"type": "string"}, _url),
    "markup": ({"type": "string"}, _markup),
    "pattern": ({"type": "string"}, lambda rng: "*" + str(EXTS[rng.integers(len(EXTS))])),
    "ints": ({"type": "array", "items": {"type": "integer"}},
             lambda rng: [int(x) for x in rng.integers(1, 100, size=int(rng.integers(3, 8)))]),
    "floats": ({"type": "array", "items": {"type": "number"}},
               lambda rng: [round(float(x), 1) for x in rng.uniform(0, 100, size=int(rng.integers(3, 8)))]),
    "words": ({"type": "array", "items": {"type": "string"}},
              lambda rng: [_word(rng) for _ in range(int(rng.integers(3, 7)))]),
    "paths": ({"type": "array", "items": {"type": "string"}},
              lambda rng: [_path(rng) for _ in range(int(rng.integers(2, 5)))]),
    "bool": ({"type": "boolean"}, lambda rng: bool(rng.random() < 0.5)),
}

# The tools: "module.function" -> the kind of each parameter drawn (parameters left out keep their defaults; one whose
# kind ends in "?" is given in about half the conversations).
TOOLS: dict[str, dict[str, str]] = {
    "math.comb": {"n": "int", "k": "small"},
    "math.perm": {"n": "small", "k": "small?"},
    "math.factorial": {"n": "small"},
    "math.isqrt": {"n": "int"},
    "math.degrees": {"x": "float"},
    "math.radians": {"x": "float"},
    "math.copysign": {"x": "float", "y": "float"},
    "math.fmod": {"x": "float", "y": "float"},
    "string.capwords": {"s": "text", "sep": "word?"},
    "textwrap.shorten": {"text": "text", "width": "int", "placeholder": "word?"},
    "textwrap.wrap": {"text": "text", "width": "small"},
    "textwrap.fill": {"text": "text", "width": "int"},
    "textwrap.indent": {"text": "text", "prefix": "word"},
    "posixpath.basename": {"p": "path"},
    "posixpath.dirname": {"p": "path"},
    "posixpath.splitext": {"p": "path"},
    "posixpath.normpath": {"path": "path"},
    "posixpath.isabs": {"s": "path"},
    "posixpath.commonprefix": {"m": "paths"},
    "html.escape": {"s": "markup", "quote": "bool?"},
    "html.unescape": {"s": "markup"},
    "urllib.parse.quote": {"string": "text", "safe": "word?"},
    "urllib.parse.unquote": {"string": "url"},
    "urllib.parse.urljoin": {"base": "url", "url": "word"},
    "urllib.parse.quote_plus": {"string": "text"},
    "urllib.parse.parse_qs": {"qs": "url"},
    "statistics.mean": {"data": "floats"},
    "statistics.median": {"data": "ints"},
    "statistics.pstdev": {"data": "floats"},
    "statistics.variance": {"data": "floats"},
    "statistics.median_high": {"data": "ints"},
    "fnmatch.fnmatch": {"name": "path", "pat": "pattern"},
    "fnmatch.filter": {"names": "paths", "pat": "pattern"},
    "difflib.get_close_matches": {"word": "word", "possibilities": "words", "n": "small?"},
    "shlex.quote": {"s": "text"},
    "shlex.split": {"s": "text"},
    "shlex.join": {"split_command": "words"},
    "colorsys.rgb_to_hsv": {"r": "unit", "g": "unit", "b": "unit"},
    "colorsys.hsv_to_rgb": {"h": "unit", "s": "unit", "v": "unit"},
    "colorsys.rgb_to_hls": {"r": "unit", "g": "unit", "b": "unit"},
    "calendar.isleap": {"year": "year"},
    "calendar.leapdays": {"y1": "year", "y2": "year"},
    "calendar.monthrange": {"year": "year", "month": "month"},
    "calendar.weekday": {"year": "year", "month": "month", "day": "day"},
}
HELDOUT_MODULES = frozenset({"colorsys", "calendar"})
HELDOUT_EVERY = 6  # one tool in 6 of the other modules (by a hash of its name)

REQUESTS = ("What is {call}?", "What does {call} return?", "Please run {call}.", "Compute {call} for me.",
            "I need the result of {call}.", "Can you evaluate {call}?")
ANSWERS = ("{call} returns {result}.", "The result is {result}.", "It returned {result}.")


@dataclass(frozen=True, kw_only=True)
class Tool:
    qualname: str  # "textwrap.shorten"
    name: str  # the tool's name: "textwrap_shorten"
    schema: dict[str, Any]  # {"type": "function", "function": {"name", "description", "parameters"}}
    kinds: dict[str, str]  # parameter -> kind (KINDS), in the signature's order
    heldout: bool

    @property
    def module(self) -> str:
        return self.qualname.rsplit(".", 1)[0]

    def function(self) -> Callable:
        module, name = self.qualname.rsplit(".", 1)
        return getattr(importlib.import_module(module), name)


@dataclass(frozen=True, kw_only=True)
class ToolConversation:
    tools: tuple[dict[str, Any], ...]  # the schemas offered, in order
    messages: tuple[dict[str, Any], ...]  # user, assistant (a tool call), tool (its result), assistant (the answer)
    tool: str  # the called tool's name
    heldout: bool
    domain: str = field(default="")  # the called tool's module

    @property
    def call(self) -> dict[str, Any]:
        """The reference call: {"name", "arguments"}."""
        fn = self.messages[1]["tool_calls"][0]["function"]
        return {"name": fn["name"], "arguments": fn["arguments"]}

    def to_json(self) -> dict[str, Any]:
        return {"tools": list(self.tools), "messages": list(self.messages), "tool": self.tool, "domain": self.domain}


def is_heldout(qualname: str) -> bool:
    module = qualname.rsplit(".", 1)[0]
    if module in HELDOUT_MODULES:
        return True
    return int.from_bytes(hashlib.sha256(qualname.encode()).digest()[:4], "big") % HELDOUT_EVERY == 0


def _schema(qualname: str, kinds: dict[str, str]) -> tuple[dict[str, Any], dict[str, str]] | None:
    """The tool's schema from the real function (None when a parameter it needs is not drawable: *args, a required
    parameter without a kind)."""
    module, name = qualname.rsplit(".", 1)
    fn = getattr(importlib.import_module(module), name)
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):
        return None
    properties, required, order = {}, [], {}
    for p in signature.parameters.values():
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            if p.kind == p.VAR_POSITIONAL and not kinds:
                return None
            continue
        kind = kinds.get(p.name)
        if kind is None:
            if p.default is p.empty:
                return None
            continue  # a parameter the conversations leave at its default
        base = kind.rstrip("?")
        properties[p.name] = dict(KINDS[base][0])
        if p.default is p.empty:
            required.append(p.name)
        order[p.name] = kind
    if not properties:
        return None
    tool_name = qualname.replace(".", "_")
    description = first_sentence(inspect.getdoc(fn) or "") or f"{qualname} from the standard library."
    schema = {"type": "function", "function": {
        "name": tool_name, "description": description,
        "parameters": {"type": "object", "properties": properties, "required": required}}}
    return schema, order


def tools() -> list[Tool]:
    """Every tool of TOOLS whose function this Python has and whose parameters can all be drawn."""
    out = []
    for qualname, kinds in TOOLS.items():
        try:
            made = _schema(qualname, kinds)
        except (ImportError, AttributeError):
            continue
        if made is not None:
            schema, order = made
            out.append(Tool(qualname=qualname, name=schema["function"]["name"], schema=schema, kinds=order,
                            heldout=is_heldout(qualname)))
    return out


def _jsonable(value: Any) -> Any:
    return json.loads(json.dumps(value, default=str))  # tuples become lists, the rest their str


def _call_text(tool: Tool, args: dict[str, Any], alias: Alias | None = None) -> str:
    """The call as Python source: the required and positional-only parameters by position, the others by keyword
    (under the alias's names when given)."""
    required = tool.schema["function"]["parameters"]["required"]
    params = inspect.signature(tool.function()).parameters
    by_position = [k for k in args if k in required or params[k].kind == params[k].POSITIONAL_ONLY]
    key = (lambda k: alias.params[k]) if alias else (lambda k: k)
    parts = [repr(args[k]) for k in by_position] + [f"{key(k)}={args[k]!r}" for k in args if k not in by_position]
    return f"{alias.qualname if alias else tool.qualname}({', '.join(parts)})"


@dataclass(frozen=True, kw_only=True)
class Alias:
    """A tool renamed for one conversation: a made-up function name and parameter names (the function, its
    description and its values stay the real ones). A model trained on a few dozen tools learns their names by heart
    (the first fine-tune called held-out tools by training tools' names); with names it cannot know, it has to copy
    them from the tool list and the request, which is what an unseen tool asks for. Named as a real tool is: the
    request writes the call as `module.function(...)` and the tool is `module_function`, so the copy a renamed tool
    teaches is the one an unseen real tool needs (with the request's own spelling as the tool's name, the third
    fine-tune learned to call `colorsys.rgb_to_hsv` for `colorsys_rgb_to_hsv`)."""

    qualname: str  # how the request writes it: "river.stone_42"
    params: dict[str, str]  # real parameter -> its name here

    @property
    def name(self) -> str:
        return self.qualname.replace(".", "_")  # as `_schema` names a real tool

    @classmethod
    def draw(cls, tool: Tool, rng: np.random.Generator) -> Alias:
        words = [_word(rng) for _ in range(int(rng.integers(1, 3)))]
        function = "_".join(words) + (f"_{int(rng.integers(2, 99))}" if rng.random() < 0.3 else "")
        taken: set[str] = set()
        params = {}
        for p in tool.kinds:
            new = _word(rng) if rng.random() < 0.5 else p
            while new in taken:
                new += "_" + _word(rng)[0]
            taken.add(new)
            params[p] = new
        return cls(qualname=f"{_word(rng)}.{function}", params=params)

    def schema(self, tool: Tool) -> dict[str, Any]:
        fn = tool.schema["function"]
        props = fn["parameters"]["properties"]
        return {"type": "function", "function": {
            "name": self.name, "description": fn["description"],
            "parameters": {"type": "object", "properties": {self.params[k]: v for k, v in props.items()},
                           "required": [self.params[k] for k in fn["parameters"]["required"]]}}}


def conversation(tool: Tool, offered: list[Tool], rng: np.random.Generator, index: int,
                 aliased: bool = False) -> ToolConversation | None:
    """One conversation calling `tool` (None when the drawn call raises); `aliased`: every offered tool under a
    made-up name and parameter names (Alias), the request written with them."""
    args = {}
    for p, kind in tool.kinds.items():
        if kind.endswith("?") and rng.random() < 0.5:
            continue
        args[p] = KINDS[kind.rstrip("?")][1](rng)
    fn = tool.function()
    params = inspect.signature(fn).parameters
    positional = [args[p] for p in args if params[p].kind == params[p].POSITIONAL_ONLY]  # builtins' (x, /)
    keywords = {p: v for p, v in args.items() if params[p].kind != params[p].POSITIONAL_ONLY}
    try:
        result = fn(*positional, **keywords)
    except Exception:  # noqa: BLE001 - a drawn call the function refuses (a negative comb, ...): not used
        return None
    result = _jsonable(result)
    aliases: dict[str, Alias] = {}
    for t in offered if aliased else ():
        a = Alias.draw(t, rng)
        while a.name in {x.name for x in aliases.values()}:  # one name per tool in a conversation
            a = Alias.draw(t, rng)
        aliases[t.name] = a
    alias = aliases.get(tool.name)
    call = _call_text(tool, args, alias)
    request = REQUESTS[rng.integers(len(REQUESTS))].format(call=call)
    answer = ANSWERS[rng.integers(len(ANSWERS))].format(call=call, result=json.dumps(result, ensure_ascii=False))
    call_id = f"call_{index}"
    name = alias.name if alias else tool.name
    arguments = {alias.params[k]: v for k, v in args.items()} if alias else args
    messages = (
        {"role": "user", "content": request},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}]},
        {"role": "tool", "tool_call_id": call_id, "name": name, "content": json.dumps(result, ensure_ascii=False)},
        {"role": "assistant", "content": answer},
    )
    schemas = tuple(aliases[t.name].schema(t) if aliased else t.schema for t in offered)
    return ToolConversation(tools=schemas, messages=messages, tool=name, heldout=tool.heldout, domain=tool.module)


def build(seed: int, per_tool: int, heldout: bool, alias_share: float = 0.0) -> list[ToolConversation]:
    """`per_tool` conversations for every tool of one split (held out or not), each offering 3-5 tools of that split
    (the same module's first), in a seeded order; `alias_share` of them with every tool renamed (Alias)."""
    rng = np.random.default_rng([seed, 0x7001, int(heldout)])
    pool = [t for t in tools() if t.heldout == heldout]
    out: list[ToolConversation] = []
    for tool in pool:
        same = [t for t in pool if t.module == tool.module and t is not tool]
        rest = [t for t in pool if t.module != tool.module]
        made = 0
        for attempt in range(per_tool * 4):
            if made == per_tool:
                break
            n = int(rng.integers(2, 5))
            others = [same[i] for i in rng.permutation(len(same))][:n]
            others += [rest[i] for i in rng.permutation(len(rest))][:n - len(others)]
            offered = others + [tool]
            offered = [offered[i] for i in rng.permutation(len(offered))]
            conv = conversation(tool, offered, rng, index=len(out),
                                aliased=bool(alias_share) and rng.random() < alias_share)
            if conv is not None:
                out.append(conv)
                made += 1
    return [out[i] for i in rng.permutation(len(out))]


def encode_tool_conversation(encoding, conv: ToolConversation, template: str) -> tuple[list[int], list[int]]:
    """A conversation's token ids as one training sequence, and each token's loss mask: 1 on what the assistant says
    (the tool call, then the answer after the tool's result, each through its end-of-message marker), 0 on the tool
    list, the request and the result. Encoded piece by piece at the template's markers (specials), which gives the
    ids of the whole rendering."""
    from training.conversations import render

    messages, offered = list(conv.messages), list(conv.tools)
    cuts = (render(messages[:1], template, add_generation_prompt=True, tools=offered),
            render(messages[:2], template, tools=offered),
            render(messages[:3], template, add_generation_prompt=True, tools=offered),
            render(messages, template, tools=offered))
    ids: list[int] = []
    mask: list[int] = []
    done = ""
    for i, text in enumerate(cuts):
        if not text.startswith(done):
            raise ValueError("the template does not render a conversation's prefixes as prefixes")
        piece = encoding.encode(text[len(done):], allowed_special="all")
        ids += piece
        mask += [i % 2] * len(piece)
        done = text
    return ids, mask


def main(argv: list[str] | None = None) -> int:
    """Write the held-out cases `tqbench eval --tools` ships: `python -m training.tools --out tqbench/eval/tools.jsonl`."""
    import argparse
    from pathlib import Path

    p = argparse.ArgumentParser(description=main.__doc__)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--per-tool", type=int, default=4)
    a = p.parse_args(argv)
    cases = build(a.seed, a.per_tool, heldout=True)
    a.out.write_text("".join(json.dumps(c.to_json(), ensure_ascii=False) + "\n" for c in cases), encoding="utf-8")
    print(f"{len(cases)} held-out tool conversations ({len({c.tool for c in cases})} tools) -> {a.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
