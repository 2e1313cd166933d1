"""Data plane: segment plans, host copies and the UCX transport."""
