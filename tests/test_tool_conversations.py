"""The demo's tool-call conversations (training/tools.py): schemas from the real functions, results from really
calling them, requests that say the call, and held-out tools kept out of training."""

from __future__ import annotations

import ast
import importlib
import inspect
import json

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
