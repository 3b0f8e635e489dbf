"""Structured logging for the server: logfmt lines by default, JSON lines with CORRAL_LOG_FORMAT=json.

Secrets stay out of the log: the start-up environment dump shows "***" for any variable whose
name contains KEY, TOKEN, SECRET or PASSWORD, and a filter on the handler replaces the values of
such variables wherever they turn up in a record (a message, an argument, an extra field, a traceback).
"""

from __future__ import annotations

import datetime
import json as jsonlib
import logging
import os
import re
import sys
from collections.abc import Iterable, Mapping
from typing import IO, Any

LOGGED_PREFIXES = ("CUDA_", "CORRAL_", "OLLAMA_", "TORCH_")
SENSITIVE_WORDS = ("KEY", "TOKEN", "SECRET", "PASSWORD")
REDACTED = "***"
# Values too short or too common to scrub from free text without mangling it ("1", "true", "4096").
_MIN_SECRET_LENGTH = 5
_NOT_SECRETS = {"true", "false", "yes", "no", "on", "off", "none", "null"}
# Attributes every LogRecord has; anything else on a record came from `extra=`.
_RECORD_FIELDS = set(vars(logging.LogRecord("", 0, "", 0, "", None, None))) | {"message", "asctime", "taskName"}
_BARE = re.compile(r"[^\s=\"\\]+")


def is_sensitive(name: str) -> bool:
    """Whether an environment variable's name marks its value as a secret."""
    upper = name.upper()
    return any(word in upper for word in SENSITIVE_WORDS)


def redacted_environment(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The CUDA_*, CORRAL_*, OLLAMA_* and TORCH_* variables, sorted, secrets shown as "***"."""
    environ = os.environ if environ is None else environ
    return {
        name: REDACTED if is_sensitive(name) else value
        for name, value in sorted(environ.items())
        if name.upper().startswith(LOGGED_PREFIXES)
    }


def log_environment(logger: logging.Logger, environ: Mapping[str, str] | None = None) -> None:
    """Log the relevant environment as one record, each variable its own field."""
    logger.info("environment", extra={"env": redacted_environment(environ)})


class RedactSecrets(logging.Filter):
    """Replaces the values of sensitive environment variables anywhere in a record."""

    def __init__(self, environ: Mapping[str, str] | None = None):
        super().__init__()
        environ = os.environ if environ is None else environ
        secrets = {value for name, value in environ.items() if is_sensitive(name) and _scrubbable(value)}
        self.secrets = sorted(secrets, key=len, reverse=True)  # longest first: a secret containing another goes whole

    def filter(self, record: logging.LogRecord) -> bool:
        if not self.secrets:
            return True
        try:
            record.msg, record.args = self._scrub(record.getMessage()), None
        except Exception:  # arguments that do not fit the format: keep both, scrubbed, rather than fail the caller
            record.msg, record.args = self._scrub(f"{record.msg} (unformattable arguments {record.args!r})"), None
        if record.exc_info and not record.exc_text:
            record.exc_text = logging.Formatter().formatException(record.exc_info)
        if record.exc_text:
            record.exc_text = self._scrub(record.exc_text)
        if record.stack_info:
            record.stack_info = self._scrub(record.stack_info)
        for name in _extra_fields(record):
            setattr(record, name, self._scrub(getattr(record, name)))
        return True

    def _scrub(self, value: Any) -> Any:
        if isinstance(value, str):
            for secret in self.secrets:
                value = value.replace(secret, REDACTED)
            return value
        if isinstance(value, Mapping):
            return {key: self._scrub(item) for key, item in value.items()}
        if isinstance(value, (list, tuple)):
            return [self._scrub(item) for item in value]
        if isinstance(value, (int, float, bool)) or value is None:
            return value
        return self._scrub(str(value))


class LogfmtFormatter(logging.Formatter):
    """`time=... level=INFO logger=corral.scheduler msg="loaded smollm2 in 1.20s" key=value ...`."""

    def format(self, record: logging.LogRecord) -> str:
        pairs = [("time", _timestamp(record)), ("level", record.levelname), ("logger", record.name)]
        pairs.append(("msg", record.getMessage()))
        for name in _extra_fields(record):
            value = getattr(record, name)
            pairs.extend(value.items() if isinstance(value, Mapping) else [(name, value)])
        line = " ".join(f"{key}={_logfmt_value(value)}" for key, value in pairs)
        trace = _exception_text(self, record)
        return f"{line} error={_logfmt_value(trace)}" if trace else line


class JSONFormatter(logging.Formatter):
    """One JSON object per line: time, level, logger, msg, the `extra=` fields, and any traceback."""

    def format(self, record: logging.LogRecord) -> str:
        entry = {"time": _timestamp(record), "level": record.levelname, "logger": record.name, "msg": record.getMessage()}
        for name in _extra_fields(record):
            entry[name] = getattr(record, name)
        trace = _exception_text(self, record)
        if trace:
            entry["error"] = trace
        return jsonlib.dumps(entry, default=str)


def setup_logging(
    level: int | str | None = None, json: bool | None = None, stream: IO[str] | None = None
) -> logging.Handler:
    """Send all logging to `stream` (stderr) as structured lines, secrets redacted; returns the handler.

    `level` defaults to DEBUG when CORRAL_DEBUG (or OLLAMA_DEBUG) is set, else INFO; `json` defaults
    to CORRAL_LOG_FORMAT=json. Calling it again replaces the handler it installed before.
    """
    if level is None:
        debug = _flag(os.environ.get("CORRAL_DEBUG") or os.environ.get("OLLAMA_DEBUG"))
        level = logging.DEBUG if debug else logging.INFO
    elif isinstance(level, str):
        level = level.upper()
    if json is None:
        json = os.environ.get("CORRAL_LOG_FORMAT", "").strip().lower() == "json"
    handler = logging.StreamHandler(stream or sys.stderr)
    handler.setFormatter(JSONFormatter() if json else LogfmtFormatter())
    handler.addFilter(RedactSecrets())
    handler._corral = True  # marks the handler a later call replaces
    root = logging.getLogger()
    for old in [h for h in root.handlers if getattr(h, "_corral", False)]:
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level)
    return handler


def _scrubbable(value: str) -> bool:
    return len(value) >= _MIN_SECRET_LENGTH and value.lower() not in _NOT_SECRETS and not value.replace(".", "", 1).isdigit()


def _extra_fields(record: logging.LogRecord) -> Iterable[str]:
    return [name for name in vars(record) if name not in _RECORD_FIELDS and not name.startswith("_")]


def _exception_text(formatter: logging.Formatter, record: logging.LogRecord) -> str:
    if record.exc_info and not record.exc_text:
        record.exc_text = formatter.formatException(record.exc_info)
    parts = [part for part in (record.exc_text, record.stack_info and formatter.formatStack(record.stack_info)) if part]
    return "\n".join(parts)


def _timestamp(record: logging.LogRecord) -> str:
    return datetime.datetime.fromtimestamp(record.created, tz=datetime.timezone.utc).isoformat(timespec="milliseconds")


def _logfmt_value(value: Any) -> str:
    if isinstance(value, (Mapping, list)):
        text = jsonlib.dumps(value, default=str)
    else:
        text = str(value)
    return text if _BARE.fullmatch(text) else jsonlib.dumps(text)


def _flag(value: str | None) -> bool:
    return (value or "").strip().lower() not in ("", "0", "false", "no", "off")
