"""The worker's runtime: what one worker VM shares across its SDK processes. Its engine (generation) and its
admission ledger (what the VM holds against ``max_in_flight + worker_queue``) live together in one process,
reached by every step through a proxy; the load the two make is reported as Beam gauges.
"""
