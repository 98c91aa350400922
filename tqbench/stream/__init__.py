"""Expert streaming: routed experts stay on disk and each forward pass pages in the experts its router picks (what each
page-in did is a tqbench.events.PageIn)."""

from tqbench.stream.stats import StreamStats
from tqbench.stream.store import ExpertStore, StoreError
from tqbench.stream.streamer import StreamConfig, Streamer

__all__ = ["ExpertStore", "StoreError", "StreamConfig", "StreamStats", "Streamer"]
