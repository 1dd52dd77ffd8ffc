"""Models: the CausalLM interface, the native Llama-family path, the transformers adapter, loading."""
