"""The embedded rollout server: this project's own engine (``engine.py``: continuous batching with
a paged KV cache, in-flight weight updates), its HTTP server (``server.py``), client (``client.py``)
and launcher (``launcher.py``: ``EmbeddedBackend``), beside the SGLang and vLLM backends."""
