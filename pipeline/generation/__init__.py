"""The generate step: keyed batches in, completions, chunks and dead letters out, through the worker's engine, with the
state that survives retries, key moves, drain and update.
"""
