"""``specengine serve``: an OpenAI- and TRL-compatible HTTP server over one ``LLM``.

``build_app(llm)`` (in ``specengine.server.app``) needs the ``serve`` extra (FastAPI, uvicorn);
this package imports nothing heavy until it is used.
"""
