"""Tool calls scored (`tqbench eval --tools`, issue 49): does a model still call the right tool with the right
arguments, and answer from the tool's result?

A case is one OpenAI-style conversation with `tools`: a user request, the reference assistant message with one tool
call, and optionally the tool's result (and the reference answer, unused). The shipped cases (`tools.jsonl` beside
this module) are the demo's held-out tool conversations: standard-library functions no training conversation offered
(`training/tools.py` writes them). A user's own file has the same shape, one JSON object a line.

Per case, greedily (temperature 0, as the rest of eval):
- **the call**: the model continues the conversation before the reference call; its text is split by mlx-lm's
  markers and read by the tokenizer's tool parser (tqbench.chat.segment, the path chat and serve use). It is *valid*
  when exactly one call came out, naming an offered tool, with arguments that satisfy that tool's JSON schema
  (`schema_problem`), and *exact* when (name, arguments) equal the reference's (JSON values: 3 equals 3.0).
- **against the source** (`--against`): the source model makes its own call on the same prompt; *agrees* when both
  calls are valid and equal. This is the figure a conversion is judged by: it does not depend on the source being
  right.
- **the answer**: given the reference call and its result, the model's reply (up to ANSWER_TOKENS tokens) contains
  the result (its JSON text, or a string result's own text).
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any, Iterator

from tqbench.errors import TqbenchError
from tqbench.eval.records import CallCheck, EvalProgress, ToolCaseResult, ToolScore

TOOL_SET = "tools.jsonl"  # the shipped cases, in this package
CALL_TOKENS = 160  # at most this many tokens for a call (the longest reference call is about 120)
ANSWER_TOKENS = 48


@dataclass(frozen=True, kw_only=True)
class ToolCase:
    where: str  # "file:line", for errors and reports
    tools: tuple[dict[str, Any], ...]  # the schemas offered
    prompt: tuple[dict[str, Any], ...]  # the messages before the reference call
    name: str  # the reference call
    arguments: dict[str, Any]
    call_message: dict[str, Any]  # the reference assistant message (for the answer's prompt)
    result: str | None  # the tool message's content after the call (None: the answer is not scored)
    tool_message: dict[str, Any] | None


# ---- the cases --------------------------------------------------------------------------------------------------------


def load_cases(path: str | None = None, limit: int = 0) -> tuple[ToolCase, ...]:
    """The cases of a JSONL file (None: the shipped held-out set), the first `limit` (0: all). A line that is not a
    case raises TqbenchError naming the file, the line and what is wrong."""
    if path is None:
        text, name = resources.files("tqbench.eval").joinpath(TOOL_SET).read_text(encoding="utf-8"), TOOL_SET
    else:
        p = Path(path)
        try:
            text, name = p.read_text(encoding="utf-8"), str(p)
        except (OSError, UnicodeDecodeError) as e:
            raise TqbenchError(f"{p}: cannot read the tool cases ({e.__class__.__name__}: {e})") from None
    cases = []
    for number, line in enumerate(text.splitlines(), 1):
        if line.strip():
            cases.append(_case(line, f"{name}:{number}"))
        if limit and len(cases) == limit:
            break
    if not cases:
        raise TqbenchError(f"{name}: no tool cases in it (one JSON object a line: tools and messages)")
    return tuple(cases)


def _case(line: str, where: str) -> ToolCase:
    try:
        doc = json.loads(line)
    except json.JSONDecodeError as e:
        raise TqbenchError(f"{where}: not JSON ({e.msg})") from None
    if not isinstance(doc, dict) or not isinstance(doc.get("tools"), list) or not isinstance(doc.get("messages"), list):
        raise TqbenchError(f"{where}: a case is an object with a list of tools and a list of messages")
    tools = doc["tools"]
    names = {_tool_name(t, where) for t in tools}
    messages = doc["messages"]
    at = next((i for i, m in enumerate(messages) if isinstance(m, dict) and m.get("role") == "assistant"
               and m.get("tool_calls")), None)
    if at is None:
        raise TqbenchError(f"{where}: no assistant message with tool_calls (the reference call)")
    calls = messages[at]["tool_calls"]
    if len(calls) != 1:
        raise TqbenchError(f"{where}: the reference message has {len(calls)} tool calls; give exactly one")
    fn = calls[0].get("function") if isinstance(calls[0], dict) else None
    if not isinstance(fn, dict) or fn.get("name") not in names:
        raise TqbenchError(f"{where}: the reference call must name one of the offered tools ({', '.join(sorted(names))})")
    arguments = fn.get("arguments", {})
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            raise TqbenchError(f"{where}: the reference call's arguments are not JSON") from None
    following = messages[at + 1] if at + 1 < len(messages) else None
    tool_message = following if isinstance(following, dict) and following.get("role") == "tool" else None
    return ToolCase(where=where, tools=tuple(tools), prompt=tuple(messages[:at]), name=fn["name"],
                    arguments=arguments, call_message=messages[at], tool_message=tool_message,
                    result=str(tool_message.get("content", "")) if tool_message is not None else None)


def _tool_name(tool: Any, where: str) -> str:
    fn = tool.get("function") if isinstance(tool, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise TqbenchError(f"{where}: each tool is {{\"type\": \"function\", \"function\": {{\"name\": ...}}}}")
    return fn["name"]


# ---- checking a call ----------------------------------------------------------------------------------------------------


JSON_TYPES = {"object": dict, "array": list, "string": str, "boolean": bool, "null": type(None)}


def schema_problem(value: Any, schema: dict[str, Any], path: str = "arguments") -> str:
    """Why `value` does not satisfy `schema` ("" when it does). The subset of JSON schema tool definitions use:
    type (one or a list), properties, required, additionalProperties false, items, enum; other keywords are not
    checked."""
    kinds = schema.get("type")
    if kinds is not None:
        kinds = kinds if isinstance(kinds, list) else [kinds]
        if not any(_is(value, k) for k in kinds):
            return f"{path}: expected {' or '.join(kinds)}, got {json.dumps(value)[:40]}"
    if "enum" in schema and value not in schema["enum"]:
        return f"{path}: {json.dumps(value)[:40]} is not one of {schema['enum']}"
    if isinstance(value, dict):
        props = schema.get("properties", {})
        for key in schema.get("required", []):
            if key not in value:
                return f"{path}: '{key}' is missing"
        for key, v in value.items():
            if key in props:
                problem = schema_problem(v, props[key], f"{path}.{key}")
                if problem:
                    return problem
            elif schema.get("additionalProperties") is False or props:
                return f"{path}: '{key}' is not a parameter"
    if isinstance(value, list) and isinstance(schema.get("items"), dict):
        for i, v in enumerate(value):
            problem = schema_problem(v, schema["items"], f"{path}[{i}]")
            if problem:
                return problem
    return ""


def _is(value: Any, kind: str) -> bool:
    if kind == "integer":
        return isinstance(value, int) and not isinstance(value, bool) or (
            isinstance(value, float) and value.is_integer())
    if kind == "number":
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    return isinstance(value, JSON_TYPES.get(kind, object))


def same_value(a: Any, b: Any) -> bool:
    """JSON equality: numbers by value (3 == 3.0, but not True == 1), objects key by key, arrays in order."""
    if isinstance(a, bool) or isinstance(b, bool):
        return type(a) is type(b) and a == b
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        return math.isclose(a, b, rel_tol=1e-9, abs_tol=0.0) if isinstance(a, float) or isinstance(b, float) else a == b
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same_value(a[k], b[k]) for k in a)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(same_value(x, y) for x, y in zip(a, b))
    return type(a) is type(b) and a == b


def check_call(text: str, tokenizer: Any, tools: tuple[dict[str, Any], ...]) -> CallCheck:
    """Read the call(s) in a generated text with the tokenizer's tool parser and check the one call against the
    offered tools' schemas."""
    from tqbench.chat.segment import Segmenter

    split = Segmenter(tokenizer, [dict(t) for t in tools])
    _, _, calls = split.feed(text, final="length")
    if not calls:
        return CallCheck(text=text, name=None, arguments=None, problem="no tool call")
    call = calls[0]
    try:
        arguments = json.loads(call.arguments)
    except json.JSONDecodeError:
        return CallCheck(text=text, name=call.name, arguments=call.arguments, problem="arguments are not JSON")
    if len(calls) > 1:
        return CallCheck(text=text, name=call.name, arguments=arguments, problem=f"{len(calls)} calls, not one")
    offered = {t["function"]["name"]: t["function"] for t in tools}
    if call.name not in offered:
        return CallCheck(text=text, name=call.name, arguments=arguments, problem=f"unknown tool {call.name!r}")
    schema = offered[call.name].get("parameters") or {"type": "object"}
    return CallCheck(text=text, name=call.name, arguments=arguments, problem=schema_problem(arguments, schema))


