"""The demo's tool-call conversations (training/tools.py): schemas from the real functions, results from really
calling them, requests that say the call, and held-out tools kept out of training."""

from __future__ import annotations

import ast
import importlib
import inspect
import json
import re

import pytest

from training.tools import HELDOUT_MODULES, build, tools


def _function(qualname: str):
    module, name = qualname.rsplit(".", 1)
    return getattr(importlib.import_module(module), name)


def test_every_schema_is_the_real_signature():
    """Each property is a parameter of the function, in the signature's order; required exactly where the parameter
    has no default."""
    made = tools()
    assert len(made) >= 40
    for t in made:
        params = inspect.signature(_function(t.qualname)).parameters
        props = t.schema["function"]["parameters"]["properties"]
        assert list(props) == [p for p in params if p in props], t.qualname
        required = [p for p in props if params[p].default is inspect.Parameter.empty]
        assert t.schema["function"]["parameters"]["required"] == required, t.qualname
        assert t.name == t.qualname.replace(".", "_")


def test_each_result_is_the_function_really_called_and_the_request_says_the_call():
    convs = build(seed=3, per_tool=4, heldout=False) + build(seed=3, per_tool=4, heldout=True)
    assert len(convs) > 150
    by_name = {t.name: t for t in tools()}
    for c in convs:
        tool = by_name[c.tool]
        # the request's call, read back as Python and run: the tool's result; bound to the function's signature, the
        # call's arguments are the tool call's
        source = c.messages[0]["content"]
        call = ast.parse(source[source.index(tool.qualname):source.rindex(")") + 1], mode="eval").body
        assert ast.unparse(call.func) == tool.qualname
        args = [ast.literal_eval(a) for a in call.args]
        kwargs = {k.arg: ast.literal_eval(k.value) for k in call.keywords}
        expected = json.loads(json.dumps(_function(tool.qualname)(*args, **kwargs), default=str))
        assert json.loads(c.messages[2]["content"]) == expected
        bound = inspect.signature(_function(tool.qualname)).bind(*args, **kwargs)
        assert dict(bound.arguments) == c.call["arguments"]
        assert c.tool in [s["function"]["name"] for s in c.tools] and 3 <= len(c.tools) <= 5


def test_held_out_tools_never_reach_training():
    held = {t.name for t in tools() if t.heldout}
    assert {t.module for t in tools() if t.heldout} >= HELDOUT_MODULES
    train = build(seed=0, per_tool=10, heldout=False)
    offered = {s["function"]["name"] for c in train for s in c.tools}
    assert offered and not offered & held
    evaluation = build(seed=0, per_tool=3, heldout=True)
    assert {c.tool for c in evaluation} == held


def test_the_same_seed_builds_the_same_conversations():
    a = [c.to_json() for c in build(seed=7, per_tool=2, heldout=True)]
    b = [c.to_json() for c in build(seed=7, per_tool=2, heldout=True)]
    assert a == b and a != [c.to_json() for c in build(seed=8, per_tool=2, heldout=True)]


OLD_TEMPLATE = (  # the template before tools: a conversation without them must render exactly as it did
    "{% for m in messages %}"
    '<|open|>message role="{{ m.role }}"<|sep|>{{ m.content }}<|end_of_msg|>'
    "{% endfor %}"
    '{% if add_generation_prompt %}<|open|>message role="assistant"<|sep|>{% endif %}'
)


@pytest.fixture
def wrapper(tool_tokenizer):
    return tool_tokenizer


def test_a_conversation_without_tools_renders_as_before():
    from training.conversations import render

    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": 'a "quoted" <b> & é'},
                {"role": "assistant", "content": "ok"}, {"role": "user", "content": "and?"}]
    for gen in (False, True):
        assert render(messages, add_generation_prompt=gen) == render(messages, OLD_TEMPLATE, add_generation_prompt=gen)


def test_tool_calls_render_as_k3_writes_them_and_mlx_lms_parser_reads_them_back(wrapper):
    """The rendering of training equals the tokenizer's (transformers), and the assistant's tools section, read by
    mlx-lm's kimi_k3 tool parser, gives back each reference call: name and JSON-typed arguments."""
    from training.conversations import render

    convs = build(seed=1, per_tool=2, heldout=False) + build(seed=1, per_tool=2, heldout=True)
    parse = wrapper.tool_parser
    assert wrapper.has_tool_calling and wrapper.tool_call_start == "<|open|>tools<|sep|>"
    for c in convs:
        text = render(c.messages, tools=c.tools)
        assert text == wrapper.apply_chat_template(list(c.messages), tools=list(c.tools), tokenize=False)
        assert text.startswith('<|open|>message role="system" name="tool_declare"<|sep|>')
        assert json.loads(text[text.index("<|sep|>") + 7:text.index("<|end_of_msg|>")]) == list(c.tools)
        start = text.index("<|open|>tools<|sep|>") + len("<|open|>tools<|sep|>")
        calls = parse(text[start:text.index("<|close|>tools<|sep|>")], list(c.tools))
        assert calls == [c.call]
        assert f'<|open|>message role="tool" tool="{c.tool}" index="1"<|sep|>{c.messages[2]["content"]}' in text
        prompt = render(c.messages[:1], tools=c.tools, add_generation_prompt=True)
        assert text.startswith(prompt) and prompt.endswith('<|open|>message role="assistant"<|sep|>')


