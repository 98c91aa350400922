"""The Recipe screen, driven with Pilot on the tiny skeleton checkpoint of test_tui.py.

Every cell is checked against the engine's plan report (tqbench.recipe.report.plan_report of make_plan / assess on a
Recipe parsed from its name; tests/test_report.py checks the report's values) or the real `tqbench plan`, never
against the screen's own state. The quality rows are checked against records put into (or left by a real quick eval
in) the evaluation store of the test's own cache directory.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from textual.widgets import Input, Static

from cli_helpers import tqbench
from test_tui import write_tiny
from tui_helpers import burst, screen_lines, settle, wait_for
from tqbench import units
from tqbench.convert.pipeline import source_fingerprint
from tqbench.demo import ensure_demo
from tqbench.destination import default_dest
from tqbench.engine import engine as engine_thread
from tqbench.eval.store import EvalStore, RecipeQuality, ToolQuality
from tqbench.recipe import Recipe, assess, group_sources, machine, make_plan, parse_size
from tqbench.machine import GB, cached_disk_speed, disk_cache_file, disk_speed
from tqbench.recipe.fit import Verdict
from tqbench.recipe.report import plan_report
from tqbench.source import open_checkpoint
from tui.app import TqbenchApp
from tui.screens.help import sections
from tui.screens.recipe import MAX_PINS, RecipeScreen
from tui.widgets.plan_table import BPW_HEADING, COMPACT_WIDTH, CURRENT, QUALITY_ROWS, PlanTable, wrap_name
from tui.widgets.recipe_editor import (CONTROLS, INITIAL_RECIPE, CycleSelect, RecipeEditor, controls_from_recipe,
                                       recipe_from_controls)

SIZE = (80, 24)
RESIDENT_MEMORY = "512GB"
STREAMING_MEMORY = "3.0002GB"  # the tiny model streams: 3 GB reserve + resident + top-2 pages fit, the whole does not
NO_FIT_MEMORY = "3GB"
DISK = "2"


@pytest.fixture
def tiny(tmp_path) -> Path:
    return write_tiny(tmp_path / "tiny-k3")


@pytest.fixture
def engine(tiny):
    """Plans and fits computed straight from the engine, as `tqbench plan` does."""
    sources = group_sources(open_checkpoint(tiny))

    def plan_and_fit(name: str, memory: str, gbps: float = float(DISK)):
        plan = make_plan(sources, Recipe.parse(name))
        return plan, assess(plan.footprint, machine(parse_size(memory), None, None, gbps * GB))

    return plan_and_fit


async def open_recipe_screen(pilot, memory: str = RESIDENT_MEMORY, disk: str = DISK) -> RecipeScreen:
    await settle(pilot)
    await pilot.press("p")
    await settle(pilot)
    screen = pilot.app.screen
    assert isinstance(screen, RecipeScreen)
    screen.query_one("#memory", Input).value = memory
    screen.query_one("#disk", Input).value = disk
    await settle(pilot)
    return screen


async def set_input(pilot, selector: str, value: str) -> None:
    pilot.app.screen.query_one(selector, Input).value = value
    await settle(pilot)


def expected_cells(plan, fit) -> dict[str, str]:
    """The plan report's cells for one recipe (row key -> text), the rows `tqbench plan` prints."""
    return plan_report([plan], [fit]).cells(0)


def flat(text: str) -> str:
    """A cell without its line breaks and spacing (the table wraps verdicts and the sysctl command to its width)."""
    return "".join(text.replace(" / ", " ").split())


def column(table: PlanTable, key: str) -> dict[str, str]:
    """One column's plan cells by row key (the bpw heading row aside, and the quality rows: the tiny checkpoint was
    never evaluated)."""
    cells = {str(row.key.value): table.text(str(row.key.value), key) for row in table.ordered_rows}
    assert cells.pop(BPW_HEADING, "") == ""
    assert [cells.pop(row) for row in QUALITY_ROWS] == ["-"] * len(QUALITY_ROWS)
    for wrapped in ("verdict", "raise the limit"):
        if wrapped in cells:
            cells[wrapped] = " ".join(cells[wrapped].split())
    return cells


def compact_cells(plan, fit) -> dict[str, str]:
    """What compact mode shows of the report's cells, flattened: sizes by their decimal figure, the expert page by its
    total (tqbench.units of the engine's numbers)."""
    first = {"resident": plan.resident_bytes, "routed experts": plan.streamed_bytes, "total": plan.total_bytes,
             "cache budget": fit.cache_budget_bytes, "expert page": plan.experts.bytes_per_expert}
    return {k: flat(units.gb(first[k]) if k in first else v) for k, v in expected_cells(plan, fit).items()}


def flat_column(table: PlanTable, key: str) -> dict[str, str]:
    return {k: flat(v) for k, v in column(table, key).items()}


def footer(app) -> str:
    return screen_lines(app)[-1]


def name_field(app) -> str:
    return app.screen.query_one("#recipe-name", Input).value


def status(app) -> str:
    return str(app.screen.query_one("#recipe-status", Static).render())


