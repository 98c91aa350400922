"""The Textual UI, driven headless with Pilot on small header-only (skeleton) checkpoints."""

from __future__ import annotations

import fnmatch
import json
import sys
import types
from pathlib import Path

import pytest
from textual.widgets import DataTable, Input, Static, TabbedContent

from tqbench.paths import state_file
from tqbench.skeleton import K3_TEXT_CONFIG, k3_config, k3_tensor_specs, write_skeleton
from tui.app import TqbenchApp
from tui.screens.open import OpenScreen
from tui.widgets.roles import RoleTable
from tui.widgets.shards import MISSING, ShardTable
from tui.widgets.summary import SummaryPanel
from tui.widgets.tensors import ROW_LIMIT, TensorPanel
from tui_helpers import burst, screen_lines

SIZE = (80, 24)
LAYERS = 4
EXPERTS = 8
FIRST_DENSE = 1


def tiny_text_config() -> dict:
    """Kimi K3's text config shrunk to a few KB: 4 layers (MLA at 4), 8 experts top-2, latent 32."""
    text = dict(K3_TEXT_CONFIG)
    text.update(hidden_size=64, num_hidden_layers=LAYERS, vocab_size=256, intermediate_size=128,
                num_attention_heads=2, num_key_value_heads=2, q_lora_rank=16, kv_lora_rank=16, qk_nope_head_dim=8,
                qk_rope_head_dim=8, v_head_dim=8, num_experts=EXPERTS, num_experts_per_token=2,
                num_shared_experts=1, moe_intermediate_size=64, routed_expert_hidden_size=32,
                first_k_dense_replace=FIRST_DENSE)
    text["linear_attn_config"] = dict(text["linear_attn_config"], num_heads=2, head_dim=16,
                                      kda_layers=[1, 2, 3], full_attn_layers=[4])
    return text


SPECS = k3_tensor_specs(tiny_text_config())
NAMES = [s.name for s in SPECS]
SHARD_SIZE = 100_000  # four shards


def write_tiny(dest: Path) -> Path:
    return write_skeleton(dest, k3_config(tiny_text_config()), SPECS, shard_size=SHARD_SIZE)


@pytest.fixture(autouse=True)
def cache_dir(tmp_path, monkeypatch) -> Path:
    """Keep the state file (last checkpoint) inside the test's tmp_path."""
    cache = tmp_path / "cache"
    monkeypatch.setenv("TQBENCH_CACHE_DIR", str(cache))
    return cache


@pytest.fixture
def tiny(tmp_path) -> Path:
    return write_tiny(tmp_path / "tiny-k3")


@pytest.fixture
def incomplete(tmp_path) -> tuple[Path, str, int]:
    """A skeleton with its second shard deleted: (path, missing file, tensors the index puts there)."""
    path = write_tiny(tmp_path / "partial-k3")
    weight_map = json.loads((path / "model.safetensors.index.json").read_text())["weight_map"]
    shards = sorted(set(weight_map.values()))
    assert len(shards) >= 3, "the fixture needs several shards"
    gone = shards[1]
    (path / gone).unlink()
    return path, gone, sum(1 for f in weight_map.values() if f == gone)


async def settle(pilot) -> None:
    """Wait for the load worker, the filter worker it starts, and the messages they post."""
    for _ in range(3):
        await pilot.app.workers.wait_for_complete()
        await pilot.pause()


def summary_text(app) -> str:
    return str(app.screen.query_one(SummaryPanel).render())


def error_text(app) -> str:
    error = app.screen.query_one("#error", Static)
    return str(error.render()) if error.display else ""


def test_tiny_fixture_has_experts_and_shards(tiny):
    experts = [n for n in NAMES if ".experts." in n]
    assert len(experts) == (LAYERS - FIRST_DENSE) * EXPERTS * 3 * 2  # w1/w2/w3 x packed/scale
    assert len(list(tiny.glob("*.safetensors"))) >= 3


