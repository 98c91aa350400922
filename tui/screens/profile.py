"""The Profile screen: a model's hot-expert profile (tqbench.profile), as `tqbench profile show` reports it: which
profile applies and how mature it is, a layer x expert heat map of its counts, the experts each layer needs for
50/80/90% of its routings; plus export and import, as `tqbench profile export/import` do them.

The model is the one the Chat screen opens (the last converted model, else the demo's conversion); o opens another
model directory, or a profile file (shown against the model when it fits, else on its own). The profile is read again
each time the screen is shown, and while it is shown whenever the engine's stamp of what it was read from changes
(tqbench.profile.profile_stamp, checked every POLL_S in a worker): chat sessions, here or in another process, keep
learning. A dialog open over the screen holds that reload back until it closes; the cursors stay where they were.
e proposes the engine's default export file (tqbench.profile.default_export_file) and names the file written in full."""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
from textual import on, work
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Vertical
from textual.content import Content
from textual.screen import Screen
from textual.widgets import DataTable, Header, Static
from textual.worker import Worker, WorkerState

from tqbench.errors import TqbenchError
from tui.screens.open import OpenScreen
from tui.state import display_path
from tui.widgets.footer import FittingFooter
from tui.widgets.heat_map import RAMP, HeatMap

if TYPE_CHECKING:
    from tqbench.profile import Overview, Profile, ProfileStamp

HOTTEST_SHOWN = 3  # hottest experts per layer in the coverage table (it fits 80 columns)
POLL_S = 2.0  # how often a shown profile's stamp is read again


def one_line(e: TqbenchError) -> str:
    """The engine's one-line error, its path as the screen shows paths."""
    return f"{display_path(Path(e.path))}: {e.message}" if e.path else e.message


