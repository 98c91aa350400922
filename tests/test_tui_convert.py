"""The Convert screen, driven with Pilot: real conversions of a tiny seeded demo source, checked against the engine's
`tqbench.convert.convert` run directly (files byte for byte, totals, per-layer aggregates), plus cancel, resume,
conflicts, quitting mid-run and `r` pressed while the output is still being checked.
"""

from __future__ import annotations

import os
import threading
import types
from collections import defaultdict
from pathlib import Path

import pytest
from textual.widgets import Input, ProgressBar, Static

import tqbench.convert
from tqbench.engine import engine
import tqbench.convert.pipeline as pipeline
from conftest import demo_source
from model_helpers import file_bytes
from tui_helpers import burst, screen_lines, settle
from tqbench import units
from tqbench.convert import destination_status, layout
from tqbench.demo import DemoSpec
from tqbench.destination import default_dest
from tqbench.events import ConvertFinished, ShardWritten, UnitConverted
from tqbench.recipe import Recipe
from tui.app import TqbenchApp
from tui.screens.confirm import ConfirmScreen
from tui.screens.convert import ConvertScreen
from tui.widgets.layer_table import LayerTable

SIZE = (80, 24)
RECIPE = "tq3a-tqTe-down4-g64"  # the Recipe screen's initial recipe
SHARD = 150_000  # five shards of the demo below
SPEC = DemoSpec(routed_expert_hidden_size=64, moe_intermediate_size=128)  # experts wide enough for group 64

_real_convert = tqbench.convert.convert


@pytest.fixture(scope="module")
def demo_dir() -> Path:
    return demo_source(SPEC)  # shared with other modules (read-only)


@pytest.fixture
def src(demo_dir, tmp_path) -> Path:
    """A private copy of the demo source (the default destination is created next to it)."""
    import shutil

    return Path(shutil.copytree(demo_dir, tmp_path / "src"))


@pytest.fixture(scope="module")
def direct(demo_dir, tmp_path_factory):
    """The engine run directly: (output directory, events)."""
    out = tmp_path_factory.mktemp("direct") / "out"
    return out, list(_real_convert(demo_dir, out, Recipe.parse(RECIPE), SHARD))


def output_files(dst: Path) -> dict[str, bytes]:
    """Every output file; the report without its timings and the source's path (each test converts its own copy)."""
    return file_bytes(dst, drop=("timings", "source"))


async def open_convert(pilot, shard: int | None = SHARD) -> ConvertScreen:
    await settle(pilot)
    await pilot.press("c")
    await settle(pilot)
    screen = pilot.app.screen
    assert isinstance(screen, ConvertScreen)
    if shard is not None:
        await set_field(pilot, "#shard-size", str(shard))
    return screen


async def set_field(pilot, selector: str, value: str) -> None:
    field = pilot.app.screen.query_one(selector, Input)
    field.value = value
    field.focus()
    await pilot.pause()
    await pilot.press("enter")  # submits: checks at once, focus back on the table
    await settle(pilot)


def status_text(screen) -> str:
    return str(screen.query_one("#convert-status", Static).render())


def rate_text(screen) -> str:
    return str(screen.query_one("#convert-rate", Static).render())


def expected_layers(events) -> list[dict[str, str]]:
    """Per-layer rows computed straight from a run's UnitConverted events, formatted as the table formats them."""
    acc: dict = defaultdict(lambda: {"units": 0, "in": 0, "out": 0, "errors": []})
    for ev in events:
        if isinstance(ev, UnitConverted):
            a = acc[ev.layer]
            a["units"] += 1
            a["in"] += ev.bytes_in
            a["out"] += ev.bytes_out
            if ev.rel_error is not None:
                a["errors"].append(ev.rel_error)
    rows = []
    for layer, a in acc.items():  # insertion order: the order units are converted in
        errs = a["errors"]
        mean = sum(errs) / len(errs) if errs else None  # summed in event order, as the screen sums
        rows.append({"layer": "-" if layer is None else str(layer), "units": f"{a['units']}/{a['units']}",
                     "read": units.gb(a["in"]), "written": units.gb(a["out"]),
                     "err mean": "-" if mean is None else f"{mean:.4f}",
                     "err max": "-" if not errs else f"{max(errs):.4f}"})
    return rows


