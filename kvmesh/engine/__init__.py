"""Inference engine: model runner, scheduler, sampler and the LLM API."""