def controls(app) -> dict[str, str]:
    return app.screen.query_one(RecipeEditor).control_values()


# ---- controls and names ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", [INITIAL_RECIPE, "tq4", "tq2-g32", "tq3a-tqTe-g64-mlpg128", "tq4-tq3a-tq2e-down3",
                                  "affine4-g32", "affine6-affine4a-affine2e-down8", "tq3-mxfp4e", "tq3-srce-g128",
                                  "src", "srca-tq2e-down4", "srca-tqTe", "tq3-norot-seed7", "affine4-tqTe-down4",
                                  "tq3-g64-cal", "tq3a-tqTe-down4-g64-cal", "affine4-tq3e-cal"])
def test_controls_spell_the_same_recipe_as_the_name(name):
    recipe = Recipe.parse(name)
    values = controls_from_recipe(recipe)
    assert set(values) == set(CONTROLS)
    assert recipe_from_controls(values, recipe.seed) == recipe


def test_a_quick_evals_calibration_is_shown_as_it_goes():
    """A calibrated recipe's quick eval calibrates as it converts: the line says how far the pass is (the engine's
    weighed fraction), then that it calibrated."""
    from tqbench.events import CalibrationProgress, Calibrated
    from tui.widgets.quality_line import progress_text

    name = "tq3-g64-cal"
    step = CalibrationProgress(done=12, total=72, step="inputs", at="language_model.model.layers.1.mlp.gate_proj",
                               tokens=8192, fraction=0.154, elapsed=10.0)
    assert progress_text(name, step) == f"quick eval of {name} on the demo: converting, calibrated 15%"
    done = Calibrated(tokens=8192, inputs=72, modules=99, seconds=61.4, file="")
    assert progress_text(name, done) == f"quick eval of {name} on the demo: calibrated in 61 s; converting..."


# ---- the screen -----------------------------------------------------------------------------------------------------

@pytest.mark.slow
async def test_p_opens_the_recipe_screen_on_the_loaded_checkpoint(tiny, engine, tmp_path):
    other = write_tiny(tmp_path / "other-k3")
    app = TqbenchApp(tiny)
    async with app.run_test(size=SIZE) as pilot:
        screen = await open_recipe_screen(pilot)
        assert screen.checkpoint is app.checkpoint  # the Source screen's checkpoint, not opened again
        table = screen.query_one(PlanTable)
        assert table.display and table.column_names == [CURRENT]
        assert name_field(app) == INITIAL_RECIPE
        assert column(table, CURRENT) == expected_cells(*engine(INITIAL_RECIPE, RESIDENT_MEMORY))
        assert table.header_text("label").split("\n") == ["sizes decimal", "over binary", "shards <=", "5.00 GiB"]

        # Back to Source (s), open another checkpoint there: the Recipe screen plans that one.
        await pilot.press("s")
        await pilot.pause()
        assert app.screen.__class__.__name__ == "SourceScreen"
        await pilot.press("o")
        await pilot.pause()
        app.screen.query_one(Input).value = str(other)
        await pilot.press("enter")
        await settle(pilot)
        await pilot.press("p")
        await settle(pilot)
        assert app.screen is screen and screen.checkpoint is app.checkpoint and screen.checkpoint.path == other
        assert screen.shown == [Recipe.parse(INITIAL_RECIPE)] and screen._plans[screen.recipe].path == str(other)


@pytest.mark.slow
async def test_controls_update_the_numbers(tiny, engine):
    app = TqbenchApp(tiny)
    async with app.run_test(size=SIZE) as pilot:
        screen = await open_recipe_screen(pilot)
        table = screen.query_one(PlanTable)
        assert isinstance(app.focused, CycleSelect) and app.focused.id == "base"
        steps = [
            (["right"], "tq4a-tqTe-down4-g64"),  # base 3 -> 4
            (["down", "right"], "tq4a-tqTe-down4-g128"),  # group 64 -> 128
            (["down", "down", "left"], "tq4-tq4e-down4-g128"),  # experts ternary -> tq4: all 4-bit, named tq4-g128
            (["down", "left", "left"], "tq4a-tq4e-down2-g128"),  # expert down 4 -> 2 (choices: none, 2, 3, 4)
            (["down", "down", "right"], "tq4a-tq4e-down2-g128-norot"),  # rotation on -> off
            (["down", "right"], "tq4a-tq4e-down2-g128-norot-rms"),  # scales searched -> rms
            (["down", "right"], "tq4a-tq4e-down2-g128-norot-rms-cal"),  # rounding nearest -> calibrated
        ]
        for keys, name in steps:
            await pilot.press(*keys)
            await settle(pilot)
            expected = Recipe.parse(name)
            assert name_field(app) == expected.name
            assert screen.recipe == expected
            assert column(table, CURRENT) == expected_cells(*engine(name, RESIDENT_MEMORY)), name


