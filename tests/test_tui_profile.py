"""The Profile screen (h) and the app's help screen and command palette, driven with Pilot on real conversions of small
seeded demo sources: profiles learned by a real chat session, or seeded counts stored through the real store; every
figure is checked against the engine (tqbench.profile) or computed here independently."""

from __future__ import annotations

import json
import math
import os
import re
from pathlib import Path

import numpy as np
import pytest
from textual.binding import Binding
from textual.widgets import DataTable, Input

from tqbench.convert import convert
from tqbench.demo import DemoSpec, write_source
from tqbench.profile import Profile, ProfileStore, default_export_file, identify, overview, read_file
from tqbench.recipe import Recipe
from tqbench.runtime.conversation import Sampling
from tqbench.chat.request import ChatRequest, ProfileOptions
from tqbench.chat.session import ChatSession
from tqbench.state import remember_model
from tui.app import TqbenchApp
from tui.screens.help import HelpScreen
from tui.screens.open import OpenScreen
from tui.screens.profile import ProfileScreen
from tui.widgets.heat_map import RAMP, HeatMap
from conftest import converted_copy
from tui_helpers import screen_lines, settle, stable_screen_lines, wait_for

SIZE = (80, 24)


def _convert(root: Path, spec: DemoSpec) -> tuple[Path, Path]:
    src = write_source(root / "src", spec, seed=0)
    dest = root / "model"
    for _ in convert(src, dest, Recipe.parse("tq4")):
        pass
    return src, dest


@pytest.fixture(scope="module")
def demo(tmp_path_factory) -> tuple[Path, Path, str]:
    """(source, its tq4 conversion: 3 MoE layers x 64 experts, a profile file learned by a real chat session on it)."""
    root = tmp_path_factory.mktemp("profile-demo")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TQBENCH_CACHE_DIR", str(root / "cache"))
        src, model = _convert(root, DemoSpec(num_experts=64))
        store_dir = root / "store"
        s = ChatSession()
        try:
            opts = ProfileOptions(store=str(store_dir))
            with s.open(ChatRequest(model=str(model), chat_template=False, profile=opts)) as job:
                job.result()
            with s.reply("def fib(n):", Sampling(max_tokens=12)) as job:
                job.result()
        finally:
            s.close()  # the learner's last save
        fp, geo = identify(model)
        store = ProfileStore(store_dir)
        learned = store.load(fp, geo)
        store.close()
    assert learned.routings > 0
    return src, model, learned.to_text()


@pytest.fixture(scope="module")
def wide(tmp_path_factory) -> Path:
    """A conversion with Kimi K3's 896 experts per layer (2 MoE layers): a copy, named `model`, of the test session's
    (test_profile_output reads the same); the snapshots show its name, relative to its directory."""
    spec = DemoSpec(num_experts=896, num_hidden_layers=3)
    return converted_copy(tmp_path_factory.mktemp("profile-wide"), "tq4", spec, name="model")


def put(p: Profile) -> None:
    store = ProfileStore()
    try:
        store.put(p)
    finally:
        store.close()


def stored(model: Path) -> Profile:
    fp, geo = identify(model)
    store = ProfileStore()
    try:
        return store.load(fp, geo)
    finally:
        store.close()


def learned_into_store(model: Path, text: str, tmp_path: Path) -> Profile:
    """The demo's learned profile, put into this test's store (as `tqbench profile import` does)."""
    fp, geo = identify(model)
    (tmp_path / "learned.json").write_text(text)
    p = read_file(tmp_path / "learned.json", fp, geo)
    put(p)
    return p


def seeded(model: Path, seed: int, sessions: int = 2) -> Profile:
    """Counts drawn from a seeded generator, about a third of the experts never routed, a few hot."""
    fp, geo = identify(model)
    rng = np.random.default_rng(seed)
    p = Profile.empty(fp, geo)
    for n in geo.layers:
        hot = rng.random(geo.experts) < 0.05
        p.decode[n] = (rng.integers(0, 40, geo.experts) * (rng.random(geo.experts) > 0.33) + 400 * hot).astype(float)
        p.prefill[n] = rng.integers(0, 12, geo.experts).astype(float)
    p.routings = float(sum(p.decode[n].sum() + p.prefill[n].sum() for n in geo.layers))
    p.sessions = sessions
    return p