async def test_summary_shows_model_type_and_counts(tiny):
    app = TqbenchApp(tiny)
    async with app.run_test(size=SIZE) as pilot:
        await settle(pilot)
        text = summary_text(app)
        assert "kimi_k3" in text
        assert f"{len(NAMES):,} in " in text
        assert "compressed-tensors mxfp4-pack-quantized" in text
        assert f"{EXPERTS} per layer x {LAYERS - FIRST_DENSE} MoE layers" in text
        assert "top-2" in text
        assert "384.06 kB (375.06 KiB)" in text  # decimal and binary sizes (tqbench.units)
        assert "INCOMPLETE" not in text
        panel = app.screen.query_one(TensorPanel)
        assert panel.row_count == len(NAMES)
        assert panel.count_text == f"{len(NAMES)} of {len(NAMES)}"
        assert error_text(app) == ""


@pytest.mark.parametrize("pattern, typed", [pytest.param("*layers.2.*experts.*", True, marks=pytest.mark.slow),
                                            ("w2.weight_scale", False),
                                            ("EXPERTS.7.", False), ("*norm*", False), ("experts.3.w2*", False)])
async def test_filter_narrows_tensor_table(tiny, pattern, typed):
    if any(c in pattern for c in "*?["):
        expected = [n for n in NAMES if fnmatch.fnmatchcase(n, f"*{pattern}*")]  # a glob matches anywhere
    else:
        expected = [n for n in NAMES if pattern.lower() in n.lower()]
    assert 0 < len(expected) < len(NAMES)
    app = TqbenchApp(tiny)
    async with app.run_test(size=SIZE) as pilot:
        await settle(pilot)
        await pilot.press("slash")
        assert app.screen.query_one(TabbedContent).active == "tensors-pane"
        assert isinstance(app.focused, Input)
        panel = app.screen.query_one(TensorPanel)
        if typed:
            await pilot.press(*pattern)
        else:  # typing costs a table refill per key; once is enough
            panel.filter_input.value = pattern
        await settle(pilot)
        assert panel.filter_input.value == pattern
        assert panel.row_count == len(expected)
        assert panel.count_text == f"{len(expected)} of {len(NAMES)}"
        shown = {key.value for key in panel.table.rows}
        assert shown == set(expected)

        await pilot.press("escape")  # clears the filter
        await settle(pilot)
        assert panel.filter_input.value == ""
        assert panel.row_count == len(NAMES)


async def test_ctrl_u_then_typing_at_once_replaces_the_filter(tiny):
    """ctrl+u with characters right behind it (one terminal read): the characters land after the deletion."""
    expected = [n for n in NAMES if "w2.weight_scale" in n.lower()]
    assert 0 < len(expected) < len(NAMES)
    app = TqbenchApp(tiny)
    async with app.run_test(size=SIZE) as pilot:
        await settle(pilot)
        await pilot.press("slash", *"norm")
        await settle(pilot)
        panel = app.screen.query_one(TensorPanel)
        burst(pilot, "ctrl+u", *"w2.weight_scale")
        await settle(pilot)
        assert panel.filter_input.value == "w2.weight_scale"
        assert panel.count_text == f"{len(expected)} of {len(NAMES)}"
        assert {key.value for key in panel.table.rows} == set(expected)


async def test_filter_typed_keys_do_not_trigger_bindings(tiny):
    app = TqbenchApp(tiny)
    async with app.run_test(size=SIZE) as pilot:
        await settle(pilot)
        await pilot.press("slash", "q", "r", "o")
        await settle(pilot)
        assert app.is_running
        assert app.screen.query_one(TensorPanel).filter_input.value == "qro"
        assert not isinstance(app.screen, OpenScreen)