@pytest.mark.slow
async def test_typed_names_set_the_controls_and_bad_ones_are_refused(tiny, engine):
    app = TqbenchApp(tiny)
    async with app.run_test(size=SIZE) as pilot:
        screen = await open_recipe_screen(pilot)
        table = screen.query_one(PlanTable)
        before = controls(app)
        await set_input(pilot, "#recipe-name", "tq3-bogus")
        text = status(app)
        assert "unknown part 'bogus'" in text and "\n" not in text and "Traceback" not in text
        assert screen.query_one("#recipe-status").has_class("error")
        assert screen.recipe == Recipe.parse(INITIAL_RECIPE) and controls(app) == before  # the last good recipe
        assert column(table, CURRENT) == expected_cells(*engine(INITIAL_RECIPE, RESIDENT_MEMORY))
        await set_input(pilot, "#recipe-name", "tq3-tqTe-down5")  # ternary experts are TurboQuant: 2-4 bits
        assert "expert down bits 5 is out of range" in status(app)

        field = screen.query_one("#recipe-name", Input)
        field.focus()
        field.value = "tq2-tq4a-tq3e-g32-mlpg128"
        field.cursor_position = len(field.value)
        await pilot.press(*"-norot")  # typed: "-", "-n", ... are bad names for a moment, then it is good again
        await settle(pilot)
        assert controls(app) == {"base": "tq2", "group": "32", "attn": "4", "experts": "tq3", "down": "none",
                                 "mlpg": "128", "rotation": "off", "scales": "search",
                                 "rounding": "nearest"}
        assert not screen.query_one("#recipe-status").has_class("error")
        name = "tq2-tq4a-tq3e-g32-mlpg128-norot"
        assert column(table, CURRENT) == expected_cells(*engine(name, RESIDENT_MEMORY))

        await set_input(pilot, "#recipe-name", "affine4-mxfp4e")  # the down-bit and group controls no longer apply
        assert controls(app)["base"] == "affine4" and controls(app)["experts"] == "mxfp4"
        assert screen.query_one("#down", CycleSelect).disabled and screen.query_one("#mlpg", CycleSelect).disabled
        assert screen.query_one("#rotation", CycleSelect).disabled  # no TurboQuant tier
        assert screen.query_one("#scales", CycleSelect).disabled and screen.query_one("#rounding", CycleSelect).disabled
        assert column(table, CURRENT) == expected_cells(*engine("affine4-mxfp4e", RESIDENT_MEMORY))


@pytest.mark.slow
async def test_pin_recipes_side_by_side(tiny, engine):
    app = TqbenchApp(tiny)
    async with app.run_test(size=SIZE) as pilot:
        screen = await open_recipe_screen(pilot)
        table = screen.query_one(PlanTable)
        await pilot.press("plus")  # pin tq3a-tqTe-down4-g64
        await pilot.press("right")  # base tq4 (focus is on the base control)
        await settle(pilot)
        await pilot.press("enter")  # enter pins too
        await pilot.press("right")  # and go on editing: base tq4 -> affine2
        await settle(pilot)
        first, second, current = INITIAL_RECIPE, "tq4a-tqTe-down4-g64", "affine2a-tqTe-down4-g64"
        assert [r.name for r in screen.pins] == [first, second]
        assert table.column_names == [CURRENT, first, second]
        assert table.header_text(first).startswith("pin 1") and table.header_text(second).startswith("pin 2")
        assert table.compact  # two pins do not fit 80 columns in full
        for key, name in ((CURRENT, current), (first, first), (second, second)):
            assert flat_column(table, key) == compact_cells(*engine(name, RESIDENT_MEMORY)), name

        # Pinning what is pinned already, or a fourth recipe, is refused with a message.
        await pilot.press("left")
        await settle(pilot)
        await pilot.press("plus")
        await pilot.pause()
        assert len(screen.pins) == 2 and "pinned already" in list(app._notifications)[-1].message
        await pilot.press("left", "left")  # tq2
        await settle(pilot)
        await pilot.press("plus")
        await pilot.press("right", "right", "right")  # affine2 again
        await settle(pilot)
        await pilot.press("plus")
        await pilot.pause()
        assert len(screen.pins) == MAX_PINS
        assert f"{MAX_PINS} recipes are pinned" in list(app._notifications)[-1].message

        # x unpins the column under the table's cursor; outside the table, it says how to select one.
        await pilot.press("x")
        assert len(screen.pins) == MAX_PINS and "select a pinned column" in list(app._notifications)[-1].message
        await pilot.press("tab", "tab", "tab")  # past memory and disk to the table, its cursor on the current recipe
        assert app.focused is table and table.selected_name == CURRENT
        await pilot.press("right")
        assert table.selected_name == first
        await pilot.press("x")
        await settle(pilot)
        assert [r.name for r in screen.pins] == [second, "tq2a-tqTe-down4-g64"]
        assert table.column_names == [CURRENT, second, "tq2a-tqTe-down4-g64"]
        assert flat_column(table, second) == compact_cells(*engine(second, RESIDENT_MEMORY))
        # e loads the selected pin into the editor; esc goes back to the editor's row focused last.
        assert table.selected_name == second  # the cursor stays on the column that took the unpinned one's place
        await pilot.press("e")
        await settle(pilot)
        await pilot.press("escape")
        assert app.focused is screen.query_one("#base") and table.selected_name == CURRENT
        assert name_field(app) == second and controls(app)["base"] == "tq4"
        assert flat_column(table, CURRENT) == compact_cells(*engine(second, RESIDENT_MEMORY))


