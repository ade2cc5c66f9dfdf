"""Decode role: gRPC service around the engine that receives KV and decodes."""
