"""JSON log lines (`--log-format json`), with the session id and the device as fields where there are."""
from __future__ import annotations

import datetime
import json
import logging


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        line = {
            # ISO 8601 in UTC, to the millisecond: orderable, and comparable across machines.
            "ts": datetime.datetime.fromtimestamp(record.created, datetime.timezone.utc).isoformat(
                timespec="milliseconds"),
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        for field in ("session", "device"):  # where the line has one
            if value := getattr(record, field, None):
                line[field] = value
        if record.exc_info:
            line["exc"] = self.formatException(record.exc_info)
        return json.dumps(line)