@pytest.mark.slow
async def test_three_pins_are_readable_at_80x24(tiny, engine):
    """The current recipe and three pins side by side at 80x24: every recipe's name and total on screen, in its
    column, as the engine computes them."""
    app = TqbenchApp(tiny)
    async with app.run_test(size=SIZE) as pilot:
        screen = await open_recipe_screen(pilot)
        table = screen.query_one(PlanTable)
        for _ in range(MAX_PINS):
            await pilot.press("plus", "right")  # pin, then the next base bits
            await settle(pilot)
        names = [r.name for r in screen.wanted]
        assert len(names) == 1 + MAX_PINS and len(set(names)) == len(names)
        assert table.compact and table.column_names == [CURRENT, *names[1:]]
        totals = [units.gb(engine(n, RESIDENT_MEMORY)[0].total_bytes) for n in names]
        lines = screen_lines(app)
        row = next(line for line in lines if " total " in f" {line} ")
        assert " ".join(row[row.index("total") + len("total"):].split()) == " ".join(totals)  # in column order
        assert all(line.rstrip().__len__() <= SIZE[0] for line in lines)
        header = "\n".join(lines[:6])
        for i, name in enumerate(names):
            assert ("current" if i == 0 else f"pin {i}") in header
            parts = [part for line in lines[1:6] for part in line.split()]  # the wrapped name, piece by piece
            assert all(piece in parts for piece in wrap_name(name, COMPACT_WIDTH) if piece), name


@pytest.mark.slow
async def test_a_wide_screen_keeps_labels_and_names_on_one_line(tiny, engine):
    """At 120x35 the current recipe and two pins fit with every label and name on one line (at 80x24 they wrap); at
    150 columns and more the editor widens too."""
    app = TqbenchApp(tiny)
    async with app.run_test(size=(120, 35)) as pilot:
        screen = await open_recipe_screen(pilot)
        table = screen.query_one(PlanTable)
        for _ in range(2):
            await pilot.press("plus", "right")  # pin, then the next base bits
            await settle(pilot)
        names = [r.name for r in screen.wanted]
        assert not table.compact and table.column_names == [CURRENT, *names[1:]]
        labels = [table.text(str(row.key.value), "label") for row in table.ordered_rows]
        assert "experts/token top-2" in labels and all("\n" not in label for label in labels)
        lines = screen_lines(app)
        assert all(name in "\n".join(lines[:6]) for name in names)  # each name whole, on one line
        assert table.region.right <= 120 and table.region.x == screen.editor.region.right
        for key, name in zip(table.column_names, names):
            assert column(table, key) == expected_cells(*engine(name, RESIDENT_MEMORY)), name
        narrow = screen.editor.region.width
        await pilot.resize_terminal(200, 50)
        await settle(pilot)
        assert screen.editor.region.width > narrow and not table.compact
        await pilot.press("plus", "right")  # a third pin; the current recipe is affine3a-tqTe-down4-g64
        await settle(pilot)
        assert len(screen.pins) == MAX_PINS and not table.compact
        assert screen.recipe.name == "affine3a-tqTe-down4-g64"
        header = "\n".join(screen_lines(app)[:6])
        assert all(r.name in header for r in screen.wanted), header  # each on one line


@pytest.mark.slow
async def test_ctrl_u_then_typing_at_once_sets_the_memory(tiny, engine):
    """ctrl+u and a size typed right behind it (as a paste does): the field holds the size, the plan is assessed for
    it."""
    app = TqbenchApp(tiny)
    async with app.run_test(size=SIZE) as pilot:
        screen = await open_recipe_screen(pilot)
        table = screen.query_one(PlanTable)
        memory = screen.query_one("#memory", Input)
        memory.focus()
        memory.cursor_position = len(memory.value)
        await pilot.press("ctrl+u", "6", "4", "G", "B")
        await settle(pilot)
        assert memory.value == "64GB" and screen.machine.memory_bytes == parse_size("64GB") == 64 * GB
        assert column(table, CURRENT) == expected_cells(*engine(INITIAL_RECIPE, "64GB"))
        burst(pilot, "ctrl+u", *STREAMING_MEMORY)  # one terminal read: nothing waits between the keys
        await settle(pilot)
        assert memory.value == STREAMING_MEMORY and screen.machine.memory_bytes == parse_size(STREAMING_MEMORY)
        assert column(table, CURRENT) == expected_cells(*engine(INITIAL_RECIPE, STREAMING_MEMORY))


