"""The Chat screen's export of the learned hot-expert profile (e), as `tqbench profile export`: a thread worker writes
it where the engine puts an export the user did not name (tqbench.profile.default_export_file: the cache directory's
`profile-exports/`, named after the model), then posts ChatProfileExported with the file's absolute path."""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable

from textual.content import Content
from textual.screen import Screen

from tui.messages import ChatProfileExported
from tui.screens.chat_relay import one_line

if TYPE_CHECKING:
    from tqbench.chat.session import ChatSession  # importing it loads MLX

GROUP = "export"  # the workers' group


def export_profile(screen: Screen, session: Callable[[], ChatSession], model_path: str) -> None:
    """Export the profile that `session` (the screen's ChatSession) learned of the model at `model_path`."""
    from tqbench.profile import default_export_file

    file = default_export_file(model_path)

    def export() -> None:
        try:
            info = session().export_profile(file)
        except Exception as e:
            screen.post_message(ChatProfileExported(file=None, error=one_line(e)))
            return
        screen.post_message(ChatProfileExported(file=info.file, routings=info.routings))

    screen.run_worker(export, thread=True, exclusive=True, group=GROUP, exit_on_error=False,
                      description="export the profile")


def exported_line(where: str, routings: float) -> Content:
    """The status once the profile is written to `where` (its absolute path)."""
    return Content.assemble("profile exported to ", (where, "bold"),
                            (f"\n{routings:,.0f} routings; tqbench chat --profile FILE uses it", "$text-muted"))
