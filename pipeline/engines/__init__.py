"""One engine per worker VM: requests in, streams of chunks, completions and dead letters out (vLLM client or the
in-process transformers model), and what the worker holds.
"""
