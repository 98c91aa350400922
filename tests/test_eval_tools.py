"""`tqbench eval --tools` (tqbench/eval/tools.py): the shipped held-out cases, the checks of a generated call, and the
command's counts against an independent parse of what the model generated."""

from __future__ import annotations

import json
import shutil

import pytest

from tqbench.errors import TqbenchError
from tqbench.eval.tools import check_call, has_result, load_cases, same_call, same_value, schema_problem

SCHEMA = {"type": "object", "properties": {"n": {"type": "integer"}, "x": {"type": "number"}, "s": {"type": "string"},
                                           "l": {"type": "array", "items": {"type": "integer"}},
                                           "e": {"enum": ["a", "b"]}}, "required": ["n", "s"]}


@pytest.mark.parametrize("value, ok", [
    ({"n": 3, "s": "a"}, True),
    ({"n": 3.0, "s": "a", "x": 2}, True),  # an integral float is an integer, an integer a number
    ({"n": 3, "s": "a", "l": [1, 2], "e": "b"}, True),
    ({"n": 3}, False),  # s missing
    ({"n": "3", "s": "a"}, False),  # a string is not an integer
    ({"n": True, "s": "a"}, False),  # nor is a boolean
    ({"n": 3.5, "s": "a"}, False),
    ({"n": 3, "s": "a", "l": [1, "2"]}, False),
    ({"n": 3, "s": "a", "e": "c"}, False),
    ({"n": 3, "s": "a", "z": 1}, False),  # not a parameter
    ([3, "a"], False),
])
def test_schema_problem(value, ok):
    assert (schema_problem(value, SCHEMA) == "") is ok


def test_same_value_is_json_equality():
    assert same_value({"a": [1, 2.0]}, {"a": [1.0, 2]}) and same_value(0.1 + 0.2, 0.3)
    assert not same_value(True, 1) and not same_value([1, 2], [2, 1]) and not same_value({"a": 1}, {"a": 1, "b": 2})
    assert not same_value("1", 1) and not same_value(None, 0)


def test_the_shipped_cases_are_held_out_tools_with_their_results():
    from training.tools import tools

    cases = load_cases()
    held = {t.name for t in tools() if t.heldout}
    assert len(cases) >= 50 and {c.name for c in cases} == held
    for c in cases:
        assert c.prompt[0]["role"] == "user" and c.result is not None
        assert schema_problem(c.arguments, next(t["function"]["parameters"] for t in c.tools
                                                if t["function"]["name"] == c.name)) == ""
    assert len(load_cases(limit=3)) == 3


def _reference_text(wrapper, case) -> str:
    """The reference call as the template renders it after the generation prompt: what a right model generates."""
    prompt = wrapper.apply_chat_template([dict(m) for m in case.prompt], tools=list(case.tools), tokenize=False,
                                         add_generation_prompt=True)
    whole = wrapper.apply_chat_template([dict(m) for m in case.prompt] + [case.call_message], tools=list(case.tools),
                                        tokenize=False)
    assert whole.startswith(prompt)
    return whole[len(prompt):]


def test_a_right_call_is_valid_and_exact_and_each_wrong_one_says_why(tool_tokenizer):
    wrapper = tool_tokenizer
    cases = load_cases()
    for case in cases:
        got = check_call(_reference_text(wrapper, case), wrapper, case.tools)
        assert got.valid and got.name == case.name and same_call(got, case.name, case.arguments), case.where
    case = next(c for c in cases if c.name == "calendar_weekday")  # three required integers
    text = _reference_text(wrapper, case)
    assert check_call("The answer is 4.", wrapper, case.tools).problem == "no tool call"
    assert check_call(text.replace("calendar_weekday", "calendar_week"), wrapper, case.tools).problem == (
        "unknown tool 'calendar_week'")
    dropped = text[:text.index('<|open|>argument key="day"')] + text[text.index('<|close|>call'):]
    assert check_call(dropped, wrapper, case.tools).problem == "arguments: 'day' is missing"
    year = str(case.arguments["year"])
    wrong = text.replace(f'type="number"<|sep|>{year}<', 'type="string"<|sep|>y2k<', 1)
    assert check_call(wrong, wrapper, case.tools).problem.startswith("arguments.year: expected integer")
    other = check_call(text.replace(f">{year}<", f">{int(year) + 1}<", 1), wrapper, case.tools)
    assert other.valid and not same_call(other, case.name, case.arguments)