def gated_convert(gate: threading.Event, after_shard: int = 1):
    """The engine's convert, held after its `after_shard`-th ShardWritten until `gate` is set (on the engine thread),
    so a test cancels at an exact point. Closing it closes the real generator."""
    def convert(*args, **kwargs):
        gen = _real_convert(*args, **kwargs)
        try:
            for ev in gen:
                yield ev
                if isinstance(ev, ShardWritten) and ev.index == after_shard:
                    assert gate.wait(20), "the test never opened the gate"
        finally:
            gen.close()
    return convert


async def wait_for(pilot, condition, what: str) -> None:
    for _ in range(400):
        if condition():
            return
        await pilot.pause(0.01)
    raise AssertionError(f"timed out waiting for {what}")


# ---- a full conversion ----------------------------------------------------------------------------------------------

async def test_screen_shows_source_recipe_and_default_destination(src):
    app = TqbenchApp(src)
    async with app.run_test(size=SIZE) as pilot:
        screen = await open_convert(pilot, shard=None)
        assert app.recipe == Recipe.parse(RECIPE)
        assert RECIPE in str(screen.query_one("#convert-recipe", Static).render())
        assert str(src) in str(screen.query_one("#convert-source", Static).render())
        assert Path(screen.query_one("#dest", Input).value) == default_dest(src, RECIPE) == src.parent / f"src-{RECIPE}"
        assert screen.query_one("#shard-size", Input).value == "5GiB"
        lay = layout(src, Recipe.parse(RECIPE))
        assert status_text(screen).startswith(f"new output: {len(lay.files)} shard")
        assert (f"{units.gb(lay.plan.source_bytes)} -> {units.gb(lay.file_bytes)} "
                f"({units.gb(lay.plan.total_bytes)} of tensors)") in status_text(screen)
        # Before a run, the table lists the layout's layers with nothing done.
        per_layer = defaultdict(int)
        for shard in lay.shards():
            for u in shard:
                per_layer["-" if u.layer is None else str(u.layer)] += 1
        assert [(r["layer"], r["units"]) for r in screen.table.rows_text] == \
            [(k, f"0/{n}") for k, n in per_layer.items()]
        assert not screen.query_one("#convert-bar-row").display


@pytest.mark.slow
async def test_full_conversion_matches_the_engine(src, direct):
    out, events = direct
    finished = events[-1]
    assert isinstance(finished, ConvertFinished)
    app = TqbenchApp(src)
    async with app.run_test(size=SIZE) as pilot:
        screen = await open_convert(pilot)
        await pilot.press("r")
        await settle(pilot)
        assert not screen.running
        dest = default_dest(src, RECIPE)
        # Same files, byte for byte, as the engine run directly.
        ours, theirs = output_files(dest), output_files(out)
        assert sorted(ours) == sorted(theirs)
        assert sum(n.endswith(".safetensors") for n in ours) == finished.shards == 5
        for name in theirs:
            assert ours[name] == theirs[name], name
        # The totals shown are the ConvertFinished event's.
        ev = screen.finished_event
        assert (ev.bytes_in, ev.bytes_out, ev.shards, ev.mean_rel_error, ev.max_rel_error) == \
            (finished.bytes_in, finished.bytes_out, finished.shards, finished.mean_rel_error, finished.max_rel_error)
        summary = " ".join(rate_text(screen).split())  # the keys are padded to the form's column
        assert f"done in {ev.seconds:.1f} s: read {units.gb(finished.bytes_in)}, wrote " \
               f"{units.size(finished.bytes_out)} in {finished.shards} shards" in summary
        assert f"rel. error mean {finished.mean_rel_error:.4f}, max {finished.max_rel_error:.4f}" in summary
        assert summary.endswith(f"written to {dest}")
        assert status_text(screen).startswith("complete:")
        # Per-layer rows equal the aggregates of the direct run's UnitConverted events.
        assert screen.table.rows_text == expected_layers(events)
        assert len(screen.table.rows_text) == len({e.layer for e in events if isinstance(e, UnitConverted)})


