"""The recipe editor: one-line controls for each recipe option, the recipe's name, and the machine to plan for.

Controls and names are two spellings of one recipe: `recipe_from_controls` and `controls_from_recipe` translate, and
`recipe_from_controls(controls_from_recipe(r), r.seed) == r` for every recipe (the seed has no control; a typed
`seedN` is kept). A bad combination or a bad typed name shows its one-line RecipeError and the last good recipe
stays in force.

Keys: up/down move between the option rows (the choice controls), never into a text field: there the app's one-letter
keys would type (`s` into the name), so a text field (the name, memory, disk bandwidth) is entered with tab or
shift+tab (the screen's order, tui.screens.recipe) or a click, and left with tab, shift+tab or esc (back to the rows).
Left/right step a choice control through its values (space opens its list) and move the text cursor in a text field;
the footer says which ("↑↓ Row ←→ Change", or "esc Rows ←→ Cursor", the app's keys hidden while they type). Text fields
run their editing keys in order with the characters typed after them (tui.widgets.inputs: ctrl+u then a paste).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

from textual import on, work
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical
from textual.content import Content
from textual.widgets import Input, Label, Select, Static

from tqbench import units
from tqbench.errors import TqbenchError
from tqbench.recipe.recipe import AFFINE_BITS, DEFAULT_BITS, DEFAULT_SEED, GROUP_SIZES, TQ_BITS, Format, Recipe
from tqbench.machine import GB, DiskSpeed, cached_disk_speed, disk_speed
from tui.machine import plan_machine, read_gbps, read_memory
from tui.messages import MachineChosen, RecipeChosen
from tui.widgets.inputs import OrderedInput

INITIAL_RECIPE = "tq3a-tqTe-down4-g64"  # the published Kimi K3 build
_PREFIX = {Format.TURBOQUANT: "tq", Format.AFFINE: "affine"}
_QUANTIZED = (Format.TURBOQUANT, Format.AFFINE)

BASE_OPTIONS = ([(f"tq{b}", f"tq{b}") for b in TQ_BITS] + [(f"affine{b}", f"affine{b}") for b in AFFINE_BITS]
                + [("source", "src")])
GROUP_OPTIONS = [(str(g), str(g)) for g in GROUP_SIZES]
TIER_OPTIONS = ([("same as base", "same")] + [(f"tq{b}", f"tq{b}") for b in TQ_BITS] + [("ternary", "tqT")]
                + [(f"affine{b}", f"affine{b}") for b in AFFINE_BITS] + [("mxfp4 copy", "mxfp4"), ("source", "src")])
MLPG_OPTIONS = [("same", "same")] + GROUP_OPTIONS
ROTATION_OPTIONS = [("on", "on"), ("off", "off")]
SCALES_OPTIONS = [("searched", "search"), ("rms", "rms")]  # TurboQuant group scales (tqbench.recipe.SCALE_RULES)
ROUNDING_OPTIONS = [("nearest", "nearest"), ("calibrated", "cal")]  # TurboQuant codes: recipe part `cal`
CONTROLS = ("base", "group", "attn", "experts", "down", "mlpg", "rotation", "scales", "rounding")


def _tier(value: str) -> tuple[Format, int | None, bool]:
    """A control value as (format, bits, ternary): `tq3`, `affine4`, `tqT`, `mxfp4`, `src`."""
    if value == "tqT":
        return Format.TURBOQUANT, None, True
    if value == "mxfp4":
        return Format.MXFP4, None, False
    if value == "src":
        return Format.SOURCE, None, False
    if value.startswith("affine"):
        return Format.AFFINE, int(value[len("affine"):]), False
    return Format.TURBOQUANT, int(value[len("tq"):]), False


def bits_options(fmt: Format, none: str) -> list[tuple[str, str]]:
    """`none` plus the bits `fmt` allows (TurboQuant 2-4, affine 2-8); just `none` for a format without bits."""
    bits = TQ_BITS if fmt is Format.TURBOQUANT else AFFINE_BITS if fmt is Format.AFFINE else ()
    return [(none, none)] + [(str(b), str(b)) for b in bits]


def recipe_from_controls(values: Mapping[str, str], seed: int = DEFAULT_SEED) -> Recipe:
    """The recipe the controls spell. Controls that do not apply (attention bits of a source base, down bits of
    mxfp4 experts, rotation, scales and rounding without TurboQuant) are ignored. Raises RecipeError."""
    fmt, bits, _ = _tier(values["base"])
    kw: dict = {"format": fmt, "bits": bits or DEFAULT_BITS}
    efmt = fmt
    if values["experts"] != "same":
        efmt, ebits, ternary = _tier(values["experts"])
        kw.update(expert_format=efmt, mlp_bits=ebits, ternary_experts=ternary)
    if fmt in _QUANTIZED and values["attn"] != "same":
        kw["attn_bits"] = int(values["attn"])
    if efmt in _QUANTIZED:
        if values["down"] != "none":
            kw["expert_down_bits"] = int(values["down"])
        if values["mlpg"] != "same":
            kw["mlp_group_size"] = int(values["mlpg"])
    if fmt in _QUANTIZED or efmt in _QUANTIZED:
        kw["group_size"] = int(values["group"])
    if Format.TURBOQUANT in (fmt, efmt):
        kw.update(rotation=values["rotation"] == "on", seed=seed, scales=values["scales"],
                  calibrate=values["rounding"] == "cal")
    return Recipe(**kw)


def controls_from_recipe(r: Recipe) -> dict[str, str]:
    """The control values that spell `r` (all but its seed)."""
    if r.ternary_experts:
        tier = "tqT"
    elif r.expert_format is None and r.mlp_bits is None:
        tier = "same"
    elif r.experts_format in (Format.MXFP4, Format.SOURCE):
        tier = "mxfp4" if r.experts_format is Format.MXFP4 else "src"
    else:
        tier = f"{_PREFIX[r.experts_format]}{r.expert_bits}"
    return {
        "base": "src" if r.format is Format.SOURCE else f"{_PREFIX[r.format]}{r.bits}",
        "group": str(r.group_size),
        "attn": "same" if r.attn_bits is None else str(r.attn_bits),
        "experts": tier,
        "down": "none" if r.expert_down_bits is None else str(r.expert_down_bits),
        "mlpg": "same" if r.mlp_group_size is None else str(r.mlp_group_size),
        "rotation": "on" if r.rotation else "off",
        "scales": r.scales,
        "rounding": "cal" if r.calibrate else "nearest",
    }


def _short_path(word: str) -> str:
    """`language_model.model.layers.1.block_sparse_moe.switch_mlp.gate_proj` -> `layers.1...switch_mlp.gate_proj`."""
    parts = word.rstrip(":,").split(".")
    if len(parts) < 5:
        return word
    tail = ".".join(parts[-2:]) + word[len(word.rstrip(":,")):]
    if "layers" in parts[:-3]:
        i = parts.index("layers")
        return f"layers.{parts[i + 1]}...{tail}"
    return f"...{tail}"


class CycleSelect(Select[str], inherit_bindings=False):
    """A one-line Select: left/right step through the values, space (or a click) opens the list, up/down move to the
    previous/next option row. Enter is left to the screen (it pins the recipe)."""

    BINDINGS = [
        Binding("up", "row(-1)", "Row", key_display="↑↓"),
        Binding("down", "row(1)", "Row", show=False),
        Binding("left", "step(-1)", "Change", key_display="←→"),
        Binding("right", "step(1)", "Change", show=False),
        Binding("space", "show_overlay", "List", show=False),
    ]

    def __init__(self, options: list[tuple[str, str]], **kwargs) -> None:
        super().__init__(options, allow_blank=False, compact=True, **kwargs)
        self.values = [v for _, v in options]

    def set_options(self, options) -> None:
        options = list(options)
        self.values = [v for _, v in options]
        super().set_options(options)

    def action_row(self, delta: int) -> None:
        _move_row(self, delta)

    def action_step(self, delta: int) -> None:
        if self.value in self.values:
            i = min(max(self.values.index(self.value) + delta, 0), len(self.values) - 1)
            self.value = self.values[i]


class FormInput(OrderedInput):
    """A one-line text field: left/right move the text cursor and esc goes back to the option rows, as the footer
    says; the app's one-letter keys type here, so the footer hides them."""

    hides_app_keys = True
    BINDINGS = [
        Binding("escape", "leave", "Rows", key_display="esc"),
        Binding("left", "cursor_left", "Cursor", key_display="←→"),
        Binding("right", "cursor_right", "Cursor", show=False),
    ]

    def __init__(self, **kwargs) -> None:
        super().__init__(compact=True, select_on_focus=False, **kwargs)

    def action_leave(self) -> None:
        next(a for a in self.ancestors if isinstance(a, RecipeEditor)).focus_rows()


