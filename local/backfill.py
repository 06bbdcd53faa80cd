"""``python -m ops.backfill`` against the local BigQuery emulator, for the tests.

Google's BigQuery library does not go to an emulator by itself (local/emulators.py), and ``ops/`` imports nothing
from ``local/``: so the emulator's client is installed here, in the process, before the backfill runs. Without
``BIGQUERY_EMULATOR_HOST`` in the environment this is ``ops.backfill`` itself.
"""

from __future__ import annotations

import sys

from local.emulators import use_bigquery_emulator
from ops.backfill import main

if __name__ == "__main__":
    use_bigquery_emulator()
    sys.exit(main())
