"""`make bench-engine`: ours vs llama.cpp vs HF transformers (see __main__.py)."""