@pytest.mark.slow
async def test_progress_shows_engine_rate_eta_and_shards(src, monkeypatch):
    """Mid-run (held after the second shard): the bar is the last unit's done_in of total_in, rate and ETA are the
    engine's numbers, and shards count what was written."""
    gate = threading.Event()
    monkeypatch.setattr(tqbench.convert, "convert", gated_convert(gate, after_shard=2))
    app = TqbenchApp(src)
    async with app.run_test(size=SIZE) as pilot:
        screen = await open_convert(pilot)
        await pilot.press("r")
        await wait_for(pilot, lambda: screen.shards_done == 2 and screen.last_unit is not None
                       and "shards 2/5" in rate_text(screen), "the second shard")
        u = screen.last_unit
        bar = screen.query_one("#convert-bar", ProgressBar)
        assert (bar.total, bar.progress) == (u.total_in, u.done_in)
        line = rate_text(screen)
        assert line.startswith(f"{units.gb(u.rate)}/s  ETA ")
        assert "shards 2/5" in line
        assert status_text(screen).startswith("converting")
        assert app.screen.query_one("#dest", Input).disabled
        gate.set()
        await settle(pilot)
        assert screen.finished_event is not None


# ---- cancel, reopen, resume -----------------------------------------------------------------------------------------

@pytest.mark.slow
async def test_cancel_leaves_a_resumable_output_and_reopening_resumes_it(src, direct, monkeypatch):
    out, _ = direct
    dest = default_dest(src, RECIPE)
    gate = threading.Event()
    monkeypatch.setattr(tqbench.convert, "convert", gated_convert(gate, after_shard=1))
    app = TqbenchApp(src)
    async with app.run_test(size=SIZE) as pilot:
        screen = await open_convert(pilot)
        await pilot.press("r")
        await wait_for(pilot, lambda: screen.shards_done == 1, "the first shard")
        await pilot.press("x")
        assert screen.run.stopping and "stopping" in status_text(screen)
        gate.set()  # the engine converts one more unit, sees the stop and closes the generator
        await settle(pilot)
        assert not screen.running
        assert not list(dest.glob("*.partial"))
        lay = layout(src, Recipe.parse(RECIPE), SHARD)
        status = destination_status(lay, dest)
        assert (status.state, status.done_shards, status.total_shards) == ("resumable", 1, 5)
        text = status_text(screen)
        assert text.startswith("cancelled at ") and "only whole shards were kept" in text
        assert "resumable: 1 of 5 shards done.  r: resume" in text
        # The table now counts the first shard's units as done, the rest not.
        first = defaultdict(int)
        for u in next(lay.shards()):
            first[u.layer] += 1
        for u_layer, n in first.items():
            assert screen.table.row_text(u_layer)["units"].startswith(f"{n}/")
    monkeypatch.setattr(tqbench.convert, "convert", _real_convert)

    # Reopened (a new app): the same destination and shard size come back, resumable.
    app = TqbenchApp(src)
    async with app.run_test(size=SIZE) as pilot:
        screen = await open_convert(pilot, shard=None)
        assert Path(screen.query_one("#dest", Input).value) == dest
        assert screen.query_one("#shard-size", Input).value == str(SHARD)
        assert status_text(screen) == "resumable: 1 of 5 shards done.  r: resume"
        await pilot.press("r")
        await settle(pilot)
        assert screen.started.resumed_shards == 1
        assert screen.finished_event is not None
        assert "(resumed: 1 of 5 shards were done before)" in rate_text(screen)
    ours, theirs = output_files(dest), output_files(out)
    assert sorted(ours) == sorted(theirs)
    for name in theirs:
        assert ours[name] == theirs[name], name


