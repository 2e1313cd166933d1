"""The rules at the daemon's gRPC edge, one place each, for every service (engine, admin,
peer): ``wire`` checks each value as it enters; ``rpc`` maps the one error tree to status
codes and back, and wraps every handler so."""
