"""The OpenAI-compatible HTTP layer: FastAPI routes, request validation, SSE, health, Prometheus.

Runs in the API process of `tokenmill serve`, which never imports torch (the engine core runs in its own
process). May import frontend/, core/ (the client and wire types only), structured_output/ (to validate
a constraint before admission), model/ (resolution and the tokenizer) and the top-level leaves.
"""
