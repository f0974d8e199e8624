"""The embedded rollout server: this project's own engine (``engine.py``: continuous batching with
a paged KV cache, in-flight weight updates), its HTTP server (``server.py`` wires the routes of
``routes_generation.py``, ``routes_weights.py`` and ``routes_admin.py``; its command line is
``server_args.py``), client (``client.py``) and launcher (``launcher.py``: ``EmbeddedBackend``),
beside the SGLang and vLLM backends."""