@pytest.mark.slow
async def test_up_on_the_first_row_stays_and_app_keys_switch_screens(tiny):
    """The issue's trap: up on the base row, then s and p. Up stays on the base (arrows never enter a text field), s
    opens the Source screen and p comes back; nothing was typed into the recipe's name."""
    app = TqbenchApp(tiny)
    async with app.run_test(size=SIZE) as pilot:
        screen = await open_recipe_screen(pilot)
        base = screen.query_one("#base")
        assert app.focused is base
        await pilot.press("up", "up")
        assert app.focused is base
        await pilot.press("s")
        assert app.current_mode == "source"
        await pilot.press("p")
        assert app.screen is screen and app.focused is base and name_field(app) == INITIAL_RECIPE
        assert screen.recipe == Recipe.parse(INITIAL_RECIPE)
        for _ in range(12):  # down to the last enabled row, and no further: never into the memory field
            await pilot.press("down")
        assert app.focused is screen.query_one("#rounding")
        await pilot.press("s")
        assert app.current_mode == "source"


@pytest.mark.slow
async def test_tab_goes_round_every_part_and_esc_goes_back_to_the_rows(tiny):
    """Tab and shift+tab visit every part in reading order (name, option rows, memory, disk, table) and round again;
    in a text field the app's keys type (the footer hides them) and esc goes back to the row focused last."""
    app = TqbenchApp(tiny)
    async with app.run_test(size=SIZE) as pilot:
        screen = await open_recipe_screen(pilot)
        table = screen.query_one(PlanTable)
        name, memory, disk = (screen.query_one(f"#{key}", Input) for key in ("recipe-name", "memory", "disk"))
        base, group = screen.query_one("#base"), screen.query_one("#group")
        assert app.focused is base and "↑↓ Row" in footer(app) and "←→ Change" in footer(app)
        await pilot.press("down")
        assert app.focused is group
        order = [memory, disk, table, name, group]  # the rows resume on the row focused last
        for part in order:
            await pilot.press("tab")
            assert app.focused is part
        for part in reversed(order[:-1]):
            await pilot.press("shift+tab")
            assert app.focused is part
        await pilot.press("shift+tab")
        assert app.focused is group

        # In the table: left/right select a recipe; esc goes back to the rows.
        await pilot.press("shift+tab", "shift+tab")
        assert app.focused is table and "←→ Recipe" in footer(app) and "x Unpin" in footer(app)
        await pilot.press("escape")
        assert app.focused is group

        # In a text field the app's one-letter keys type, and the footer says so by leaving them out.
        await pilot.press("shift+tab")
        assert app.focused is name
        assert "esc Rows" in footer(app) and "←→ Cursor" in footer(app)
        assert not any(key in footer(app) for key in ("s Source", "q Quit", "+ Pin", "v Eval"))
        name.cursor_position = len(name.value)
        await pilot.press("s")
        assert app.current_mode == "recipe" and name_field(app) == INITIAL_RECIPE + "s"
        await pilot.press("backspace", "left", "left")
        assert name_field(app) == INITIAL_RECIPE and name.cursor_position == len(name.value) - 2
        await pilot.press("up", "down")  # nothing: a one-line field
        assert app.focused is name
        await pilot.press("escape")
        assert app.focused is group and name_field(app) == INITIAL_RECIPE
        assert footer(app).rstrip().endswith("h Profile")  # the footer's keys fit, whole (w Serve is left out)

        # Memory: typed there, then tab on to the disk field.
        await pilot.press("tab")
        assert app.focused is memory
        memory.cursor_position = len(memory.value)
        before = (memory.value, screen.recipe, screen.machine)
        await pilot.press("left", "left")
        assert memory.cursor_position == len(memory.value) - 2 and (memory.value, screen.recipe, screen.machine) == before
        await pilot.press("tab")
        assert app.focused is disk
        assert all(len(line) <= SIZE[0] for line in screen_lines(app))


@pytest.mark.slow
async def test_memory_size_decides_the_verdict(tiny, engine):
    app = TqbenchApp(tiny)
    async with app.run_test(size=SIZE) as pilot:
        screen = await open_recipe_screen(pilot)
        table = screen.query_one(PlanTable)
        await pilot.press("plus")  # the pinned column is assessed for the same machine
        for memory, verdict in ((STREAMING_MEMORY, Verdict.STREAMING), (NO_FIT_MEMORY, Verdict.NO_FIT),
                                (RESIDENT_MEMORY, Verdict.RESIDENT)):
            await set_input(pilot, "#memory", memory)
            plan, fit = engine(INITIAL_RECIPE, memory)
            assert fit.verdict is verdict
            assert column(table, CURRENT) == column(table, INITIAL_RECIPE) == expected_cells(plan, fit), memory
            if verdict is Verdict.STREAMING:
                assert fit.tok_s_ceiling is not None  # a real disk-bound ceiling is shown
            style = str(table.get_cell("verdict", CURRENT).style)
            assert {"resident": "green", "streaming": "yellow", "does not fit": "red"}[verdict.value] in style

        # A bad size or bandwidth says so in one line and keeps the last good machine.
        await set_input(pilot, "#memory", "lots")
        assert "memory: cannot read 'lots' as a size" in status(app)
        assert column(table, CURRENT) == expected_cells(*engine(INITIAL_RECIPE, RESIDENT_MEMORY))
        await set_input(pilot, "#memory", NO_FIT_MEMORY)
        await set_input(pilot, "#disk", "fast")
        assert "disk: cannot read 'fast'" in status(app)
        assert column(table, CURRENT) == expected_cells(*engine(INITIAL_RECIPE, NO_FIT_MEMORY))
        await set_input(pilot, "#disk", "")  # empty: the measured bandwidth of the checkpoint's disk
        assert not screen.query_one("#recipe-status").has_class("error")
        plan, fit = engine(INITIAL_RECIPE, NO_FIT_MEMORY, disk_speed(tiny).bytes_per_s / GB)
        assert column(table, CURRENT) == expected_cells(plan, fit)


