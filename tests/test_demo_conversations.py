"""The chat demo's data: conversations mined from the standard library with `ast`, the train/held-out split by file,
the mixed code + chat stream, and the rendering through the model's chat template (as transformers and mlx-lm do it)."""

from __future__ import annotations

import hashlib
import inspect
import re
import textwrap
from pathlib import Path

import numpy as np
import pytest

from tqbench.demo import CHAT_SPEC, TRAINED_SPEC, DemoSpec, demo_tokenizer_ranks, tensor_plan
from tqbench.tokenizer import CHAT_TEMPLATE, load_encoding, write_tokenizer
from training.conversations import (
    CALL,
    RICH,
    WHAT,
    DocItem,
    answer,
    build_conversations,
    clean_doc,
    encode_conversation,
    mine_file,
    mine_source,
    mine_stdlib,
    mix_stream,
    module_name,
    pseudo_module,
    question,
    render,
    renamed,
    returns_sentence,
    rich_items,
    split_items,
    turn,
)
from training.corpus import corpus_files, is_heldout, stdlib_root

ROOT_DIR = Path(__file__).resolve().parent.parent

JSON_DUMPS = (
    "`json.dumps(obj, *, skipkeys=False, ensure_ascii=True, check_circular=True, allow_nan=True, cls=None, "
    "indent=None, separators=None, default=None, sort_keys=False, **kw)`\n\n"
    "Serialize ``obj`` to a JSON formatted ``str``.\n\n"
    "If ``skipkeys`` is true then ``dict`` keys that are not basic types (``str``, ``int``, ``float``, ``bool``, "
    "``None``) will be skipped instead of raising a ``TypeError``."
)

SOURCE = textwrap.dedent('''\
    """A small module for the miner's rules.

    Second paragraph of the module docstring."""

    def public(a, b=0o777, *, c=None) -> int:
        """Add the numbers a and b together.

        >>> public(1, 2)
        3
        """
        def nested(x):
            """A nested function is never mined, whatever it says."""

    def _private(x):
        """A private function is skipped even with a long docstring."""

    def trivial():
        """Return self."""

    async def wait(delay):
        """Wait for delay seconds before returning."""

    class Thing(Base):
        """A thing that holds some value for later use."""

        def __init__(self, value, *, label="x"):
            """Never asked: dunder methods are skipped."""

        def get(self, default=None):
            """Return the stored value or the given default."""

        @staticmethod
        def make(x):
            """Make a new thing from the value x."""

        @classmethod
        def parse(cls, text):
            """Parse a thing from its text form."""

        @property
        def size(self):
            """The number of bytes the value takes."""

        @size.setter
        def size(self, v):
            """Setting the size is never asked about."""

    if True:
        def conditional():
            """Defined under an if: not a top-level definition."""
''')


def test_miner_rules_on_a_known_source():
    items = {i.name: i for i in mine_source(SOURCE, "pkg/tool.py")}
    assert list(items) == ["pkg.tool", "pkg.tool.public", "pkg.tool.wait", "pkg.tool.Thing", "pkg.tool.Thing.get",
                           "pkg.tool.Thing.make", "pkg.tool.Thing.parse", "pkg.tool.Thing.size"]
    sig = {n: i.signature for n, i in items.items()}
    assert sig["pkg.tool.public"] == "pkg.tool.public(a, b=0o777, *, c=None) -> int"  # defaults as written
    assert sig["pkg.tool.wait"] == "coroutine pkg.tool.wait(delay)"
    assert sig["pkg.tool.Thing"] == 'class pkg.tool.Thing(value, *, label="x")'  # from __init__, as written
    assert sig["pkg.tool.Thing.get"] == "pkg.tool.Thing.get(default=None)"
    assert sig["pkg.tool.Thing.make"] == "staticmethod pkg.tool.Thing.make(x)"
    assert sig["pkg.tool.Thing.parse"] == "classmethod pkg.tool.Thing.parse(text)"
    assert sig["pkg.tool.Thing.size"] == "pkg.tool.Thing.size" and items["pkg.tool.Thing.size"].kind == "property"
    assert items["pkg.tool.public"].doc == "Add the numbers a and b together."  # the doctest paragraph is dropped
    assert items["pkg.tool"].doc == "A small module for the miner's rules.\n\nSecond paragraph of the module docstring."
    assert {i.domain for i in items.values()} == {"pkg"} and {i.file for i in items.values()} == {"pkg/tool.py"}
    assert mine_source(SOURCE, "_private_mod.py") == [] and mine_source("def broken(:\n", "x.py") == []


