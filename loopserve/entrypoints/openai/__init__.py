"""The OpenAI-compatible HTTP server: protocol.py (request/response bodies), serving.py
(requests through the router, responses and SSE), choices.py (a request's n choices as router
streams), chat_template.py, server.py (FastAPI app, uvicorn)."""
