"""Prefill role: gRPC service around the engine that builds and ships KV blocks."""