def test_a_case_file_that_is_not_one_says_where(tmp_path):
    good = load_cases(limit=1)[0]
    line = json.dumps({"tools": list(good.tools), "messages": list(good.prompt) + [good.call_message]})
    f = tmp_path / "mine.jsonl"
    f.write_text(line + "\n\n" + line + "\n")
    read = load_cases(str(f))
    assert len(read) == 2 and read[1].where == f"{f}:3" and read[0].result is None
    for bad, says in [("{", "not JSON"), ('{"tools": [], "messages": []}', "no assistant message with tool_calls"),
                      (line.replace(good.name, "nope", 1).replace(f'"name": "{good.name}"', '"name": "zz"'),
                       "must name one of the offered tools")]:
        f.write_text(line + "\n" + bad + "\n")
        with pytest.raises(TqbenchError, match=f"{f}:2: .*{says}"):
            load_cases(str(f))
    with pytest.raises(TqbenchError, match="cannot read"):
        load_cases(str(tmp_path / "missing.jsonl"))


def test_an_answer_quotes_the_result():
    assert has_result('It returned "ab cd".', '"ab cd"') and has_result("The result is ab cd.", '"ab cd"')
    assert has_result("returns [1, 2].", "[1, 2]") and not has_result("returns [1, 3].", "[1, 2]")
    assert not has_result("nothing", '""')


@pytest.mark.slow
def test_eval_tools_counts_what_the_model_generated(tmp_path, capsys):
    """The command end to end on the demo (converted, with today's chat template), against itself: every count is
    what an independent read of the generated texts gives, and a model against itself agrees wherever it is valid."""
    from conftest import demo_tq4
    from mlx_lm.tokenizer_utils import load as load_tokenizer

    from tqbench.cli.main import app
    from tqbench.tokenizer import CHAT_TEMPLATE
    from typer.testing import CliRunner

    model = tmp_path / "m"
    shutil.copytree(demo_tq4(tmp_path), model)
    config = json.loads((model / "tokenizer_config.json").read_text())
    config["chat_template"] = CHAT_TEMPLATE
    (model / "tokenizer_config.json").write_text(json.dumps(config))
    out = CliRunner().invoke(app, ["eval", str(model), "--against", str(model), "--tools", "--tool-cases", "2",
                                   "--json"])
    assert out.exit_code == 0, out.output
    doc = json.loads(out.stdout[out.stdout.index("{"):])["tools"]
    parse = load_tokenizer(model).tool_parser
    cases = load_cases(limit=2)

    def parsed(text):
        if "<|open|>tools<|sep|>" not in text or "<|close|>tools<|sep|>" not in text:
            return None
        body = text[text.index("<|open|>tools<|sep|>") + 20:text.index("<|close|>tools<|sep|>")]
        try:
            return parse(body, [dict(t) for t in cases[0].tools])
        except (ValueError, KeyError):
            return None

    assert doc["cases"] == 2 and [r["case"] for r in doc["results"]] == [c.where for c in cases]
    assert doc["valid"] == sum(r["call"]["valid"] for r in doc["results"])
    assert doc["agree"] == doc["valid"] and doc["source_valid"] == doc["valid"]
    for r, c in zip(doc["results"], cases):
        calls = parsed(r["call"]["text"])
        assert r["call"]["valid"] <= (calls is not None)
        assert r["answered"] == has_result(r["answer"], c.result)
    assert doc["answered"] == sum(r["answered"] for r in doc["results"]) and doc["answers"] == 2
    near = [r for r in doc["results"] if r["call"]["valid"] and not r["exact"]]
    assert doc["wrong_tool"] == sum(r["call"]["name"] != r["tool"] for r in near)
    assert doc["wrong_arguments"] == sum(r["call"]["name"] == r["tool"] for r in near)
    shown = CliRunner().invoke(app, ["eval", str(model), "--tools", "--tool-cases", "2"])
    kinds = [r["call"]["problem"] for r in doc["results"] if r["call"]["problem"]]
    flat = " ".join(shown.stdout.split())  # the caption wraps at the terminal's width
    assert shown.exit_code == 0 and all(k.split(":")[0] in flat for k in kinds)


