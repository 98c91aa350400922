"""The chat demo's conversations, mined from the Python standard library with `ast`, and the mixed training stream.

A user asks what a module, function, class or method does, or how to call it, and the assistant answers with its
signature and its docstring (the first paragraph or two, bounded). Everything is decided by the source and a seed:

- `mine_file` / `mine_stdlib`: one `DocItem` per public module, top-level function, top-level class and public method
  (or property) of a top-level class that has a non-trivial docstring; private names (a leading underscore, also in a
  module path) and dunder methods are skipped, as are nested definitions and conditional ones (inside `if`/`try`).
  `wide=True` (the training data of the chat demo since v5) also takes private names (not dunders), and functions,
  methods and classes without a docstring as signature-only items (`doc == ""`: only "how do I call it" is asked);
  the evaluation keeps the default set, so its questions stay the same;
- `rich=True` (training only; implies `wide`): the wide items, then items of new kinds derived from the training files'
  items (`rich_items`), each a question with a new answer: what a module provides (`contents`; also its `functions` and
  `classes` alone when it has both), what methods a class has (`methods`), what a function or method returns (`returns`:
  a docstring sentence starting "Return"), and which module defines a public name (`where`, names defined once only);
- `build_conversations`: seeded sessions of one to three turns about one module (so a conversation keeps to one domain),
  each question in one of several phrasings; `passes` rebuilds the sessions with fresh groupings and phrasings;
- `render` / `encode_conversation`: the messages through the model's chat template with jinja2, exactly as transformers'
  `apply_chat_template` (and so mlx-lm's tokenizer wrapper) renders it; every turn ends with the eos `<|end_of_msg|>`;
- `mix_stream`: code documents and conversations shuffled into one token stream with a given share of chat tokens.

The split is the code corpus's: an item is held out when its file is (`training.corpus.is_heldout`), so conversations
about held-out modules never reach training. Every item and document carries a domain: the top-level package or module
of its file (`asyncio`, `email`, `json`, ...)."""

from __future__ import annotations

import ast
import re
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import numpy as np

from tqbench.tokenizer import CHAT_TEMPLATE
from training.corpus import corpus_files, is_heldout, stdlib_root

MAX_DOC_CHARS = 400  # an answer's docstring part: the first paragraph, the second too while the total stays below this
MAX_SIGNATURE_CHARS = 480  # longer signatures (huge default literals) are skipped
MIN_DOC_WORDS = 4  # fewer words of two or more letters: a trivial docstring ("Return self.", "XXX")
SESSION_TURNS = (1, 2, 3)
SESSION_WEIGHTS = (0.5, 0.3, 0.2)
FOLLOW_UP_SHARE = 0.3  # later turns of a session ask "And ...?" this often

