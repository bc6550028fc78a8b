"""One folder per op family: ``checks.py`` (validation shared by all backends), ``reference.py``
(plain torch, the semantic spec) and, written by the GPU engineers, ``triton.py``."""
