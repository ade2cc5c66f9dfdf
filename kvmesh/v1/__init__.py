"""Generated protobuf and gRPC code for package kvmesh.v1 (do not edit; `make protos`)."""