# Questions. {name}: the qualified name (json.dumps), {short}: its last part (dumps), {module}: the module (json),
# {owner}: the class of a method. "what" questions get the signature then the docstring, "call" questions a sentence
# with the signature first.
WHAT = {
    "function": ["What does {name} do?", "What does `{name}` do?", "What is {name} for?", "Can you explain {name}?",
                 "Explain {short} from the {module} module.", "I found {short} in {module}. What does it do?",
                 "Tell me about {name}.", "what does {name} do"],
    "method": ["What does {name} do?", "What does the {short} method of {owner} do?", "What is {name} for?",
               "Can you explain {owner}.{short}?", "Tell me about {name}.", "what does {name} do"],
    "property": ["What is {name}?", "What does the {short} attribute of {owner} hold?", "Tell me about {name}."],
    "class": ["What is {name}?", "What is the {short} class in {module}?", "What does {name} do?",
              "Can you explain the {name} class?", "Tell me about {name}.", "what is {name}"],
    "module": ["What is the {name} module?", "What is {name} for?", "What does the {name} module do?",
               "Tell me about the {name} module.", "what is {name}"],
}
CALL = {
    "function": ["How do I call {name}?", "What arguments does {name} take?", "What is the signature of {name}?",
                 "How do I use {short} from {module}?"],
    "method": ["How do I call {name}?", "What arguments does {owner}.{short} take?",
               "What is the signature of {name}?"],
    "class": ["How do I create an instance of {name}?", "What arguments does {name} take?", "How do I use {name}?"],
}
CALL_LEAD = {"function": "Call it as", "method": "Call it as", "class": "Create one with"}
# The rich kinds (`rich_items`): questions about a module's, a class's or a function's contents, each with its answer
# precomputed as the item's `doc` (`returns`: the signature then the sentence, as the "what" answers).
RICH = {
    "contents": ["What does the {name} module provide?", "What is in the {name} module?", "What does {name} contain?",
                 "What can I use from {name}?", "List the functions and classes of {name}.",
                 "what is in {name}"],
    "functions": ["Which functions are in {name}?", "What functions does the {name} module have?",
                  "List the functions in {name}.", "which functions does {name} define"],
    "classes": ["Which classes are in {name}?", "What classes does the {name} module define?",
                "List the classes in {name}."],
    "methods": ["What methods does {name} have?", "Which methods does the {short} class of {module} have?",
                "List the methods of {name}.", "What can I do with a {name} object?", "what methods does {name} have"],
    "returns": ["What does {name} return?", "What does `{name}` return?", "What is the return value of {name}?",
                "What do I get back from {name}?", "what does {name} return"],
    "where": ["Which module defines {short}?", "Where is {short} defined?", "Which module is {short} in?",
              "Where does {short} come from?", "where is {short}"],
}
RICH_MAX_ENTRIES = 12  # the entries an overview lists (then "... and N more")
MAX_SENTENCE_CHARS = 160  # an overview entry's first docstring sentence, longer ones cut at a word
FOLLOW_UP = ["And {name}?", "What about {name}?", "And what does {short} do?"]
GREETINGS = ["hello", "Hello!", "hi", "Hi there", "hey", "Good morning", "Who are you?", "What can you do?", "help",
             "Hello, what can I ask you?"]
GREETING_ANSWERS = [
    "Hello! I am a small model trained on the Python standard library. Ask me what a module, function or class "
    "does, for example: What does {name} do?",
    "Hi! Ask me about the Python standard library: what a function does or how to call it, for example: How do I "
    "call {name}?",
    "I know the Python standard library a little. Ask me what something does, for example: What is {name}?",
]


@dataclass(frozen=True)
class DocItem:
    """One documented public thing of the standard library."""

    file: str  # the corpus-relative path it is defined in
    module: str  # dotted module name (json, email.mime.text)
    domain: str  # the top-level package or module of the file (json, email)
    kind: str  # module | function | class | method | property
    name: str  # qualified name: json, json.dumps, json.JSONEncoder.encode
    signature: str  # what the answer shows: "json.dumps(obj, *, ...)", "class json.JSONEncoder(...)"; "" for a module
    doc: str  # the cleaned docstring (`clean_doc`)

    @property
    def short(self) -> str:
        return self.name.rsplit(".", 1)[-1]

    @property
    def owner(self) -> str:
        return self.name.rsplit(".", 2)[-2] if self.kind in ("method", "property") else self.module


def module_name(rel: str) -> str:
    """The dotted module name of a corpus-relative path: `json/__init__.py` -> `json`, `email/mime/text.py` ->
    `email.mime.text`."""
    parts = rel.removesuffix(".py").split("/")
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def domain_of(rel: str) -> str:
    """The domain of a corpus file: its top-level package or module (`asyncio/tasks.py` -> `asyncio`)."""
    return rel.split("/", 1)[0].removesuffix(".py")


def is_private(name: str) -> bool:
    return name.startswith("_")


