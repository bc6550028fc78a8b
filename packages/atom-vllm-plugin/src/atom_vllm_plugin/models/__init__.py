"""vLLM model classes (constructed by vLLM as ``cls(vllm_config=..., prefix=...)``)."""
