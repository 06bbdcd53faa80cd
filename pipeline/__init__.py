"""The worker package: what a Dataflow worker runs, grouped by stage (docs/architecture.md). Each stage package imports
only those below it.
"""
