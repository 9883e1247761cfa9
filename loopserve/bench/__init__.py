"""`loopserve bench serve`: a seeded serving benchmark against a running server's HTTP or gRPC front."""
