"""Worker-side gRPC plumbing shared by the prefill, decode and colocated services.

Conversion (`convert`), status mapping (`status`), the engine thread (`engine_worker`),
server bootstrap (`server`), command-line options (`options`) and the control-plane agent
(`agent`). Importing the package is light; import the submodules you need.
"""
