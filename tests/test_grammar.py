"""Constrained decoding (tqbench/runtime/grammar.py): the grammars accept what the chat template itself renders and
refuse, at the first wrong token, a call that breaks the tools' schemas; a real model held to them produces calls
and JSON that an independent parse accepts."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from tqbench.errors import TqbenchError
from tqbench.eval.tools import schema_problem
from tqbench.runtime.grammar import (Constrained, check_grammar, check_tool_format, json_grammar, reply_grammar,
                                     tool_call_grammar)
from tqbench.tokenizer import CHAT_TEMPLATE

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 24},
                                     "days": {"type": "integer", "minimum": 1},
                                     "unit": {"type": "string", "enum": ["c", "f"]},
                                     "tags": {"type": "array", "items": {"type": "string"}}},
    "required": ["city"]}}}
ODD = {"type": "function", "function": {"name": 'say "hi" & go', "parameters": {
    "type": "object", "properties": {"x": {}}}}}  # a name to escape, a value of any type
TOOLS = [WEATHER, ODD]
VOCAB = 4608


def _call(name: str, arguments: dict, i: int = 1) -> dict:
    return {"id": f"c{i}", "type": "function", "function": {"name": name, "arguments": arguments}}


def _reply_text(tok, calls: list[dict], content: str = "Let me see.") -> str:
    """What the chat template renders for an assistant turn with `calls`, after the generation prompt."""
    user = [{"role": "user", "content": "weather?"}]
    whole = tok.apply_chat_template(user + [{"role": "assistant", "content": content, "tool_calls": calls}],
                                    tools=TOOLS, tokenize=False, chat_template=CHAT_TEMPLATE)
    prompt = tok.apply_chat_template(user, tools=TOOLS, tokenize=False, add_generation_prompt=True,
                                     chat_template=CHAT_TEMPLATE)
    assert whole.startswith(prompt)
    return whole[len(prompt):]


def _feed(tok, grammar: str, text: str) -> tuple[int, list[int], Constrained]:
    """Feed `text`'s tokens to a matcher of `grammar`: (tokens accepted before the first refused one, the tokens,
    the matcher)."""
    c = Constrained.around(lambda lp: lp, tok, grammar, VOCAB)
    ids = tok.encode(text, add_special_tokens=False)
    for n, i in enumerate(ids):
        if not c.allowed()[i]:
            return n, ids, c
        assert c.matcher.consume_token(i)
    return len(ids), ids, c


def test_the_templates_own_calls_are_accepted_to_the_end(tool_tokenizer):
    text = _reply_text(tool_tokenizer, [
        _call("get_weather", {"city": 'Paris "left bank"\nx', "days": 3, "tags": ["a", "b"]}),
        _call('say "hi" & go', {"x": {"k": [1, None]}}, 2)])
    assert text.count("<|open|>call") == 2 and "&quot;hi&quot; &amp; go" in text
    accepted, ids, c = _feed(tool_tokenizer, tool_call_grammar(TOOLS), text)
    assert accepted == len(ids) and c.matcher.is_stopped()  # the end-of-message token ends the grammar too
    # one call at most when parallel calls are off: the second call's opening is refused
    n, ids, _ = _feed(tool_tokenizer, tool_call_grammar(TOOLS, parallel=False), text)
    assert tool_tokenizer.decode(ids[:n]).endswith('<|close|>call<|sep|>')
    assert tool_tokenizer.decode(ids[n:]).startswith('<|open|>call tool="say')
    assert reply_grammar(tools=TOOLS, parallel=False) == tool_call_grammar(TOOLS, parallel=False)
    # text alone is a reply too, unless a call is required
    n, ids, c = _feed(tool_tokenizer, tool_call_grammar(TOOLS), "No call.<|end_of_msg|>")
    assert n == len(ids) and c.matcher.is_stopped()
    n, ids, _ = _feed(tool_tokenizer, tool_call_grammar(TOOLS, required=True), "No call.<|end_of_msg|>")
    assert n == 0


@pytest.mark.parametrize("arguments, name, bad", [
    ({"city": "Oslo", "days": "three"}, "get_weather", 'type="string"<|sep|>three'),  # days is a number
    ({"days": 2}, "get_weather", 'key="days"'),  # city is required and comes first
    ({"city": "Oslo", "unit": "k"}, "get_weather", "k<|close|>"),  # not in the enum
    ({"city": "Oslo", "days": 0}, "get_weather", "0<|close|>"),  # below the minimum
    ({"city": "Llanfairpwllgwyngyllgogerych"}, "get_weather", "rych"),  # the 25th character: past maxLength
    ({"city": "Oslo"}, "get_time", 'get_time"'),  # not an offered tool
    ({"city": "Oslo", "country": "NO"}, "get_weather", 'key="country"'),  # not a parameter
])
def test_a_call_that_breaks_the_schema_is_refused_where_it_breaks(tool_tokenizer, arguments, name, bad):
    text = _reply_text(tool_tokenizer, [_call(name, arguments)])
    n, ids, _ = _feed(tool_tokenizer, tool_call_grammar(TOOLS), text)
    assert n < len(ids)
    before, refused = tool_tokenizer.decode(ids[:n]), tool_tokenizer.decode(ids[n:n + 1])
    at = text.index(bad)
    assert text.startswith(before) and len(before) < at + len(bad) and len(before) + len(refused) > at, \
        (before[-40:], refused)


def test_tool_choice_none_allows_no_call_and_a_named_tool_only_itself(tool_tokenizer):
    call = _reply_text(tool_tokenizer, [_call("get_weather", {"city": "Oslo"})], content="")
    n, ids, _ = _feed(tool_tokenizer, reply_grammar(tools=TOOLS, tool_choice="none"), call)
    assert n == 0 and tool_tokenizer.decode(ids[:1]) == "<|open|>"
    assert _feed(tool_tokenizer, reply_grammar(tools=TOOLS, tool_choice="get_weather"), call)[0] == len(ids)
    assert _feed(tool_tokenizer, reply_grammar(tools=TOOLS, tool_choice='say "hi" & go'), call)[0] < len(ids)
    assert reply_grammar(tools=TOOLS) is None and reply_grammar(tools=None, tool_syntax="schema") is None
    assert reply_grammar(tools=TOOLS, tool_syntax="schema") == tool_call_grammar(TOOLS)
    with pytest.raises(TqbenchError, match="get_time"):
        tool_call_grammar(TOOLS, required=True, only="get_time")
    check_tool_format(tool_tokenizer)  # K3's format: the grammars apply

    class Other:  # a tokenizer whose calls are text (Qwen's <tool_call>): refused with what it writes
        tool_call_start = "<tool_call>"

    with pytest.raises(TqbenchError, match="K3's tool-call format only.*'<tool_call>'"):
        check_tool_format(Other())


def test_json_grammar_holds_a_reply_to_its_schema(tool_tokenizer):
    schema = {"type": "object", "properties": {"n": {"type": "integer"}, "s": {"type": "string"}},
              "required": ["n", "s"], "additionalProperties": False}
    g = json_grammar(schema)
    check_grammar(g)
    good = '{"n": 4, "s": "x y"}<|end_of_msg|>'
    n, ids, c = _feed(tool_tokenizer, g, good)
    assert n == len(ids) and c.matcher.is_stopped()
    n, ids, _ = _feed(tool_tokenizer, g, '{"n": 4}<|end_of_msg|>')  # s missing: the closing brace is refused
    assert tool_tokenizer.decode(ids[:n]) == '{"n": 4' and n < len(ids)
    assert _feed(tool_tokenizer, json_grammar(None), "[1]<|end_of_msg|>")[0] == 0  # json_object: an object
    with pytest.raises(TqbenchError, match="cannot constrain"):
        check_grammar(json_grammar({"type": "object", "properties": {"a": {"$ref": "#/nowhere"}}}))


@pytest.fixture(scope="module")
def tool_model(tmp_path_factory):
    """The demo (a real mlx-lm kimi_k3) with today's chat template, which renders tools."""
    from tqbench.demo import ensure_demo
    from tqbench.runtime.load import load

    model = Path(shutil.copytree(ensure_demo(), tmp_path_factory.mktemp("grammar") / "demo"))
    cfg = json.loads((model / "tokenizer_config.json").read_text())
    cfg["chat_template"] = CHAT_TEMPLATE
    (model / "tokenizer_config.json").write_text(json.dumps(cfg))
    return load(model)


