"""Process set-up shared by the entry points (launch_server, sglang.Engine) and the scheduler process."""

from __future__ import annotations

import logging


def configure_logging(level: str, prefix: str = "") -> None:
    """Root logging at `level` ("info", ...); `prefix` follows the time in each line (" scheduler" marks the
    scheduler process's lines in the server's log)."""
    logging.basicConfig(level=level.upper(), format=f"[%(asctime)s{prefix}] %(levelname)s %(name)s: %(message)s")
