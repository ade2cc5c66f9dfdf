"""Tiered KV storage below the device cache: host memory and disk (see docs/TIERS.md).

Modules: `blockfile` (the disk format, no torch), `watermarks`, `host`, `disk`, `device`
(copies with the block gather/scatter ops), `store` (the TieredStore coordinating them),
`costs` (swap or recompute), `build` (a store from an engine's settings).
Import them directly: this package's import stays light (no torch).
"""
