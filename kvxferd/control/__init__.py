"""Control plane: the engine and admin gRPC services, the fd socket, the listeners (the peer
service is in :mod:`kvxferd.peer`, with its other end; the checks of what every service
receives and the error-to-status mapping are in :mod:`kvxferd.edge`)."""
