"""The footer of every screen: Textual's Footer, less the keys that do not fit whole.

Textual's Footer cuts the key at the right edge mid-word (`w Se`) when the keys are wider than the terminal. This one
leaves out the last keys instead, whole: the screen's own keys come first, then the app's (Help before the screens),
so at 80 columns the last screens' keys go first. The help screen (? or F1) and the palette list every key."""

from __future__ import annotations

from textual.geometry import Size
from textual.widgets import Footer


class FittingFooter(Footer):
    def on_resize(self) -> None:
        self.call_after_refresh(self.recompose)  # every key again, then fitted to the new width

    async def recompose(self) -> None:
        await super().recompose()
        self._leave_out_what_does_not_fit()

    def _leave_out_what_does_not_fit(self) -> None:
        """Widths from the keys' own text, not from a layout: a footer recomposed under a dialog is laid out late."""
        room = self.scrollable_content_region.width
        if not room:
            return  # not laid out yet: fitted on its first resize
        viewport = Size(room, 1)
        used = 0
        fits = True
        for child in self.children:
            if not child.display:
                continue  # the palette key (app.tcss hides it)
            margin = child.styles.margin
            used += margin.left + child.get_content_width(viewport, viewport) + child.styles.gutter.width
            fits = fits and used <= room
            child.display = fits
            used += margin.right