def matrix(p: Profile) -> np.ndarray:
    c = p.counts()
    return np.stack([c[n] for n in p.geometry.layers])


def ramp(values: list[float], top: float) -> str:
    """The glyph of each value, computed here: blank for 0, else RAMP[ceil(9 x value / the map's hottest cell)]."""
    return "".join(" " if v == 0 else RAMP[min(9, math.ceil(9 * v / top))] for v in values)


async def open_profile(pilot) -> ProfileScreen:
    await settle(pilot)
    await pilot.press("h")
    await settle(pilot)
    screen = pilot.app.screen
    assert isinstance(screen, ProfileScreen)
    return screen


def map_rows(app, heat: HeatMap) -> list[str]:
    """The heat map's layer rows as drawn: the cells after each layer label."""
    lines = screen_lines(app)
    top = heat.region.y + 1  # below the expert axis
    lw = heat.label_width
    return [lines[top + i][heat.region.x + lw: heat.region.right] for i in range(len(heat.layer_ids))]


def table_rows(table: DataTable) -> list[list[str]]:
    return [[str(c) for c in table.get_row_at(i)] for i in range(table.row_count)]


# ---- what is shown ---------------------------------------------------------------------------------------------------

async def test_every_expert_its_own_cell_with_the_learned_counts(demo, tmp_path):
    src, model, text = demo
    remember_model(model)
    p = learned_into_store(model, text, tmp_path)
    app = TqbenchApp(src)
    async with app.run_test(size=SIZE) as pilot:
        screen = await open_profile(pilot)
        heat = screen.query_one(HeatMap)
        counts = matrix(p)
        assert heat.bin == 1 and heat.layer_ids == list(p.geometry.layers)
        assert np.array_equal(heat.cells, counts)  # one cell per expert: its count, decode + prefill
        top = counts.max()
        assert map_rows(app, heat) == [ramp(list(row), top).ljust(heat.region.width - heat.label_width)
                                       for row in counts]
        info = "\n".join(screen_lines(app)[:6])
        assert f"learned: {p.routings:,.0f} routings, 1 session" in info and "mature at 20,000 (" in info
        assert "3 MoE layers x 64 experts, top-4" in info
        # The cursor cell: layer 2 (the second MoE layer), expert 5.
        await pilot.press("down", *["right"] * 5)
        n = p.geometry.layers[1]
        cell = str(screen.query_one("#heat-cell").render())
        assert cell.startswith(f"layer {n} expert 5: {counts[1, 5]:,.0f} ") or cell.startswith(
            f"layer {n} expert 5: {counts[1, 5]:,.1f} ")
        assert all(len(line) <= SIZE[0] for line in screen_lines(app))


async def test_896_experts_are_binned_and_zoom_scrolls(wide, tmp_path):
    """At 102 columns the map has 100 (two for the labels): 896 experts in bins of 9, the last of 5. + zooms to bins
    of 4 (224 columns, scrolled); end scrolls to the last."""
    remember_model(wide)
    p = seeded(wide, seed=1)
    put(p)
    counts = matrix(p)
    app = TqbenchApp(tmp_path)
    async with app.run_test(size=(102, 30)) as pilot:
        screen = await open_profile(pilot)
        heat = screen.query_one(HeatMap)
        for size, columns in ((9, 100), (4, 224)):
            sums = [[sum(row[c * size:(c + 1) * size]) for c in range(columns)] for row in counts.tolist()]
            maxima = [[max(row[c * size:(c + 1) * size]) for c in range(columns)] for row in counts.tolist()]
            assert heat.bin == size and heat.cells.shape == (2, columns)
            assert np.allclose(heat.cells, sums) and np.array_equal(heat.maxima, maxima)
            top = max(map(max, sums))
            shown = map_rows(app, heat)
            if size == 9:
                assert shown == [ramp(row, top) for row in sums]  # every bin on screen
            else:
                await pilot.press("end")  # to the last column: the map scrolls
                await pilot.pause()
                shown = map_rows(app, heat)
                assert shown == [ramp(row[-100:], top) for row in sums]
            await pilot.press("end")
            last = columns - 1
            first = last * size
            hottest = first + int(np.argmax(counts[0, first:]))
            cell = str(screen.query_one("#heat-cell").render())
            assert cell.startswith(f"layer {p.geometry.layers[0]} experts {first}-895: ")
            assert f"hottest {hottest}: {maxima[0][last]:,.0f}" in cell or f"hottest {hottest}: " \
                   f"{maxima[0][last]:,.1f}" in cell
            await pilot.press("plus")
            await pilot.pause()