async def test_r_toggles_role_and_layer_tables(tiny):
    app = TqbenchApp(tiny)
    async with app.run_test(size=SIZE) as pilot:
        await settle(pilot)
        table = app.screen.query_one(RoleTable)
        assert [c.label.plain for c in table.columns.values()][0] == "role"
        roles = {str(table.get_row_at(i)[0]) for i in range(table.row_count)}
        assert {"embedding", "lm_head", "attention", "routed_expert", "router", "latent_proj"} <= roles
        await pilot.press("r")
        await pilot.pause()
        assert table.by_layer
        assert [c.label.plain for c in table.columns.values()][0] == "layer"
        assert table.row_count == LAYERS
        assert [str(table.get_row_at(i)[2]) for i in range(LAYERS)] == ["dense", "moe", "moe", "moe"]
        assert [str(table.get_row_at(i)[1]) for i in range(LAYERS)] == ["kda", "kda", "kda", "mla"]
        await pilot.press("r")
        await pilot.pause()
        assert table.row_count == len(roles)


async def test_missing_shard_is_listed_and_flagged(incomplete):
    path, gone, gone_tensors = incomplete
    app = TqbenchApp(path)
    async with app.run_test(size=SIZE) as pilot:
        await settle(pilot)
        text = summary_text(app)
        assert "INCOMPLETE: 1 of" in text and "shards missing" in text
        assert f"{len(NAMES) - gone_tensors:,} in " in text
        shards = app.screen.query_one(ShardTable)
        row = shards.get_row(gone)
        assert str(row[0]) == gone and str(row[-1]) == MISSING
        assert "red" in str(row[0].style)
        assert shards.get_row_at(0) == row  # missing shards come first
        label = app.screen.query_one(TabbedContent).get_tab("shards-pane").label
        assert "1 missing" in label.plain
        await pilot.press("3")
        assert app.screen.query_one(TabbedContent).active == "shards-pane"
        assert app.focused is shards
        assert error_text(app) == ""


async def test_bad_path_shows_one_line_error_and_stays_usable(tmp_path, tiny):
    app = TqbenchApp(tmp_path / "nope")
    async with app.run_test(size=SIZE) as pilot:
        await settle(pilot)
        error = error_text(app)
        assert "no such directory" in error and "nope" in error
        assert "Traceback" not in error and "\n" not in error
        assert app.is_running
        assert app.screen.query_one("#empty").display  # says how to go on
        # Open a good one from the modal.
        await pilot.press("o")
        assert isinstance(app.screen, OpenScreen)
        dialog_input = app.screen.query_one(Input)
        dialog_input.value = str(tiny)
        await pilot.press("enter")
        await settle(pilot)
        assert not isinstance(app.screen, OpenScreen)
        assert error_text(app) == ""
        assert f"{len(NAMES):,} in " in summary_text(app)


async def test_not_a_checkpoint_error(tmp_path):
    (tmp_path / "empty").mkdir()
    app = TqbenchApp(tmp_path / "empty")
    async with app.run_test(size=SIZE) as pilot:
        await settle(pilot)
        assert "no config.json" in error_text(app)


async def test_open_modal_escape_cancels(tiny):
    app = TqbenchApp(tiny)
    async with app.run_test(size=SIZE) as pilot:
        await settle(pilot)
        await pilot.press("o")
        assert isinstance(app.screen, OpenScreen)
        assert app.screen.query_one(Input).value == str(tiny)
        await pilot.press("escape")
        await pilot.pause()
        assert not isinstance(app.screen, OpenScreen)
        assert app.is_running


async def test_open_modal_ctrl_u_then_a_pasted_path(tiny):
    """ctrl+u and the pasted path arrive in one read: the field ends up holding the path, not empty."""
    app = TqbenchApp(tiny)
    async with app.run_test(size=SIZE) as pilot:
        await settle(pilot)
        await pilot.press("o")
        burst(pilot, "ctrl+u", *"/x/y")
        await pilot.pause()
        await pilot.pause()
        assert app.screen.query_one(Input).value == "/x/y"


async def test_q_quits(tiny):
    app = TqbenchApp(tiny)
    async with app.run_test(size=SIZE) as pilot:
        await settle(pilot)
        await pilot.press("q")
        await pilot.pause()
        assert not app.is_running


