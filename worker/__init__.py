"""The gRPC convolution service a worker runs (see the distributed-offload work)."""