def clean_doc(doc: str, max_chars: int = MAX_DOC_CHARS) -> str:
    """A docstring (already `inspect.cleandoc`ed) cut to what an answer shows: the first paragraph, the second while
    the total stays within `max_chars`, none that starts a doctest; wrapped prose lines joined into one line (indented
    or list lines kept as they are); a first paragraph longer than `max_chars` cut at its last sentence end (else its
    last word) that fits. "" when nothing is left or the text is trivial (fewer than `MIN_DOC_WORDS` words)."""
    paras = [p.strip("\n") for p in re.split(r"\n[ \t]*\n", doc.strip()) if p.strip()]
    out: list[str] = []
    for p in paras[:2]:
        if p.lstrip().startswith(">>>"):
            break
        lines = p.splitlines()
        if all(line == line.lstrip() and not re.match(r"[-*+]\s|\d+[.)]\s", line) for line in lines):
            p = " ".join(line.strip() for line in lines)
        if not out:
            if len(p) > max_chars:
                cut = p[:max_chars]
                end = max(cut.rfind(". "), cut.rfind(".\n"))
                p = cut[: end + 1] if end >= max_chars // 3 else cut.rsplit(None, 1)[0] + " ..."
            out.append(p)
        elif len(out[0]) + 2 + len(p) <= max_chars:
            out.append(p)
    text = "\n\n".join(out).strip()
    return text if len(re.findall(r"[A-Za-z]{2,}", text)) >= MIN_DOC_WORDS else ""


def _decorators(node) -> set[str]:
    return {ast.unparse(d).split("(")[0] for d in node.decorator_list}


def _as_written(source: str, node):
    """`node` as its source spells it (`0o777`, not `511`), as a name node that unparses to that text."""
    if node is None:
        return None
    text = ast.get_source_segment(source, node)
    return ast.Name(id=text) if text and "\n" not in text else node


def _arguments(node, drop_first: bool, source: str) -> str:
    args = ast.arguments(**{f: getattr(node.args, f) for f in node.args._fields})
    args.defaults = [_as_written(source, d) for d in args.defaults]
    args.kw_defaults = [_as_written(source, d) for d in args.kw_defaults]
    if drop_first:
        if args.posonlyargs:
            args.posonlyargs = args.posonlyargs[1:]
        elif args.args:
            if len(args.defaults) > len(args.args) - 1:  # the dropped argument had a default
                args.defaults = args.defaults[1:]
            args.args = args.args[1:]
    text = ast.unparse(args)
    if node.returns is not None:
        return f"({text}) -> {ast.unparse(node.returns)}"
    return f"({text})"


def _function_signature(node, qual: str, method: bool, source: str) -> str:
    decos = _decorators(node)
    sig = qual + _arguments(node, method and "staticmethod" not in decos, source)
    if isinstance(node, ast.AsyncFunctionDef):
        sig = "coroutine " + sig
    elif "classmethod" in decos:
        sig = "classmethod " + sig
    elif "staticmethod" in decos:
        sig = "staticmethod " + sig
    return sig


def _class_signature(node: ast.ClassDef, qual: str, source: str) -> str:
    init = next((b for b in node.body if isinstance(b, ast.FunctionDef) and b.name == "__init__"), None)
    if init is not None:
        return "class " + qual + _arguments(init, True, source).split(" -> ")[0]
    bases = ", ".join(ast.unparse(b) for b in node.bases + node.keywords)
    return f"class {qual}({bases})" if bases else f"class {qual}"


def mine_source(source: str, rel: str, wide: bool = False) -> list[DocItem]:
    """The documented public items of one module's source (the corpus-relative path `rel` names it). An unparsable
    source, or one whose module path has a private part, gives none. `wide`: private names too (dunders never), and
    functions, methods and classes without a docstring as signature-only items (`doc == ""`)."""
    module = module_name(rel)
    private = (lambda name: name.startswith("__")) if wide else is_private
    if any(private(part) for part in module.split(".")) or rel.endswith("__main__.py"):
        return []
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return []
    domain = domain_of(rel)
    items: list[DocItem] = []
    seen: set[str] = set()

    def add(kind: str, qual: str, signature: str, node) -> None:
        doc = ast.get_docstring(node, clean=True)
        text = clean_doc(doc) if doc else ""
        keep = text or (wide and kind in CALL)
        if keep and qual not in seen and len(signature) <= MAX_SIGNATURE_CHARS:
            seen.add(qual)
            items.append(DocItem(rel, module, domain, kind, qual, signature, text))

    add("module", module, "", tree)
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and not private(node.name):
            qual = f"{module}.{node.name}"
            add("function", qual, _function_signature(node, qual, False, source), node)
        elif isinstance(node, ast.ClassDef) and not private(node.name):
            cls = f"{module}.{node.name}"
            add("class", cls, _class_signature(node, cls, source), node)
            for sub in node.body:
                if not isinstance(sub, (ast.FunctionDef, ast.AsyncFunctionDef)) or private(sub.name):
                    continue
                decos, qual = _decorators(sub), f"{cls}.{sub.name}"
                if decos & {"property", "functools.cached_property", "cached_property"}:
                    add("property", qual, qual, sub)
                elif not any(d.endswith((".setter", ".deleter", ".getter")) for d in decos):
                    add("method", qual, _function_signature(sub, qual, True, source), sub)
    return items