@pytest.mark.slow
async def test_resumed_run_shows_the_errors_of_layers_finished_before(src, direct, monkeypatch):
    """Interrupted after two shards, then resumed: every layer's error mean and max cover all its units, those the
    first run converted included, as computed from an uninterrupted engine run's UnitConverted events."""
    _, events = direct
    expected = {r["layer"]: (r["err mean"], r["err max"]) for r in expected_layers(events)}
    lay = layout(src, Recipe.parse(RECIPE), SHARD)
    shards = list(lay.shards())
    later = {u.layer for s in shards[2:] for u in s}
    earlier_only = [("-" if l is None else str(l)) for l in dict.fromkeys(u.layer for s in shards[:2] for u in s)
                    if l not in later]
    assert earlier_only  # layers whose units are all in the two shards of the first run
    gate = threading.Event()
    monkeypatch.setattr(tqbench.convert, "convert", gated_convert(gate, after_shard=2))
    app = TqbenchApp(src)
    async with app.run_test(size=SIZE) as pilot:
        screen = await open_convert(pilot)
        await pilot.press("r")
        await wait_for(pilot, lambda: screen.shards_done == 2, "the second shard")
        await pilot.press("x")
        gate.set()
        await settle(pilot)
        assert status_text(screen).endswith("resumable: 2 of 5 shards done.  r: resume")
        monkeypatch.setattr(tqbench.convert, "convert", _real_convert)
        await pilot.press("r")
        await settle(pilot)
        assert screen.started.resumed_shards == 2 and screen.finished_event is not None
        shown = {r["layer"]: (r["err mean"], r["err max"]) for r in screen.table.rows_text}
        for layer in earlier_only:
            assert screen.table.row_text(None if layer == "-" else int(layer))["read"] == "-"  # not read again
            assert shown[layer] == expected[layer] != ("-", "-"), layer
        assert shown == expected  # layers split between the runs too


@pytest.mark.slow
async def test_quit_while_converting_stops_first(src, monkeypatch):
    dest = default_dest(src, RECIPE)
    gate = threading.Event()
    monkeypatch.setattr(tqbench.convert, "convert", gated_convert(gate, after_shard=2))
    app = TqbenchApp(src)
    async with app.run_test(size=SIZE) as pilot:
        screen = await open_convert(pilot)
        await pilot.press("r")
        await wait_for(pilot, lambda: screen.shards_done == 2, "the second shard")
        await pilot.press("q")
        assert app.is_running and engine().busy  # the engine stops the conversion first
        gate.set()
        await wait_for(pilot, lambda: not app.is_running, "the app to exit")
    assert not list(dest.glob("*.partial"))
    status = destination_status(layout(src, Recipe.parse(RECIPE), SHARD), dest)
    assert (status.state, status.done_shards) == ("resumable", 2)


# ---- conflicts ------------------------------------------------------------------------------------------------------

@pytest.mark.slow
async def test_conflicting_destination_is_shown_and_not_written(src, direct):
    out, _ = direct
    dest = default_dest(src, RECIPE)
    list(_real_convert(src, dest, Recipe.parse("tq4-g32"), SHARD))  # another recipe's complete output
    before = output_files(dest)
    app = TqbenchApp(src)
    async with app.run_test(size=SIZE) as pilot:
        screen = await open_convert(pilot)
        assert status_text(screen) == ("conflict: the output holds a conversion of another recipe or source "
                                       "(tq4-g32).  f: replace it")
        assert screen.check_action("start", ()) is None  # shown, disabled
        await pilot.press("r")
        await pilot.press("enter")
        await settle(pilot)
        assert not screen.running and output_files(dest) == before
        # f asks first; n keeps the output.
        await pilot.press("f")
        await pilot.pause()
        assert isinstance(app.screen, ConfirmScreen)
        await pilot.press("n")
        await settle(pilot)
        assert app.screen is screen and output_files(dest) == before
        # f, y: replaced by this recipe's conversion.
        await pilot.press("f")
        await pilot.pause()
        await pilot.press("y")
        await settle(pilot)
        assert screen.finished_event is not None and status_text(screen).startswith("complete:")
    ours, theirs = output_files(dest), output_files(out)
    assert sorted(ours) == sorted(theirs)
    for name in theirs:
        assert ours[name] == theirs[name], name