def same_call(a: CallCheck, name: str | None, arguments: Any) -> bool:
    return a.valid and a.name == name and same_value(a.arguments, arguments)


def has_result(answer: str, result: str) -> bool:
    """The answer quotes the tool's result: its JSON text, or (a JSON string) the string itself."""
    if result.strip() and result.strip() in answer:
        return True
    try:
        value = json.loads(result)
    except json.JSONDecodeError:
        return False
    return isinstance(value, str) and bool(value) and value in answer


# ---- scoring (engine thread) --------------------------------------------------------------------------------------------


def score_tools(model, ref, cases: tuple[ToolCase, ...], temp: float = 0.0, tool_syntax: str = "sample",
                seed: int = 0) -> Iterator:
    """Yield an EvalProgress (stage "tools") per case, return the ToolScore. `model`, `ref`:
    tqbench.runtime.load.Loaded (ref None without --against). MODEL samples at `temp` (0: greedy), seeded per case,
    with `tool_syntax` (tqbench.runtime.conversation.ToolCallsGreedy); the source always decodes greedily."""
    t0 = time.perf_counter()
    results = []
    for i, case in enumerate(cases):
        sampled = dict(temp=temp, tool_syntax=tool_syntax, seed=seed + i)
        call = check_call(_reply(model, case.prompt, case.tools, CALL_TOKENS, **sampled), model.tokenizer, case.tools)
        source = agrees = None
        if ref is not None:
            source = check_call(_reply(ref, case.prompt, case.tools, CALL_TOKENS), ref.tokenizer, case.tools)
            agrees = source.valid and same_call(call, source.name, source.arguments)
        answer = answered = None
        if case.tool_message is not None:
            answer = _reply(model, case.prompt + (case.call_message, case.tool_message), case.tools, ANSWER_TOKENS,
                            **sampled)
            answered = has_result(answer, case.result or "")
        results.append(ToolCaseResult(where=case.where, tool=case.name, call=call,
                                      exact=same_call(call, case.name, case.arguments), source=source, agrees=agrees,
                                      answer=answer, answered=answered))
        yield EvalProgress(stage="tools", done=i + 1, total=len(cases), elapsed_s=time.perf_counter() - t0)
    with_answer = [r for r in results if r.answered is not None]
    compared = ref is not None
    return ToolScore(cases=len(results), valid=sum(r.call.valid for r in results),
                     exact=sum(r.exact for r in results),
                     source_valid=sum(r.source.valid for r in results) if compared else None,
                     source_exact=sum(same_call(r.source, c.name, c.arguments) for r, c in zip(results, cases))
                     if compared else None,
                     agree=sum(bool(r.agrees) for r in results) if compared else None,
                     answers=len(with_answer), answered=sum(r.answered for r in with_answer), results=tuple(results))


