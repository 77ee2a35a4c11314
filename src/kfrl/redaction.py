"""Secrets kept out of everything kfrl prints, logs or stores: URI credentials, query-string tokens,
the values of secret environment variables and of config keys named like a secret.

One module with no heavy imports, so the CLI, the config model, the tracker and the stages all apply
the same rule. Redaction happens where text leaves the process (a printed or stored config, an
MLflow param, an error line, a log record); the values in memory stay as given, so a run still
connects with them.
"""
from __future__ import annotations

import logging
import os
import re
from collections.abc import Mapping

MASK = "***"

# scheme://user:password@host → scheme://***@host (any userinfo: a bare token before @ is a secret too).
_USERINFO = re.compile(r"(\b[a-zA-Z][a-zA-Z0-9+.-]*://)[^/@\s?#]+@")
# ?token=...&sig=... in URLs (presigned S3 URLs, tokens passed as query parameters).
_QUERY_SECRET = re.compile(
    r"([?&](?:[a-z0-9_.-]*(?:token|password|passwd|secret|signature|credential|api[_-]?key|apikey)"
    r"|sig|key|x-amz-security-token)=)[^&#\s]+", re.IGNORECASE)
# Keys whose value is a secret. A name like "secret" or "secret_keys" alone is left alone: in kfrl's
# config it names a Kubernetes secret or the variables taken from it, not a secret value.
_SECRET_KEY = re.compile(
    r"(?:.*[_.-])?(?:password|passwd|pwd|passphrase|token|api[_-]?key|apikey|access[_-]?key|secret[_-]?access[_-]?key"
    r"|secret[_-]?key|private[_-]?key|client[_-]?secret|auth[_-]?secret|credentials?)", re.IGNORECASE)
# Environment variables whose values never appear in output, wherever they turn up in a text.
SECRET_VARIABLES = ("MLFLOW_TRACKING_PASSWORD", "MLFLOW_TRACKING_TOKEN", "AWS_SECRET_ACCESS_KEY",
                    "AWS_SESSION_TOKEN", "KF_PIPELINES_TOKEN", "HF_TOKEN")
_SHORTEST_VALUE = 4  # shorter values would mask ordinary words


def without_userinfo(uri: str) -> str:
    """``scheme://user:pw@host/...`` → ``scheme://host/...``: a URI another process may be given, whose
    credentials it takes from its own environment (a secret)."""
    return _USERINFO.sub(r"\1", uri)


def is_secret_key(name: str) -> bool:
    """Whether a key (the last part of a dotted name) holds a secret value: ``password``,
    ``api_key``, ``aws_secret_access_key``, ``hf_token``...; not ``secret`` or ``secret_keys``."""
    leaf = str(name).rsplit(".", 1)[-1]
    return bool(_SECRET_KEY.fullmatch(leaf))


def redact(text: str) -> str:
    """``text`` with URI credentials, secret query parameters and the values of secret environment
    variables replaced by ``***``."""
    text = _USERINFO.sub(rf"\1{MASK}@", str(text))
    text = _QUERY_SECRET.sub(rf"\1{MASK}", text)
    for name in SECRET_VARIABLES:
        value = os.environ.get(name)
        if value and len(value) >= _SHORTEST_VALUE:
            text = text.replace(value, MASK)
    return text


def redact_tree(value, key: str = ""):
    """A copy of a nested dict/list (a config tree) with every value under a secret-named key
    replaced by ``***`` and every string redacted (``redact``)."""
    if key and is_secret_key(key) and value not in (None, "", [], {}):
        return MASK
    if isinstance(value, Mapping):
        return {k: redact_tree(v, str(k)) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(redact_tree(v) for v in value)
    if isinstance(value, str):
        return redact(value)
    return value


def is_redacted_form_of(shown: str, value: str) -> bool:
    """Whether ``shown`` (read back from a stored config) is ``value`` as redaction wrote it."""
    return MASK in str(shown) and redact_tree(value) == shown


def redact_logging() -> None:
    """Redact every log record of this process, whoever logs it and whichever handler prints it: the
    record factory merges a record's arguments into its message and redacts that (installed once, by
    the CLI and the engine)."""
    previous = logging.getLogRecordFactory()
    if getattr(previous, "kfrl_redacting", False):
        return

    def factory(*args, **kwargs) -> logging.LogRecord:
        record = previous(*args, **kwargs)
        try:
            message = record.getMessage()
        except Exception:  # noqa: BLE001 - a malformed record is logging's to report, unchanged
            return record
        cleaned = redact(message)
        if cleaned != message:
            record.msg, record.args = cleaned, None
        return record

    factory.kfrl_redacting = True
    logging.setLogRecordFactory(factory)