def test_tool_calls_greedy_samples_outside_a_call_and_takes_the_likeliest_inside(tool_tokenizer):
    """`--tool-syntax greedy`: from the token that completes the tool-call start marker to the one that completes
    its end marker, the sampler's draw is replaced by the likeliest token; elsewhere the sampler draws."""
    import mlx.core as mx

    from tqbench.runtime.conversation import ToolCallsGreedy

    wrapper = tool_tokenizer
    start = wrapper.encode(wrapper.tool_call_start, add_special_tokens=False)
    end = wrapper.encode(wrapper.tool_call_end, add_special_tokens=False)
    vocab, likeliest = len(wrapper.get_vocab()), 7
    drawn: list[int] = []

    def sampler(logprobs):  # a draw that is never the likeliest token: what a hot temperature might give
        token = script.pop(0)
        drawn.append(token)
        return mx.array([token])

    def peaked(at: int):
        return mx.array([[0.0 if i == at else -9.0 for i in range(vocab)]])

    guard = ToolCallsGreedy.around(sampler, wrapper)
    script = [11, *start]  # outside: the sampler draws, the start marker included
    got = [int(guard(peaked(likeliest)).item()) for _ in range(len(script))]
    assert got == [11, *start] and guard.inside
    inside = [int(guard(peaked(t)).item()) for t in [5, 6, *end]]  # inside: the likeliest, whatever the sampler
    assert inside == [5, 6, *end] and not guard.inside and drawn == [11, *start]
    script = [12]
    assert int(guard(peaked(likeliest)).item()) == 12  # outside again: sampled
    assert ToolCallsGreedy.around(sampler, type("NoTools", (), {"has_tool_calling": False})()) is sampler


def test_valid_calls_that_miss_say_whether_the_tool_or_the_arguments_were_wrong():
    """ToolScore.wrong_tool and wrong_arguments split MODEL's valid, inexact calls into another tool and other
    arguments; exact and invalid calls count in neither; --json carries both counts."""
    from tqbench.eval.records import CallCheck, ToolCaseResult, ToolScore
    from tqbench.eval.report import tools_dict

    def case(i, name, arguments, problem=""):
        call = CallCheck(text="", name=name, arguments=arguments, problem=problem)
        exact = not problem and name == "f" and arguments == {"x": 1}
        return ToolCaseResult(where=f"c:{i}", tool="f", call=call, exact=exact)

    results = (case(1, "f", {"x": 1}), case(2, "g", {"x": 1}), case(3, "f", {"x": 2}), case(4, "f", {"x": 1, "x2": 1}),
               case(5, "h", {}, problem="unknown tool 'h'"), case(6, None, None, problem="no tool call"))
    score = ToolScore(cases=6, valid=4, exact=1, source_valid=None, source_exact=None, agree=None, answers=0,
                      answered=0, results=results)
    assert (score.wrong_tool, score.wrong_arguments) == (1, 2)
    doc = tools_dict(score)
    assert (doc["wrong_tool"], doc["wrong_arguments"]) == (1, 2)
