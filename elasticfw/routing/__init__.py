"""Routers: who decides, per input, which KV heads run the retrieval mode or the sparse mode."""
