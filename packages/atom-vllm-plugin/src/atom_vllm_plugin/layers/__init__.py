"""vLLM-facing layers that hold vLLM's caches and compute with atom-kernels (the cores of atom-models)."""