@pytest.mark.slow
async def test_same_numbers_as_the_cli(tiny, engine, capsys, monkeypatch):
    """The Recipe screen's column and `tqbench plan`'s table (piped: one line per row) hold the same cells."""
    name = "tq3a-tqTe-down3-g64"
    result = tqbench(capsys, monkeypatch, "plan", tiny, "--recipe", name, "--memory", STREAMING_MEMORY,
                     "--disk-gbps", DISK)
    assert result.code == 0, result.err
    lines = result.out.splitlines()
    title = next(i for i, line in enumerate(lines) if line.startswith("plan (sizes in"))
    assert lines[title + 1].split() == [name]
    cli = {}
    for line in lines[title + 2:]:
        label, _, value = line.strip().partition("  ")
        if not value:
            break  # the caption
        cli[label] = value.strip()
    app = TqbenchApp(tiny)
    async with app.run_test(size=SIZE) as pilot:
        screen = await open_recipe_screen(pilot, memory=STREAMING_MEMORY)
        await set_input(pilot, "#recipe-name", name)
        shown = column(screen.query_one(PlanTable), CURRENT)
    plan, fit = engine(name, STREAMING_MEMORY)
    report = plan_report([plan], [fit])
    labels = {r.key: r.label.strip() for r in report.rows}
    assert set(shown) == set(labels) and len(cli) == len(labels)
    assert shown["verdict"] == cli["verdict"] == "streaming"
    assert shown["max tok/s top-k"] not in ("-", "not disk-bound")
    for key, text in shown.items():
        assert flat(text) == flat(cli[labels[key]]), key


async def test_disk_is_measured_in_a_worker_as_tqbench_plan_measures_it(tiny, capsys, monkeypatch):
    """No assumed bandwidth: the checkpoint's disk is measured once (tqbench.machine.disk_speed, in a thread
    worker, "measuring..." meanwhile) and the CLI reports the same figure."""
    app = TqbenchApp(tiny)
    async with app.run_test(size=SIZE) as pilot:
        screen = await open_recipe_screen(pilot, disk="")
        editor = screen.query_one(RecipeEditor)
        note = lambda: str(screen.query_one("#machine-note", Static).render())  # noqa: E731
        speed = cached_disk_speed(tiny)  # what the screen measured when the checkpoint was opened
        assert speed is not None and speed.directory == str(tiny) and f"disk: measured, {speed.method}" in note()
        assert (screen.machine.disk_bytes_per_s, screen.machine.disk_source) == (speed.bytes_per_s,
                                                                                 f"measured, {speed.method}")
        assert screen.query_one("#disk", Input).placeholder == f"{speed.bytes_per_s / GB:.2f}"

        disk_cache_file().unlink()  # a disk never measured: the worker measures it
        editor.set_checkpoint_path(tiny)
        assert "disk: measuring..." in note() and screen.query_one("#disk", Input).placeholder == "measuring..."
        await settle(pilot)
        measured = cached_disk_speed(tiny)
        assert measured is not None and measured.directory == str(tiny)
        assert f"disk: measured, {measured.method}" in note()
        assert screen.machine.disk_bytes_per_s == measured.bytes_per_s
    r = tqbench(capsys, monkeypatch, "plan", tiny, "--memory", STREAMING_MEMORY, "--platform", "linux")
    assert r.code == 0, r.err
    assert f"disk {measured.bytes_per_s / GB:.2f} GB/s (measured earlier, {measured.method})" in r.out


async def test_without_a_checkpoint_the_screen_says_how_to_get_one(tmp_path):
    app = TqbenchApp(tmp_path / "nope")
    async with app.run_test(size=SIZE) as pilot:
        await settle(pilot)
        await pilot.press("p")
        await settle(pilot)
        empty = app.screen.query_one("#plan-empty", Static)
        assert empty.display and "No checkpoint loaded yet" in str(empty.render())
        assert not app.screen.query_one(PlanTable).display
        await pilot.press("plus")  # nothing to pin: no crash
        assert app.is_running


def snapshot_one_pin(tmp_path, monkeypatch, snap_compare, size: tuple[int, int]) -> bool:
    """The Recipe screen on the tiny skeleton with one pinned recipe, streaming on a typed machine."""
    import tqbench.machine
    import tui.machine

    write_tiny(tmp_path / "tiny-k3")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(tqbench.machine, "physical_memory", lambda: 128 * GB)  # the "(here)" placeholder
    real_machine = tui.machine.machine
    monkeypatch.setattr(tui.machine, "machine", lambda m, g, p, d, s=None: real_machine(m, g, "linux", d, s))

    async def run_before(pilot) -> None:
        await open_recipe_screen(pilot, memory=STREAMING_MEMORY)
        await pilot.press("plus", "left")  # pin, then base tq3 -> tq2
        await settle(pilot)

    return snap_compare(TqbenchApp(Path("tiny-k3")), terminal_size=size, run_before=run_before)