@pytest.mark.parametrize("size", [(80, 24), (120, 35), (200, 50)])
async def test_the_expert_axis_labels_are_whole(wide, tmp_path, size):
    """The axis names the first expert of every tenth column, each label whole: one that would run past the map's
    last column is left out (at 120 columns, 880 in bins of 8 would have read `88`)."""
    remember_model(wide)
    put(seeded(wide, seed=1))
    app = TqbenchApp(tmp_path)
    async with app.run_test(size=size) as pilot:
        screen = await open_profile(pilot)
        heat = screen.query_one(HeatMap)
        region = heat.scrollable_content_region
        shown = min(heat.cells.shape[1], region.width - heat.label_width)
        axis = screen_lines(app)[region.y][region.x + heat.label_width:region.right]
        labels = {m.start(): m.group() for m in re.finditer(r"\d+", axis)}
        expected = {c: str(c * heat.bin) for c in range(0, shown, 10) if c + len(str(c * heat.bin)) <= shown}
        assert labels == expected, (axis, heat.bin)
        assert all(start + len(label) <= shown for start, label in labels.items())


async def test_coverage_is_the_engines(demo, tmp_path):
    src, model, _ = demo
    remember_model(model)
    p = seeded(model, seed=2)
    put(p)
    store = ProfileStore()
    shown = overview(model, store).summary  # what `tqbench profile show` prints
    store.close()
    app = TqbenchApp(src)
    async with app.run_test(size=SIZE) as pilot:
        screen = await open_profile(pilot)
        table = screen.query_one("#coverage", DataTable)
        header = [str(c.label) for c in table.columns.values()]
        assert header[4:7] == ["50%", "80%", "90%"]
        rows = table_rows(table)
        for row, layer, n in zip(rows, shown.layers, p.geometry.layers):
            assert row[0] == str(n) and row[3] == str(layer.experts_used)
            assert row[4:7] == [str(c.experts) for c in layer.coverage]
            assert row[4:7] == [str(p.coverage(n, s)) for s in (0.5, 0.8, 0.9)]
        assert rows[-1][0] == "all" and rows[-1][4:7] == [str(c.experts) for c in shown.coverage]


# ---- export and import -----------------------------------------------------------------------------------------------

async def type_path(pilot, path: Path) -> None:
    field = pilot.app.screen.query_one("#open-path", Input)
    field.value = str(path)
    await pilot.press("enter")
    await settle(pilot)


async def test_export_writes_what_the_engine_reads_back(demo, tmp_path):
    src, model, text = demo
    remember_model(model)
    p = learned_into_store(model, text, tmp_path)
    app = TqbenchApp(src)
    async with app.run_test(size=SIZE) as pilot:
        screen = await open_profile(pilot)
        await pilot.press("e")
        await type_path(pilot, tmp_path / "no-such-dir" / "out.json")
        assert screen.error.endswith("out.json: No such file or directory") and "\n" not in screen.error
        await pilot.press("e")
        await type_path(pilot, tmp_path / "out.json")
        assert screen.error is None
    fp, geo = identify(model)
    back = read_file(tmp_path / "out.json", fp, geo)  # as `chat --profile` and `import` read it
    assert np.array_equal(matrix(back), matrix(p)) and back.routings == p.routings
    assert (tmp_path / "out.json").read_text() == p.to_text()  # `tqbench profile export`'s file


async def test_export_proposes_the_engines_default_file_and_names_it_in_full(demo, tmp_path, monkeypatch):
    """e proposes the file the Chat screen's e writes (the cache directory's profile-exports/, made when missing);
    what is written is named by its absolute path, whatever the working directory."""
    src, model, text = demo
    monkeypatch.chdir(tmp_path)
    remember_model(model)
    p = learned_into_store(model, text, tmp_path)
    out = Path(os.environ["TQBENCH_CACHE_DIR"]) / "profile-exports" / f"{model.name}.json"
    assert not out.parent.exists()
    app = TqbenchApp(src)
    async with app.run_test(size=SIZE) as pilot:
        screen = await open_profile(pilot)
        await pilot.press("e")
        await settle(pilot)
        assert app.screen.query_one("#open-path", Input).value == str(out) == str(default_export_file(model))
        await pilot.press("enter")
        await settle(pilot)
        assert screen.error is None and out.read_text() == p.to_text()
        assert list(app._notifications)[-1].message == f"wrote {out}: {p.routings:,.0f} routings"
        await pilot.press("e")
        await type_path(pilot, Path("mine.json"))  # a relative name: named in full too
        assert list(app._notifications)[-1].message == f"wrote {tmp_path / 'mine.json'}: {p.routings:,.0f} routings"
        assert (tmp_path / "mine.json").read_text() == p.to_text()


