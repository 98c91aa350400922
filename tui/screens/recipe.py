"""The Recipe screen: edit a recipe and watch its exact converted size and fit update; pin up to three to compare.

It plans the checkpoint the Source screen loaded (app.checkpoint; never opened again) with the engine's functions, as
`tqbench plan` does: `group_sources` once per checkpoint, then `make_plan` per recipe (cached per recipe) and
`assess` per machine. On Kimi K3 (497k tensors) grouping takes ~1 s and one plan ~0.27 s, so both run in thread
workers; a lock lets one plan run at a time and a superseded request is skipped, so held-down keys never pile up
plans. A change of memory or disk bandwidth only re-assesses (microseconds).

Pinning: `+` (or enter outside a text field) pins the current recipe as the next column, at most MAX_PINS; a fourth
pin is refused with a message (unpin one first: pins are never dropped silently), and so is a recipe already pinned.
At 80x24 the current recipe and three pins fit side by side (the table's compact mode, tui.widgets.plan_table).

Focus and arrows: tab and shift+tab go round the screen's parts in reading order: the recipe name, the option rows
(one stop, on the row focused last: the base at first), memory, disk bandwidth, then the table (its cursor on the
current recipe). Up/down move between the option rows only, never into a text field, where the app's one-letter keys
type (a user pressing up on the base and then `s` meant the Source screen, not a recipe ending in `s`); esc goes
back to the option rows from a text field or the table. Left/right change a choice control and move the cursor in a
text field. In the table, left/right select a recipe's column (`x` / delete unpin the selected pinned recipe, `e`
loads it into the editor) and up/down scroll. The footer names what the arrows do where the focus is (`←→ Change`,
`←→ Cursor`, `←→ Recipe`) and, in a text field, leaves out the keys that type there. Leaving the table puts its
cursor back on the current recipe, so the current column is always in view while editing.

Quality: the table's quality rows show, per recipe, the latest evaluation of its conversion against the loaded source
that tqbench.eval.store remembers (read in a worker once per checkpoint and after each quick eval; a recipe's cells
are then a dict lookup), and the line under the table what they were measured on. `v` runs a quick eval of the
current recipe on the demo (tqbench.eval.quick: the demo converted with it unless done, then scored against the demo)
on the engine thread, one at a time, its progress on that line; the result comes as a notification, and in the table
when the loaded source is the demo (an evaluation on the demo is not another source's). Leaving the screen stops it.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from functools import partial
from pathlib import Path

from textual import work
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical
from textual.content import Content
from textual.screen import Screen
from textual.widgets import Header, Input, Static
from textual.worker import Worker, WorkerState, get_current_worker

from tqbench.demo import demo_path
from tqbench.engine import Job, iterate_in_daemon, submit
from tqbench.errors import TqbenchError
from tqbench.eval.quick import QUICK_TOKENS
from tqbench.eval.records import EvalReport
from tqbench.eval.store import RecipeQuality
from tqbench.events import UnitConverted
from tqbench.recipe import Plan, Recipe, assess, group_sources, make_plan
from tui.messages import (MachineChosen, PlanFailed, PlansReady, QualitiesRead, QuickEvalDone, QuickEvalFailed,
                          QuickEvalProgress, QuickEvalStopped, RecipeChosen, SourcesGrouped)
from tui.screens.chat_relay import one_line
from tqbench.source.hub.disk import hub_disk
from tui.state import source_name
from tui.widgets.footer import FittingFooter
from tui.widgets.plan_table import CURRENT, PlanTable
from tui.widgets.quality_line import QualityLine, progress_text
from tui.widgets.recipe_editor import INITIAL_RECIPE, RecipeEditor

MAX_PINS = 3
CACHE_PLANS = 12  # plans kept besides the shown ones (a K3 plan holds ~2.6k modules)
PROGRESS_INTERVAL = 0.1  # seconds between a quick eval's progress messages


class RecipeScreen(Screen):
    """Left: the recipe editor. Right: the current recipe and the pinned ones, side by side."""

    BINDINGS = [
        Binding("plus", "pin", "Pin", key_display="+"),
        Binding("enter", "pin", "Pin", show=False),
        Binding("x", "unpin", "Unpin", show=False),  # shown by the table, where a pinned column is selected
        Binding("delete", "unpin", "Unpin", show=False),
        Binding("e", "edit_pin", "Edit pin", show=False),
        Binding("v", "quick_eval", "Eval"),  # "Quick eval" would push "h Profile" off an 80-column footer
        Binding("tab", "focus_part(1)", "Next part", show=False),
        Binding("shift+tab", "focus_part(-1)", "Previous part", show=False),
        Binding("escape", "focus_rows", "Option rows", show=False),  # the text fields show it as `esc Rows`
    ]
    HORIZONTAL_BREAKPOINTS = [(0, "-narrow"), (150, "-wide")]  # the editor widens (app.tcss)

    def __init__(self) -> None:
        super().__init__()
        self.recipe = Recipe.parse(INITIAL_RECIPE)
        self.pins: list[Recipe] = []
        self.checkpoint = None
        self.hub = None  # HubDisk of a checkpoint on the hub
        self.sources = None
        self.machine = None
        self.shown: list[Recipe] = []  # the recipes in the table's columns now
        self._plans: OrderedDict[Recipe, Plan] = OrderedDict()
        self._request_id = 0
        self._plan_lock = threading.Lock()
        self.qualities: dict[str, RecipeQuality] = {}  # recipe name -> its evaluation against the loaded source
        self.quick_tokens = QUICK_TOKENS  # tokens a quick eval scores
        self._eval_id = 0
        self._eval_job: Job | None = None  # the quick eval running
        self._eval_recipe = ""

    def compose(self) -> ComposeResult:
        yield Header()
        with Horizontal(id="recipe-body"):
            yield RecipeEditor(self.recipe, id="editor")
            with Vertical(id="plan-side"):
                yield Static("", id="plan-empty")
                yield PlanTable(id="plan-table")
                yield QualityLine(id="quality-line")
        yield FittingFooter()

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

    @property
    def quality_line(self) -> QualityLine:
        return self.query_one(QualityLine)

    # ---- the checkpoint and its grouped sources ---------------------------------------------------------------------

    def _checkpoint_changed(self, ckpt) -> None:
        if ckpt is None:
            self._empty("No checkpoint loaded yet. Press s for the Source screen and open one (o).")
            return
        if ckpt is self.checkpoint:
            return
        self.checkpoint, self.sources = ckpt, None
        self.hub = hub_disk(ckpt) if ckpt.origin else None  # converting it from the hub: the disk that needs
        self.qualities = {}
        self._plans.clear()
        self.shown = []
        self.sub_title = f"Recipe: {source_name(ckpt)}"
        self.editor.set_checkpoint_path(ckpt.path)
        self._empty(f"Grouping {len(ckpt.tensors):,} tensors of {source_name(ckpt)} into modules...")
        self._group(ckpt)
        self._read_qualities(ckpt)

    @work(thread=True, exclusive=True, group="group", exit_on_error=False, description="group sources")
    def _group(self, ckpt) -> None:
        worker = get_current_worker()
        try:
            # On a daemon thread: quitting never waits for the ~1 s grouping of a K3 checkpoint.
            sources = next(iter(iterate_in_daemon(lambda: [group_sources(ckpt)], lambda: worker.is_cancelled)),
                           None)
        except TqbenchError as e:
            self.post_message(PlanFailed(message=str(e)))
            return
        if sources is not None and not worker.is_cancelled:
            self.post_message(SourcesGrouped(checkpoint=ckpt, sources=sources))

    def on_sources_grouped(self, message: SourcesGrouped) -> None:
        if message.checkpoint is self.checkpoint:
            self.sources = message.sources
            self._refresh()

    # ---- quality: what the store remembers for the checkpoint, and the quick eval ---------------------------------

    @work(thread=True, exclusive=True, group="quality", exit_on_error=False, description="read evaluations")
    def _read_qualities(self, ckpt) -> None:
        from tqbench.eval.store import remembered

        worker = get_current_worker()
        # On a daemon thread: fingerprinting a K3 checkpoint's 497k tensors takes a while, and quitting never waits.
        qualities = next(iter(iterate_in_daemon(lambda: [remembered(ckpt)], lambda: worker.is_cancelled)), None)
        if qualities is not None and not worker.is_cancelled:
            self.post_message(QualitiesRead(checkpoint=ckpt, qualities=qualities))

    def on_qualities_read(self, message: QualitiesRead) -> None:
        if message.checkpoint is self.checkpoint:
            self.qualities = message.qualities
            if self.shown and all(r in self._plans for r in self.wanted):
                self._show_plans()

    def action_quick_eval(self) -> None:
        if self._eval_job is not None:
            self.notify(f"a quick eval of {self._eval_recipe} is running: one at a time", severity="warning")
            return
        self._eval_id += 1
        self._eval_recipe = name = self.recipe.name
        tokens = self.quick_tokens

        def evaluation():  # on the engine thread: MLX is imported, used and released there
            from tqbench.eval.quick import quick_eval

            return quick_eval(name, tokens)

        self._eval_job = submit(evaluation)
        self.quality_line.show_progress(progress_text(name, None))
        self.run_worker(partial(self._relay_eval, self._eval_id, self._eval_job, name), thread=True,
                        exclusive=True, group="quick eval", exit_on_error=False, description="quick eval")

    def _relay_eval(self, eval_id: int, job: Job, recipe: str) -> None:
        """The quick eval's events as messages (conversion progress at most every PROGRESS_INTERVAL), then what the
        store remembered of it."""
        from tqbench.eval.quick import demo_quality

        worker = get_current_worker()
        post = self.post_message
        finished = False
        posted = 0.0
        try:
            for event in job.items(lambda: worker.is_cancelled):
                if isinstance(event, EvalReport):
                    finished = True
                elif not isinstance(event, UnitConverted) or time.monotonic() - posted >= PROGRESS_INTERVAL:
                    post(QuickEvalProgress(eval_id=eval_id,
                                           event=event))  # a skipped unit's figures come with a later one
                    posted = time.monotonic()
            job.stop()
            job.wait()  # closed on the engine thread
            if not finished:
                post(QuickEvalStopped(eval_id=eval_id))
                return
            post(QuickEvalDone(eval_id=eval_id, quality=demo_quality(recipe)))
        except Exception as e:  # TqbenchError (a recipe the demo cannot take) or a bug: one line either way
            job.stop()
            post(QuickEvalFailed(eval_id=eval_id, message=one_line(e)))

    def on_quick_eval_progress(self, message: QuickEvalProgress) -> None:
        if message.eval_id == self._eval_id and self._eval_job is not None:
            self.quality_line.show_progress(progress_text(self._eval_recipe, message.event))

    def on_quick_eval_done(self, message: QuickEvalDone) -> None:
        if message.eval_id != self._eval_id:
            return
        recipe = self._eval_recipe
        self._eval_ended()
        q = message.quality
        if q is None:
            self.notify(f"{recipe} on the demo: evaluated, but nothing was remembered", severity="warning")
            return
        elsewhere = self.checkpoint is None or Path(self.checkpoint.path).resolve() != demo_path().resolve()
        scored = "; calibrated on the text it was scored on" if Recipe.parse(q.recipe).calibrate else ""
        self.notify(f"{q.recipe} on the demo: perplexity {q.perplexity:.2f} ({q.perplexity_change:+.1%} vs source), "
                    f"KL {q.kl:.3f}{scored}" + ("; the table shows the loaded source's only" if elsewhere else ""),
                    timeout=10)
        if self.checkpoint is not None:
            self._read_qualities(self.checkpoint)  # the loaded source's: the demo's if it is the demo

    def on_quick_eval_failed(self, message: QuickEvalFailed) -> None:
        if message.eval_id == self._eval_id:
            recipe = self._eval_recipe
            self._eval_ended()
            self.notify(f"quick eval of {recipe}: {message.message}", severity="error", timeout=10)

    def on_quick_eval_stopped(self, message: QuickEvalStopped) -> None:
        if message.eval_id == self._eval_id:
            self._eval_ended()

    def _eval_ended(self) -> None:
        self._eval_job = None
        self.quality_line.show_progress(None)

    def on_screen_suspend(self) -> None:
        """Leaving the screen for another stops a quick eval (a conversion keeps its whole shards and resumes next
        time); a dialog over it (help) does not."""
        if self._eval_job is not None and self not in self.app.screen_stack:
            self._eval_job.stop()
            self.notify(f"quick eval of {self._eval_recipe} stopped: the Recipe screen was left")
            self._eval_ended()

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
            self.post_message(PlanFailed(message=str(e)))
        if plans:
            self.post_message(PlansReady(request_id=request_id, checkpoint=ckpt, plans=plans))

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
        qualities = [self.qualities.get(r.name) for r in self.wanted]
        self.table.show([r.name for r in self.wanted], plans, fits, qualities, self.hub)
        self.quality_line.show_caption(list(zip(self.table.column_names, qualities)))
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
        """Anything a worker did not turn into a PlanFailed (a bug, an OSError) still ends as one line; so does a
        store of evaluations that cannot be read."""
        if event.state is not WorkerState.ERROR:
            return
        text = one_line(event.worker.error)
        if event.worker.group in ("group", "plan"):
            self.editor.set_busy(False)
            self.editor.set_error("plan", f"plan: {text}")
        elif event.worker.group == "quality":
            self.notify(f"evaluations: {text}", severity="error")

    def _empty(self, text: str) -> None:
        empty = self.query_one("#plan-empty", Static)
        empty.update(Content(text))
        empty.display = True
        self.table.display = False
        self.quality_line.show_caption(None)
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
        if action in ("quick_eval", "pin") and isinstance(self.focused, Input):
            return False  # v and + type there (and enter is the field's)
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

    def action_focus_part(self, step: int) -> None:
        """Tab (step 1), shift+tab (-1): the next or previous part in reading order (the module docstring), round."""
        parts = [*self.editor.parts, *([self.table] if self.table.display else [])]
        focused = self.focused
        here = next((i for i, part in enumerate(parts)
                     if focused is not None and (focused is part or part in focused.ancestors)), None)
        target = parts[0 if here is None and step > 0 else -1 if here is None else (here + step) % len(parts)]
        if target.id == "recipe-rows":
            self.editor.focus_rows()
        else:
            self.set_focus(target)

    def action_focus_rows(self) -> None:
        self.editor.focus_rows()

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
