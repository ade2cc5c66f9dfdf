"""Worker-side gRPC plumbing shared by the prefill, decode and colocated services.

Conversion (`convert`), status mapping (`status`), the worker runtime around
`kvmesh.engine.async_engine.AsyncLLMEngine` (`runtime`), server bootstrap and drain (`server`),
command-line options (`options`), the worker process (`process`) and the control-plane agent
(`agent`). Importing the package is light; import the submodules you need.
"""