async def test_remembers_last_checkpoint(tiny):
    app = TqbenchApp(tiny)
    async with app.run_test(size=SIZE) as pilot:
        await settle(pilot)
    assert json.loads(state_file().read_text()) == {"last_checkpoint": str(tiny.resolve())}

    again = TqbenchApp(None)
    async with again.run_test(size=SIZE) as pilot:
        await settle(pilot)
        assert again.checkpoint is not None and again.checkpoint.path.resolve() == tiny.resolve()


async def test_no_path_and_nothing_remembered_opens_the_demo(tmp_path, monkeypatch):
    demo_path = write_tiny(tmp_path / "demo")
    fake = types.ModuleType("tqbench.demo")
    fake.ensure_demo = lambda force=False: demo_path
    monkeypatch.setitem(sys.modules, "tqbench.demo", fake)
    app = TqbenchApp(None)
    async with app.run_test(size=SIZE) as pilot:
        await settle(pilot)
        assert app.checkpoint is not None and app.checkpoint.path == demo_path
        assert error_text(app) == ""


async def test_remembered_checkpoint_gone_falls_back_to_demo(tmp_path, monkeypatch):
    state_file().parent.mkdir(parents=True, exist_ok=True)
    state_file().write_text(json.dumps({"last_checkpoint": str(tmp_path / "deleted")}))
    demo_path = write_tiny(tmp_path / "demo")
    fake = types.ModuleType("tqbench.demo")
    fake.ensure_demo = lambda force=False: demo_path
    monkeypatch.setitem(sys.modules, "tqbench.demo", fake)
    app = TqbenchApp(None)
    async with app.run_test(size=SIZE) as pilot:
        await settle(pilot)
        assert app.checkpoint is not None and app.checkpoint.path == demo_path


async def test_demo_unavailable_shows_a_message(monkeypatch):
    monkeypatch.setitem(sys.modules, "tqbench.demo", None)  # import fails
    app = TqbenchApp(None)
    async with app.run_test(size=SIZE) as pilot:
        await settle(pilot)
        error = error_text(app)
        assert "demo model is unavailable" in error and "\n" not in error
        assert app.screen.query_one("#empty").display  # "Press o to open a checkpoint directory"
        assert app.is_running


async def test_row_limit_caps_the_table(tiny, monkeypatch):
    import tui.widgets.tensors as tensors

    monkeypatch.setattr(tensors, "ROW_LIMIT", 10)
    app = TqbenchApp(tiny)
    async with app.run_test(size=SIZE) as pilot:
        await settle(pilot)
        panel = app.screen.query_one(TensorPanel)
        assert panel.row_count == 10
        assert panel.count_text == f"{len(NAMES)} of {len(NAMES)} (10 shown)"
    assert ROW_LIMIT == 1000


async def test_layout_fits_80x24(tiny):
    """Everything the Source screen needs is on screen at 80x24: summary, tabs, a table with rows, footer."""
    app = TqbenchApp(tiny)
    async with app.run_test(size=SIZE) as pilot:
        await settle(pilot)
        screen = app.screen
        summary = screen.query_one(SummaryPanel)
        assert summary.region.height <= 8
        table = screen.query_one(RoleTable)
        assert table.region.height >= 8
        assert table.region.bottom <= 23
        for widget in screen.query(DataTable):
            if widget.display and widget.region.height:
                assert widget.region.right <= 80


def check_tensor_rows(app, width: int) -> int:
    """Each shown row's role whole, right after its name, the name whole or its end after an ellipsis; no line wider
    than the screen. Returns how many names were shortened."""
    panel = app.screen.query_one(TensorPanel)
    table = panel.table
    lines = screen_lines(app)
    assert lines[table.region.y].split()[:4] == ["name", "role", "layer", "expert"]
    assert all(len(line) <= width for line in lines)
    shortened = 0
    for i, row in enumerate(table.ordered_rows[:table.region.height - 2]):
        full = row.key.value
        tensor = panel._shown[full]
        role = tensor.name.role.value + (f" ({tensor.name.attention})" if tensor.name.attention else "")
        line = lines[table.region.y + 1 + i][table.region.x:table.region.right]
        shown = line.split()[0]
        assert shown == full or (shown.startswith("…") and full.endswith(shown[1:])), (shown, full)
        shortened += shown != full
        assert f" {role} " in f"{line} ", (line, role)
    return shortened


