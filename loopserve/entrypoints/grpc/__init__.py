"""The gRPC front: the LoopServe service over a Router (`server.py`), its wire mapping
(`protocol.py`), the generated stubs (`proto/`) and a Python client (`client.py`)."""
