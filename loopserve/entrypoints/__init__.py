"""Front ends over a Router besides the gRPC server (cluster/server.py)."""