async def test_a_directory_that_is_no_conversion_is_never_replaced(src):
    dest = default_dest(src, RECIPE)
    dest.mkdir()
    (dest / "notes.txt").write_text("mine\n")
    app = TqbenchApp(src)
    async with app.run_test(size=SIZE) as pilot:
        screen = await open_convert(pilot)
        assert status_text(screen) == ("not an output: the directory is not empty and holds no tqbench conversion; "
                                       "choose another")
        await pilot.press("r", "f", "y")  # neither starts nor replaces
        await settle(pilot)
    assert sorted(p.name for p in dest.iterdir()) == ["notes.txt"]


@pytest.mark.slow
async def test_bad_fields_are_one_line_errors(src):
    app = TqbenchApp(src)
    async with app.run_test(size=SIZE) as pilot:
        screen = await open_convert(pilot)
        await set_field(pilot, "#shard-size", "lots")
        assert status_text(screen).startswith("error: shard size: cannot read 'lots' as a size")
        assert screen.check_action("start", ()) is None
        await set_field(pilot, "#shard-size", str(SHARD))
        await set_field(pilot, "#dest", str(src / "inside"))
        assert status_text(screen) == "error: the output directory must not be the source or inside it"
        await pilot.press("r")
        await settle(pilot)
        assert not (src / "inside").exists()


@pytest.mark.slow
async def test_ctrl_u_then_typing_at_once_replaces_the_shard_size(src):
    """ctrl+u with characters right behind it (one terminal read): the characters land after the deletion."""
    app = TqbenchApp(src)
    async with app.run_test(size=SIZE) as pilot:
        screen = await open_convert(pilot, shard=None)
        field = screen.query_one("#shard-size", Input)
        field.focus()
        await pilot.pause()
        assert field.value == "5GiB" and field.cursor_position == len("5GiB")
        keys = screen_lines(app)[-1]
        assert "⏎ Check" in keys and "esc Table" in keys  # what the keys do in a field
        burst(pilot, "ctrl+u", *str(SHARD), "enter")
        await settle(pilot)
        assert field.value == str(SHARD)
        shards = len(layout(src, Recipe.parse(RECIPE), SHARD).files)
        assert status_text(screen).startswith(f"new output: {shards} shards")


@pytest.mark.slow
async def test_recipe_from_the_recipe_screen_and_its_default_destination(src):
    app = TqbenchApp(src)
    async with app.run_test(size=SIZE) as pilot:
        screen = await open_convert(pilot)
        await pilot.press("p")
        await settle(pilot)
        name = app.screen.query_one("#recipe-name", Input)
        name.value = "tq4-g32"
        await settle(pilot)
        await pilot.press("c")
        await settle(pilot)
        assert app.screen is screen and screen.recipe == Recipe.parse("tq4-g32")
        assert "tq4-g32" in str(screen.query_one("#convert-recipe", Static).render())
        assert Path(screen.query_one("#dest", Input).value) == default_dest(src, "tq4-g32")
        assert status_text(screen).startswith("new output")


async def test_without_a_checkpoint_the_screen_says_how_to_get_one(tmp_path):
    app = TqbenchApp(tmp_path / "nothing-here")
    async with app.run_test(size=SIZE) as pilot:
        await settle(pilot)
        await pilot.press("c")
        await settle(pilot)
        empty = app.screen.query_one("#convert-empty", Static)
        assert empty.display and "No checkpoint loaded yet" in str(empty.render())
        await pilot.press("r")
        assert app.is_running


@pytest.mark.slow
async def test_layout_fits_80x24(src):
    app = TqbenchApp(src)
    async with app.run_test(size=SIZE) as pilot:
        screen = await open_convert(pilot)
        await pilot.press("r")
        await settle(pilot)
        table = screen.query_one(LayerTable)
        assert table.region.height >= 8 and table.region.bottom <= 23
        for w in (table, screen.query_one("#convert-status"), screen.query_one("#convert-rate"),
                  screen.query_one("#dest")):
            assert w.region.right <= 80 and w.region.height


# ---- r while the output is being checked ----------------------------------------------------------------------------

def held_status(gate: threading.Event):
    """tqbench.convert.destination_status held until `gate` is set (on the check's thread), so a test presses keys
    while the screen checks its output."""
    real = tqbench.convert.destination_status

    def status(lay, dest):
        assert gate.wait(20), "the test never opened the gate"
        return real(lay, dest)
    return status


