"""The Recipe screen, driven with Pilot on the tiny skeleton checkpoint of test_tui.py.

Every number is checked against the engine (tqbench.recipe.make_plan / assess on a Recipe parsed from its name) or the
real `tqbench plan --json`, never against the screen's own state.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from textual.widgets import Input, Static

from cli_helpers import tqbench
from test_tui import write_tiny
from tui_helpers import settle
from tqbench import units
from tqbench.recipe import Recipe, assess, group_sources, machine, make_plan, parse_size
from tqbench.recipe.fit import GB, Verdict, disk_cache_file
from tqbench.source import open_checkpoint
from tui.app import TqbenchApp
from tui.machine import DEFAULT_DISK_GBPS, default_disk
from tui.screens.recipe import MAX_PINS, RecipeScreen
from tui.widgets.plan_table import CURRENT, PlanTable
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


def both(n: int | None) -> str:
    return "-" if n is None else f"{units.gb(n)}\n{units.gib(n)}"


def rate(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}"


def expected_cells(plan, fit) -> dict[str, str]:
    """The table's text for one recipe, formatted as tqbench plan formats it."""
    e = plan.experts
    return {
        "resident": both(plan.resident_bytes),
        "routed experts": both(plan.streamed_bytes),
        "total": both(plan.total_bytes),
        "bits/weight": f"{plan.bits_per_weight:.3f}",
        "expert page": "\n".join([units.gb(e.bytes_per_expert),
                                  *(f"{k} {units.gb(v)}" for k, v in e.page_by_projection.items())]),
        "shards": str(plan.shards),
        "verdict": fit.verdict.value,
        "cache budget": both(fit.cache_budget_bytes),
        "max tok/s top-k": rate(fit.tok_s_ceiling),
        "max tok/s reduced": rate(fit.tok_s_ceiling_reduced),
        "kept at source": units.gb(sum(k.bytes for k in plan.kept)),
        "experts/token top-k": units.gb(fit.bytes_per_token),
        "hit rate": "-" if fit.hit_rate is None else f"{fit.hit_rate:.1%}",
    }


def column(table: PlanTable, key: str) -> dict[str, str]:
    cells = {row: table.text(row, key) for row in expected_keys()}
    cells["verdict"] = cells["verdict"].replace("\n", " ")  # wrapped to the column width
    return cells


def expected_keys() -> list[str]:
    return ["resident", "routed experts", "total", "bits/weight", "expert page", "shards", "verdict", "cache budget",
            "max tok/s top-k", "max tok/s reduced", "kept at source", "experts/token top-k", "hit rate"]


def name_field(app) -> str:
    return app.screen.query_one("#recipe-name", Input).value


def status(app) -> str:
    return str(app.screen.query_one("#recipe-status", Static).render())


def controls(app) -> dict[str, str]:
    return app.screen.query_one(RecipeEditor).control_values()


# ---- controls and names ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", [INITIAL_RECIPE, "tq4", "tq2-g32", "tq3a-tqTe-g64-mlpg128", "tq4-tq3a-tq2e-down3",
                                  "affine4-g32", "affine6-affine4a-affine2e-down8", "tq3-mxfp4e", "tq3-srce-g128",
                                  "src", "srca-tq2e-down4", "srca-tqTe", "tq3-norot-seed7", "affine4-tqTe-down4"])
def test_controls_spell_the_same_recipe_as_the_name(name):
    recipe = Recipe.parse(name)
    values = controls_from_recipe(recipe)
    assert set(values) == set(CONTROLS)
    assert recipe_from_controls(values, recipe.seed) == recipe