def _move_row(widget, delta: int) -> None:
    """Focus the previous/next enabled option row (no wrapping, never into a text field)."""
    editor = next(a for a in widget.ancestors if isinstance(a, RecipeEditor))
    rows = [w for w in editor.query(CycleSelect) if w.focusable]
    if widget in rows:
        # Screen.set_focus at once, not Widget.focus (queued behind keys already received: a burst would be lost).
        widget.screen.set_focus(rows[min(max(rows.index(widget) + delta, 0), len(rows) - 1)])


def _row(label: str, control, id: str | None = None) -> Horizontal:
    return Horizontal(Label(label, classes="form-label"), control, classes="form-row", id=id)


class RecipeEditor(Vertical):
    """Posts RecipeChosen when the controls or a typed name give a new valid recipe, MachineChosen when the memory size
    or disk bandwidth give a new machine. `recipe` and `machine` are the last good ones."""

    def __init__(self, recipe: Recipe | None = None, **kwargs) -> None:
        super().__init__(**kwargs)
        self.recipe = recipe or Recipe.parse(INITIAL_RECIPE)
        self._errors: dict[str, str] = {}  # field -> one-line error, newest last
        self._busy = False
        self._last_row: CycleSelect | None = None  # the option row focused last
        self._disk_path: Path | None = None  # the checkpoint whose disk is measured
        self._disk: DiskSpeed | None = None  # its measured bandwidth (tqbench.machine.disk_speed)
        self._disk_note = "not measured (no checkpoint open)"
        self._memory: int | None = None
        self._typed_gbps: float | None = None  # the disk field's value; None: the measured bandwidth
        self.machine = plan_machine(None, None, self._disk_note)
        self._here = self.machine.memory_bytes  # this machine's memory (the default)

    def compose(self) -> ComposeResult:
        values = controls_from_recipe(self.recipe)
        yield FormInput(value=self.recipe.name, placeholder="recipe name, e.g. tq3a-tqTe-down4-g64", id="recipe-name")
        yield Static("", id="recipe-status")
        with Vertical(id="recipe-rows"):  # one stop of tab: up/down move inside
            yield _row("base", CycleSelect(BASE_OPTIONS, value=values["base"], id="base"))
            yield _row("group", CycleSelect(GROUP_OPTIONS, value=values["group"], id="group"))
            yield _row("attention", CycleSelect(bits_options(self.recipe.format, "same"), value=values["attn"],
                                                id="attn"))
            yield _row("experts", CycleSelect(TIER_OPTIONS, value=values["experts"], id="experts"))
            yield _row("exp down", CycleSelect(bits_options(self.recipe.experts_format, "none"),
                                               value=values["down"], id="down"))
            yield _row("exp group", CycleSelect(MLPG_OPTIONS, value=values["mlpg"], id="mlpg"))
            yield _row("rotation", CycleSelect(ROTATION_OPTIONS, value=values["rotation"], id="rotation"))
            yield _row("scales", CycleSelect(SCALES_OPTIONS, value=values["scales"], id="scales"))
            yield _row("rounding", CycleSelect(ROUNDING_OPTIONS, value=values["rounding"], id="rounding"))
        yield _row("memory", FormInput(id="memory"), id="memory-row")
        yield _row("disk GB/s", FormInput(id="disk"))
        yield Static("", id="machine-note")
        yield Static("", id="plan-note")

    def on_mount(self) -> None:
        self._update_enabled(controls_from_recipe(self.recipe))
        self._show_machine()
        self._show_status()

    # ---- recipe -----------------------------------------------------------------------------------------------------

    def control_values(self) -> dict[str, str]:
        return {key: self.query_one(f"#{key}", CycleSelect).value for key in CONTROLS}

    @property
    def parts(self) -> list:
        """What tab stops at, in reading order: the name field, the option rows (one stop), memory, disk bandwidth."""
        return [self.query_one(f"#{key}") for key in ("recipe-name", "recipe-rows", "memory", "disk")]

    def focus_rows(self) -> None:
        """Focus the option row focused last (the base at first; the next enabled one if it was disabled since)."""
        rows = list(self.query(CycleSelect))
        row = self._last_row if self._last_row in rows else rows[0]
        enabled = [w for w in rows[rows.index(row):] if w.focusable] or rows[:1]  # the base is never disabled
        self.screen.set_focus(enabled[0])

    def on_descendant_focus(self, event) -> None:
        if isinstance(event.widget, CycleSelect):
            self._last_row = event.widget

    def set_recipe(self, recipe: Recipe, name: bool = True) -> None:
        """Show `recipe` in the controls (and in the name field when `name`); no messages are posted."""
        self.recipe = recipe
        self._set_controls(controls_from_recipe(recipe))
        self._set_error("name", None)
        self._set_error("controls", None)
        if name:
            with self.prevent(Input.Changed):
                self.query_one("#recipe-name", Input).value = recipe.name

    def _set_controls(self, values: Mapping[str, str]) -> None:
        with self.prevent(Select.Changed):
            self._update_options(values)
            for key in CONTROLS:
                select = self.query_one(f"#{key}", CycleSelect)
                if select.value != values[key]:
                    select.value = values[key]
        self._update_enabled(values)

    def _update_options(self, values: Mapping[str, str]) -> None:
        """Attention and down-bit choices follow the base and expert formats (TurboQuant 2-4, affine 2-8)."""
        fmt = _tier(values["base"])[0]
        efmt = fmt if values["experts"] == "same" else _tier(values["experts"])[0]
        for key, f, none in (("attn", fmt, "same"), ("down", efmt, "none")):
            select = self.query_one(f"#{key}", CycleSelect)
            options = bits_options(f, none)
            if [v for _, v in options] != select.values:
                keep = select.value if select.value in [v for _, v in options] else none
                select.set_options(options)
                select.value = keep

    def _update_enabled(self, values: Mapping[str, str]) -> None:
        fmt = _tier(values["base"])[0]
        efmt = fmt if values["experts"] == "same" else _tier(values["experts"])[0]
        experts_q = efmt in _QUANTIZED
        enabled = {"attn": fmt in _QUANTIZED, "down": experts_q, "mlpg": experts_q,
                   "group": fmt in _QUANTIZED or experts_q, "rotation": Format.TURBOQUANT in (fmt, efmt),
                   "scales": Format.TURBOQUANT in (fmt, efmt), "rounding": Format.TURBOQUANT in (fmt, efmt)}
        for key, is_on in enabled.items():
            self.query_one(f"#{key}", CycleSelect).disabled = not is_on

    @on(Select.Changed)
    def _control_changed(self, event: Select.Changed) -> None:
        event.stop()
        values = self.control_values()
        with self.prevent(Select.Changed):
            self._update_options(values)
        values = self.control_values()
        self._update_enabled(values)
        try:
            recipe = recipe_from_controls(values, self.recipe.seed)
        except TqbenchError as e:
            self._set_error("controls", str(e))
            return
        self._set_error("controls", None)
        self._set_error("name", None)
        with self.prevent(Input.Changed):
            self.query_one("#recipe-name", Input).value = recipe.name
        self._choose(recipe)

    @on(Input.Changed, "#recipe-name")
    @on(Input.Submitted, "#recipe-name")
    def _name_typed(self, event: Input.Changed | Input.Submitted) -> None:
        event.stop()
        try:
            recipe = Recipe.parse(event.value)
        except TqbenchError as e:
            self._set_error("name", str(e))
            return
        self._set_error("name", None)
        self._set_error("controls", None)
        self.set_recipe(recipe, name=False)
        self._choose(recipe)

    def _choose(self, recipe: Recipe) -> None:
        if recipe != self.recipe:
            self.recipe = recipe
        self.post_message(RecipeChosen(recipe=recipe))

    # ---- machine ----------------------------------------------------------------------------------------------------

    def set_checkpoint_path(self, path: Path | str | None) -> None:
        """The default disk bandwidth becomes the checkpoint's disk's (as `tqbench plan` has it): the cached
        measurement at once, else "measuring..." until a thread worker has measured it (once per disk)."""
        self._disk_path = Path(path) if path is not None else None
        try:
            self._disk = cached_disk_speed(path)
        except OSError:
            self._disk = None
        if self._disk is None:
            self._disk_note = "measuring..."
            self._measure_disk(self._disk_path)
        self._machine_typed()

    @work(thread=True, exclusive=True, group="disk", exit_on_error=False, description="measure the disk")
    def _measure_disk(self, path: Path | None) -> None:
        try:
            speed: DiskSpeed | str = disk_speed(path)
        except OSError as e:
            speed = f"measurement failed: {e.strerror or e}"
        try:
            self.app.call_from_thread(self._disk_measured, path, speed)
        except RuntimeError:
            pass  # the app has quit meanwhile

    def _disk_measured(self, path: Path | None, speed: DiskSpeed | str) -> None:
        if path != self._disk_path:
            return  # another checkpoint was opened meanwhile
        self._disk = speed if isinstance(speed, DiskSpeed) else None
        self._disk_note = speed if isinstance(speed, str) else ""
        self._machine_typed()

    @on(Input.Changed, "#memory")
    @on(Input.Changed, "#disk")
    @on(Input.Submitted, "#memory")
    @on(Input.Submitted, "#disk")
    def _machine_event(self, event: Input.Changed | Input.Submitted) -> None:
        event.stop()
        self._machine_typed()

    def _machine_typed(self) -> None:
        ok = True
        try:
            self._memory = read_memory(self.query_one("#memory", Input).value)
            self._set_error("memory", None)
        except TqbenchError as e:
            self._set_error("memory", f"memory: {e}")
            ok = False
        try:
            self._typed_gbps = read_gbps(self.query_one("#disk", Input).value, None)
            self._set_error("disk", None)
        except TqbenchError as e:
            self._set_error("disk", f"disk: {e}")
            ok = False
        if ok:
            try:
                if self._typed_gbps is not None:
                    disk, source = self._typed_gbps * GB, "typed"
                elif self._disk is not None:
                    disk, source = self._disk.bytes_per_s, self._disk.source
                else:
                    disk, source = None, self._disk_note
                self.machine = plan_machine(self._memory, disk, source)
            except TqbenchError as e:
                self._set_error("memory", f"memory: {e}")
        self._show_machine()
        self.post_message(MachineChosen(machine=self.machine))

    def _show_machine(self) -> None:
        self.query_one("#memory", Input).placeholder = f"{units.gb(self._here)} (here)"
        self.query_one("#disk", Input).placeholder = (
            f"{self._disk.bytes_per_s / GB:.2f}" if self._disk is not None
            else "measuring..." if self._disk_note == "measuring..." else "-")
        m = self.machine
        self.query_one("#machine-note", Static).update(Content.styled(
            f"{m.platform}, GPU limit {units.gb(m.gpu_limit_bytes)}\n"
            f"disk: {m.disk_source}", "$text-muted"))

    # ---- messages -----------------------------------------------------------------------------------------------

    def _set_error(self, key: str, text: str | None) -> None:
        self._errors.pop(key, None)
        if text:
            self._errors[key] = text
        self._show_status()

    def set_error(self, key: str, text: str | None) -> None:
        """Show (or, with None, clear) a one-line error under the name; the newest error is the one shown."""
        self._set_error(key, text)

    @property
    def error_text(self) -> str:
        return next(reversed(self._errors.values()), "")

    def set_busy(self, busy: bool) -> None:
        """Say that plans are being made (the table shows the previous numbers until they come)."""
        if busy != self._busy:
            self._busy = busy
            self._show_status()

    def _show_status(self) -> None:
        status = self.query_one("#recipe-status", Static)
        text = self.error_text
        status.set_class(bool(text), "error")
        hint = "planning..." if self._busy else "tab: next part  +: pin"
        status.update(Content(text) if text else Content.styled(hint, "$text-muted"))

    def set_notes(self, lines: list[str]) -> None:
        """Plan warnings for the current recipe (the first few; the count when there are more)."""
        note = self.query_one("#plan-note", Static)
        if not lines:
            note.update("")
            return
        head = f"{len(lines)} plan warning{'s' if len(lines) > 1 else ''} (all in `tqbench plan`): "
        note.update(Content.styled(head + " ".join(map(_short_path, lines[0].split(" "))), "$text-warning"))