async def open_while_checking(pilot) -> ConvertScreen:
    await settle(pilot)
    await pilot.press("c")
    await wait_for(pilot, lambda: isinstance(pilot.app.screen, ConvertScreen) and pilot.app.screen.checking,
                   "the check of the output")
    screen = pilot.app.screen
    assert status_text(screen).startswith("checking the output (planning ")
    return screen


async def test_start_pressed_while_checking_is_queued_and_x_drops_it(src, monkeypatch):
    gate = threading.Event()
    monkeypatch.setattr(tqbench.convert, "destination_status", held_status(gate))
    app = TqbenchApp(src)
    try:
        async with app.run_test(size=SIZE) as pilot:
            screen = await open_while_checking(pilot)
            assert "r Start" in screen_lines(app)[-1] and "x Cancel" not in screen_lines(app)[-1]
            await pilot.press("r")
            await pilot.pause()
            assert not screen.running
            assert status_text(screen).endswith("...  r: starts when checked (x: don't)")
            assert "x Cancel" in screen_lines(app)[-1]
            await pilot.press("x")
            await pilot.pause()
            assert status_text(screen).endswith("tensors)...")
            gate.set()
            await settle(pilot)
            assert not screen.running and screen.started is None
            assert status_text(screen).startswith("new output: 1 shard")
    finally:
        gate.set()
    assert not default_dest(src, RECIPE).exists()


async def test_start_pressed_while_checking_a_directory_that_is_no_conversion_never_starts(src, monkeypatch):
    dest = default_dest(src, RECIPE)
    dest.mkdir()
    (dest / "notes.txt").write_text("mine\n")
    gate = threading.Event()
    monkeypatch.setattr(tqbench.convert, "destination_status", held_status(gate))
    app = TqbenchApp(src)
    try:
        async with app.run_test(size=SIZE) as pilot:
            screen = await open_while_checking(pilot)
            await pilot.press("r")
            gate.set()
            await settle(pilot)
            assert not screen.running and screen.started is None
            assert status_text(screen).startswith("not an output: ")
            assert screen.check_action("cancel", ()) is False  # nothing is waiting any more
    finally:
        gate.set()
    assert sorted(p.name for p in dest.iterdir()) == ["notes.txt"]


@pytest.mark.slow
async def test_start_pressed_while_checking_starts_when_the_check_ends(src, monkeypatch):
    gate = threading.Event()
    monkeypatch.setattr(tqbench.convert, "destination_status", held_status(gate))
    app = TqbenchApp(src)
    try:
        async with app.run_test(size=SIZE) as pilot:
            screen = await open_while_checking(pilot)
            await pilot.press("r")
            await pilot.pause()
            assert not screen.running and screen.started is None
            gate.set()
            await settle(pilot)  # the check ends, the run starts and finishes
            assert screen.finished_event is not None and status_text(screen).startswith("complete:")
    finally:
        gate.set()
    dest = default_dest(src, RECIPE)
    assert destination_status(layout(src, Recipe.parse(RECIPE)), dest).state == "complete"


# ---- snapshot -------------------------------------------------------------------------------------------------------

@pytest.mark.slow
def test_snapshot_finished_conversion(demo_dir, tmp_path, monkeypatch, snap_compare):
    """A finished conversion at 80x24: timings frozen (a fake engine clock), paths relative to the working directory."""
    import shutil

    shutil.copytree(demo_dir, tmp_path / "src")
    monkeypatch.chdir(tmp_path)
    ticks = iter(range(10**9))
    monkeypatch.setattr(pipeline, "time", types.SimpleNamespace(monotonic=lambda: next(ticks) * 0.001))

    async def run_before(pilot) -> None:
        await open_convert(pilot)
        await pilot.press("r")
        await settle(pilot)

    assert snap_compare(TqbenchApp(Path("src")), terminal_size=SIZE, run_before=run_before)


