"""State kept between runs in the user cache (JSON in tqbench.paths.state_file()): shared by both faces. The model
converted (or chatted with) last lives here; the UI keeps its own keys in the same file (tui/state.py)."""

from __future__ import annotations

import json
from pathlib import Path

from tqbench.atomic import write_json
from tqbench.paths import state_file


def load_state() -> dict:
    try:
        data = json.loads(state_file().read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def save_state(data: dict) -> None:
    """Write the state atomically; a cache that cannot be written is not an error."""
    file = state_file()
    try:
        file.parent.mkdir(parents=True, exist_ok=True)
        write_json(file, data, fsync=False)
    except OSError:
        pass


def remember_model(path: Path) -> None:
    """Record `path` (absolute) as the last converted model, the one `tqbench chat` opens by default."""
    data = load_state()
    data["last_model"] = str(Path(path).resolve())
    save_state(data)


def last_model() -> Path | None:
    """The last converted model, if recorded and still a complete conversion."""
    from tqbench.layout.names import INDEX_FILE

    last = load_state().get("last_model")
    if isinstance(last, str) and (Path(last) / INDEX_FILE).is_file() and (Path(last) / "config.json").is_file():
        return Path(last)
    return None
