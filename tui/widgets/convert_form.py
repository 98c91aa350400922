"""The Convert screen's form: the source and recipe lines, the output directory and shard size fields, a calibrated
recipe's calibration text and tokens (shown only for one), and the status line under them (what the check of the
output found, or what a run is doing). The fields' defaults are those of the last conversion of the checkpoint with
the recipe (to resume it), else `<source>-<recipe>` and 5GiB; calibration on the demo's held-out texts, 8,192 tokens
(what `tqbench convert` does without --calibrate-text / --calibrate-tokens)."""

from __future__ import annotations

from pathlib import Path

from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical
from textual.content import Content
from textual.widgets import Input, Label, Static

from tqbench import units
from tqbench.convert.calibration_request import DEFAULT_TOKENS
from tqbench.destination import DEFAULT_SHARD_SIZE, default_dest
from tui.state import display_path, last_conversion, source_name
from tui.widgets.inputs import OrderedInput

KEY = 11  # width of the form's labels (the run's summary aligns with them)


def plural(n: int, word: str) -> str:
    return f"{n:,} {word}{'' if n == 1 else 's'}"


def pair(key: str, value: Content | str, hint: str = "") -> Content:
    line = Content.assemble((f"{key:<{KEY}}", "bold"), value)
    return line + Content.styled(f"  {hint}", "$text-muted") if hint else line


class ConvertInput(OrderedInput):
    """A one-line field; escape and enter hand the keys back to the screen (the table). Its key bindings (ctrl+u,
    ...) run in order with the characters typed around them (tui.widgets.inputs)."""

    BINDINGS = [
        Binding("enter", "submit", "Check"),  # checks the output at once and goes back to the table
        Binding("escape", "screen.leave_input", "Table", key_display="esc"),
    ]

    def __init__(self, **kwargs) -> None:
        super().__init__(compact=True, select_on_focus=False, **kwargs)


class ConvertForm(Vertical):
    """Source, recipe, output directory, shard size and the status line. Typing posts Input.Changed, enter
    Input.Submitted (the screen checks the output again)."""

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self._default_dest: str | None = None  # the destination field's text when it was set by default
        self._default_size = DEFAULT_SHARD_SIZE  # the shard size field's, likewise

    def compose(self) -> ComposeResult:
        yield Static("", id="convert-source")
        yield Static("", id="convert-recipe")
        with Horizontal(classes="form-row"):
            yield Label("output", classes="convert-label")
            yield ConvertInput(placeholder="output directory", id="dest")
            yield Label("shard size", id="shard-label")
            yield ConvertInput(value=DEFAULT_SHARD_SIZE, id="shard-size")
        with Horizontal(classes="form-row", id="calibration-row"):
            yield Label("calibrate", classes="convert-label")
            yield ConvertInput(placeholder="the demo's held-out texts, or files a.txt,b.txt", id="cal-text")
            yield Label("tokens", id="cal-tokens-label")
            yield ConvertInput(value=str(DEFAULT_TOKENS), id="cal-tokens")
        yield Static("", id="convert-status")

    @property
    def dest_text(self) -> str:
        return self.query_one("#dest", Input).value

    @property
    def size_text(self) -> str:
        return self.query_one("#shard-size", Input).value

    @property
    def calibration_texts(self) -> tuple[str, str]:
        """The calibration row's text files and tokens, as typed."""
        return self.query_one("#cal-text", Input).value, self.query_one("#cal-tokens", Input).value

    def show_source(self, ckpt) -> None:
        """ckpt: tqbench.source.Checkpoint (present_bytes sums every tensor: once per checkpoint)."""
        self.query_one("#convert-source", Static).update(pair(
            "source", source_name(ckpt),
            f"{units.gb(ckpt.present_bytes)} in {plural(len(ckpt.shards), 'shard')} (s: open another)"))

    def show_recipe(self, recipe) -> None:
        """The recipe's line, and the calibration row when the recipe calibrates (recipe part `cal`)."""
        self.query_one("#convert-recipe", Static).update(pair(
            "recipe", Content.styled(recipe.name, "bold $text-accent"), "(p: change it on the Recipe screen)"))
        self.query_one("#calibration-row").display = recipe.calibrate

    def fill_defaults(self, source: Path, recipe_name: str) -> None:
        """Unless the user typed them: the destination and shard size of the last conversion of `source` with this
        recipe, else `<source>-<recipe>` and the shard size shown (5GiB unless typed)."""
        dest_input, size_input = self.query_one("#dest", Input), self.query_one("#shard-size", Input)
        if dest_input.value and dest_input.value != self._default_dest:
            return
        remembered = last_conversion(source, recipe_name)
        if remembered is not None:
            dest, size = display_path(remembered[0]), remembered[1]
        else:
            dest = display_path(default_dest(source, recipe_name))
            size = DEFAULT_SHARD_SIZE if size_input.value == self._default_size else size_input.value
        self._default_dest, self._default_size = dest, size
        with self.prevent(Input.Changed):
            dest_input.value = dest
            size_input.value = size

    def disable_fields(self, disabled: bool) -> None:
        """While a run goes on, the fields keep the run's output."""
        for field in self.query(ConvertInput):
            field.disabled = disabled

    def show_status(self, line: Content) -> None:
        self.query_one("#convert-status", Static).update(line)
