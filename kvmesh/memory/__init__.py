"""Paged KV memory: block pool, block tables, prefix cache, capacity planning."""