def test_wide_mining_adds_private_names_and_signature_only_items():
    items = {i.name: i for i in mine_source(SOURCE, "pkg/tool.py", wide=True)}
    public = [i.name for i in mine_source(SOURCE, "pkg/tool.py")]
    assert list(items) == ["pkg.tool", "pkg.tool.public", "pkg.tool._private", "pkg.tool.trivial", "pkg.tool.wait",
                           "pkg.tool.Thing", "pkg.tool.Thing.get", "pkg.tool.Thing.make", "pkg.tool.Thing.parse",
                           "pkg.tool.Thing.size"]
    assert set(public) < set(items)  # the default set is a subset, the same items
    assert all(items[n] == i for n, i in zip(public, mine_source(SOURCE, "pkg/tool.py")))
    assert items["pkg.tool._private"].doc == "A private function is skipped even with a long docstring."
    trivial = items["pkg.tool.trivial"]  # "Return self." is trivial: kept without a docstring, for its signature
    assert (trivial.doc, trivial.signature) == ("", "pkg.tool.trivial()")
    # Only how to call it is asked, and the answer is the signature alone, whatever the seed draws.
    for seed in range(20):
        q, a = turn(trivial, np.random.default_rng(seed))
        assert a["content"] == "Call it as `pkg.tool.trivial()`." and "trivial" in q["content"]
    assert mine_source(SOURCE, "_private_mod.py", wide=True)[0].name == "_private_mod"
    assert mine_source(SOURCE, "__main__.py", wide=True) == []


def test_clean_doc_bounds_and_joins():
    doc = inspect.cleandoc("""First line of a paragraph
        wrapped onto a second line.

        Indented block kept:
            x = 1
        """)
    assert clean_doc(doc) == "First line of a paragraph wrapped onto a second line.\n\nIndented block kept:\n    x = 1"
    long = " ".join(f"Sentence number {i} is here." for i in range(40))
    cut = clean_doc(long, max_chars=200)
    assert len(cut) <= 200 and cut.endswith("here.")
    assert clean_doc("Return self.") == "" and clean_doc("XXX") == ""


def test_json_dumps_conversation_from_the_real_stdlib():
    items = {i.name: i for i in mine_file(stdlib_root(), "json/__init__.py")}
    dumps = items["json.dumps"]
    assert (dumps.kind, dumps.module, dumps.domain, dumps.file) == ("function", "json", "json", "json/__init__.py")
    assert answer(dumps) == JSON_DUMPS
    assert answer(dumps, "call") == "Call it as " + JSON_DUMPS.replace("`\n\n", "`.\n\n", 1)
    assert all(not part.startswith("_") for name in items for part in name.split("."))
    # A turn is a seeded question from the templates and the answer.
    rng = np.random.default_rng(0)
    q, a = turn(dumps, rng)
    assert q["role"] == "user" and a["role"] == "assistant"
    assert q["content"] in [t.format(name="json.dumps", short="dumps", module="json", owner="json")
                            for t in WHAT["function"] + CALL["function"]]
    assert a["content"] in (answer(dumps), answer(dumps, "call"))
    assert turn(dumps, np.random.default_rng(0)) == [q, a]


def test_reexported_names_are_the_packages():
    root = stdlib_root()
    items = {i.name: i for i in mine_stdlib(root, ["json/__init__.py", "json/decoder.py", "json/encoder.py"])}
    enc = items["json.JSONEncoder.encode"]
    assert enc.file == "json/encoder.py" and enc.module == "json" and enc.signature == "json.JSONEncoder.encode(o)"
    assert items["json.JSONEncoder"].signature.startswith("class json.JSONEncoder(*, skipkeys=False")
    assert "json.encoder.JSONEncoder" not in items and module_name("json/__init__.py") == "json"


SPLIT_FILES = ["ast.py", "logging/__init__.py", "logging/handlers.py", "json/__init__.py", "getopt.py", "secrets.py",
               "shlex.py", "platform.py"]