class ProfileScreen(Screen):
    BINDINGS = [
        Binding("o", "open", "Open"),
        Binding("e", "export", "Export"),
        Binding("i", "import", "Import"),
        Binding("r", "reload", "Reload", show=False),
        Binding("escape", "own_profile", "Model's profile"),  # while a file is shown
    ]
    DEFAULT_CSS = """
    ProfileScreen #error { text-wrap: nowrap; text-overflow: ellipsis; }
    ProfileScreen #profile-info { height: auto; padding: 0 1; background: $boost; text-wrap: nowrap;
                                  text-overflow: ellipsis; }
    ProfileScreen #profile-body { height: 1fr; }
    ProfileScreen #heat-cell { height: 1; padding: 0 1; color: $text-muted; text-wrap: nowrap;
                               text-overflow: ellipsis; }
    ProfileScreen #coverage { height: 1fr; }
    ProfileScreen #profile-empty { height: 1fr; padding: 1 2; color: $text-muted; }
    """

    def __init__(self) -> None:
        super().__init__()
        self.model: Path | None = None  # None: the Chat screen's default model
        self.file: Path | None = None  # a profile file shown instead of the model's own profile
        self.overview: Overview | None = None  # tqbench.profile.overview's record of what is shown
        self.profile: Profile | None = None  # the profile it describes
        self.shown_model: Path | None = None  # the model it was read for (None: a file on its own)
        self.error: str | None = None
        self._load_id = 0
        self._loading = False  # a load is in flight (the poll waits for it)
        self._stale_stamp: ProfileStamp | None = None  # the stamp that last asked for a reload (asked once)
        self._shown_paths: tuple[Path | None, Path | None] = (None, None)  # (model, file) of the last good load

    def compose(self) -> ComposeResult:
        yield Header()
        yield Static("", id="error")
        yield Static("", id="profile-info")
        yield Static("", id="profile-empty")
        with Vertical(id="profile-body"):
            yield HeatMap(id="heat")
            yield Static("", id="heat-cell")
            yield DataTable(id="coverage", cursor_type="row", zebra_stripes=True)
        yield FittingFooter()

    def on_mount(self) -> None:
        self.sub_title = "Profile"
        self.query_one("#profile-body").display = False
        self.query_one("#profile-empty").display = False
        self.set_interval(POLL_S, self._poll)

    def on_screen_resume(self) -> None:
        self.reload(clear=False)  # also back from a dialog: an error it led to stays

    # ---- keeping up with the store ---------------------------------------------------------------------------------

    def _poll(self) -> None:
        """Read the shown profile's stamp again, unless the screen is hidden or covered (a dialog is open) or a load
        is in flight."""
        if self.overview is not None and self.app.screen is self and not self._loading:
            self._check(self._load_id, self.overview)

    @work(thread=True, exclusive=True, group="poll", exit_on_error=False, description="check the profile")
    def _check(self, load_id: int, shown: Overview) -> None:
        from tqbench.profile import profile_stamp

        try:
            stamp = profile_stamp(shown)
        except TqbenchError:
            return  # the store cannot be read now: the next reload says so, the screen stays as it is
        if stamp != shown.stamp:
            self.app.call_from_thread(self._stale, load_id, stamp)

    def _stale(self, load_id: int, stamp: ProfileStamp) -> None:
        """The shown profile is out of date: read it again, once per stamp (a reload that fails is not repeated)."""
        if load_id == self._load_id and self.app.screen is self and not self._loading and stamp != self._stale_stamp:
            self._stale_stamp = stamp
            self.reload(clear=False)

    # ---- loading ----------------------------------------------------------------------------------------------------

    def reload(self, clear: bool = True) -> None:
        if clear:
            self._set_error(None)
        self._load_id += 1
        self._loading = True
        self._load(self._load_id, self.model, self.file)

    @work(thread=True, exclusive=True, group="profile", exit_on_error=False, description="read the profile")
    def _load(self, load_id: int, model: Path | None, file: Path | None) -> None:
        from tqbench.chat.choose import default_model
        from tqbench.profile import profile_view

        try:
            model = model or default_model()
            view = profile_view(model, file, HOTTEST_SHOWN)
        except TqbenchError as e:
            self.app.call_from_thread(self._fail, load_id, one_line(e))
            return
        if view is None:
            self.app.call_from_thread(self._show, load_id, None, None, None)
            return
        shown, p = view  # the file on its own when it is another model's (shown.model None)
        self.app.call_from_thread(self._show, load_id, model if shown.model is not None else None, shown, p)

    def on_worker_state_changed(self, event: Worker.StateChanged) -> None:
        """Anything else a worker raised (a locked store, a bug) is one line too."""
        if event.state is WorkerState.ERROR and event.worker.group in ("profile", "share"):
            if event.worker.group == "profile":
                self._loading = False
            e = event.worker.error
            self._set_error(" ".join(f"{type(e).__name__}: {e}".split()))

    def _fail(self, load_id: int, text: str) -> None:
        if load_id == self._load_id:
            self._loading = False
            self.model, self.file = self._shown_paths  # what is shown stays shown
            self.refresh_bindings()
            self._set_error(text)

    def _show(self, load_id: int, model: Path | None, overview: Overview | None, profile: Profile | None) -> None:
        if load_id != self._load_id:
            return
        self._loading = False
        self._shown_paths = (self.model, self.file)
        self.overview, self.profile, self.shown_model = overview, profile, model
        self.query_one("#profile-body").display = overview is not None
        empty = self.query_one("#profile-empty", Static)
        empty.display = overview is None
        self.query_one("#profile-info").display = overview is not None
        self.refresh_bindings()
        if overview is None:
            empty.update("No converted model yet: the Chat screen (t) converts the demo, the Convert screen (c) "
                         "converts a checkpoint. Or press o to open a model directory or a profile file.")
            return
        shown = overview.where if overview.source == "file" else overview.model
        self.sub_title = f"Profile: {display_path(Path(shown))}"
        self.query_one("#profile-info", Static).update(Content("\n".join(self._info_lines(overview))))
        counts = profile.counts()
        layers = list(profile.geometry.layers)
        heat = self.query_one(HeatMap)
        heat.show(layers, np.stack([counts[n] for n in layers]) if layers else np.zeros((0, 0)))
        self._fill_table(overview)
        if self.focused is None:
            heat.focus()

    def _info_lines(self, overview: Overview) -> list[str]:
        from tqbench.profile.report import CHAT_STARTS, count, number, shape

        s = overview.summary
        routings = f"{number(s.routings)} routings"
        if overview.source == "learned":
            mature = overview.mature_at
            maturity = (f"mature (from {mature:,})" if s.routings >= mature else
                        f"mature at {mature:,} ({s.routings / mature:.0%} there)")
            line = f"learned: {routings}, {count(s.sessions)} session{'s' if s.sessions != 1 else ''}; {maturity}"
        elif overview.source == "none":
            line = "none yet: chat sessions learn one"
        else:
            line = f"{overview.source} {display_path(Path(overview.where))}: {routings}"
        chat_line = "-" if overview.chat is None else CHAT_STARTS[overview.chat.source]
        model = (f"{shape(s.geometry)} [{s.fingerprint}]" if overview.model else
                 f"none: the file on its own ({shape(s.geometry)})")
        lines = [f"model    {model}", f"profile  {line}", f"chat     {chat_line}"]
        return lines + [f"warning  {w}" for w in overview.warnings]

    def _fill_table(self, overview: Overview) -> None:
        from tqbench.profile.report import coverage_report

        table = self.query_one("#coverage", DataTable)
        row = table.cursor_row  # kept when the same profile is read again
        table.clear(columns=True)
        report = coverage_report(overview.summary)
        names = [*report.columns, "hottest (share)"]
        rows = [[*r.cells(), r.hottest] for r in report.rows]
        # Widths fixed from the contents (what DataTable's automatic width gives): an automatic width is updated after
        # the rows arrive, and a row drawn before that kept a cell cut to its header's width on a loaded machine.
        for i, name in enumerate(names):
            table.add_column(name, width=max(len(name), *(len(r[i]) for r in rows)))
        for r in rows:
            table.add_row(*r)
        table.move_cursor(row=min(row, len(rows) - 1), animate=False)

    @on(HeatMap.Moved)
    def _cell_moved(self) -> None:
        from tqbench.profile.report import number

        heat = self.query_one(HeatMap)
        line = self.query_one("#heat-cell", Static)
        if not heat.layer_ids:
            line.update("")
            return
        row, col = heat.cursor
        first, last = heat.cell_span(col)
        value = heat.cells[row, col]
        total = heat.counts[row].sum()
        share = f" ({value / total:.1%})" if total > 0 else ""
        where = f"expert {first}" if first == last else f"experts {first}-{last}"
        hottest = ""
        if first != last and value > 0:
            e = first + int(np.argmax(heat.counts[row, first:last + 1]))
            hottest = f", hottest {e}: {number(heat.maxima[row, col])}"
        per = "1 expert" if heat.bin == 1 else f"{heat.bin} experts"
        line.update(Content(f"layer {heat.layer_ids[row]} {where}: {number(value)}{share}{hottest} · {per}/cell, "
                            f"+/- zoom · \"{RAMP}\" 0..max"))

    def _set_error(self, text: str | None) -> None:
        self.error = text
        error = self.query_one("#error", Static)
        error.update(Content(f"error: {text}" if text else ""))
        error.tooltip = text
        error.display = bool(text)

    # ---- actions ----------------------------------------------------------------------------------------------------

    def check_action(self, action: str, parameters: tuple[object, ...]) -> bool | None:
        if action == "own_profile":
            return self.file is not None
        return True

    def action_reload(self) -> None:
        self.reload()

    def action_own_profile(self) -> None:
        self.file = None
        self.refresh_bindings()
        self.reload()

    def action_open(self) -> None:
        current = self.file or self.model or self.shown_model

        def opened(path: Path | None) -> None:
            if path is None:
                return
            if path.is_dir():
                self.model, self.file = path, None
            else:
                self.file = path
            self.refresh_bindings()
            self.reload()

        self.app.push_screen(OpenScreen(str(current) if current else "", "Open a model directory or a profile file "
                                        "(Esc cancels)", "/path/to/model or profile.json"), opened)

    def _model_or_error(self) -> Path | None:
        from tqbench.chat.choose import default_model

        model = self.model or self.shown_model or default_model()
        if model is None:
            self._set_error("no model: open a model directory first (o)")
        return model

    def action_export(self) -> None:
        from tqbench.profile import default_export_file

        model = self._model_or_error()
        if model is None:
            return
        initial = str(default_export_file(model))

        def chosen(dest: Path | None) -> None:
            if dest is not None:
                self._set_error(None)
                self._export(model, dest)

        self.app.push_screen(OpenScreen(initial, "Write the learned profile to (Esc cancels)",
                                        "profile.json"), chosen)

    @work(thread=True, group="share", exit_on_error=False, description="export the profile")
    def _export(self, model: Path, dest: Path) -> None:
        from tqbench.profile import export_learned
        from tqbench.profile.report import number

        try:
            p = export_learned(model, None, dest)
        except TqbenchError as e:
            self.app.call_from_thread(self._set_error, one_line(e))
            return
        except OSError as e:
            self.app.call_from_thread(self._set_error, f"{display_path(dest)}: {e.strerror or e}")
            return
        self.app.call_from_thread(self._done, f"wrote {os.path.abspath(dest)}: {number(p.routings)} routings")

    def action_import(self) -> None:
        model = self._model_or_error()
        if model is None:
            return

        def chosen(file: Path | None) -> None:
            if file is not None:
                self._set_error(None)
                self._import(model, file)

        self.app.push_screen(OpenScreen("", "Import a profile file as the learned profile "
                                        "(Esc cancels)", "profile.json"), chosen)

    @work(thread=True, group="share", exit_on_error=False, description="import a profile")
    def _import(self, model: Path, file: Path) -> None:
        from tqbench.profile import import_file
        from tqbench.profile.report import number

        try:
            p, _ = import_file(model, file)
        except TqbenchError as e:
            self.app.call_from_thread(self._set_error, one_line(e))
            return
        self.app.call_from_thread(self._imported, f"imported {display_path(file)}: {number(p.routings)} routings")

    def _imported(self, text: str) -> None:
        self.file = None  # show the learned profile, now the imported one
        self._done(text)
        self.reload()

    def _done(self, text: str) -> None:
        self.notify(text)