def _generate(loaded, messages, tools, sampling) -> str:
    from mlx_lm.models.cache import make_prompt_cache

    from tqbench.events import TokenOut
    from tqbench.runtime.complete import chat_prompt
    from tqbench.runtime.conversation import generate

    tokens = chat_prompt(loaded, messages, tools)
    return "".join(ev.text for ev in generate(loaded, tokens, make_prompt_cache(loaded.model), sampling, cached=0,
                                               held=[]) if isinstance(ev, TokenOut))


@pytest.mark.parametrize("seed", [1, 2])
def test_a_real_model_held_to_a_named_tool_calls_it_with_valid_arguments(tool_model, seed):
    """The demo has not learned to call tools: held to one, sampled, its call still parses with mlx-lm's kimi_k3
    parser and its arguments satisfy the schema (checked by the eval's own validator)."""
    from tqbench.chat.segment import Segmenter
    from tqbench.runtime.conversation import Sampling

    messages = [{"role": "user", "content": "What is the weather in Oslo?"}]
    grammar = reply_grammar(tools=TOOLS, tool_choice="get_weather")
    text = _generate(tool_model, messages, TOOLS, Sampling(max_tokens=120, temp=0.8, seed=seed, grammar=grammar))
    split = Segmenter(tool_model.tokenizer, TOOLS)
    calls = split.feed(text)[2] + split.feed("", "stop")[2]
    assert text.startswith("<|open|>tools<|sep|>") and len(calls) >= 1, text
    for call in calls:
        assert call.name == "get_weather"
        args = json.loads(call.arguments)
        assert schema_problem(args, WEATHER["function"]["parameters"]) == "", (args, text)


def test_a_real_model_held_to_a_json_schema_writes_json_that_follows_it(tool_model):
    from tqbench.runtime.conversation import Sampling

    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                               "size": {"type": "integer"}}, "required": ["name", "size"],
              "additionalProperties": False}
    messages = [{"role": "user", "content": "Describe a list as JSON."}]
    sampling = Sampling(max_tokens=80, temp=0.7, seed=3, grammar=json_grammar(schema))
    text = _generate(tool_model, messages, None, sampling)
    value = json.loads(text)
    assert set(value) == {"name", "size"} and isinstance(value["size"], int) and len(value["name"]) <= 12
