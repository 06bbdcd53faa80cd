"""When a request moves on: reading (only what the worker has room for), admission (each request in the place its
read took) and batching (length buckets, size and delay timers). In: the input subscription and measured requests;
out: Pub/Sub messages and keyed batches.
"""
