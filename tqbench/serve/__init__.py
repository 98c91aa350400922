"""Serving a model over the OpenAI API: `openai` (the wire format), `service` (admission, counting, watching),
`http` (the server), `metrics` and `wire` (the live view's JSON)."""