def mine_file(root: Path, rel: str, wide: bool = False) -> list[DocItem]:
    """`mine_source` of the corpus file `rel` under the stdlib directory `root`."""
    return mine_source((Path(root) / rel).read_text(encoding="utf-8"), rel, wide)


def public_names(tree: ast.Module) -> list[str]:
    """What `from module import *` gives: a literal `__all__`, else the public top-level functions and classes."""
    for node in tree.body:
        if (isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets)):
            try:
                names = ast.literal_eval(node.value)
            except ValueError:
                break
            return [n for n in names if isinstance(n, str)]
    return [n.name for n in tree.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
            and not is_private(n.name)]


def reexports(tree: ast.Module, package: str, public: dict[str, list[str]]) -> dict[str, str]:
    """The names a package's `__init__` re-exports from its own submodules (`from .tasks import *`,
    `from .encoder import JSONEncoder`), as {defining name: package name}, e.g. `asyncio.tasks.sleep` ->
    `asyncio.sleep`; `public` gives each module's `public_names` for star imports."""
    out: dict[str, str] = {}
    for node in tree.body:
        if not isinstance(node, ast.ImportFrom) or not node.module:
            continue
        if node.level == 1:
            sub = f"{package}.{node.module}"
        elif node.level == 0 and node.module.startswith(package + "."):
            sub = node.module
        else:
            continue
        for alias in node.names:
            names = public.get(sub, []) if alias.name == "*" else [alias.name]
            for n in names:
                exported = alias.asname if alias.name != "*" and alias.asname else n
                if not is_private(exported):
                    out[f"{sub}.{n}"] = f"{package}.{exported}"
    return out


def _renamed(item: DocItem, aliases: dict[str, str]) -> DocItem:
    """`item` under the name its package re-exports it as (methods follow their class), if any."""
    from dataclasses import replace

    head = item.name if item.kind in ("function", "class") else item.name.rsplit(".", 1)[0]
    if item.kind == "module" or head not in aliases:
        return item
    new = aliases[head] + item.name[len(head):]
    return replace(item, name=new, module=aliases[head].rsplit(".", 1)[0],
                   signature=item.signature.replace(item.name, new, 1))


def mine_stdlib(root: Path | None = None, files: Sequence[str] | None = None, wide: bool = False,
                rich: bool = False) -> list[DocItem]:
    """The items of every corpus file (default: `corpus_files(root)`), in file order, named as users know them: what a
    package's `__init__` re-exports from its submodules goes by the package's name (`asyncio.sleep`, not
    `asyncio.tasks.sleep`; `json.JSONEncoder.encode`). `wide`: as `mine_source`'s. `rich`: the `wide` items (the
    same list, first) then `rich_items` of them, which come from training files only."""
    wide = wide or rich
    root = Path(root or stdlib_root())
    files = list(files if files is not None else corpus_files(root))
    sources = {rel: (root / rel).read_text(encoding="utf-8") for rel in files}
    trees: dict[str, ast.Module] = {}
    for rel, src in sources.items():
        try:
            trees[rel] = ast.parse(src)
        except (SyntaxError, ValueError):
            pass
    public = {module_name(rel): public_names(t) for rel, t in trees.items()}
    aliases: dict[str, str] = {}
    for rel, t in trees.items():
        if rel.endswith("/__init__.py"):
            aliases.update(reexports(t, module_name(rel), public))
    items, seen = [], set()
    for rel in files:
        for item in mine_source(sources[rel], rel, wide):
            item = _renamed(item, aliases)
            if item.name not in seen:
                seen.add(item.name)
                items.append(item)
    if rich:
        items += rich_items(items, {module_name(rel): rel for rel in files})
    return items


