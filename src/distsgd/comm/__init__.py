"""Communication helpers: process groups (and, later, RPC and shared memory)."""
