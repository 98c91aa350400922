"""Progress while a checkpoint opens: a bar over shard headers, then an indeterminate one while tensors are
classified."""

from __future__ import annotations

from textual.app import ComposeResult
from textual.containers import Vertical
from textual.content import Content
from textual.widgets import Label, ProgressBar

from tqbench import units


class ScanPanel(Vertical):
    """Shown while a load runs; the screen hides it when the load ends."""

    def compose(self) -> ComposeResult:
        yield Label("", id="scan-label")
        yield ProgressBar(total=None, show_eta=False, id="scan-bar")

    def start(self, text: str) -> None:
        self.query_one("#scan-label", Label).update(Content(text))
        self.query_one("#scan-bar", ProgressBar).update(total=None, progress=0)

    def progress(self, index: int, total: int, file: str, tensors_so_far: int, fetched_bytes: int = 0) -> None:
        label = self.query_one("#scan-label", Label)
        bar = self.query_one("#scan-bar", ProgressBar)
        fetched = f"  {units.size(fetched_bytes)} fetched" if fetched_bytes else ""
        if index < total:
            label.update(Content(f"shard {index:,}/{total:,}  {file}  {tensors_so_far:,} tensors{fetched}"))
            bar.update(total=total, progress=index)
        else:  # every header read; what remains is classifying the tensors, with no finer progress to report
            label.update(Content(f"{total:,} shards read; classifying {tensors_so_far:,} tensors..."))
            bar.update(total=None)
