"""The handoff paths: a local copy, the decode side of a remote pull, the offering side."""