def first_sentence(doc: str, max_chars: int = MAX_SENTENCE_CHARS) -> str:
    """The first sentence of a cleaned docstring's first paragraph, on one line; cut at its last word within
    `max_chars` (" ...") when longer."""
    para = " ".join(doc.strip().split("\n\n", 1)[0].split())
    m = re.match(r"(.+?[.!?])(?=\s|$)", para)
    text = m.group(1) if m else para
    if len(text) > max_chars:
        text = text[:max_chars].rsplit(None, 1)[0] + " ..."
    return text


def sentences(doc: str) -> list[str]:
    """A cleaned docstring's sentences: its paragraphs' lines joined, split after ".", "!" or "?" before a capital."""
    out = []
    for para in doc.split("\n\n"):
        out += [s for s in re.split(r"(?<=[.!?])\s+(?=[A-Z`(])", " ".join(para.split())) if s]
    return out


def returns_sentence(doc: str) -> str:
    """The first sentence of a cleaned docstring that starts "Return"/"Returns" and says something (at least
    `MIN_DOC_WORDS` words, within `MAX_DOC_CHARS`); "" when there is none."""
    for s in sentences(doc):
        if (re.match(r"Returns?\b", s) and len(re.findall(r"[A-Za-z]{2,}", s)) >= MIN_DOC_WORDS
                and len(s) <= MAX_DOC_CHARS):
            return s
    return ""


def _entry(item: DocItem, short: bool = False) -> str:
    """One line of an overview: the name and the first sentence of its docstring, or the signature when it has none."""
    name = item.short if short else item.name
    if item.doc:
        return f"- `{name}`: {first_sentence(item.doc)}"
    sig = item.signature.replace(item.name, item.short, 1) if short else item.signature
    return f"- `{sig}`"


def _listing(lead: str, entries: Sequence[str]) -> str:
    more = len(entries) - RICH_MAX_ENTRIES
    return "\n".join([lead, *entries[:RICH_MAX_ENTRIES]] + ([f"... and {more} more."] if more > 0 else []))


def rich_items(items: Sequence[DocItem], module_files: dict[str, str]) -> list[DocItem]:
    """The rich kinds derived from `items` (`mine_stdlib`'s, named as users know them), from training files only:
    nothing of a held-out file (`is_heldout`) is used, and no module or class whose own file is held out is asked
    about. `module_files`: each module's own file ({"json": "json/__init__.py"}). Each gets its module and domain, and
    the file of its subject (the module's, the class's, the function's), so `split_items` keeps them all for training.

    - `contents` (a module with two or more public functions and classes), `functions` / `classes` (two or more of
      that kind when the module has the other kind too): their names in source order and the first sentence of
      each docstring (`first_sentence`; the signature when undocumented), one per line, at most `RICH_MAX_ENTRIES`;
    - `methods` (a class with two or more public methods): the methods the same way, by their short names;
    - `returns` (a documented function or method with a `returns_sentence`): the signature, then that sentence;
    - `where` (a public function or class whose short name no other function or class of `items` has): the module."""
    train = [i for i in items if not is_heldout(i.file)]
    public = [i for i in train if not any(is_private(p) for p in i.name.split("."))]
    by_module: dict[str, list[DocItem]] = {}
    by_class: dict[str, list[DocItem]] = {}
    for i in train:
        if i.kind in ("function", "class") and not is_private(i.short):
            by_module.setdefault(i.module, []).append(i)
        elif i.kind == "method" and not is_private(i.short):
            by_class.setdefault(i.name.rsplit(".", 1)[0], []).append(i)
    classes = {i.name: i for i in train if i.kind == "class"}
    out: list[DocItem] = []
    for module, group in by_module.items():
        rel = module_files.get(module)
        if rel is None or is_heldout(rel):
            continue
        derived = (DocItem(rel, module, domain_of(rel), "contents", module, "",
                           _listing(f"The `{module}` module provides:", [_entry(i) for i in group])),)
        funcs = [i for i in group if i.kind == "function"]
        klass = [i for i in group if i.kind == "class"]
        if funcs and klass:
            derived += tuple(DocItem(rel, module, domain_of(rel), kind, module, "",
                                     _listing(f"The {kind} of `{module}`:", [_entry(i) for i in these]))
                             for kind, these in (("functions", funcs), ("classes", klass)) if len(these) >= 2)
        out += derived if len(group) >= 2 else ()
    for cls, group in by_class.items():
        owner = classes.get(cls)
        if owner is None or len(group) < 2:
            continue
        out.append(DocItem(owner.file, owner.module, owner.domain, "methods", cls, owner.signature,
                           _listing(f"`{owner.signature}` has these methods:", [_entry(i, short=True) for i in group])))
    for i in train:
        sentence = returns_sentence(i.doc) if i.kind in ("function", "method") and i.doc else ""
        if sentence:
            out.append(DocItem(i.file, i.module, i.domain, "returns", i.name, i.signature, sentence))
    names = Counter(i.short for i in items if i.kind in ("function", "class"))
    for i in public:
        if i.kind in ("function", "class") and names[i.short] == 1:
            out.append(DocItem(i.file, i.module, i.domain, "where", i.name, i.signature,
                               f"`{i.short}` is defined in the `{i.module}` module: `{i.signature}`"))
    return out


