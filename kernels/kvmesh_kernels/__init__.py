"""Paged-attention and KV-cache kernels: torch references and Triton kernels."""