async def test_import_replaces_the_learned_profile_and_a_corrupt_file_changes_nothing(demo, tmp_path, monkeypatch):
    src, model, _ = demo
    monkeypatch.chdir(tmp_path)  # the error names the file as typed: corrupt.json
    remember_model(model)
    before = seeded(model, seed=3)
    put(before)
    corrupt = tmp_path / "corrupt.json"
    corrupt.write_text('{"schema": "tqbench.profile/1", "fingerprint": "12')
    app = TqbenchApp(src)
    async with app.run_test(size=SIZE) as pilot:
        screen = await open_profile(pilot)
        shown = await stable_screen_lines(pilot)
        await pilot.press("i")
        await type_path(pilot, corrupt)
        lines = await stable_screen_lines(pilot)
        errors = [line for line in lines if "error" in line]
        assert len(errors) == 1 and errors[0].strip().startswith("error: corrupt.json: invalid JSON (")
        assert lines.index(errors[0]) == 1 and "\n" not in screen.error
        assert lines[:1] + lines[2:] == shown[:22] + shown[23:]  # the rest as it was, one blank row less
        assert np.array_equal(matrix(stored(model)), matrix(before))

        after = seeded(model, seed=4, sessions=7)
        (tmp_path / "good.json").write_text(after.to_text())
        await pilot.press("i")
        await type_path(pilot, tmp_path / "good.json")
        assert screen.error is None
        assert np.array_equal(matrix(stored(model)), matrix(after))
        assert np.array_equal(screen.query_one(HeatMap).cells, matrix(after))
        assert "7 sessions" in "\n".join(screen_lines(app)[:5])


async def test_a_profile_file_of_another_model_is_shown_on_its_own(demo, wide, tmp_path):
    src, model, _ = demo
    remember_model(model)
    other = seeded(wide, seed=5)
    (tmp_path / "k3.json").write_text(other.to_text())
    app = TqbenchApp(src)
    async with app.run_test(size=SIZE) as pilot:
        screen = await open_profile(pilot)
        await pilot.press("o")
        await type_path(pilot, tmp_path / "k3.json")
        assert screen.error is None and screen.shown_model is None
        assert np.array_equal(screen.query_one(HeatMap).cells.sum(axis=1), matrix(other).sum(axis=1))
        info = "\n".join(screen_lines(app)[:6])
        assert "none: the file on its own" in info and "896 experts" in info and "warning" in info
        await pilot.press("escape")  # back to the model's own profile
        await settle(pilot)
        assert screen.file is None and screen.query_one(HeatMap).experts == 64


async def test_a_path_that_is_neither_keeps_what_is_shown(demo, tmp_path):
    src, model, _ = demo
    remember_model(model)
    put(seeded(model, seed=7))
    app = TqbenchApp(src)
    async with app.run_test(size=SIZE) as pilot:
        screen = await open_profile(pilot)
        cells = screen.query_one(HeatMap).cells.copy()
        for bad in (tmp_path / "nothing-here", tmp_path):  # no such file; a directory that is no model
            await pilot.press("o")
            await type_path(pilot, bad)
            assert screen.error.startswith(f"{bad}: ") and "\n" not in screen.error
            assert (screen.model, screen.file) == (None, None) and "Model's profile" not in screen_lines(app)[-1]
            assert np.array_equal(screen.query_one(HeatMap).cells, cells)


