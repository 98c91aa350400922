"""Chat, owned by the engine: what a user asks (`request.ChatRequest`), which model a chat opens when none is named
(`choose`), the session that runs it on the engine thread (`session.ChatSession`), the records its events carry
(`records`; the events themselves, with the union each job yields, are in tqbench.events), the words the faces show
(`report`) and the live expert view's model (`live`). The CLI, the TUI and any later face only render these.

Import the modules themselves: all but `session` are cheap (no MLX), so a face can name their types at import time.
"""