@pytest.mark.slow
def test_snapshot_recipe_screen(tmp_path, monkeypatch, snap_compare):
    """At 80x24: labels and names wrap, the table right of the narrow editor."""
    assert snapshot_one_pin(tmp_path, monkeypatch, snap_compare, SIZE)


@pytest.mark.slow
@pytest.mark.parametrize("size", [(120, 35), (200, 50)], ids=["120x35", "200x50"])
def test_snapshot_recipe_screen_wide(tmp_path, monkeypatch, snap_compare, size):
    """Where there is room: labels and names on one line; at 200 columns the editor widens; every screen's key in
    the footer."""
    assert snapshot_one_pin(tmp_path, monkeypatch, snap_compare, size)


@pytest.mark.slow
def test_snapshot_recipe_screen_three_pins(tmp_path, monkeypatch, snap_compare):
    """Three pinned recipes and the current one at 80x24 (the table's compact mode), the table focused on pin 2."""
    import tqbench.machine
    import tui.machine

    write_tiny(tmp_path / "tiny-k3")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(tqbench.machine, "physical_memory", lambda: 128 * GB)
    real_machine = tui.machine.machine
    monkeypatch.setattr(tui.machine, "machine", lambda m, g, p, d, s=None: real_machine(m, g, "linux", d, s))

    async def run_before(pilot) -> None:
        await open_recipe_screen(pilot, memory=STREAMING_MEMORY)
        for _ in range(MAX_PINS):
            await pilot.press("plus", "right")  # pin, then the next base bits
            await settle(pilot)
        await pilot.press("tab", "tab", "tab", "right", "right")  # past memory and disk to the table, pin 2
        await settle(pilot)

    assert snap_compare(TqbenchApp(Path("tiny-k3")), terminal_size=SIZE, run_before=run_before)


# ---- quality ---------------------------------------------------------------------------------------------------------

def quality(recipe: str, fingerprint: str, perplexity: float, active_experts: int = 8) -> RecipeQuality:
    return RecipeQuality(recipe=recipe, source_fingerprint=fingerprint, texts="code, chat", tokens=512, window=256,
                         text_digest="digest", perplexity=perplexity, source_perplexity=10.41, kl=0.15234,
                         top1_agreement=0.87125, top5_overlap=0.9, greedy_share=None, active_experts=active_experts,
                         native_experts=8, when=time.time())


def store_holds(*records: RecipeQuality, tools: dict | None = None) -> None:
    """`tools`: {(fingerprint, recipe): ToolQuality} stored as `tqbench eval --tools` stores them."""
    store = EvalStore()  # the test's own cache directory (conftest)
    try:
        for q in records:
            store.put(q)
        for (fingerprint, recipe), t in (tools or {}).items():
            store.put_tools(fingerprint, recipe, t)
    finally:
        store.close()


def notes(app) -> list[str]:
    return [n.message for n in app._notifications]


def quality_column(table: PlanTable, key: str) -> tuple[str, ...]:
    return tuple(table.text(row, key) for row in ("perplexity", "kl", "top-1 agreement", "tool calls"))


def quality_caption(app) -> str:
    return str(app.screen.query_one("#quality-line", Static).render())


@pytest.mark.slow  # a TUI run of ~5-8 s on the shipped demo (its source fingerprint, the Recipe screen's plans)
async def test_quality_rows_show_the_evaluations_of_the_loaded_source():
    demo = ensure_demo()
    fingerprint = source_fingerprint(open_checkpoint(demo))
    initial = Recipe.parse(INITIAL_RECIPE).name
    calls = ToolQuality(cases=52, tool_set="d", valid_rate=1.0, exact_rate=0.8, agree_rate=0.9423,
                        source_exact_rate=0.85, when=time.time())
    store_holds(quality(initial, fingerprint, 11.2623),
                quality("tq4-g64", "another source", 10.5),  # measured on another source: never shown here
                quality("tq4-g64", fingerprint, 10.0, active_experts=4),  # at another routing: not this recipe's
                tools={(fingerprint, initial): calls, ("another source", "tq4-g64"): calls})
    app = TqbenchApp(demo)
    async with app.run_test(size=(120, 40)) as pilot:
        screen = await open_recipe_screen(pilot)
        table = screen.query_one(PlanTable)
        await wait_for(pilot, lambda: initial in screen.qualities, "the store to be read")
        await settle(pilot)
        assert quality_column(table, CURRENT) == ("11.26 (+8.2%)", "0.152", "87.1%", "94% of 52")
        assert quality_caption(app) == "quality: 512 tokens of code, chat, window 256"
        rows = [str(r.key.value) for r in table.ordered_rows]
        at = rows.index("perplexity")  # after what decides a recipe (Row.primary), before the details
        assert rows[at - 1] == "max tok/s reduced" and rows[at:at + 5] == [*QUALITY_ROWS, BPW_HEADING]

        await set_input(pilot, "#recipe-name", "tq4-g64")  # never evaluated on this source at native routing
        assert quality_column(table, CURRENT) == ("-", "-", "-", "-")
        assert quality_caption(app) == "quality: none measured on this source (v: quick eval)"
        await set_input(pilot, "#recipe-name", initial)
        await pilot.press("plus")  # pinned, then edited: the caption says what the pin's cells were measured on
        await set_input(pilot, "#recipe-name", "tq4-g64")
        assert quality_column(table, CURRENT) == ("-", "-", "-", "-")
        assert quality_column(table, initial) == ("11.26 (+8.2%)", "0.152", "87.1%", "94% of 52")
        assert quality_caption(app) == "quality: 512 tokens of code, chat, window 256"

        recipe_keys = dict(next(keys for title, keys in sections(app) if title.startswith("Recipe screen")))
        assert recipe_keys["v"] == "Eval"
        assert "v Eval" in footer(app) and footer(app).rstrip().endswith("h Profile w Serve")  # every key at 120
        screen.query_one("#memory", Input).focus()  # v types in a text field: not offered there
        await pilot.pause()
        assert "v Eval" not in footer(app)