async def test_the_screen_follows_the_store_and_waits_for_an_open_dialog(demo, tmp_path, monkeypatch):
    """Another session's save shows while the screen is shown (the coverage table's cursor row kept); none is read
    while a dialog is open over the screen, and the dialog's closing reads it; coming back to the screen reads it."""
    import tui.screens.profile as profile_screen

    monkeypatch.setattr(profile_screen, "POLL_S", 0.2)
    src, model, _ = demo
    remember_model(model)
    first, second, third, fourth = (seeded(model, seed=10 + i, sessions=1 + i) for i in range(4))
    put(first)
    app = TqbenchApp(src)
    async with app.run_test(size=SIZE) as pilot:
        screen = await open_profile(pilot)
        heat = screen.query_one(HeatMap)
        table = screen.query_one("#coverage", DataTable)
        assert np.array_equal(heat.cells, matrix(first))
        table.focus()
        await pilot.press("down", "down")
        assert table.cursor_row == 2

        put(second)  # as a chat session in another process saves
        await wait_for(pilot, lambda: np.array_equal(heat.cells, matrix(second)), "the second profile")
        await settle(pilot)
        assert f"learned: {second.routings:,.0f} routings, 2 sessions" in "\n".join(screen_lines(app)[:5])
        assert table.cursor_row == 2 and table_rows(table)[2][0] == str(second.geometry.layers[2])

        await pilot.press("o")  # a dialog over the screen: nothing is read under it
        await settle(pilot)
        put(third)
        await pilot.pause(1.0)  # five polls
        assert isinstance(app.screen, OpenScreen) and np.array_equal(heat.cells, matrix(second))
        await pilot.press("escape")
        await wait_for(pilot, lambda: np.array_equal(heat.cells, matrix(third)), "the third profile")

        await pilot.press("s")  # another screen, then back
        await settle(pilot)
        put(fourth)
        await pilot.press("h")
        await wait_for(pilot, lambda: np.array_equal(heat.cells, matrix(fourth)), "the fourth profile")
        await settle(pilot)
        assert f"learned: {fourth.routings:,.0f} routings, 4 sessions" in "\n".join(screen_lines(app)[:5])


async def test_without_a_converted_model_the_screen_says_how_to_get_one(tmp_path):
    app = TqbenchApp(tmp_path)
    async with app.run_test(size=SIZE) as pilot:
        await open_profile(pilot)
        assert "No converted model yet" in "\n".join(screen_lines(app))


# ---- the app: help, palette, footer ----------------------------------------------------------------------------------

def sections(text: str) -> dict[str, str]:
    """The help text by section title (the lines that are not indented)."""
    out: dict[str, str] = {}
    title = None
    for line in text.splitlines():
        if line and not line.startswith(" "):
            title = line
            out[title] = ""
        elif title is not None:
            out[title] += line + "\n"
    return out


async def test_help_lists_the_bindings_of_the_app_and_of_each_screen(tmp_path):
    app = TqbenchApp(tmp_path)
    async with app.run_test(size=SIZE) as pilot:
        await settle(pilot)
        await pilot.press("question_mark")
        await pilot.pause()
        assert isinstance(app.screen, HelpScreen)
        parts = sections(str(app.screen.query_one("#help-text").render()))
        keys = {b.action: b.key_display or b.key for b in Binding.make_bindings(TqbenchApp.BINDINGS)}
        assert all(b.description in parts["Everywhere"] for b in Binding.make_bindings(TqbenchApp.BINDINGS))
        for mode, screen in TqbenchApp.MODES.items():
            title = next(t for t in parts if t.endswith(f" screen ({keys[f'switch_mode({mode!r})']})"))
            for b in Binding.make_bindings(screen.BINDINGS):
                line = next((x for x in parts[title].splitlines() if x.endswith(" " + b.description)), None)
                assert line is not None and app.get_key_display(b) in line, (title, b)
        await pilot.press("escape")
        assert not isinstance(app.screen, HelpScreen)


async def test_the_palette_reaches_every_screen(tmp_path):
    app = TqbenchApp(tmp_path)
    async with app.run_test(size=SIZE) as pilot:
        await settle(pilot)
        names = {c.title for c in app.get_system_commands(app.screen)}
        assert {"Source", "Recipe", "Convert", "Chat", "Profile", "Help"} <= names
        await pilot.press("ctrl+p")
        await pilot.pause()
        for ch in "Profile":
            await pilot.press(ch)
        await pilot.pause(0.3)
        await pilot.press("enter")
        await settle(pilot)
        assert app.current_mode == "profile" and isinstance(app.screen, ProfileScreen)