def test_disk_default_is_the_cached_measurement_else_assumed(tmp_path):
    assert default_disk(tmp_path) == default_disk(None)
    assert default_disk(tmp_path).gbps == DEFAULT_DISK_GBPS and "assumed" in default_disk(tmp_path).source
    import os

    disk_cache_file().parent.mkdir(parents=True, exist_ok=True)
    disk_cache_file().write_text(json.dumps({str(os.stat(tmp_path).st_dev): {"bytes_per_s": 1.8e9,
                                                                             "method": "O_DIRECT"}}))
    cached = default_disk(tmp_path)
    assert cached.gbps == pytest.approx(1.8) and cached.source == "measured (O_DIRECT)"


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
        assert table.header_text("label").split("\n") == ["sizes in", "GB over GiB", "shards <=", "5.00 GiB"]

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
                                 "mlpg": "128", "rotation": "off"}
        assert not screen.query_one("#recipe-status").has_class("error")
        name = "tq2-tq4a-tq3e-g32-mlpg128-norot"
        assert column(table, CURRENT) == expected_cells(*engine(name, RESIDENT_MEMORY))

        await set_input(pilot, "#recipe-name", "affine4-mxfp4e")  # the down-bit and group controls no longer apply
        assert controls(app)["base"] == "affine4" and controls(app)["experts"] == "mxfp4"
        assert screen.query_one("#down", CycleSelect).disabled and screen.query_one("#mlpg", CycleSelect).disabled
        assert screen.query_one("#rotation", CycleSelect).disabled  # no TurboQuant tier
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
        for key, name in ((CURRENT, current), (first, first), (second, second)):
            assert column(table, key) == expected_cells(*engine(name, RESIDENT_MEMORY)), name

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
        await pilot.press("tab")  # to the table, its cursor on the current recipe
        assert app.focused is table and table.selected_name == CURRENT
        await pilot.press("right")
        assert table.selected_name == first
        await pilot.press("x")
        await settle(pilot)
        assert [r.name for r in screen.pins] == [second, "tq2a-tqTe-down4-g64"]
        assert table.column_names == [CURRENT, second, "tq2a-tqTe-down4-g64"]
        assert column(table, second) == expected_cells(*engine(second, RESIDENT_MEMORY))
        # e loads the selected pin into the editor; tab goes back to the editor's control focused last.
        assert table.selected_name == second  # the cursor stays on the column that took the unpinned one's place
        await pilot.press("e")
        await settle(pilot)
        await pilot.press("tab")
        assert app.focused is screen.query_one("#base") and table.selected_name == CURRENT
        assert name_field(app) == second and controls(app)["base"] == "tq4"
        assert column(table, CURRENT) == expected_cells(*engine(second, RESIDENT_MEMORY))


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
                assert rate(fit.tok_s_ceiling) != "-"  # a real disk-bound ceiling is shown
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
        await set_input(pilot, "#disk", "")  # empty: the default bandwidth
        assert not screen.query_one("#recipe-status").has_class("error")
        plan, fit = engine(INITIAL_RECIPE, NO_FIT_MEMORY, DEFAULT_DISK_GBPS)
        assert column(table, CURRENT) == expected_cells(plan, fit)


@pytest.mark.slow
async def test_same_numbers_as_the_cli(tiny, capsys, monkeypatch):
    name = "tq3a-tqTe-down3-g64"
    result = tqbench(capsys, monkeypatch, "plan", tiny, "--recipe", name, "--memory", STREAMING_MEMORY,
                     "--disk-gbps", DISK, "--json")
    assert result.code == 0, result.err
    cli = json.loads(result.out)["plans"][0]
    assert cli["recipe"]["name"] == name and cli["fit"]["verdict"] == "streaming"
    app = TqbenchApp(tiny)
    async with app.run_test(size=SIZE) as pilot:
        screen = await open_recipe_screen(pilot, memory=STREAMING_MEMORY)
        await set_input(pilot, "#recipe-name", name)
        shown = column(screen.query_one(PlanTable), CURRENT)
    b, fit, e = cli["bytes"], cli["fit"], cli["experts"]
    assert shown["resident"] == both(b["resident"])
    assert shown["routed experts"] == both(b["streamed"])
    assert shown["total"] == both(b["total"])
    assert shown["bits/weight"] == f"{cli['bits_per_weight']:.3f}"
    assert shown["expert page"].split("\n")[0] == units.gb(e["bytes_per_expert"])
    assert shown["shards"] == str(cli["shards"]["count"])
    assert shown["verdict"] == fit["verdict"]
    assert shown["cache budget"] == both(fit["cache_budget_bytes"])
    assert shown["max tok/s top-k"] == rate(fit["tok_s_ceiling"])
    assert shown["max tok/s reduced"] == rate(fit["tok_s_ceiling_reduced"])
    assert shown["hit rate"] == f"{fit['hit_rate']:.1%}"


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


@pytest.mark.slow
def test_snapshot_recipe_screen(tmp_path, monkeypatch, snap_compare):
    """The Recipe screen at 80x24 on the tiny skeleton with one pinned recipe, streaming on a typed machine."""
    import tqbench.recipe.fit as fit
    import tui.machine

    write_tiny(tmp_path / "tiny-k3")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(fit, "physical_memory", lambda: 128 * GB)  # the "(here)" placeholder
    real_machine = tui.machine.machine
    monkeypatch.setattr(tui.machine, "machine", lambda m, g, p, d: real_machine(m, g, "linux", d))

    async def run_before(pilot) -> None:
        await open_recipe_screen(pilot, memory=STREAMING_MEMORY)
        await pilot.press("plus", "left")  # pin, then base tq3 -> tq2
        await settle(pilot)

    assert snap_compare(TqbenchApp(Path("tiny-k3")), terminal_size=SIZE, run_before=run_before)