def split_items(items: Iterable[DocItem]) -> tuple[list[DocItem], list[DocItem]]:
    """(training, held-out) by the code corpus's rule on each item's file."""
    items = list(items)
    return [i for i in items if not is_heldout(i.file)], [i for i in items if is_heldout(i.file)]


# ---- conversations --------------------------------------------------------------------------------------------------


def answer(item: DocItem, style: str = "what") -> str:
    """The assistant's answer: the signature in backticks, then the docstring; for "call" questions a sentence
    leads with it. A module's answer is its docstring; a rich item's is its `doc` (`returns`: the signature first)."""
    if item.kind == "module" or item.kind in RICH and item.kind != "returns":
        return item.doc
    if style == "call" and item.kind in CALL_LEAD:
        return f"{CALL_LEAD[item.kind]} `{item.signature}`." + (f"\n\n{item.doc}" if item.doc else "")
    return f"`{item.signature}`\n\n{item.doc}"


def question(item: DocItem, template: str) -> str:
    return template.format(name=item.name, short=item.short, module=item.module, owner=item.owner)


def turn(item: DocItem, rng: np.random.Generator, follow_up: bool = False) -> list[dict]:
    """One seeded question about `item` and its answer, as two messages."""
    styles = ["what"] + (["call"] if item.kind in CALL else [])
    style = styles[rng.integers(len(styles))] if rng.random() < 0.7 or len(styles) == 1 else "call"
    if not item.doc:  # a signature-only item: only how to call it can be answered
        style = "call"
    if style == "call":
        template = CALL[item.kind][rng.integers(len(CALL[item.kind]))]
    elif follow_up and item.kind not in ("module", *RICH) and rng.random() < FOLLOW_UP_SHARE:
        template = FOLLOW_UP[rng.integers(len(FOLLOW_UP))]
    else:
        templates = RICH.get(item.kind) or WHAT[item.kind]
        template = templates[rng.integers(len(templates))]
    return [{"role": "user", "content": question(item, template)},
            {"role": "assistant", "content": answer(item, style)}]


@dataclass(frozen=True)
class Conversation:
    messages: tuple  # ({"role", "content"}, ...)
    domain: str  # the items' domain, "chat" for greetings
    names: tuple[str, ...]  # the items asked about


COPYABLE = ("function", "method", "class", "property")  # kinds whose name a renamed session may change