def test_argument_types_and_attribute_escapes():
    """Every JSON type gets K3's type name, strings stay raw, attribute values escape & and "; arguments given as a
    string go in one json block."""
    from training.conversations import render

    args = {"s": 'a "b" & <c>', "i": 3, "f": 1.5, "t": True, "n": None, "o": {"k": [1]}, "l": ["x"]}
    call = {"role": "assistant", "content": None, "tool_calls": [
        {"type": "function", "function": {"name": 'we"ird&', "arguments": args}},
        {"type": "function", "function": {"name": "raw", "arguments": '{"a": 1}'}}]}
    text = render([{"role": "user", "content": "go"}, call])
    assert text == (
        '<|open|>message role="user"<|sep|>go<|end_of_msg|>'
        '<|open|>message role="assistant"<|sep|><|open|>tools<|sep|>'
        '<|open|>call tool="we&quot;ird&amp;" index="1"<|sep|>'
        '<|open|>argument key="s" type="string"<|sep|>a "b" & <c><|close|>argument<|sep|>'
        '<|open|>argument key="i" type="number"<|sep|>3<|close|>argument<|sep|>'
        '<|open|>argument key="f" type="number"<|sep|>1.5<|close|>argument<|sep|>'
        '<|open|>argument key="t" type="boolean"<|sep|>true<|close|>argument<|sep|>'
        '<|open|>argument key="n" type="null"<|sep|>null<|close|>argument<|sep|>'
        '<|open|>argument key="o" type="object"<|sep|>{"k": [1]}<|close|>argument<|sep|>'
        '<|open|>argument key="l" type="array"<|sep|>["x"]<|close|>argument<|sep|>'
        '<|close|>call<|sep|>'
        '<|open|>call tool="raw" index="2"<|sep|><|open|>json type="object"<|sep|>{"a": 1}<|close|>json<|sep|>'
        '<|close|>call<|sep|><|close|>tools<|sep|><|end_of_msg|>')


def test_aliased_tools_are_the_real_functions_under_names_a_model_cannot_know():
    """prepare --tool-alias-share: a conversation's tools renamed (function and parameters) stay the real functions:
    the call's arguments, mapped back to the real parameter names, give the tool's result when really called; the
    request says the renamed call as a real tool's is said (`module.function(...)` for the tool `module_function`);
    the schema keeps the description and types under the new names."""
    convs = build(seed=5, per_tool=3, heldout=False, alias_share=1.0)
    real = {t.name: t for t in tools()}
    names = {t.name for t in tools()}
    for c in convs:
        assert c.tool not in names and c.tool in [s["function"]["name"] for s in c.tools]
        assert not {s["function"]["name"] for s in c.tools} & names
        schema = next(s["function"] for s in c.tools if s["function"]["name"] == c.tool)
        assert set(c.call["arguments"]) <= set(schema["parameters"]["properties"])
        assert set(schema["parameters"]["required"]) <= set(c.call["arguments"])
        request = c.messages[0]["content"]
        said = re.search(r"([A-Za-z_][\w.]*)\(", request).group(1)
        assert "." in said and said.replace(".", "_") == c.tool and f"{c.tool}(" not in request
        tool = next(t for t in real.values() if t.module == c.domain and t.schema["function"]["description"]
                    == schema["description"] and len(t.kinds) == len(schema["parameters"]["properties"]))
        assert len({s["function"]["name"] for s in c.tools}) == len(c.tools)
        params = inspect.signature(_function(tool.qualname)).parameters
        mapping = dict(zip(schema["parameters"]["properties"], tool.kinds))
        real_args = {mapping[k]: v for k, v in c.call["arguments"].items()}
        positional = [real_args[p] for p in real_args if params[p].kind == params[p].POSITIONAL_ONLY]
        keywords = {p: v for p, v in real_args.items() if params[p].kind != params[p].POSITIONAL_ONLY}
        expected = json.loads(json.dumps(_function(tool.qualname)(*positional, **keywords), default=str))
        assert json.loads(c.messages[2]["content"]) == expected
    assert build(seed=5, per_tool=3, heldout=False) == build(seed=5, per_tool=3, heldout=False, alias_share=0.0)