async def test_a_quick_eval_that_fails_says_why_in_one_line():
    """The engine's error (here: the demo's conversion cannot go where a file is in the way) as one notification."""
    demo = ensure_demo()
    dest = default_dest(demo, INITIAL_RECIPE)
    dest.write_text("not a directory")
    app = TqbenchApp(demo)
    async with app.run_test(size=(120, 40)) as pilot:
        screen = await open_recipe_screen(pilot)
        await pilot.press("v")
        await wait_for(pilot, lambda: any("quick eval of" in n for n in notes(app)), "the failure", 60)
        failure = next(n for n in notes(app) if "quick eval of" in n)
        assert failure.startswith(f"quick eval of {INITIAL_RECIPE}: ") and str(dest) in failure
        assert "\n" not in failure and "Traceback" not in failure
        assert screen._eval_job is None and "quick eval of" not in quality_caption(app)
    assert dest.read_text() == "not a directory"


@pytest.mark.slow
async def test_quick_eval_fills_the_quality_rows_of_the_demo():
    """A real quick eval (the demo converted with a recipe, then 256 tokens scored against it): progress under the
    table, a second press refused, then the rows show what the store remembered; leaving the screen stops the next."""
    demo = ensure_demo()
    fingerprint = source_fingerprint(open_checkpoint(demo))
    name = "affine4-g64"
    app = TqbenchApp(demo)
    async with app.run_test(size=(120, 40)) as pilot:
        screen = await open_recipe_screen(pilot)
        screen.quick_tokens = 256
        await set_input(pilot, "#recipe-name", name)
        table = screen.query_one(PlanTable)
        assert quality_column(table, CURRENT) == ("-", "-", "-", "-")
        await pilot.press("v")
        await wait_for(pilot, lambda: "converting" in quality_caption(app), "the conversion's progress", 60)
        assert f"quick eval of {name} on the demo: converting" in quality_caption(app)
        await pilot.press("v")
        assert notes(app)[-1] == f"a quick eval of {name} is running: one at a time"
        await pilot.press("question_mark")  # the help over the screen does not stop it
        await pilot.press("escape")
        assert screen._eval_job is not None and not screen._eval_job.stopping
        await wait_for(pilot, lambda: "scor" in quality_caption(app), "the scoring's progress", 120)
        await wait_for(pilot, lambda: screen._eval_job is None, "the quick eval to end", 180)
        await settle(pilot)

        store = EvalStore()
        q = store.for_source(fingerprint)[name]
        store.close()
        assert (q.tokens, q.texts, q.window) == (512, "code, chat", 256)  # 256 asked: a whole window of each text
        assert notes(app)[-1] == (f"{name} on the demo: perplexity {q.perplexity:.2f} ({q.perplexity_change:+.1%} vs "
                                  f"source), KL {q.kl:.3f}")
        assert quality_column(table, CURRENT) == (f"{q.perplexity:.2f} ({q.perplexity_change:+.1%})", f"{q.kl:.3f}",
                                                  f"{q.top1_agreement:.1%}", "-")  # no tool calls in a quick eval
        assert quality_caption(app) == "quality: 512 tokens of code, chat, window 256"

        await set_input(pilot, "#recipe-name", "affine8-g64")
        await pilot.press("v")
        await wait_for(pilot, lambda: engine_thread().busy, "the next quick eval to start")
        await pilot.press("s")  # leaving the screen stops it
        stopped = "quick eval of affine8-g64 stopped: the Recipe screen was left"
        await wait_for(pilot, lambda: stopped in notes(app), "the notification")
        assert screen._eval_job is None
        await wait_for(pilot, lambda: not engine_thread().busy, "the quick eval to stop", 60)
