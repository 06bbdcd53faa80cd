"""Starts bqemulator without network access (run with the emulator virtualenv's Python).

bqemulator loads DuckDB's spatial extension at start, which it downloads; here
there is no network, so that step is skipped and GEOGRAPHY columns are not
supported. Nothing else changes.
"""

import sys

from bqemulator.cli import main
from bqemulator.storage import engine

engine.DuckDBEngine._load_spatial = lambda self: None

if __name__ == "__main__":
    sys.exit(main())
