"""Flex Template entry point (``FLEX_TEMPLATE_PYTHON_PY_FILE``).

The launcher runs this file with every template parameter as ``--name=value``
(all values are strings). Invalid parameters stop the launch with a message
that names what to change, before any job is created.
"""

from __future__ import annotations

import logging
import os
import sys


def configure_logging() -> None:
    """INFO (or ``$LOG_LEVEL``) to stderr; a no-op when logging is already configured."""
    level = os.environ.get("LOG_LEVEL", "INFO").upper()
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    # Beam logs every string type hint it meets at INFO; that is noise here.
    logging.getLogger("apache_beam.typehints.native_type_compatibility").setLevel(logging.WARNING)


def main(argv: list[str] | None = None) -> int:
    configure_logging()
    from pipeline.assembly import run
    from pipeline.config.options import ConfigError

    try:
        run(sys.argv[1:] if argv is None else argv)
    except ConfigError as exc:
        logging.getLogger("template").error("%s", exc)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
