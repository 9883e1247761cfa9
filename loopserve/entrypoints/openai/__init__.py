"""The OpenAI-compatible HTTP server: protocol (request/response models), serving (requests
through the router), chat_template, server (FastAPI app, uvicorn)."""
