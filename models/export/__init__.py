"""A draft's exported directory: writing and loading it, and what SGLang, vLLM and speculators make of it."""
