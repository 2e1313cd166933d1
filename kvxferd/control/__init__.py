"""Control plane: the gRPC services, the checks of what they receive, the fd socket."""
