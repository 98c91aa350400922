"""Chat, owned by the engine: what a user asks (`request.ChatRequest`), what the engine decides to run
(`session.StreamPlan`), the session that runs it on the engine thread (`session.ChatSession`), the typed records it
hands the faces (`records`), the words they show (`report`) and the live expert view's model (`live`). The CLI, the
TUI and any later face only render these.

Import the modules themselves: all but `session` are cheap (no MLX), so a face can name their types at import time.
"""
