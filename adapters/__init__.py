"""Connection adapters: one module per driver."""
