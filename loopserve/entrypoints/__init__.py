"""The API fronts over a Router: gRPC (`grpc/`), OpenAI-compatible HTTP (`openai/`), their
shared bearer-token check (`auth.py`), and `serve.py`, which runs both."""
