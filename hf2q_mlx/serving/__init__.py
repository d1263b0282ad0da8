"""Serving: the continuous-batching engine, ``BatchGenerator`` and the OpenAI-compatible server.

The HTTP layer (``app.py``) needs the ``serve`` extra (FastAPI, uvicorn); nothing else here does.
"""
