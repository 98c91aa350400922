"""The Recipe screen: edit a recipe and watch its exact converted size and fit update; pin up to three to compare.

It plans the checkpoint the Source screen loaded (app.checkpoint; never opened again) with the engine's functions, as
`tqbench plan` does: `group_sources` once per checkpoint, then `make_plan` per recipe (cached per recipe) and
`assess` per machine. On Kimi K3 (497k tensors) grouping takes ~1 s and one plan ~0.27 s, so both run in thread
workers; a lock lets one plan run at a time and a superseded request is skipped, so held-down keys never pile up
plans. A change of memory or disk bandwidth only re-assesses (microseconds).

Pinning: `+` (or enter outside a text field) pins the current recipe as the next column, at most MAX_PINS; a fourth
pin is refused with a message (unpin one first: pins are never dropped silently), and so is a recipe already pinned.
At 80x24 the current recipe and three pins fit side by side (the table's compact mode, tui.widgets.plan_table).

Focus and arrows: the screen has two panes, the editor and the table. Tab and shift+tab switch between them (never
into the middle of the editor's rows): into the table with its cursor on the current recipe, back into the editor on
the row focused last (the base at first). In the editor, up/down move between the rows, choice controls and text
fields alike; left/right change a choice control and move the cursor in a text field. In the table, left/right select
a recipe's column (`x` / delete unpin the selected pinned recipe, `e` loads it into the editor) and up/down scroll.
The footer names what the arrows do where the focus is (`←→ Change`, `←→ Cursor`, `←→ Recipe`). Leaving the table
puts its cursor back on the current recipe, so the current column is always in view while editing.
"""

from __future__ import annotations

import threading
from collections import OrderedDict

from textual import work
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical
from textual.content import Content
from textual.screen import Screen
from textual.widgets import Footer, Header, Static
from textual.worker import Worker, WorkerState, get_current_worker

from tqbench.errors import TqbenchError
from tqbench.recipe import Plan, Recipe, assess, group_sources, make_plan
from tqbench.engine import iterate_in_daemon
from tui.messages import MachineChosen, PlanFailed, PlansReady, RecipeChosen, SourcesGrouped
from tui.state import display_path
from tui.widgets.plan_table import CURRENT, PlanTable
from tui.widgets.recipe_editor import INITIAL_RECIPE, RecipeEditor

MAX_PINS = 3
CACHE_PLANS = 12  # plans kept besides the shown ones (a K3 plan holds ~2.6k modules)