def pseudo_module(rng: np.random.Generator) -> str:
    """A made-up module path (one or two parts of 3-8 random letters): names the model cannot have memorised."""
    parts = int(rng.integers(1, 3))
    return ".".join("".join(chr(97 + int(c)) for c in rng.integers(0, 26, int(rng.integers(3, 9))))
                    for _ in range(parts))


def renamed(item: DocItem, module: str) -> DocItem:
    """`item` as if its module were `module`: the qualified name and the signature change, the docstring does not.
    Items whose signature does not hold their name come back unchanged."""
    if item.kind not in COPYABLE or not item.name.startswith(item.module + ".") or item.name not in item.signature:
        return item
    name = module + item.name[len(item.module):]
    return DocItem(item.file, module, item.domain, item.kind, name, item.signature.replace(item.name, name, 1),
                   item.doc)


def build_conversations(items: Sequence[DocItem], seed: int, passes: int = 1, greetings: int = 0,
                        copy_share: float = 0.0) -> list[Conversation]:
    """Seeded sessions over `items`: per pass, each module's items in a random order cut into sessions of 1-3 turns
    (`SESSION_WEIGHTS`), every item asked once per pass; the sessions of all modules in a random order. Plus
    `greetings` small-talk exchanges whose answers point at random items. The same items and seed give the same
    conversations.

    `copy_share`: that share of the sessions ask about their items under a made-up module path (`pseudo_module`,
    one per session: `renamed`), so the answer's signature can only be right by copying the name from the question,
    not by recalling a memorised one (the demo answering about unseen functions named another function three times
    in four). Drawn from a generator of its own: the sessions, their questions and answers are otherwise those of
    copy_share 0."""
    rng = np.random.default_rng([seed, 0xC0DE])
    copy_rng = np.random.default_rng([seed, 0xC0DE, 1])
    by_module: dict[str, list[DocItem]] = {}
    for item in items:
        by_module.setdefault(item.module, []).append(item)
    out: list[Conversation] = []
    for _ in range(passes):
        sessions: list[Conversation] = []
        for module in sorted(by_module):
            group = [by_module[module][i] for i in rng.permutation(len(by_module[module]))]
            while group:
                n = int(rng.choice(SESSION_TURNS, p=SESSION_WEIGHTS))
                chunk, group = group[:n], group[n:]
                asked = chunk
                if copy_share and copy_rng.random() < copy_share:
                    fake = pseudo_module(copy_rng)
                    asked = [renamed(it, fake) for it in chunk]
                messages = [m for j, it in enumerate(asked) for m in turn(it, rng, follow_up=j > 0)]
                sessions.append(Conversation(tuple(messages), chunk[0].domain, tuple(it.name for it in chunk)))
        out += [sessions[i] for i in rng.permutation(len(sessions))]
    named = [i for i in items if i.kind != "module"]
    for _ in range(greetings if named else 0):
        item = named[rng.integers(len(named))]
        reply = GREETING_ANSWERS[rng.integers(len(GREETING_ANSWERS))].format(name=item.name)
        messages = ({"role": "user", "content": GREETINGS[rng.integers(len(GREETINGS))]},
                    {"role": "assistant", "content": reply})
        out.insert(int(rng.integers(len(out) + 1)), Conversation(messages, "chat", ()))
    return out


# ---- rendering ------------------------------------------------------------------------------------------------------


@lru_cache(maxsize=4)
def _compiled(template: str):
    """The template compiled as transformers compiles chat templates (a sandboxed environment, trim_blocks,
    lstrip_blocks, the loopcontrols extension, its `tojson`: json.dumps without HTML escapes, non-ASCII kept), so the
    rendering is the same string."""
    import json

    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = lambda x, ensure_ascii=False, indent=None, separators=None, sort_keys=False: json.dumps(
        x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)
    return env.from_string(template)


def render(messages: Sequence[dict], template: str = CHAT_TEMPLATE, add_generation_prompt: bool = False,
           tools: Sequence[dict] | None = None, **special) -> str:
    """`messages` rendered by the chat `template` (the one `tqbench.tokenizer` writes into tokenizer_config.json), with
    `tools` offered: what `tokenizer.apply_chat_template(messages, tools=tools, tokenize=False)` returns."""
    return _compiled(template).render(messages=list(messages), add_generation_prompt=add_generation_prompt,
                                      tools=list(tools) if tools else None, **special)


