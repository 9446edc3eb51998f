"""JSON log lines (`--log-format json`), with the session id as a field where there is one."""
from __future__ import annotations

import json
import logging


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        line = {
            "ts": self.formatTime(record, "%Y-%m-%dT%H:%M:%S"),
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        if session := getattr(record, "session", None):
            line["session"] = session
        if record.exc_info:
            line["exc"] = self.formatException(record.exc_info)
        return json.dumps(line)
