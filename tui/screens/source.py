"""The Source screen: open a checkpoint (headers only) and show its summary, roles/layers, tensors and shards."""

from __future__ import annotations

from pathlib import Path

from textual import on, work
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Vertical
from textual.content import Content
from textual.screen import Screen
from textual.widgets import DataTable, Header, Input, Static, TabbedContent, TabPane
from textual.worker import Worker, WorkerState, get_current_worker

from tqbench.errors import TqbenchError
from tqbench.events import CheckpointOpened, ShardScanned
from tqbench.engine import iterate_in_daemon
from tui.messages import CheckpointLoaded, LoadFailed, ScanProgress, ScanStarted
from tui.screens.open import OpenScreen
from tui.state import display_path, last_checkpoint, remember_checkpoint, source_name, source_ref
from tui.widgets.footer import FittingFooter
from tui.widgets.roles import RoleTable
from tui.widgets.scan import ScanPanel
from tui.widgets.shards import ShardTable
from tui.widgets.summary import SummaryPanel
from tui.widgets.tensors import TensorPanel


class SourceScreen(Screen):
    """Opens `app.start_path` (or the remembered checkpoint, or the demo) in a thread worker and shows it."""

    BINDINGS = [
        Binding("slash", "focus_filter", "Filter"),
        Binding("r", "toggle_grouping", "Role/Layer"),
        Binding("o", "open", "Open"),
        Binding("escape", "clear_filter", "Clear filter"),
        Binding("1", "show_tab('roles-pane')", "Roles", show=False),
        Binding("2", "show_tab('tensors-pane')", "Tensors", show=False),
        Binding("3", "show_tab('shards-pane')", "Shards", show=False),
    ]

    def __init__(self) -> None:
        super().__init__()
        self._load_id = 0
        self._loaded = False
        self._opening: Path | None = None  # the path of the load in progress or failed last
        self.checkpoint = None
        self.summary = None

    def compose(self) -> ComposeResult:
        yield Header()
        yield Static("", id="error")
        yield ScanPanel(id="scan")
        yield Static(Content("No checkpoint open. Press o to open a checkpoint directory."), id="empty")
        with Vertical(id="body"):
            yield SummaryPanel(id="summary")
            with TabbedContent(id="tabs", initial="roles-pane"):
                with TabPane("1 By role", id="roles-pane"):
                    yield RoleTable(id="roles")
                with TabPane("2 Tensors", id="tensors-pane"):
                    yield TensorPanel(id="tensors")
                with TabPane("3 Shards", id="shards-pane"):
                    yield ShardTable(id="shards")
        yield FittingFooter()

    def on_mount(self) -> None:
        self.sub_title = "Source"
        self.open_path(getattr(self.app, "start_path", None))

    # ---- loading --------------------------------------------------------------------------------------------------

    def open_path(self, path: Path | None) -> None:
        """Start (or restart) loading `path`; None means the remembered checkpoint, else the demo model."""
        self._load_id += 1
        self._opening = path
        self._set_error(None)
        self.query_one("#empty").display = False
        self.query_one(ScanPanel).start(f"opening {display_path(path)}..." if path else "finding a checkpoint...")
        self.query_one(ScanPanel).display = True
        self._load(self._load_id, path)

    @work(thread=True, exclusive=True, group="load", exit_on_error=False, description="open checkpoint")
    def _load(self, load_id: int, path: Path | None) -> None:
        from tqbench.source import scan_checkpoint, select_tensors, summarize

        worker = get_current_worker()
        if path is None:
            path = last_checkpoint()
        if path is None:
            self.post_message(ScanStarted(load_id=load_id, text="preparing the built-in demo model..."))
            try:
                from tqbench.demo import ensure_demo
            except ImportError as e:
                self.post_message(LoadFailed(load_id=load_id,
                                             message=f"no checkpoint given and the demo model is unavailable ({e})"))
                return
            path = next(iter(iterate_in_daemon(lambda: [ensure_demo()], lambda: worker.is_cancelled)), None)
            if path is None:
                return  # cancelled
        self.post_message(ScanStarted(load_id=load_id, text=f"opening {display_path(path)}...", path=path))

        def engine():
            for event in scan_checkpoint(path):
                yield event
                if isinstance(event, CheckpointOpened):
                    yield summarize(event.checkpoint), select_tensors(event.checkpoint)

        seen = 0
        ckpt = prepared = None
        try:
            for item in iterate_in_daemon(engine, lambda: worker.is_cancelled):
                if isinstance(item, ShardScanned):
                    seen += item.tensors
                    self.post_message(ScanProgress(load_id=load_id, index=item.index, total=item.total, file=item.file,
                                                   tensors_so_far=seen, fetched_bytes=item.fetched_bytes))
                elif isinstance(item, CheckpointOpened):
                    ckpt = item.checkpoint
                else:
                    prepared = item
        except TqbenchError as e:
            self.post_message(LoadFailed(load_id=load_id, message=str(e)))
            return
        if ckpt is None or prepared is None or worker.is_cancelled:
            return
        summary, tensors = prepared
        if ckpt.origin is None:  # a hub repository is opened on request, never by surprise at start
            remember_checkpoint(Path(path))
        self.post_message(CheckpointLoaded(load_id=load_id, checkpoint=ckpt, summary=summary, tensors=tensors))

    def on_scan_started(self, message: ScanStarted) -> None:
        if message.load_id == self._load_id:
            self.query_one(ScanPanel).start(message.text)
            if message.path is not None:
                self._opening = Path(message.path)

    def on_scan_progress(self, message: ScanProgress) -> None:
        if message.load_id == self._load_id:
            self.query_one(ScanPanel).progress(message.index, message.total, message.file, message.tensors_so_far,
                                               message.fetched_bytes)

    def on_checkpoint_loaded(self, message: CheckpointLoaded) -> None:
        if message.load_id != self._load_id:
            return
        ckpt, summary = message.checkpoint, message.summary
        self.checkpoint, self.summary = ckpt, summary
        self.app.checkpoint = ckpt  # for later screens (Recipe, Convert, ...)
        self.sub_title = f"Source: {source_name(ckpt)}"
        self.query_one(ScanPanel).display = False
        self.query_one(SummaryPanel).show(summary, ckpt)
        self.query_one(RoleTable).show(summary)
        self.query_one(ShardTable).show(ckpt)
        self.query_one(TensorPanel).set_tensors(message.tensors)
        tab = self.query_one(TabbedContent).get_tab("shards-pane")
        tab.label = (Content.styled(f"3 Shards ({len(ckpt.missing)} missing)", "bold $text-error") if ckpt.missing
                     else Content("3 Shards"))
        first = not self._loaded
        self._loaded = True
        self.query_one("#body").display = True
        self.refresh_bindings()
        if first:
            self._focus_active_table()

    def on_load_failed(self, message: LoadFailed) -> None:
        if message.load_id == self._load_id:
            self._fail(message.message)

    def on_worker_state_changed(self, event: Worker.StateChanged) -> None:
        """Anything the worker did not turn into a LoadFailed (a bug, an OSError) still ends as one line."""
        if event.state is WorkerState.ERROR and event.worker.group == "load":
            error = event.worker.error
            text = str(error) if isinstance(error, TqbenchError) else f"{type(error).__name__}: {error}"
            self._fail(text)

    def _fail(self, text: str) -> None:
        self.query_one(ScanPanel).display = False
        self.query_one("#empty").display = not self._loaded
        self._set_error(f"error: {text}")

    def _set_error(self, text: str | None) -> None:
        error = self.query_one("#error", Static)
        error.update(Content(text or ""))
        error.display = bool(text)

    # ---- actions --------------------------------------------------------------------------------------------------

    def check_action(self, action: str, parameters: tuple[object, ...]) -> bool | None:
        if action in ("focus_filter", "toggle_grouping", "clear_filter", "show_tab"):
            if not self._loaded:
                return False  # nothing to filter or group before a checkpoint is shown
        if action == "clear_filter":
            # Only while there is a filter to clear or the filter has focus: then the footer has room for every mode.
            panel = self.query_one(TensorPanel)
            return bool(panel.filter_input.value) or self.focused is panel.filter_input
        return True

    @on(Input.Changed, "#filter")
    def _filter_typed(self) -> None:
        self.refresh_bindings()

    def _focus_active_table(self) -> None:
        tabs = self.query_one(TabbedContent)
        pane = tabs.get_pane(tabs.active)
        pane.query(DataTable).first().focus()

    def action_show_tab(self, pane: str) -> None:
        self.query_one(TabbedContent).active = pane
        self._focus_active_table()

    def action_focus_filter(self) -> None:
        self.query_one(TabbedContent).active = "tensors-pane"
        self.query_one(TensorPanel).filter_input.focus()

    def action_clear_filter(self) -> None:
        panel = self.query_one(TensorPanel)
        panel.clear_filter()
        if self.focused is panel.filter_input:
            panel.table.focus()

    def action_toggle_grouping(self) -> None:
        tabs = self.query_one(TabbedContent)
        roles = self.query_one(RoleTable)
        roles.toggle()
        tabs.active = "roles-pane"
        tabs.get_tab("roles-pane").label = "1 By layer" if roles.by_layer else "1 By role"
        roles.focus()

    def action_open(self) -> None:
        current = self._opening or (source_ref(self.checkpoint) if self.checkpoint is not None else None)

        def opened(path: Path | None) -> None:
            if path is not None:
                self.open_path(path)

        self.app.push_screen(OpenScreen(str(current) if current else ""), opened)
