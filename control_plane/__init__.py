"""Control plane: routing, worker registry, block-ownership ledger. Never imports torch."""