def _reply(loaded, messages: tuple[dict[str, Any], ...], tools: tuple[dict[str, Any], ...], max_tokens: int,
           temp: float = 0.0, tool_syntax: str = "sample", seed: int = 0) -> str:
    """The model's reply to `messages` with `tools` (the text as generated, markers included), up to `max_tokens`
    tokens, stopping once a tool call is complete; greedy unless `temp`."""
    from mlx_lm.models.cache import make_prompt_cache

    from tqbench.events import ReplyDone, TokenOut
    from tqbench.runtime.complete import chat_prompt
    from tqbench.runtime.conversation import Sampling, generate
    from tqbench.runtime.grammar import check_tool_format, reply_grammar

    tokens = chat_prompt(loaded, [dict(m) for m in messages], [dict(t) for t in tools])
    end = getattr(loaded.tokenizer, "tool_call_end", None)
    text: list[str] = []
    grammar = reply_grammar(tools=[dict(t) for t in tools], tool_syntax=tool_syntax)
    if grammar is not None:
        check_tool_format(loaded.tokenizer)
    sampling = Sampling(max_tokens=max_tokens, temp=temp, tool_syntax=tool_syntax, seed=seed if temp else None,
                        grammar=grammar)
    steps = generate(loaded, tokens, make_prompt_cache(loaded.model), sampling, cached=0, held=[])
    try:
        for ev in steps:
            if isinstance(ev, TokenOut):
                text.append(ev.text)
                if end and end in "".join(text[-16:]):  # the call block is closed (its marker spans tokens)
                    break
            elif isinstance(ev, ReplyDone):
                break
    finally:
        steps.close()
    return "".join(text)