async def test_an_output_that_cannot_be_made_is_refused_in_one_line(src, tmp_path):
    notes = tmp_path / "notes.txt"
    notes.write_text("mine\n")
    before = sorted(p.name for p in tmp_path.iterdir())
    app = TqbenchApp(src)
    async with app.run_test(size=SIZE) as pilot:
        screen = await open_convert(pilot)
        proc_why = "the file system does not allow it" if os.geteuid() == 0 else "permission denied"
        for dest, problem in ((notes / "out", f"{notes} is a file, not a directory"),
                              (notes, "is a file, not a directory"),
                              (Path("/proc/nope"), f"cannot create the output directory in /proc ({proc_why})")):
            await set_field(pilot, "#dest", str(dest))
            assert status_text(screen) == f"error: {dest}: {problem}"
            assert screen.check_action("start", ()) is None  # shown, disabled
            await pilot.press("r", "f")
            await settle(pilot)
            assert not screen.running and screen.started is None
    assert notes.read_text() == "mine\n" and sorted(p.name for p in tmp_path.iterdir()) == before
    assert not Path("/proc/nope").exists()


# ---- a calibrated recipe --------------------------------------------------------------------------------------------

@pytest.mark.slow
async def test_calibrated_recipe_runs_on_the_typed_text_and_is_complete_after(src, tmp_path, monkeypatch):
    """A `cal` recipe shows the calibration row. A missing text file is one line naming it; the run calibrates on the
    typed text and tokens (its progress on the bar, the Calibrated in the summary) and writes what the engine writes
    with the same request; checked again, the output is complete (the texts' digest is in the check's fingerprint,
    as in the run's), and another text makes it a conflict."""
    from tqbench.convert.calibration_request import CalibrationRequest
    from tqbench.events import CalibrationProgress, Calibrated
    from tqbench.texts import default_texts
    from tui.widgets.run_progress import RunProgress

    text = tmp_path / "cal.txt"
    text.write_text("\n\n".join(default_texts()[0].documents[:40]), encoding="utf-8")
    name = RECIPE + "-cal"
    shown: list = []
    original = RunProgress.calibrating
    monkeypatch.setattr(RunProgress, "calibrating", lambda self, ev: (shown.append(ev), original(self, ev))[1])
    app = TqbenchApp(src)
    async with app.run_test(size=SIZE) as pilot:
        screen = await open_convert(pilot)
        assert not screen.query_one("#calibration-row").display
        app.recipe = Recipe.parse(name)
        await settle(pilot)
        assert screen.query_one("#calibration-row").display
        await set_field(pilot, "#cal-text", str(tmp_path / "missing.txt"))
        assert status_text(screen) == f"error: {tmp_path / 'missing.txt'}: no such file"
        await set_field(pilot, "#cal-text", str(text))
        await set_field(pilot, "#cal-tokens", "512")
        assert status_text(screen).startswith("new output")
        table = screen.query_one(LayerTable)
        assert table.region.height >= 8 and table.region.bottom <= 23  # the row still fits 80x24
        await pilot.press("r")
        await settle(pilot)
        dest = default_dest(src, name)
        assert status_text(screen).startswith("complete:")
        cal = screen.calibrated
        assert isinstance(cal, Calibrated) and cal.tokens == 512 and cal.file == ""
        assert shown and all(isinstance(e, CalibrationProgress) for e in shown) and shown[-1].fraction == 1.0
        assert [e.done for e in shown] == sorted(e.done for e in shown) and shown[-1].done == shown[-1].total
        summary = " ".join(rate_text(screen).split())
        line = f"calibrated 512 tokens, {cal.inputs} inputs for {cal.modules} modules in {cal.seconds:.0f} s"
        assert f"{line} written to" in summary
        assert screen.query_one("#convert-rate").region.height == 4  # done, rel. error, calibrated, written to

        out = tmp_path / "direct"
        request = CalibrationRequest(texts=(str(text),), tokens=512)
        list(_real_convert(src, out, Recipe.parse(name), SHARD, calibration=request))
        ours, theirs = output_files(dest), output_files(out)
        assert sorted(ours) == sorted(theirs) and all(ours[n] == theirs[n] for n in theirs)

        await set_field(pilot, "#cal-tokens", "1024")  # other statistics: another conversion
        assert status_text(screen).startswith("conflict:")
        await set_field(pilot, "#cal-tokens", "512")
        assert status_text(screen).startswith("complete:")