@pytest.mark.parametrize("size", [(80, 24), (120, 35), (200, 50)])
async def test_tensor_table_shows_roles_whole_and_names_by_their_end(tiny, size):
    """Each row's role reads whole, right after its name; a name too long for the room left shows its end after an
    ellipsis (at 200 columns every name is whole), and the line under the table names the highlighted tensor in
    full."""
    app = TqbenchApp(tiny)
    async with app.run_test(size=size) as pilot:
        await settle(pilot)
        await pilot.press("2")
        await settle(pilot)
        assert (check_tensor_rows(app, size[0]) == 0) == (size[0] >= 200)
        table = app.screen.query_one(TensorPanel).table
        detail = str(app.screen.query_one("#tensor-detail", Static).render())
        assert detail.split("\n")[0] == table.ordered_rows[0].key.value


async def test_tensor_table_refits_its_names_when_resized(tiny):
    """A filtered table at 80 columns, then 120 and 80 again: the names shortened to the new room each time (the
    columns' widths follow), the roles whole."""
    app = TqbenchApp(tiny)
    async with app.run_test(size=SIZE) as pilot:
        await settle(pilot)
        await pilot.press("slash", *"experts.7.w2", "enter")
        await settle(pilot)
        panel = app.screen.query_one(TensorPanel)
        assert panel.row_count == 2 * (LAYERS - FIRST_DENSE)
        widths = []
        for width, height in ((80, 24), (120, 35), (80, 24)):
            await pilot.resize_terminal(width, height)
            await settle(pilot)
            await pilot.pause(0.1)
            check_tensor_rows(app, width)
            widths.append(panel.table.columns["name"].get_render_width(panel.table))
        assert widths[0] == widths[2] < widths[1]


def test_snapshot_source_screen(tmp_path, monkeypatch, snap_compare):
    """The loaded Source screen at 80x24 on the tiny skeleton (path shown relative to the working directory)."""
    write_tiny(tmp_path / "tiny-k3")
    monkeypatch.chdir(tmp_path)

    async def run_before(pilot) -> None:
        await settle(pilot)

    assert snap_compare(TqbenchApp(Path("tiny-k3")), terminal_size=SIZE, run_before=run_before)


@pytest.mark.parametrize("size", [(80, 24), (120, 35), (200, 50)], ids=["80x24", "120x35", "200x50"])
def test_snapshot_tensors_tab(tmp_path, monkeypatch, snap_compare, size):
    """The Tensors tab: roles whole after the names (their ends where the room is short), the highlighted tensor's full
    name under the table."""
    write_tiny(tmp_path / "tiny-k3")
    monkeypatch.chdir(tmp_path)

    async def run_before(pilot) -> None:
        await settle(pilot)
        await pilot.press("2", "down", "down")
        await settle(pilot)

    assert snap_compare(TqbenchApp(Path("tiny-k3")), terminal_size=size, run_before=run_before)


def test_snapshot_incomplete_shards_tab(tmp_path, monkeypatch, snap_compare):
    """A checkpoint with a missing shard, Shards tab shown: warning line and the red MISSING row."""
    path = write_tiny(tmp_path / "partial-k3")
    (path / sorted(path.glob("*.safetensors"))[1].name).unlink()
    monkeypatch.chdir(tmp_path)

    async def run_before(pilot) -> None:
        await settle(pilot)
        await pilot.press("3")
        await pilot.pause()

    assert snap_compare(TqbenchApp(Path("partial-k3")), terminal_size=SIZE, run_before=run_before)


async def test_keys_pressed_while_quitting_open_nothing(tiny):
    """q then t at once: the app quits; t does not mount the Chat screen into an app that is closing."""
    app = TqbenchApp(tiny)
    async with app.run_test(size=SIZE) as pilot:
        await settle(pilot)
        burst(pilot, "q", "t", "w")
        await pilot.pause()
        await pilot.pause()
        assert not app.is_running
    assert app.return_code in (None, 0)
