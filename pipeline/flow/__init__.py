"""When a request moves on: admission (room on the worker) and batching (length buckets, size and delay timers). In:
measured requests; out: keyed batches.
"""