def test_split_never_leaks_heldout_modules():
    root = stdlib_root()
    assert [f for f in SPLIT_FILES if is_heldout(f)] == ["ast.py", "logging/handlers.py", "getopt.py", "secrets.py",
                                                          "platform.py"]
    items = mine_stdlib(root, SPLIT_FILES)
    train, held = split_items(items)
    assert train and held and len(train) + len(held) == len(items)
    assert not any(is_heldout(i.file) for i in train) and all(is_heldout(i.file) for i in held)
    text = "".join(render(c.messages) for c in build_conversations(train, seed=0, passes=2, greetings=5))
    held_names = {i.name for i in held} - {i.name for i in train}
    for item in held:  # neither a held-out name nor a held-out docstring reaches a training conversation
        assert f"{item.name}(" not in text and f"{item.name}`" not in text and item.doc not in text, item.name
    assert held_names
    # the same rule as the code corpus: no held-out file among the corpus's training files
    assert not set(f for f in corpus_files(root) if not is_heldout(f)) & {i.file for i in held}


def test_conversations_are_seeded_and_keep_to_one_module():
    items = mine_stdlib(stdlib_root(), ["json/__init__.py", "json/decoder.py", "json/encoder.py", "shlex.py"])
    a = build_conversations(items, seed=3, passes=2, greetings=4)
    assert a == build_conversations(items, seed=3, passes=2, greetings=4)
    assert a != build_conversations(items, seed=4, passes=2, greetings=4)
    by_name = {i.name: i for i in items}
    assert sum(c.domain == "chat" for c in a) == 4
    for c in a:
        assert [m["role"] for m in c.messages] == ["user", "assistant"] * (len(c.messages) // 2)
        if c.domain != "chat":
            assert 1 <= len(c.names) <= 3 and len({by_name[n].module for n in c.names}) == 1
            assert {by_name[n].domain for n in c.names} == {c.domain}
    # every item is asked once per pass
    asked = [n for c in a for n in c.names]
    assert sorted(asked) == sorted([i.name for i in items] * 2)


def test_renamed_sessions_ask_under_a_made_up_module_and_change_nothing_else():
    items = mine_stdlib(stdlib_root(), ["json/__init__.py", "json/decoder.py", "json/encoder.py", "shlex.py"])
    plain = build_conversations(items, seed=3, passes=2, greetings=4)
    assert build_conversations(items, seed=3, passes=2, greetings=4, copy_share=0.0) == plain
    half = build_conversations(items, seed=3, passes=2, greetings=4, copy_share=0.5)
    assert half == build_conversations(items, seed=3, passes=2, greetings=4, copy_share=0.5)  # seeded
    by_name = {i.name: i for i in items}
    changed = 0
    for p, h in zip(plain, half, strict=True):  # the same sessions, items, kinds of question, in the same order
        assert (p.names, p.domain, len(p.messages)) == (h.names, h.domain, len(h.messages))
        if p.messages == h.messages:
            continue
        changed += 1
        real = {by_name[n].module for n in p.names}
        assert len(real) == 1
        module = real.pop()
        fakes = set()
        for mp, mh in zip(p.messages, h.messages):
            text = mh["content"]
            for n in p.names:
                item = by_name[n]
                fake = renamed(item, "FAKE")
                if fake is item:  # a module's own docstring, or a name its signature does not hold: as it was
                    continue
                if item.doc and item.doc in mp["content"]:
                    assert item.doc in text  # the docstring is the real one
                if f"`{item.signature}`" in mp["content"]:  # the signature is shown under the made-up module
                    found = re.search(r"`(?:class |classmethod |staticmethod )?([a-z.]+)\." +
                                      re.escape(item.name[len(module) + 1:]), text)
                    assert found, text
                    fakes.add(found.group(1))
        assert len(fakes) <= 1 and module not in fakes  # one made-up module per session
    assert 0.3 < changed / len(plain) < 0.6


def test_a_renamed_item_keeps_its_docstring_and_short_name():
    item = DocItem("json/__init__.py", "json", "json", "function", "json.dumps", "json.dumps(obj, *, skipkeys=False)",
                   "Serialize ``obj`` to a JSON formatted ``str``.")
    r = renamed(item, "qzv.mlk")
    assert (r.name, r.module, r.signature, r.doc, r.short) == (
        "qzv.mlk.dumps", "qzv.mlk", "qzv.mlk.dumps(obj, *, skipkeys=False)", item.doc, "dumps")
    module = DocItem("json/__init__.py", "json", "json", "module", "json", "", "JSON encoder and decoder.")
    assert renamed(module, "qzv") is module
    rng = np.random.default_rng(0)
    names = [pseudo_module(rng) for _ in range(200)]
    assert all(re.fullmatch(r"[a-z]{3,8}(\.[a-z]{3,8})?", n) for n in names) and len(set(names)) > 190


def test_mix_meets_the_ratio_and_is_reproducible():
    rng = np.random.default_rng(1)
    code = [rng.integers(0, 100, rng.integers(500, 20000)).astype(np.uint32) for _ in range(60)]
    chat = [rng.integers(100, 200, rng.integers(40, 400)).astype(np.uint32) for _ in range(800)]
    for share in (0.4, 0.6, 0.1):  # 0.6 needs more conversations than there are: they are cycled
        m = mix_stream(code, chat, share, seed=0, code_domains=[f"c{i % 3}" for i in range(60)],
                       chat_domains=[f"d{i % 5}" for i in range(800)])
        assert abs(m.chat_share - share) < 0.005, (share, m.chat_share)
        assert m.code_tokens == sum(len(c) for c in code) and len(m.tokens) == m.code_tokens + m.chat_tokens
        assert m.kinds.count("code") == 60 and ((m.tokens < 100).sum() == m.code_tokens)
        ends = np.append(m.starts[1:], len(m.tokens))
        for kind, d, s, e in zip(m.kinds, m.domains, m.starts, ends):
            assert d[0] == ("c" if kind == "code" else "d") and e > s
        again = mix_stream(code, chat, share, seed=0)
        assert np.array_equal(again.tokens, m.tokens)
    assert not np.array_equal(mix_stream(code, chat, 0.4, seed=1).tokens, mix_stream(code, chat, 0.4, seed=0).tokens)
    assert mix_stream(code, [], 0.0, seed=0).chat_tokens == 0
    with pytest.raises(ValueError):
        mix_stream(code, [], 0.4, seed=0)


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("tok")
    write_tokenizer(d, demo_tokenizer_ranks(DemoSpec()))
    return d


def test_rendering_equals_the_tokenizers_chat_template(tok_dir, monkeypatch):
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", "")
    from mlx_lm.tokenizer_utils import load as load_tokenizer

    wrapper = load_tokenizer(tok_dir)  # mlx-lm's TokenizerWrapper over the transformers tokenizer
    enc = load_encoding(tok_dir)
    items = mine_file(stdlib_root(), "json/__init__.py")
    convs = build_conversations(items, seed=0, passes=1, greetings=2)
    assert any(len(c.messages) > 2 for c in convs)
    for c in convs:
        messages = list(c.messages)
        text = render(messages)
        assert text == wrapper.apply_chat_template(messages, tokenize=False)
        assert text.count("<|end_of_msg|>") == len(messages) and text.endswith("<|end_of_msg|>")
        ids = encode_conversation(enc, messages)
        assert ids == wrapper.encode(text, add_special_tokens=False)
        assert ids[-1] == enc.encode("<|end_of_msg|>", allowed_special="all")[0]
    prompt = render(convs[0].messages[:1], add_generation_prompt=True)
    assert prompt == wrapper.apply_chat_template(list(convs[0].messages[:1]), add_generation_prompt=True,
                                                 tokenize=False)
    assert prompt.endswith('<|open|>message role="assistant"<|sep|>')
    assert render([{"role": "user", "content": "hi"}], CHAT_TEMPLATE) == (
        '<|open|>message role="user"<|sep|>hi<|end_of_msg|>')


def test_chat_spec_has_k3s_active_share_and_fits_a_wheel():
    assert CHAT_SPEC.num_experts_per_token / CHAT_SPEC.num_experts == 16 / 896
    plan = tensor_plan(CHAT_SPEC)
    assert sum(t.nbytes for t in plan) == 16_069_376  # under 30 MB with headers and index (about 21 MB on disk)
    assert sum(t.nbytes for t in plan if t.dtype == "U8") == 10_235_904  # 3,136 experts x 3,264 bytes of mxfp4
    # the same dense parts and tokenizer as the first demo, the same routed compute per token
    same = ("hidden_size", "num_hidden_layers", "intermediate_size", "bpe_merges", "kda_num_heads", "q_lora_rank")
    assert all(getattr(CHAT_SPEC, f) == getattr(TRAINED_SPEC, f) for f in same)
    routed = lambda s: s.num_experts_per_token * 3 * s.moe_intermediate_size * s.routed_expert_hidden_size  # noqa: E731
    assert routed(CHAT_SPEC) == routed(TRAINED_SPEC)
    assert CHAT_SPEC.moe_intermediate_size * CHAT_SPEC.num_shared_experts == 128  # the shared MLP as wide as v1's


def test_docitem_owner_and_short():
    item = DocItem("json/encoder.py", "json", "json", "method", "json.JSONEncoder.encode", "", "Encode it now.")
    assert (item.short, item.owner) == ("encode", "JSONEncoder")


def test_test_files_are_the_test_suites_only(tmp_path):
    from training.corpus import test_files

    for rel, data in {"json/__init__.py": b"x = 1\n", "test/test_json.py": b"def test(): pass\n",
                      "ctypes/tests/t.py": b"y = 2\n", "idlelib/idle_test/h.py": b"z = 3\n",
                      "site-packages/pkg/tests/t.py": b"no = 1\n", "test/bad_coding.py": b"# coding: latin-1\n\xe9\n",
                      "test/data.txt": b"not python\n"}.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_bytes(data)
    got = test_files(tmp_path)
    assert got == ["ctypes/tests/t.py", "idlelib/idle_test/h.py", "test/test_json.py"]
    assert not set(got) & set(corpus_files(tmp_path)) and corpus_files(tmp_path) == ["json/__init__.py"]


# ---- rich mining (--mine rich: training-only questions with new answers) --------------------------------------------

MINI = textwrap.dedent('''\
    """Tiny tools for reading records."""

    def parse(text, sep=","):
        """Split text at sep into fields.

        Returns a list of the fields found in the text.
        """

    def count(text):
        return len(text)

    def _hidden():
        """A private helper that overviews never list."""

    class Reader:
        """Read records from a stream of lines. Each record is one line."""

        def __init__(self, stream):
            self.stream = stream

        def read(self):
            """Return the next record of the stream, or None at its end."""

        def close(self):
            pass

        def _fill(self):
            """Fill the internal buffer with more data."""
    ''')

MINI_RICH = [
    ("contents", "mini", "The `mini` module provides:\n- `mini.parse`: Split text at sep into fields.\n"
                         "- `mini.count(text)`\n- `mini.Reader`: Read records from a stream of lines."),
    ("functions", "mini", "The functions of `mini`:\n- `mini.parse`: Split text at sep into fields.\n"
                          "- `mini.count(text)`"),
    ("methods", "mini.Reader", "`class mini.Reader(stream)` has these methods:\n"
                               "- `read`: Return the next record of the stream, or None at its end.\n- `close()`"),
    ("returns", "mini.parse", '`mini.parse(text, sep=",")`\n\nReturns a list of the fields found in the text.'),
    ("returns", "mini.Reader.read", "`mini.Reader.read()`\n\nReturn the next record of the stream, or None at its end."),
    ("where", "mini.parse", '`parse` is defined in the `mini` module: `mini.parse(text, sep=",")`'),
    ("where", "mini.count", "`count` is defined in the `mini` module: `mini.count(text)`"),
    ("where", "mini.Reader", "`Reader` is defined in the `mini` module: `class mini.Reader(stream)`"),
]


def test_rich_items_of_a_tiny_module():
    wide = mine_source(MINI, "mini.py", wide=True)
    assert [i.name for i in wide] == ["mini", "mini.parse", "mini.count", "mini._hidden", "mini.Reader",
                                      "mini.Reader.read", "mini.Reader.close", "mini.Reader._fill"]
    rich = rich_items(wide, {"mini": "mini.py"})
    assert [(i.kind, i.name, answer(i)) for i in rich] == MINI_RICH  # no "classes": mini has one class only
    assert {(i.file, i.module, i.domain) for i in rich} == {("mini.py", "mini", "mini")}
    by = {(i.kind, i.name): i for i in rich}
    assert question(by["contents", "mini"], RICH["contents"][0]) == "What does the mini module provide?"
    assert question(by["functions", "mini"], RICH["functions"][0]) == "Which functions are in mini?"
    assert question(by["methods", "mini.Reader"], RICH["methods"][0]) == "What methods does mini.Reader have?"
    assert question(by["returns", "mini.parse"], RICH["returns"][0]) == "What does mini.parse return?"
    assert question(by["where", "mini.Reader"], RICH["where"][0]) == "Which module defines Reader?"
    # A turn about a rich item asks one of its kind's questions (never a bare "And mini?") and gives its answer.
    for seed in range(30):
        for item in rich:
            q, a = turn(item, np.random.default_rng(seed), follow_up=True)
            assert q["content"] in [question(item, t) for t in RICH[item.kind]] and a["content"] == answer(item)
    # A name two modules define is not asked about; a module or class of a held-out file is never asked about.
    other = mine_source("def parse(x):\n    \"\"\"Parse x into a value of some kind.\"\"\"\n", "other.py", wide=True)
    names = [(i.kind, i.name) for i in rich_items(wide + other, {"mini": "mini.py", "other": "other.py"})]
    assert ("where", "mini.count") in names and ("where", "mini.parse") not in names
    assert ("where", "other.parse") not in names and ("returns", "mini.parse") in names
    assert is_heldout("getopt.py") and rich_items(mine_source(MINI, "getopt.py", wide=True),
                                                  {"getopt": "getopt.py"}) == []


def test_returns_and_first_sentences():
    assert returns_sentence("Do things. Returns the number of things done today.") == (
        "Returns the number of things done today.")
    assert returns_sentence("Return it.") == "" and returns_sentence("Returning is not a sentence start here.") == ""
    assert returns_sentence("Compute x.\n\nReturn the value of x\nas an int, or None.") == (
        "Return the value of x as an int, or None.")


RICH_FILES = ["ast.py", "getopt.py", "shlex.py", "json/__init__.py", "json/decoder.py", "json/encoder.py",
              "logging/__init__.py", "logging/handlers.py"]


def test_rich_is_wide_plus_training_only_items():
    root = stdlib_root()
    wide = mine_stdlib(root, RICH_FILES, wide=True)
    rich = mine_stdlib(root, RICH_FILES, rich=True)
    assert rich[: len(wide)] == wide and rich == mine_stdlib(root, RICH_FILES, rich=True)  # a superset, deterministic
    extra = rich[len(wide):]
    assert {i.kind for i in extra} == {"contents", "functions", "classes", "methods", "returns", "where"}
    assert not any(is_heldout(i.file) for i in extra) and split_items(extra) == (extra, [])
    assert {i.module for i in extra if i.kind == "contents"} == {"shlex", "json", "json.decoder", "json.encoder",
                                                                 "logging"}
    # nothing of a held-out file (ast, getopt, logging.handlers) reaches a rich question or answer
    held = [i for i in wide if is_heldout(i.file)]
    assert held
    text = "".join(render(c.messages) for c in build_conversations(extra, seed=0, passes=2))
    for item in held:
        if item.kind != "module":
            assert f"{item.name}(" not in text and f"`{item.name}`" not in text, item.name
        if item.doc:
            assert item.doc not in text, item.name
    # the json overview lists what json re-exports, by the names users know
    contents = next(i for i in extra if (i.kind, i.name) == ("contents", "json"))
    assert contents.doc.splitlines()[:3] == [
        "The `json` module provides:",
        "- `json.dump`: Serialize ``obj`` as a JSON formatted stream to ``fp`` (a ``.write()``-supporting file-like "
        "object).",
        "- `json.dumps`: Serialize ``obj`` to a JSON formatted ``str``."]
    assert "- `json.JSONEncoder`: Extensible JSON <https://json.org> encoder for Python data structures." in (
        contents.doc.splitlines())
    # sessions mix the new kinds with the other questions about the same module; seeded
    a = build_conversations(split_items(rich)[0], seed=2, passes=1)
    assert a == build_conversations(split_items(rich)[0], seed=2, passes=1)
    assert a != build_conversations(split_items(rich)[0], seed=3, passes=1)
    rich_answers = {answer(i) for i in extra}
    mixed = [c for c in a if {m["content"] in rich_answers for m in c.messages[1::2]} == {True, False}]
    assert mixed and all(len({i.module for i in rich if i.name in c.names}) == 1 for c in mixed)


def test_wide_conversations_unchanged_by_rich():
    """The shipped recipe's data (--mine wide) as before the rich kinds: a digest of the items and the rendered
    conversations of a small file set, pinned for the stdlib sources it was taken on (else skipped)."""
    root = stdlib_root()
    files = ["json/__init__.py", "json/decoder.py", "json/encoder.py", "shlex.py", "getopt.py", "logging/__init__.py"]
    src = hashlib.sha256(b"".join((root / f).read_bytes() for f in files)).hexdigest()
    if src != "f2d0d0eb6c215002dafb6c110cb8fb0105e92b22d7ab937c3141a55f83ed5028":
        pytest.skip("another standard library than the digest was taken on")
    items = mine_stdlib(root, files, wide=True)
    convs = build_conversations(split_items(items)[0], seed=5, passes=2, greetings=3)
    h = hashlib.sha256(repr(items).encode())
    for c in convs:
        h.update(render(c.messages).encode() + b"\0" + repr((c.domain, c.names)).encode())
    assert (len(items), len(convs)) == (179, 213)
    assert h.hexdigest() == "6551f61e6bfbfb6aeebf655db6c55b369d65111cead895c41c21224841b956ff"


def test_prepare_chat_records_rich_and_keeps_the_held_out_conversations(tok_dir, tmp_path):
    """scripts/train_demo.py's chat stage on a small stdlib copy: --mine rich trains on more distinct conversation
    tokens per pass than wide, records itself in corpus.json, and writes the same held-out conversations."""
    import argparse
    import importlib.util
    import shutil

    from tqbench.demo import special_ids

    spec = importlib.util.spec_from_file_location("train_demo_rich", ROOT_DIR / "scripts" / "train_demo.py")
    td = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(td)
    files = ["getopt.py", "json/__init__.py", "json/decoder.py", "json/encoder.py", "shlex.py"]
    root = tmp_path / "lib"
    for f in files:
        (root / f).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(stdlib_root() / f, root / f)
    enc = load_encoding(tok_dir)
    eos = special_ids(CHAT_SPEC)["eos_token_id"]
    train_files = [f for f in files if not is_heldout(f)]
    code = [np.array(enc.encode_ordinary((root / f).read_text()) + [eos], np.uint32) for f in train_files]
    info = {}
    for mine, copy_share in (("wide", 0.0), ("rich", 0.0), ("copy", 0.5)):
        work = tmp_path / mine
        shutil.copytree(tok_dir, work / "tokenizer")
        a = argparse.Namespace(mine="wide" if mine == "copy" else mine, seed=0, chat_share=0.5, greetings=2,
                               copy_share=copy_share)
        info[mine], stream = td.prepare_chat(work, root, files, enc, code, train_files, a)
        assert info[mine]["copy_share"] == copy_share and len(stream) == info[mine]["train"]["tokens"]
    assert (tmp_path / "wide" / "val_chat.npy").read_bytes() == (tmp_path / "rich" / "val_chat.npy").read_bytes()
    # renamed training sessions: the held-out conversations stay as they were, the training ones change
    assert (tmp_path / "wide" / "val_chat.npy").read_bytes() == (tmp_path / "copy" / "val_chat.npy").read_bytes()
    assert info["copy"]["items"] == info["wide"]["items"]
    assert info["copy"]["train"]["tokens_per_pass"] != info["wide"]["train"]["tokens_per_pass"]
    assert info["rich"]["items"]["train"] > info["wide"]["items"]["train"]
    assert info["rich"]["train"]["tokens_per_pass"] > info["wide"]["train"]["tokens_per_pass"]
    assert info["rich"]["mine"] == "rich" and info["rich"]["items"]["kinds"]["contents"] == 4  # json, json.decoder, json.encoder, shlex
    assert "(rich)" in info["rich"]["source"] and "(rich)" not in info["wide"]["source"]
