"""The kvmesh.v1 wire contract: protobuf and gRPC code generated from protos/kvmesh/v1 (the
`*_pb2*` modules: do not edit; `make protos`), `wire`, the handwritten request decoding
and rich-status helpers every server and client shares, and `transfer`, the KV transfer
backend names, defaults and error codes."""
