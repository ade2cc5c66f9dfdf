"""Transfer backends; each defines `Sender` and `Receiver` (see `kv_transfer.get_backend`)."""
