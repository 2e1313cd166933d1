"""Control plane: the engine and admin gRPC services, the checks of what they receive, the fd
socket, the listeners (the peer service is in :mod:`kvxferd.peer`, with its other end)."""