class RecipeScreen(Screen):
    """Left: the recipe editor. Right: the current recipe and the pinned ones, side by side."""

    BINDINGS = [
        Binding("plus", "pin", "Pin", key_display="+"),
        Binding("enter", "pin", "Pin", show=False),
        Binding("x", "unpin", "Unpin", show=False),  # shown by the table, where a pinned column is selected
        Binding("delete", "unpin", "Unpin", show=False),
        Binding("e", "edit_pin", "Edit pin", show=False),
        Binding("tab", "switch_focus", "Table/editor", show=False),
        Binding("shift+tab", "switch_focus", "Table/editor", show=False),
    ]

    def __init__(self) -> None:
        super().__init__()
        self.recipe = Recipe.parse(INITIAL_RECIPE)
        self.pins: list[Recipe] = []
        self.checkpoint = None
        self.sources = None
        self.machine = None
        self.shown: list[Recipe] = []  # the recipes in the table's columns now
        self._plans: OrderedDict[Recipe, Plan] = OrderedDict()
        self._request_id = 0
        self._plan_lock = threading.Lock()

    def compose(self) -> ComposeResult:
        yield Header()
        with Horizontal(id="recipe-body"):
            yield RecipeEditor(self.recipe, id="editor")
            with Vertical(id="plan-side"):
                yield Static("", id="plan-empty")
                yield PlanTable(id="plan-table")
        yield Footer()

    def on_mount(self) -> None:
        self.sub_title = "Recipe"
        self.machine = self.editor.machine
        self.query_one(PlanTable).display = False
        self.watch(self.app, "checkpoint", self._checkpoint_changed, init=True)
        self.query_one("#base").focus()

    @property
    def editor(self) -> RecipeEditor:
        return self.query_one(RecipeEditor)

    @property
    def table(self) -> PlanTable:
        return self.query_one(PlanTable)

    # ---- the checkpoint and its grouped sources ---------------------------------------------------------------------

    def _checkpoint_changed(self, ckpt) -> None:
        if ckpt is None:
            self._empty("No checkpoint loaded yet. Press s for the Source screen and open one (o).")
            return
        if ckpt is self.checkpoint:
            return
        self.checkpoint, self.sources = ckpt, None
        self._plans.clear()
        self.shown = []
        self.sub_title = f"Recipe: {display_path(ckpt.path)}"
        self.editor.set_checkpoint_path(ckpt.path)
        self._empty(f"Grouping {len(ckpt.tensors):,} tensors of {display_path(ckpt.path)} into modules...")
        self._group(ckpt)

    @work(thread=True, exclusive=True, group="group", exit_on_error=False, description="group sources")
    def _group(self, ckpt) -> None:
        worker = get_current_worker()
        try:
            # On a daemon thread: quitting never waits for the ~1 s grouping of a K3 checkpoint.
            sources = next(iter(iterate_in_daemon(lambda: [group_sources(ckpt)], lambda: worker.is_cancelled)),
                           None)
        except TqbenchError as e:
            self.post_message(PlanFailed(str(e)))
            return
        if sources is not None and not worker.is_cancelled:
            self.post_message(SourcesGrouped(ckpt, sources))

    def on_sources_grouped(self, message: SourcesGrouped) -> None:
        if message.checkpoint is self.checkpoint:
            self.sources = message.sources
            self._refresh()

    # ---- plans ------------------------------------------------------------------------------------------------------

    @property
    def wanted(self) -> list[Recipe]:
        return [self.recipe, *self.pins]

    def _refresh(self) -> None:
        """Show the wanted recipes now if their plans are known, else ask a worker for the missing ones (the table
        keeps showing the previous numbers until they come)."""
        if self.sources is None:
            return
        missing = [r for r in dict.fromkeys(self.wanted) if r not in self._plans]
        if missing:
            self._request_id += 1
            self.editor.set_busy(True)
            self._make_plans(self._request_id, self.checkpoint, self.sources, missing)
        else:
            self._show_plans()

    @work(thread=True, exclusive=True, group="plan", exit_on_error=False, description="plan recipes")
    def _make_plans(self, request_id: int, ckpt, sources, recipes: list[Recipe]) -> None:
        worker = get_current_worker()
        plans = {}
        try:
            for recipe in recipes:
                with self._plan_lock:  # one plan at a time; a request superseded while waiting is skipped
                    if worker.is_cancelled:
                        break
                    plans[recipe] = make_plan(sources, recipe)
        except TqbenchError as e:
            self.post_message(PlanFailed(str(e)))
        if plans:
            self.post_message(PlansReady(request_id, ckpt, plans))

    def on_plans_ready(self, message: PlansReady) -> None:
        if message.checkpoint is not self.checkpoint:
            return
        self._plans.update(message.plans)
        self._evict()
        if all(r in self._plans for r in self.wanted):
            self._show_plans()

    def _evict(self) -> None:
        keep = set(self.wanted)
        extra = [r for r in self._plans if r not in keep]
        for r in extra[:max(0, len(extra) - CACHE_PLANS)]:
            del self._plans[r]

    def _show_plans(self) -> None:
        plans = [self._plans[r] for r in self.wanted]
        for r in self.wanted:
            self._plans.move_to_end(r)
        fits = [assess(p.footprint, self.machine) for p in plans]
        self.shown = list(self.wanted)
        self.table.show([r.name for r in self.wanted], plans, fits)
        self.editor.set_notes(list(plans[0].warnings))
        self.editor.set_busy(False)
        self.editor.set_error("plan", None)
        self.query_one("#plan-empty").display = False
        self.table.display = True
        self.refresh_bindings()

    def on_plan_failed(self, message: PlanFailed) -> None:
        self.editor.set_busy(False)
        self.editor.set_error("plan", f"plan: {message.message}")

    def on_worker_state_changed(self, event: Worker.StateChanged) -> None:
        """Anything a worker did not turn into a PlanFailed (a bug, an OSError) still ends as one line."""
        if event.state is WorkerState.ERROR and event.worker.group in ("group", "plan"):
            error = event.worker.error
            text = str(error) if isinstance(error, TqbenchError) else f"{type(error).__name__}: {error}"
            self.editor.set_busy(False)
            self.editor.set_error("plan", f"plan: {text}")

    def _empty(self, text: str) -> None:
        empty = self.query_one("#plan-empty", Static)
        empty.update(Content(text))
        empty.display = True
        self.table.display = False
        self.refresh_bindings()

    # ---- editor events ----------------------------------------------------------------------------------------------

    def on_recipe_chosen(self, message: RecipeChosen) -> None:
        if message.recipe != self.recipe:
            self.recipe = message.recipe
            self.app.recipe = message.recipe  # what the Convert screen converts with
            self._refresh()

    def on_machine_chosen(self, message: MachineChosen) -> None:
        if message.machine != self.machine:
            self.machine = message.machine
            if self.shown and all(r in self._plans for r in self.wanted):
                self._show_plans()

    # ---- pins -------------------------------------------------------------------------------------------------------

    def check_action(self, action: str, parameters: tuple[object, ...]) -> bool | None:
        if action in ("pin", "unpin", "edit_pin"):
            return None if not self.shown else True  # shown but disabled until the first plan is there
        return True

    def action_pin(self) -> None:
        recipe = self.recipe
        if recipe in self.pins:
            self.notify(f"{recipe.name} is pinned already (pin {self.pins.index(recipe) + 1})")
            return
        if len(self.pins) >= MAX_PINS:
            self.notify(f"{MAX_PINS} recipes are pinned: select one in the table and press x to unpin it first",
                        severity="warning")
            return
        self.pins.append(recipe)
        self._refresh()

    def action_switch_focus(self) -> None:
        """Tab, shift+tab: from the editor to the table and back (up/down move between the editor's rows)."""
        if self.table.has_focus or not self.table.display:
            self.editor.focus_last()
        else:
            self.set_focus(self.table)

    def _selected_pin(self) -> Recipe | None:
        name = self.table.selected_name if self.table.display and self.table.has_focus else None
        if name is None or name == CURRENT:
            self.notify("select a pinned column first: tab to the table, then left/right", severity="warning")
            return None
        return next(r for r in self.pins if r.name == name)

    def action_unpin(self) -> None:
        if not self.pins:
            self.notify("nothing is pinned: + pins the current recipe")
            return
        recipe = self._selected_pin()
        if recipe is not None:
            self.pins.remove(recipe)
            self._refresh()

    def action_edit_pin(self) -> None:
        recipe = self._selected_pin() if self.pins else None
        if recipe is not None:
            self.editor.set_recipe(recipe)
            self.recipe = recipe
            self.app.recipe = recipe
            self._refresh()
