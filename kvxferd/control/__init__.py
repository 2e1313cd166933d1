"""Control plane: the gRPC services and the peer directory."""
