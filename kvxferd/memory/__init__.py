"""Memory: engine pools mapped into the daemon."""