async def test_every_footer_names_the_other_screens_at_80_columns(demo, tmp_path):
    """Source, Recipe, Convert and Profile (Chat's footer is the Chat screen's own test's)."""
    src, model, _ = demo
    remember_model(model)
    app = TqbenchApp(src)
    names = {"s": "Source", "p": "Recipe", "c": "Convert", "t": "Chat", "h": "Profile"}
    async with app.run_test(size=SIZE) as pilot:
        await settle(pilot)
        for key in ("s", "p", "c", "h"):
            await pilot.press(key)
            await settle(pilot)
            footer = screen_lines(app)[-1]
            for other, name in names.items():
                if other != key:
                    assert f"{other} {name}" in footer, footer
            assert "? Help" in footer and "q Quit" in footer and len(footer.rstrip()) <= 80


async def test_every_footer_names_every_other_screen_at_120_columns(demo, tmp_path):
    """At 120x35 each screen's footer has every other screen's key, Serve's included (Chat's out of its message field,
    where the letters type)."""
    src, model, _ = demo
    remember_model(model)
    app = TqbenchApp(src)
    names = {"s": "Source", "p": "Recipe", "c": "Convert", "t": "Chat", "h": "Profile", "w": "Serve"}
    async with app.run_test(size=(120, 35)) as pilot:
        await settle(pilot)
        for key in ("s", "p", "c", "h", "w", "t"):
            await pilot.press(key)
            await settle(pilot)
            if key == "t":
                await pilot.press("escape")  # out of the message field
                await pilot.pause()
            footer = (await stable_screen_lines(pilot))[-1]
            assert all(f"{other} {name}" in footer for other, name in names.items() if other != key), footer
            assert "? Help" in footer and "q Quit" in footer


async def test_a_footer_too_narrow_leaves_out_its_last_keys_whole(demo, tmp_path):
    """At 80 columns the Source screen's keys and the other screens' do not all fit: the last ones are left out, never
    cut mid-word, and the help screen still lists them."""
    src, model, _ = demo
    app = TqbenchApp(src)
    async with app.run_test(size=SIZE) as pilot:
        await settle(pilot)
        footer = (await stable_screen_lines(pilot))[-1].rstrip()
        assert footer.endswith("h Profile") and "w Se" not in footer
        await pilot.resize_terminal(120, 35)
        footer = (await stable_screen_lines(pilot))[-1].rstrip()
        assert footer.endswith("h Profile w Serve")
        await pilot.press("question_mark")
        await pilot.pause()
        assert "Serve" in sections(str(app.screen.query_one("#help-text").render()))["Everywhere"]


def test_snapshot_profile_screen(demo, tmp_path, monkeypatch, snap_compare):
    """The Profile screen at 80x24 on seeded counts (paths relative to the working directory)."""
    src, model, _ = demo
    remember_model(model)
    put(seeded(model, seed=6, sessions=4))
    monkeypatch.chdir(model.parent)

    async def run_before(pilot) -> None:
        await open_profile(pilot)
        await pilot.press("down", "right", "right")

    assert snap_compare(TqbenchApp(Path("src")), terminal_size=SIZE, run_before=run_before)


@pytest.mark.parametrize("size", [(80, 24), (120, 35), (200, 50)], ids=["80x24", "120x35", "200x50"])
def test_snapshot_profile_screen_binned(wide, tmp_path, monkeypatch, snap_compare, size):
    """K3's 896 experts per layer binned to the width (seeded counts), the axis labels whole, every screen's key in the
    footer where it fits."""
    remember_model(wide)
    put(seeded(wide, seed=1))
    monkeypatch.chdir(wide.parent)

    async def run_before(pilot) -> None:
        await open_profile(pilot)
        await pilot.press("down", "right", "right")

    assert snap_compare(TqbenchApp(tmp_path), terminal_size=size, run_before=run_before)


def test_engine_modules_import_no_ui_library():
    """Engine modules stay free of the UI's libraries."""
    import subprocess
    import sys

    code = ("import sys, tqbench.profile, tqbench.chat.choose; "
            "print(json.dumps(sorted(m for m in ('textual', 'rich', 'typer') if m in sys.modules)))")
    out = subprocess.run([sys.executable, "-c", "import json; " + code], capture_output=True, text=True, check=True)
    assert json.loads(out.stdout) == []
