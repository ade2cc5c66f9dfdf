"""Authentication and transport security of every kvmesh port (grpc and the standard library
only: the control plane, the workers, the KV transfer backends and the client all import it).

- `credentials`: where the cluster token and API keys come from; constant-time comparison.
- `interceptors`: the grpc.aio server interceptor that refuses calls without a valid bearer
  secret (UNAUTHENTICATED), and the client interceptor that attaches one.
- `tls`: server and channel credentials from PEM files (TLS, mutual TLS).
- `policy`: `Security`, what one process uses on its ports and channels; `flags` builds it from
  the command line.
"""

from kvmesh.security.credentials import CredentialError
from kvmesh.security.policy import Security
from kvmesh.security.tls import TlsConfig

__all__ = ["CredentialError", "Security", "TlsConfig"]
