"""``musecore serve``: an OpenAI-compatible HTTP server with continuous batching.

``engine`` holds the scheduler (one thread, one KV cache, requests joining and leaving the running
batch between decode steps); ``app`` the HTTP routes (FastAPI, the optional ``serve`` extra).
"""
