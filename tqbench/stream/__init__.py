"""Expert streaming: routed experts stay on disk and each forward pass pages in the experts its router picks."""

from tqbench.stream.stats import PageIn, StreamStats
from tqbench.stream.store import ExpertStore, StoreError
from tqbench.stream.streamer import StreamConfig, Streamer

__all__ = ["ExpertStore", "PageIn", "StoreError", "StreamConfig", "StreamStats", "Streamer"]
