"""The OpenAI API's wire format: request bodies checked into typed requests, and the response bodies built from the
engine's records. Plain Python (no MLX, no HTTP): the server's handler calls it, tests call it directly.

Fields follow OpenAI's API reference. As OpenAI does, an unknown field is refused ("Unrecognized request argument");
a documented field tqbench does not implement is accepted at its default value and refused otherwise, so a client
never silently gets something other than what it asked for."""

from __future__ import annotations

import json
import math
import time
import uuid
from dataclasses import dataclass
from typing import Any

from tqbench.chat.request import TOOL_CHOICE, CompletionRequest, SamplingRequest
from tqbench.errors import TqbenchError
from tqbench.runtime.grammar import check_grammar, json_grammar

MAX_STOP = 4  # OpenAI allows up to 4 stop sequences
ROLES = ("system", "developer", "user", "assistant", "tool")


class ApiError(Exception):
    """An OpenAI-shaped error: HTTP status, message, type, and the offending parameter."""

    def __init__(self, status: int, message: str, param: str | None = None, type: str = "invalid_request_error",
                 code: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.type, self.code = status, message, param, type, code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


@dataclass(frozen=True, kw_only=True)
class ApiRequest:
    """A checked request: what to run, and how to answer."""

    kind: str  # "chat" (/v1/chat/completions) or "text" (/v1/completions)
    model: str | None
    completion: CompletionRequest
    stream: bool
    include_usage: bool  # stream_options.include_usage: a last chunk with the usage


# Documented fields tqbench does not implement: accepted while they hold these (default) values.
_DEFAULTS_ONLY: dict[str, tuple[Any, ...]] = {
    "n": (1, None), "presence_penalty": (0, 0.0, None),
    "frequency_penalty": (0, 0.0, None), "logit_bias": (None, {}), "echo": (False, None), "best_of": (1, None),
    "suffix": (None, ""), "response_format": (None, {"type": "text"}),
    "tool_choice": (None, "auto", "none"), "modalities": (None, ["text"]),
}
_IGNORED = ("user", "metadata", "store", "service_tier", "reasoning_effort", "prompt_cache_key", "safety_identifier",
            "verbosity", "stream_options")  # bookkeeping with no effect on the text; stream_options read apart
_CHAT = ("model", "messages", "stream", "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k",
         "seed", "stop", "tools", "logprobs", "top_logprobs", "tool_choice", "response_format",
         "parallel_tool_calls")
_TEXT = ("model", "prompt", "stream", "max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "logprobs")
MAX_TOP_LOGPROBS = {"chat": 20, "text": 5}  # OpenAI's own limits


def parse_body(raw: bytes) -> dict[str, Any]:
    try:
        body = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ApiError(400, f"the request body is not valid JSON: {e}") from None
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    return body


def parse_request(kind: str, body: dict[str, Any]) -> ApiRequest:
    """`kind` "chat" or "text": the body checked field by field (400 naming the field when one is wrong)."""
    known = _CHAT if kind == "chat" else _TEXT
    for name, value in body.items():
        if name in known or name in _IGNORED:
            continue
        if name in _DEFAULTS_ONLY:
            if value not in _DEFAULTS_ONLY[name]:
                raise ApiError(400, f"{name}={json.dumps(value)} is not supported by this server", name)
            continue
        raise ApiError(400, f"Unrecognized request argument supplied: {name}", name)
    model = _opt(body, "model", str)
    stream = bool(_opt(body, "stream", bool) or False)
    options = _opt(body, "stream_options", dict) or {}
    include_usage = bool(options.get("include_usage", False))
    max_tokens = _opt(body, "max_completion_tokens", int) if kind == "chat" else None
    if max_tokens is None:
        max_tokens = _opt(body, "max_tokens", int)
    if max_tokens is not None and max_tokens < 1:
        raise ApiError(400, f"max_tokens {max_tokens}: give 1 or more", "max_tokens")
    temp = _number(body, "temperature", 0.0, 2.0)
    top_p = _number(body, "top_p", 0.0, 1.0)
    top_k = _opt(body, "top_k", int)
    if top_k is not None and top_k < 0:
        raise ApiError(400, f"top_k {top_k}: give 0 (off) or more", "top_k")
    seed = _opt(body, "seed", int)
    if seed is not None and not 0 <= seed < 2**63:
        raise ApiError(400, f"seed {seed}: give 0 to 2^63-1", "seed")
    if top_p is not None:  # OpenAI's 1 is tqbench's 0 (off); its 0 keeps only the likeliest token
        top_p = 0.0 if top_p >= 1.0 else max(top_p, 1e-6)
    sampling = SamplingRequest(max_tokens=max_tokens, temp=temp, top_p=top_p, top_k=top_k, seed=seed,
                               logprobs=_logprobs(kind, body))
    stop = _stop(body.get("stop"))
    if kind == "chat":
        messages = _messages(body.get("messages"))
        tools = _tools(body.get("tools"))
        choice = _tool_choice(body.get("tool_choice"), tools)
        schema = _response_schema(body.get("response_format"))
        if schema is not None and tools and choice != "none":
            raise ApiError(400, "response_format with tools: set tool_choice to \"none\" or leave one out",
                           "response_format")
        parallel = _opt(body, "parallel_tool_calls", bool)
        completion = CompletionRequest(messages=messages, tools=tools, tool_choice=choice, response_schema=schema,
                                       parallel_tool_calls=parallel is not False, sampling=sampling, stop=stop)
    else:
        completion = CompletionRequest(prompt=_prompt(body.get("prompt")), sampling=sampling, stop=stop)
    return ApiRequest(kind=kind, model=model, completion=completion, stream=stream, include_usage=include_usage)


def _logprobs(kind: str, body: dict[str, Any]) -> int | None:
    """How many alternatives per token to report (0: the token's own log-probability only), None: no logprobs.
    Chat: `logprobs` true, and `top_logprobs` N; completions: `logprobs` N (the legacy form)."""
    name = "top_logprobs" if kind == "chat" else "logprobs"
    top = _opt(body, name, int)
    if top is not None and not 0 <= top <= MAX_TOP_LOGPROBS[kind]:
        raise ApiError(400, f"{name} {top}: give 0 to {MAX_TOP_LOGPROBS[kind]}", name)
    if kind == "text":
        return top
    if not _opt(body, "logprobs", bool):
        if top:
            raise ApiError(400, "top_logprobs needs logprobs: true", "top_logprobs")
        return None
    return top or 0


def chat_logprobs(entries) -> dict[str, Any]:
    """OpenAI's chat `logprobs` object for TokenLogprob records."""
    def one(t) -> dict[str, Any]:
        return {"token": t.text, "logprob": t.logprob, "bytes": list(t.text.encode("utf-8"))}

    return {"content": [{**one(e), "top_logprobs": [one(t) for t in e.top]} for e in entries]}


def text_logprobs(entries, offset: int = 0) -> dict[str, Any]:
    """The completions endpoint's (legacy) `logprobs` object; `offset`: the text's length before these tokens."""
    offsets = []
    for e in entries:
        offsets.append(offset)
        offset += len(e.text)
    return {"tokens": [e.text for e in entries], "token_logprobs": [e.logprob for e in entries],
            "top_logprobs": [{t.text: t.logprob for t in e.top} for e in entries], "text_offset": offsets}


def _opt(body: dict[str, Any], name: str, kind: type) -> Any:
    value = body.get(name)
    if value is None:
        return None
    if kind is int and (isinstance(value, bool) or not isinstance(value, int)):
        raise ApiError(400, f"{name} must be an integer, not {json.dumps(value)}", name)
    if kind is not int and not isinstance(value, kind):
        raise ApiError(400, f"{name} must be {_KIND_WORDS[kind]}, not {json.dumps(value)}", name)
    return value


_KIND_WORDS = {str: "a string", bool: "true or false", dict: "an object", list: "an array"}


def _number(body: dict[str, Any], name: str, low: float, high: float) -> float | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ApiError(400, f"{name} must be a number, not {json.dumps(value)}", name)
    if not low <= value <= high:
        raise ApiError(400, f"{name} {value:g}: give {low:g} to {high:g}", name)
    return float(value)


def _stop(value: Any) -> tuple[str, ...]:
    if value is None:
        return ()
    stops = [value] if isinstance(value, str) else value
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
        raise ApiError(400, "stop must be a non-empty string or an array of them", "stop")
    if len(stops) > MAX_STOP:
        raise ApiError(400, f"stop: at most {MAX_STOP} sequences, not {len(stops)}", "stop")
    return tuple(stops)


def _content(value: Any, where: str) -> str:
    """A message's content: a string, or text parts joined (other parts refused)."""
    if value is None or isinstance(value, str):
        return value or ""
    if isinstance(value, list):
        texts = []
        for i, part in enumerate(value):
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise ApiError(400, f"{where}.content[{i}]: only text parts are supported, not {kind}",
                               f"{where}.content")
            texts.append(part["text"])
        return "".join(texts)
    raise ApiError(400, f"{where}.content must be a string or an array of text parts", f"{where}.content")


def _messages(value: Any) -> tuple[dict[str, Any], ...]:
    if not isinstance(value, list) or not value:
        raise ApiError(400, "messages must be a non-empty array", "messages")
    out = []
    for i, m in enumerate(value):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise ApiError(400, f"{where} must be an object", "messages")
        role = m.get("role")
        if role not in ROLES:
            raise ApiError(400, f"{where}.role {json.dumps(role)}: give one of {', '.join(ROLES)}", f"{where}.role")
        msg: dict[str, Any] = {"role": "system" if role == "developer" else role,
                               "content": _content(m.get("content"), where)}
        for key in ("name", "tool_call_id"):
            if isinstance(m.get(key), str):
                msg[key] = m[key]
        if role == "assistant" and m.get("tool_calls") is not None:
            calls = m["tool_calls"]
            if not isinstance(calls, list):
                raise ApiError(400, f"{where}.tool_calls must be an array", f"{where}.tool_calls")
            msg["tool_calls"] = [_template_call(c, f"{where}.tool_calls[{j}]") for j, c in enumerate(calls)]
        out.append(msg)
    return tuple(out)


def _template_call(call: Any, where: str) -> dict[str, Any]:
    """An assistant's earlier tool call, its arguments decoded (chat templates render them as objects)."""
    fn = call.get("function") if isinstance(call, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise ApiError(400, f"{where} must have a function with a name", where)
    args = fn.get("arguments", "{}")
    try:
        args = json.loads(args) if isinstance(args, str) else args
    except json.JSONDecodeError:
        raise ApiError(400, f"{where}.function.arguments is not JSON", where) from None
    return {"id": call.get("id"), "type": "function", "function": {"name": fn["name"], "arguments": args}}


def _tool_choice(value: Any, tools: tuple[dict[str, Any], ...] | None) -> str:
    """OpenAI's tool_choice as CompletionRequest.tool_choice: auto, none, required or a tool's name; other than auto
    it is held by constrained decoding (tqbench.runtime.grammar)."""
    if value is None or (value in ("auto", "none") and not tools):
        return "auto"
    if isinstance(value, dict) and value.get("type") == "function" and isinstance(value.get("function"), dict):
        value = value["function"].get("name")
        names = [t["function"]["name"] for t in tools or ()]
        if value not in names:
            raise ApiError(400, f"tool_choice names {value!r}, which tools does not offer", "tool_choice")
        return value
    if value not in TOOL_CHOICE:
        raise ApiError(400, "tool_choice must be \"auto\", \"none\", \"required\" or "
                            "{\"type\": \"function\", \"function\": {\"name\": ...}}", "tool_choice")
    if not tools:
        raise ApiError(400, f"tool_choice {value!r} needs tools", "tool_choice")
    return value


def _response_schema(value: Any) -> dict[str, Any] | None:
    """OpenAI's response_format as the JSON schema the reply must follow (None: text): json_object is any object;
    json_schema gives its `json_schema.schema`. A schema llguidance cannot compile is a 400 naming the field."""
    if value is None or value == {"type": "text"}:
        return None
    kind = value.get("type") if isinstance(value, dict) else None
    if kind == "json_object":
        schema: Any = {"type": "object"}
    elif kind == "json_schema":
        spec = value.get("json_schema")
        schema = spec.get("schema") if isinstance(spec, dict) else None
        if not isinstance(schema, dict):
            raise ApiError(400, "response_format.json_schema.schema must be a JSON schema object", "response_format")
    else:
        raise ApiError(400, "response_format.type must be \"text\", \"json_object\" or \"json_schema\"",
                       "response_format")
    try:
        check_grammar(json_grammar(schema))
    except TqbenchError as e:
        raise ApiError(400, f"response_format: {e}", "response_format") from None
    return schema


def _tools(value: Any) -> tuple[dict[str, Any], ...] | None:
    if value is None:
        return None
    if not isinstance(value, list):
        raise ApiError(400, "tools must be an array", "tools")
    for i, t in enumerate(value):
        fn = t.get("function") if isinstance(t, dict) else None
        if not isinstance(t, dict) or t.get("type") != "function" or not isinstance(fn, dict) \
                or not isinstance(fn.get("name"), str):
            raise ApiError(400, f"tools[{i}] must be {{\"type\": \"function\", \"function\": {{\"name\": ...}}}}",
                           "tools")
    return tuple(value) or None


def _prompt(value: Any) -> str:
    if isinstance(value, list) and len(value) == 1 and isinstance(value[0], str):
        value = value[0]
    if not isinstance(value, str):
        raise ApiError(400, "prompt must be a string (one prompt per request)", "prompt")
    if not value:
        raise ApiError(400, "prompt is empty", "prompt")
    return value


# ---- responses -------------------------------------------------------------------------------------------------------

def new_id(kind: str) -> str:
    return ("chatcmpl-" if kind == "chat" else "cmpl-") + uuid.uuid4().hex[:24]


def usage(prompt_tokens: int, cached_tokens: int, completion_tokens: int) -> dict[str, Any]:
    """OpenAI's usage block: prompt_tokens counts the whole prompt, the cached part included."""
    total = prompt_tokens + cached_tokens
    return {"prompt_tokens": total, "completion_tokens": completion_tokens,
            "total_tokens": total + completion_tokens, "prompt_tokens_details": {"cached_tokens": cached_tokens}}


def chat_message(content: str, reasoning: str, tool_calls: list[dict[str, Any]]) -> dict[str, Any]:
    msg: dict[str, Any] = {"role": "assistant", "content": content if content or not tool_calls else None}
    if reasoning:
        msg["reasoning"] = reasoning
    if tool_calls:
        msg["tool_calls"] = tool_calls
    return msg


def response(kind: str, rid: str, model: str, text: str, reasoning: str, tool_calls: list[dict[str, Any]],
             finish: str, use: dict[str, Any], logprobs: dict[str, Any] | None = None) -> dict[str, Any]:
    created = int(time.time())
    if kind == "chat":
        choice = {"index": 0, "message": chat_message(text, reasoning, tool_calls), "finish_reason": finish,
                  "logprobs": logprobs}
        return {"id": rid, "object": "chat.completion", "created": created, "model": model, "choices": [choice],
                "usage": use}
    return {"id": rid, "object": "text_completion", "created": created, "model": model,
            "choices": [{"index": 0, "text": text, "finish_reason": finish, "logprobs": logprobs}], "usage": use}


def chunk(kind: str, rid: str, model: str, text: str = "", reasoning: str = "",
          tool_calls: list[dict[str, Any]] | None = None, finish: str | None = None, role: bool = False,
          use: dict[str, Any] | None = None, logprobs: dict[str, Any] | None = None) -> dict[str, Any]:
    """One streamed chunk; with `use` (and no choice), the last chunk stream_options.include_usage asks for."""
    created = int(time.time())
    if kind == "chat":
        obj = "chat.completion.chunk"
        if use is not None:
            return {"id": rid, "object": obj, "created": created, "model": model, "choices": [], "usage": use}
        delta: dict[str, Any] = {"role": "assistant"} if role else {}
        if text:
            delta["content"] = text
        if reasoning:
            delta["reasoning"] = reasoning
        if tool_calls:
            delta["tool_calls"] = tool_calls
        return {"id": rid, "object": obj, "created": created, "model": model,
                "choices": [{"index": 0, "delta": delta, "finish_reason": finish, "logprobs": logprobs}]}
    if use is not None:
        return {"id": rid, "object": "text_completion", "created": created, "model": model, "choices": [],
                "usage": use}
    return {"id": rid, "object": "text_completion", "created": created, "model": model,
            "choices": [{"index": 0, "text": text, "finish_reason": finish, "logprobs": logprobs}]}