def encode_conversation(encoding, messages: Sequence[dict], template: str = CHAT_TEMPLATE) -> list[int]:
    """Token ids of a rendered conversation: the template's special tokens as specials, the text between them as
    ordinary text (as the transformers tokenizer encodes the rendered string)."""
    return encoding.encode(render(messages, template), allowed_special="all")


# ---- the mixed stream -----------------------------------------------------------------------------------------------


@dataclass
class MixedStream:
    tokens: np.ndarray  # uint32 ids, documents back to back
    starts: np.ndarray  # int64 start of each document in `tokens`
    kinds: list[str]  # "code" or "chat" per document
    domains: list[str]  # the domain of each document
    code_tokens: int
    chat_tokens: int

    @property
    def chat_share(self) -> float:
        return self.chat_tokens / max(self.code_tokens + self.chat_tokens, 1)

    def summary(self, top: int = 20) -> dict:
        """Counts for the record: documents and tokens of each kind, the `top` domains by tokens (all documents, and
        the conversations alone)."""
        by_domain: dict[str, Counter[str]] = {"all": Counter(), "chat": Counter()}
        ends = np.append(self.starts[1:], len(self.tokens))
        for kind, d, s, e in zip(self.kinds, self.domains, self.starts, ends):
            by_domain["all"][d] += int(e - s)
            if kind == "chat":
                by_domain["chat"][d] += int(e - s)
        return {"tokens": int(len(self.tokens)), "documents": len(self.kinds),
                "code_documents": self.kinds.count("code"), "chat_documents": self.kinds.count("chat"),
                "code_tokens": self.code_tokens, "chat_tokens": self.chat_tokens,
                "chat_share": round(self.chat_share, 4),
                "top_domains": dict(by_domain["all"].most_common(top)),
                "top_chat_domains": dict(by_domain["chat"].most_common(top))}


def mix_stream(code_docs: Sequence[np.ndarray], chat_docs: Sequence[np.ndarray], chat_share: float, seed: int,
               code_domains: Sequence[str] | None = None, chat_domains: Sequence[str] | None = None) -> MixedStream:
    """One training stream: every code document once, and conversations until they make `chat_share` of the tokens
    (each document already ends with the eos). Conversations are taken in a seeded random order, cycling through them
    again (a fresh order per cycle) when there are too few, and the last one taken is the one that brings the share
    closest to the target; then all documents are shuffled together (seeded) and concatenated."""
    if not 0.0 <= chat_share < 1.0:
        raise ValueError(f"chat_share must be in [0, 1), got {chat_share}")
    rng = np.random.default_rng([seed, 0x5EED])
    code_tokens = int(sum(len(d) for d in code_docs))
    want = chat_share / (1 - chat_share) * code_tokens
    picked: list[int] = []
    got = 0
    if want > 0:
        if not chat_docs or not any(len(d) for d in chat_docs):
            raise ValueError("a chat share was asked but there are no conversations")
        while got < want:
            for i in rng.permutation(len(chat_docs)):
                n = len(chat_docs[i])
                if got + n - want > want - got:  # taking it would overshoot more than stopping short
                    break
                picked.append(int(i))
                got += n
            else:
                continue
            break
    docs = [("code", j) for j in range(len(code_docs))] + [("chat", i) for i in picked]
    order = rng.permutation(len(docs))
    parts, kinds, domains, starts, pos = [], [], [], [], 0
    for o in order:
        kind, j = docs[o]
        d = np.asarray(code_docs[j] if kind == "code" else chat_docs[j], dtype=np.uint32)
        parts.append(d)
        kinds.append(kind)
        names = code_domains if kind == "code" else chat_domains
        domains.append(names[j] if names is not None else kind)
        starts.append(pos)
        pos += len(d)
    tokens = np.concatenate(parts) if parts else np.zeros(0, np.uint32)
    return MixedStream(tokens, np.array(starts, dtype=np.int64), kinds, domains, code_tokens, got)
