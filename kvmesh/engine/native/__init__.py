"""kvmesh's own model executor for the Llama family (Llama, Qwen2, Qwen3, Mistral, SmolLM2).

Built at load from the transformers model (which still loads configs, tokenizers and weights):
merged QKV and gate/up weights, RMSNorm fused with the residual add, SiLU-and-mul, rotary
embedding from a precomputed cos/sin table, the step's paged attention plan. `executor.py` picks
it or transformers' model code per architecture.
"""
