"""Object store over fsspec (local folders and s3://) with one-shot commits.

A commit lives under a prefix (``kfrl.run`` says which prefix holds what in a training run)::

    {prefix}/attempt-{hex}/<files>
    {prefix}/_COMMITTED     (JSON manifest)

S3 has no atomic rename, so a writer puts every file under a fresh ``attempt-{hex}`` prefix and
then publishes one small manifest with a create-only write. Readers trust only manifests: a
crashed attempt leaves garbage nobody reads, and the first attempt to commit wins, which makes a
re-run of a committed stage a no-op.

Every remote call goes through :meth:`Store._retrying`, the single place that decides what is
transient (connection trouble, timeouts, 5xx, throttling) and how long to keep trying.

Each committed file's manifest entry holds its size and a digest, checked on every read: XXH3-128
(``xxh3_128``, ~10 GB/s on one core, so integrity costs little next to the I/O) when ``xxhash`` is
installed, else SHA-256 (``sha256``, ~1.3 GB/s). Readers verify whichever digest an entry holds, so
manifests written either way stay readable.
"""
from __future__ import annotations

import contextlib
import dataclasses
import datetime as _dt
import errno
import hashlib
import io
import json
import logging
import os
import tempfile
import threading
import time
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Callable, TypeVar

from kfrl.faults import failpoint

if TYPE_CHECKING:  # pragma: no cover
    import pyarrow

log = logging.getLogger(__name__)

T = TypeVar("T")

MANIFEST_NAME = "_COMMITTED"
DIGESTS = ("xxh3_128", "sha256")  # a manifest entry holds one of these; writers prefer the first available
DOWNLOAD_MARKER = ".kfrl-download.json"
MANIFEST_FORMAT = 1
_CHUNK = 8 * 2**20

# Local OSErrors that retrying cannot fix (full disk, read-only mount, bad path...).
_PERMANENT_ERRNOS = {
    errno.ENOENT, errno.EACCES, errno.EPERM, errno.EEXIST, errno.ENOTDIR, errno.EISDIR,
    errno.ENOSPC, errno.EROFS, errno.EINVAL, errno.ENAMETOOLONG, errno.EDQUOT,
}
# S3 error codes that mean "try again shortly" even though they are not 5xx.
_TRANSIENT_S3_CODES = {
    "SlowDown", "Throttling", "ThrottlingException", "RequestTimeout", "RequestTimeTooSkewed",
    "InternalError", "ServiceUnavailable", "ConditionalRequestConflict",
}


class StoreError(RuntimeError):
    """A store operation failed; the message names the URI involved and what to do."""


class StoreNotFoundError(StoreError):
    """The object a caller asked for does not exist."""


class CorruptManifestError(StoreError):
    """A ``_COMMITTED`` manifest cannot be parsed (``kfrl.run`` adds what to do about it in a run)."""


# ---------------------------------------------------------------------------------------------
# layout helpers


def _join(*parts: str) -> str:
    return _clean_rel("/".join(parts))


def _clean_rel(rel: str) -> str:
    """Normalise a store-relative path; refuse anything that could escape the store root."""
    if not isinstance(rel, str):
        raise StoreError(f"store paths are strings relative to the store root, got {rel!r}")
    parts = [p for p in rel.replace("\\", "/").split("/") if p not in ("", ".")]
    if ".." in parts:
        raise StoreError(f"store path {rel!r} contains '..'; use a path below the store root")
    return "/".join(parts)


def _clean_name(name: str, where: str) -> str:
    cleaned = _clean_rel(name)
    if not cleaned:
        raise StoreError(f"empty file name for {where}; give a relative name like 'part-00000.parquet'")
    return cleaned


def _now_iso() -> str:
    return _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="milliseconds")


# ---------------------------------------------------------------------------------------------
# manifest


@dataclasses.dataclass
class Manifest:
    """What one committed attempt published: the only thing readers trust."""

    prefix: str
    attempt: str
    files: list[dict]
    metrics: dict = dataclasses.field(default_factory=dict)
    info: dict = dataclasses.field(default_factory=dict)
    created_at: str = ""

    def names(self) -> list[str]:
        return [f["name"] for f in self.files]

    def file(self, name: str) -> dict | None:
        for entry in self.files:
            if entry["name"] == name:
                return entry
        return None

    def to_json(self) -> str:
        body = {"format": MANIFEST_FORMAT, **dataclasses.asdict(self)}
        return json.dumps(body, indent=1, sort_keys=True)

    @classmethod
    def from_json(cls, text: str | bytes, source: str) -> "Manifest":
        try:
            body = json.loads(text)
            return cls(
                prefix=body["prefix"],
                attempt=body["attempt"],
                files=[_checked_entry(f) for f in body["files"]],
                metrics={k: float(v) for k, v in (body.get("metrics") or {}).items()},
                info=dict(body.get("info") or {}),
                created_at=body.get("created_at", ""),
            )
        except (ValueError, KeyError, TypeError) as err:
            raise CorruptManifestError(
                f"manifest {source} is not a valid kfrl manifest ({err}); it was not written by kfrl or was "
                "edited. Restore it from a copy, or delete it so that its stage runs again."
            ) from err


class InFlightManifest(Manifest):
    """A commit this process is still writing on a background thread (``Attempt.write_in_background``):
    its prefix, attempt, metrics and info are final and readable now; reading its ``files`` waits until
    they are written and committed (and raises if that failed)."""

    def __init__(self, pending: "_InFlight", early_dir: Path | None = None, early_files: list[dict] | None = None,
                 ready_files: list[dict] | None = None, **fields):
        super().__init__(files=[], **fields)
        self._pending = pending
        # The whole file list when the files were in place before the commit was asked for (a data
        # stage's tables waiting only for the order of commits): readers need not wait for the manifest.
        self._ready_files = ready_files
        # Files the writer made readable before the commit (a checkpoint's config and tokenizer), in a
        # local folder, with their entries: what a reader may use without waiting for the rest.
        self.early_dir = early_dir
        self.early_files = early_files or []

    @property
    def files(self) -> list[dict]:
        if self._ready_files is not None:
            return self._ready_files
        return self._pending.wait().files

    @files.setter
    def files(self, value) -> None:  # the dataclass __init__ assigns it; the real list comes with the commit
        pass


class _InFlight:
    """One background commit: the thread writing the attempt's files and then its manifest."""

    def __init__(self, url: str):
        self.url = url
        self.done = threading.Event()
        self.manifest: Manifest | None = None
        self.error: BaseException | None = None
        self.then: list[Callable[[], None]] = []   # run in order after the commit, on its thread
        self.visible: InFlightManifest | None = None  # what readers in this process see meanwhile

    def wait(self) -> Manifest:
        """The committed manifest, once written. A failure is raised (to the first waiter that sees it;
        the commit then no longer exists for this process either, so a retried stage runs again)."""
        self.done.wait()
        if self.error is not None:
            with _IN_FLIGHT_LOCK:
                _IN_FLIGHT.pop(self.url, None)
            raise StoreError(f"committing {self.url} in the background failed ({type(self.error).__name__}: "
                             f"{self.error}); the stage is not committed and runs again on resume") from self.error
        return self.manifest


# Background commits of this process, oldest first, by manifest URL: readers in the process see them
# as committed (``Store.manifest``) and any commit with files waits for them first, so commits become
# durable in the order they were made.
_IN_FLIGHT: dict[str, _InFlight] = {}
_IN_FLIGHT_LOCK = threading.Lock()


def settle_in_flight() -> None:
    """Wait for every background commit of this process; raise the first failure."""
    for pending in list(_IN_FLIGHT.values()):
        pending.wait()


def raise_failed_in_flight() -> None:
    """Raise the failure of a background commit of this process that has ended in one (waiting for none)."""
    for pending in list(_IN_FLIGHT.values()):
        if pending.done.is_set() and pending.error is not None:
            pending.wait()


def wait_for_in_flight() -> None:
    """Wait until every background commit of this process so far has ended, raising nothing (a failure
    stays for the next commit to raise): for a writer whose own files must come after them."""
    for pending in list(_IN_FLIGHT.values()):
        pending.done.wait()


def after_in_flight(action: Callable[[], None]) -> None:
    """Run ``action`` now, or right after the newest background commit (on its thread, only if every
    commit before it succeeded): e.g. moving LATEST past an iteration whose weights are still written."""
    with _IN_FLIGHT_LOCK:
        newest = next(reversed(_IN_FLIGHT.values()), None)
        if newest is not None:
            newest.then.append(action)
            return
    action()


def _check_metrics(metrics: dict | None, where: str) -> dict:
    out = {}
    for key, value in (metrics or {}).items():
        try:
            out[str(key)] = float(value)
        except (TypeError, ValueError) as err:
            raise StoreError(f"metric {key!r}={value!r} for {where} is not a number") from err
    return out


def _check_info(info: dict | None, where: str) -> dict:
    info = dict(info or {})
    try:
        json.dumps(info)
    except (TypeError, ValueError) as err:
        raise StoreError(f"info for {where} must be JSON-serialisable: {err}") from err
    return info


# ---------------------------------------------------------------------------------------------
# transient-error classification


def _error_chain(err: BaseException):
    seen = set()
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        yield err
        err = err.__cause__ or err.__context__


def _s3_client_error(err: BaseException):
    """The botocore ClientError behind an error (s3fs translates them into OSErrors)."""
    for e in _error_chain(err):
        if hasattr(e, "response") and isinstance(getattr(e, "response"), dict) and "Error" in e.response:
            return e
    return None


def _is_transient(err: BaseException) -> bool:
    if isinstance(err, StoreError):
        return False
    client_error = _s3_client_error(err)
    if client_error is not None:
        status = client_error.response.get("ResponseMetadata", {}).get("HTTPStatusCode") or 0
        code = client_error.response.get("Error", {}).get("Code", "")
        return status >= 500 or code in _TRANSIENT_S3_CODES
    if isinstance(err, (FileNotFoundError, PermissionError, FileExistsError,
                        IsADirectoryError, NotADirectoryError)):
        return False
    if isinstance(err, (ConnectionError, TimeoutError)):
        return True
    if isinstance(err, OSError):
        return err.errno not in _PERMANENT_ERRNOS
    return _is_network_library_error(err)


def _is_network_library_error(err: BaseException) -> bool:
    """botocore/aiohttp/fsspec connection and timeout errors are not OSErrors."""
    try:
        from botocore.exceptions import ConnectionError as BotoConnectionError
        from botocore.exceptions import HTTPClientError
        if isinstance(err, (BotoConnectionError, HTTPClientError)):
            return True
    except ImportError:  # pragma: no cover - botocore ships with s3fs
        pass
    try:
        from fsspec.exceptions import FSTimeoutError
        if isinstance(err, FSTimeoutError):
            return True
    except ImportError:  # pragma: no cover
        pass
    try:
        import aiohttp
        if isinstance(err, (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError)):
            return True
    except ImportError:  # pragma: no cover
        pass
    return False


# ---------------------------------------------------------------------------------------------
# the store


class Store:
    """A store root: a local folder (``/abs``, ``./rel``, ``file:///abs``) or ``s3://bucket/prefix``.

    The S3 client reads endpoint and credentials from the standard AWS environment variables
    (``AWS_ENDPOINT_URL``, ``AWS_ACCESS_KEY_ID``, ...). Only the URI and options are pickled; the
    filesystem object is created lazily in each process.

    ``retries`` is the number of extra tries after the first for transient errors, waiting
    ``backoff_s``, 2x``backoff_s``, 4x``backoff_s``... (at most ``max_backoff_s``) in between; the S3
    client gives up on a connection after ``connect_timeout_s`` and on a silent response after
    ``read_timeout_s``, and such a timeout is retried like any transient error.
    """

    def __init__(self, uri: str, *, retries: int = 8, backoff_s: float = 0.5, max_backoff_s: float = 20.0,
                 connect_timeout_s: float = 5.0, read_timeout_s: float = 20.0):
        if retries < 0 or backoff_s < 0 or max_backoff_s < 0:
            raise ValueError("retries, backoff_s and max_backoff_s must be >= 0")
        if connect_timeout_s <= 0 or read_timeout_s <= 0:
            raise ValueError("connect_timeout_s and read_timeout_s must be > 0")
        self.uri = _normalise_root(uri)
        self.retries = int(retries)
        self.backoff_s = float(backoff_s)
        self.max_backoff_s = float(max_backoff_s)
        self.connect_timeout_s = float(connect_timeout_s)
        self.read_timeout_s = float(read_timeout_s)
        self._fs = None
        self._fs_pid = None

    # -- identity / pickling ----------------------------------------------------------------

    def __repr__(self) -> str:
        return f"Store({self.uri!r})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Store) and other.uri == self.uri

    def __hash__(self) -> int:
        return hash(self.uri)

    _OPTIONS = ("retries", "backoff_s", "max_backoff_s", "connect_timeout_s", "read_timeout_s")

    def options(self) -> dict:
        """The keyword arguments this store was made with (to open another root the same way)."""
        return {name: getattr(self, name) for name in self._OPTIONS}

    def __getstate__(self) -> dict:
        return {"uri": self.uri, **self.options()}

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["uri"], **{k: v for k, v in state.items() if k != "uri"})

    @property
    def is_s3(self) -> bool:
        return self.uri.startswith("s3://")

    @property
    def fs(self):
        # A filesystem made before a fork holds event loops/sockets of the parent: make a new one.
        if self._fs is None or self._fs_pid != os.getpid():
            self._fs = _make_filesystem(self.is_s3, self.connect_timeout_s, self.read_timeout_s)
            self._fs_pid = os.getpid()
        return self._fs

    # -- paths -------------------------------------------------------------------------------

    def url(self, rel: str) -> str:
        """Absolute URI of a path relative to the store root."""
        rel = _clean_rel(rel)
        if not rel:
            return self.uri
        return f"{self.uri.rstrip('/')}/{rel}"

    def _relative_to_root(self, found_path: str) -> str:
        root = self.uri[len("s3://"):] if self.is_s3 else self.uri
        found = found_path[len("s3://"):] if found_path.startswith("s3://") else found_path
        return found[len(root):].lstrip("/")

    # -- retries ----------------------------------------------------------------------------

    def _retrying(self, action: str, uri: str, fn: Callable[[], T]) -> T:
        """Run ``fn`` with bounded retries on transient errors.

        FileNotFoundError passes through untouched (callers turn it into None/False or a
        StoreNotFoundError); other permanent errors become a StoreError naming ``uri``.
        """
        attempts = self.retries + 1
        started = time.monotonic()
        for attempt in range(1, attempts + 1):
            try:
                return fn()
            except FileNotFoundError:
                raise
            except StoreError:
                raise
            except Exception as err:  # noqa: BLE001 - classified below
                if not _is_transient(err):
                    raise StoreError(f"could not {action} {uri}: {_describe(err)}. "
                                     f"{self._hint(err)}") from err
                if attempt == attempts:
                    elapsed = time.monotonic() - started
                    raise StoreError(
                        f"could not {action} {uri}: gave up after {attempts} attempts in "
                        f"{elapsed:.1f}s; last error: {_describe(err)}. {self._reachability_hint()}"
                    ) from err
                delay = min(self.backoff_s * 2 ** (attempt - 1), self.max_backoff_s)
                log.warning("transient error on %s %s (attempt %d/%d, %.1fs so far; retrying in %.1fs): %s",
                            action, uri, attempt, attempts, time.monotonic() - started, delay, _describe(err))
                time.sleep(delay)
        raise AssertionError("unreachable")  # pragma: no cover

    def _reachability_hint(self) -> str:
        if self.is_s3:
            endpoint = os.environ.get("AWS_ENDPOINT_URL") or os.environ.get("AWS_ENDPOINT_URL_S3")
            where = f"endpoint {endpoint}" if endpoint else "the default AWS endpoint (AWS_ENDPOINT_URL is unset)"
            return (f"Check that the S3 service at {where} is up and reachable from here, and that "
                    "the AWS_* credentials are right.")
        return "Check that the folder is on a working, writable disk."

    def _hint(self, err: BaseException) -> str:
        if isinstance(err, PermissionError):
            return ("Access was denied: check the AWS_* credentials and bucket policy."
                    if self.is_s3 else "Check the folder's permissions.")
        return self._reachability_hint() if self.is_s3 else ""

    # -- raw fs operations (no retries; callers wrap them) --------------------------------------

    def _raw_read(self, uri: str) -> bytes:
        return self.fs.cat_file(uri)

    def _raw_write(self, uri: str, data: bytes) -> None:
        if self.is_s3:
            self.fs.pipe_file(uri, data)
        else:
            _atomic_local_write(uri, data)

    def _raw_write_if_absent(self, uri: str, data: bytes) -> bool:
        """Create ``uri`` holding ``data`` unless it exists. True when this call created it."""
        if self.is_s3:
            return _s3_put_if_absent(self.fs, uri, data)
        return _local_put_if_absent(uri, data)

    # -- plain objects ------------------------------------------------------------------------

    def exists(self, rel: str) -> bool:
        uri = self.url(rel)
        return self._retrying("check", uri, lambda: self.fs.exists(uri))

    def read_bytes(self, rel: str) -> bytes:
        uri = self.url(rel)
        try:
            return self._retrying("read", uri, lambda: self._raw_read(uri))
        except FileNotFoundError as err:
            raise StoreNotFoundError(f"{uri} does not exist; check the store URI and the "
                                     "experiment/run names, or run the step that writes it") from err

    def write_bytes(self, rel: str, data: bytes) -> None:
        uri = self.url(rel)
        if not _clean_rel(rel):
            raise StoreError(f"cannot write to the store root {uri} itself; give a file name")
        self._retrying("write", uri, lambda: self._raw_write(uri, bytes(data)))

    def read_text(self, rel: str) -> str:
        return self.read_bytes(rel).decode("utf-8")

    def write_text(self, rel: str, text: str) -> None:
        self.write_bytes(rel, text.encode("utf-8"))

    def list(self, rel: str = "") -> list[str]:
        """Files below a prefix, recursively, as names relative to that prefix (sorted)."""
        uri = self.url(rel)

        def find() -> list[str]:
            try:
                return self.fs.find(uri)
            except FileNotFoundError:
                return []

        base = _clean_rel(rel)
        names = []
        for found in self._retrying("list", uri, find):
            rel_found = self._relative_to_root(found)
            if base and rel_found == base:
                continue  # `rel` names a file, not a prefix
            names.append(rel_found[len(base):].lstrip("/") if base else rel_found)
        return sorted(names)

    def subdirs(self, rel: str = "") -> list[str]:
        """Names of the folders directly below ``rel`` (sorted; hidden ones left out)."""
        uri = self.url(rel)

        def ls() -> list[dict]:
            try:
                return self.fs.ls(uri, detail=True)
            except (FileNotFoundError, NotADirectoryError):
                return []

        names = set()
        for entry in self._retrying("list", uri, ls):
            if entry.get("type") == "directory":
                name = entry["name"].rstrip("/").rsplit("/", 1)[-1]
                if name and not name.startswith("."):
                    names.add(name)
        return sorted(names)

    def delete(self, rel: str) -> None:
        """Remove one object (absent is fine)."""
        uri = self.url(rel)
        if not _clean_rel(rel):
            raise StoreError(f"refusing to delete the store root {uri}")

        def remove() -> None:
            try:
                self.fs.rm_file(uri)
            except FileNotFoundError:
                pass

        self._retrying("delete", uri, remove)

    def uncommit(self, prefix: str) -> None:
        """Withdraw a commit: its manifest is removed, so the next writer commits afresh (the attempt's
        files stay as garbage nobody reads). Only for repairs: readers may hold the old manifest."""
        self.delete(_join(prefix, MANIFEST_NAME))

    def remove_commit(self, prefix: str) -> None:
        """Delete a commit for good: the manifest first (no reader finds it after), then its files."""
        manifest = self.manifest(prefix)
        if manifest is None:
            return
        self.uncommit(prefix)
        for entry in manifest.files:
            self.delete(_join(prefix, manifest.attempt, entry["name"]))

    def get_file(self, rel: str, target: str | Path) -> None:
        """Copy one (uncommitted, unverified) file to a local path, streaming."""
        uri = self.url(rel)
        self._retrying("download", uri, lambda: self.fs.get_file(uri, str(target)))

    def ping(self) -> None:
        """Fail fast, with the URI in the message, when the store cannot be reached."""
        if self.is_s3:
            bucket = self.uri[len("s3://"):].split("/", 1)[0]
            try:
                self._retrying("reach bucket", self.uri,
                               lambda: self.fs.call_s3("head_bucket", Bucket=bucket))
            except FileNotFoundError as err:
                raise StoreNotFoundError(
                    f"bucket {bucket!r} of store {self.uri} does not exist; create it "
                    f"(e.g. `aws s3 mb s3://{bucket}`) or fix the store URI") from err
        else:
            def make_root() -> None:
                os.makedirs(self.uri, exist_ok=True)
                if not os.access(self.uri, os.W_OK):
                    raise PermissionError(errno.EACCES, "not writable", self.uri)
            self._retrying("create", self.uri, make_root)

    # -- commits --------------------------------------------------------------------------------

    def open_attempt(self, prefix: str) -> "Attempt":
        prefix = _clean_rel(prefix)
        if not prefix:
            raise StoreError(f"cannot commit the store root {self.uri}; give a prefix like 'exp/run/data'")
        return Attempt(self, prefix, f"attempt-{uuid.uuid4().hex}")

    def manifest_url(self, prefix: str) -> str:
        return self.url(_join(prefix, MANIFEST_NAME))

    def manifest(self, prefix: str) -> Manifest | None:
        uri = self.manifest_url(prefix)
        pending = _IN_FLIGHT.get(uri)
        if pending is not None:
            return pending.visible
        try:
            raw = self._retrying("read manifest", uri, lambda: self._raw_read(uri))
        except FileNotFoundError:
            return None
        return Manifest.from_json(raw, uri)

    def is_committed(self, prefix: str) -> bool:
        uri = self.manifest_url(prefix)
        if uri in _IN_FLIGHT:
            return True
        return self._retrying("check", uri, lambda: self.fs.exists(uri))

    def file_url(self, manifest: Manifest, name: str) -> str:
        if manifest.file(name) is None:
            raise StoreNotFoundError(
                f"{name!r} is not among the committed files of {self.url(manifest.prefix)} "
                f"(attempt {manifest.attempt}); it has: {', '.join(manifest.names()) or 'no files'}")
        return self.url(f"{manifest.prefix}/{manifest.attempt}/{name}")

    def read_file(self, manifest: Manifest, name: str) -> bytes:
        """A committed file's bytes, checked against the manifest's size and digest."""
        uri = self.file_url(manifest, name)
        entry = manifest.file(name)
        try:
            data = self._retrying("read", uri, lambda: self._raw_read(uri))
        except FileNotFoundError as err:
            raise StoreNotFoundError(_missing_committed_file(uri, self.manifest_url(manifest.prefix))) from err
        _verify(uri, entry, len(data), _digest_of(entry, data), self.manifest_url(manifest.prefix))
        return data

    def download(self, manifest: Manifest, local_dir: str | Path, *, names: list[str] | None = None) -> Path:
        """Copy the committed files (``names``: only these; verified) into ``local_dir``; reuse a
        complete earlier copy."""
        local_dir = Path(local_dir)
        marker = local_dir / DOWNLOAD_MARKER
        source = self.url(manifest.prefix)
        entries = _entries(manifest, names)
        if _is_complete_copy(local_dir, marker, manifest, source, entries):
            return local_dir
        local_dir.mkdir(parents=True, exist_ok=True)
        marker.unlink(missing_ok=True)  # a half-updated folder must not look complete
        for entry in entries:
            path = local_dir / entry["name"]
            if not (path.is_file() and path.stat().st_size == entry["size"]):
                self._download_file(manifest, entry, path)
        marker.write_text(json.dumps({"source": source, "attempt": manifest.attempt}))
        return local_dir

    def committed_dir(self, manifest: Manifest, *, names: list[str] | None = None) -> Path:
        """A local store's committed attempt folder, used in place (no copy), after checking the files
        (``names``: only these) against the manifest once per process."""
        if self.is_s3:
            raise StoreError(f"{self.uri} is not a local folder; use download()")
        folder = Path(self.url(f"{manifest.prefix}/{manifest.attempt}"))
        for entry in _entries(manifest, names):
            path = folder / entry["name"]
            key = (str(path), entry_digest(entry))
            if key in _VERIFIED_IN_PLACE:
                continue
            if not path.is_file():
                raise StoreNotFoundError(_missing_committed_file(str(path), self.manifest_url(manifest.prefix)))
            size, digest = _hash_local_file(path, _algorithm(entry))
            _verify(str(path), entry, size, digest, self.manifest_url(manifest.prefix))
            _VERIFIED_IN_PLACE.add(key)
        return folder

    def _download_file(self, manifest: Manifest, entry: dict, target: Path) -> None:
        uri = self.file_url(manifest, entry["name"])
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = target.with_name(f".{target.name}.part-{uuid.uuid4().hex[:8]}")

        def copy() -> tuple[int, str]:
            digest, size = _new_hasher(_algorithm(entry)), 0
            with self.fs.open(uri, "rb") as src, open(tmp, "wb") as dst:
                while chunk := src.read(_CHUNK):
                    digest.update(chunk)
                    size += len(chunk)
                    dst.write(chunk)
            return size, digest.hexdigest()

        try:
            size, digest = self._retrying("download", uri, copy)
            _verify(uri, entry, size, digest, self.manifest_url(manifest.prefix))
            os.replace(tmp, target)
        except FileNotFoundError as err:
            raise StoreNotFoundError(_missing_committed_file(uri, self.manifest_url(manifest.prefix))) from err
        finally:
            tmp.unlink(missing_ok=True)


def dictionary_columns(schema: "pyarrow.Schema") -> list[str]:
    """The columns a Parquet batch dictionary-encodes: strings, whose values repeat (a prompt group's uid,
    a data source). Token ids and per-token floats gain nothing from a dictionary (150k distinct ids
    overflow it, and the writer falls back to plain pages after hashing every value): a rollout batch of
    256 rows x 389 tokens wrote in 9.2 ms with dictionaries on every column and in 1.9 ms with them on
    its strings only, and came out smaller (0.93 against 0.68 MB); with Zipf-distributed ids, 7.2 against
    3.0 ms (0.62 against 0.51 MB). Measured on a 2-core CPU."""
    import pyarrow as pa

    return [field.name for field in schema
            if pa.types.is_string(field.type) or pa.types.is_large_string(field.type)]


class Attempt:
    """One writer's private prefix; nothing in it is visible to readers until :meth:`commit`."""

    def __init__(self, store: Store, prefix: str, attempt: str):
        self.store = store
        self.prefix = prefix
        self.attempt = attempt
        self.url = store.url(f"{prefix}/{attempt}")
        self._files: dict[str, dict] = {}
        self._manifest: Manifest | None = None
        # Facts the writer wants in the manifest (merged with commit's ``info``), e.g. a data cursor.
        self.info: dict = {}
        self._background: Callable[[Path], None] | None = None  # write_in_background's writer
        self._early_dir: Path | None = None
        self._in_flight: InFlightManifest | None = None

    def __repr__(self) -> str:
        return f"Attempt({self.url!r})"

    def _target(self, name: str) -> tuple[str, str]:
        if self._manifest is not None:
            raise StoreError(f"attempt {self.url} is already committed and must not change; "
                             "open a new attempt to write more")
        name = _clean_name(name, self.url)
        return name, self.store.url(f"{self.prefix}/{self.attempt}/{name}")

    def _record(self, name: str, size: int, digest: str) -> None:
        self._files[name] = {"name": name, "size": size, WRITE_DIGEST: digest}

    def write_bytes(self, name: str, data: bytes) -> None:
        name, uri = self._target(name)
        data = bytes(data)
        self.store._retrying("write", uri, lambda: self.store._raw_write(uri, data))
        self._record(name, len(data), _new_hasher(WRITE_DIGEST, data).hexdigest())

    def write_text(self, name: str, text: str) -> None:
        self.write_bytes(name, text.encode("utf-8"))

    def write_parquet(self, name: str, table: "pyarrow.Table") -> None:
        import pyarrow.parquet as pq

        buffer = io.BytesIO()
        pq.write_table(table, buffer, use_dictionary=dictionary_columns(table.schema))
        self.write_bytes(name, buffer.getvalue())

    def upload_file(self, name: str, local_path: str | Path) -> None:
        name, uri = self._target(name)
        local_path = Path(local_path)
        if not local_path.is_file():
            raise StoreError(f"cannot upload {local_path} to {uri}: it is not a file")
        size, digest = _hash_local_file(local_path, WRITE_DIGEST)
        self.store._retrying("upload", uri, lambda: self.store.fs.put_file(str(local_path), uri))
        self._record(name, size, digest)
        failpoint("upload")

    @contextlib.contextmanager
    def staged_dir(self):
        """A folder whose files become the attempt's when the block ends: on a local store the attempt's
        own folder (written in place, no copy), on S3 a temporary folder uploaded at the end."""
        if self.store.is_s3:
            with tempfile.TemporaryDirectory(prefix="kfrl-stage-") as tmp:
                yield Path(tmp)
                self.upload_dir(tmp)
            return
        if self._manifest is not None:
            raise StoreError(f"attempt {self.url} is already committed and must not change")
        folder = Path(self.url)
        folder.mkdir(parents=True, exist_ok=True)
        yield folder
        for path in sorted(p for p in folder.rglob("*") if p.is_file()):
            size, digest = _hash_local_file(path, WRITE_DIGEST)
            self._record(path.relative_to(folder).as_posix(), size, digest)
        failpoint("upload")

    def upload_dir(self, local_dir: str | Path) -> None:
        local_dir = Path(local_dir)
        if not local_dir.is_dir():
            raise StoreError(f"cannot upload {local_dir} to {self.url}: it is not a folder")
        for path in sorted(p for p in local_dir.rglob("*") if p.is_file()):
            self.upload_file(path.relative_to(local_dir).as_posix(), path)

    def write_in_background(self, write: Callable[[Path], None], *, early_dir: Path | None = None) -> None:
        """Have ``commit`` return at once and do the rest on a thread: ``write(folder)`` fills a
        ``staged_dir`` with the attempt's files, then the manifest is committed. Until then this process
        sees the commit as an ``InFlightManifest`` (reading its files waits), and every later commit with
        files waits for it. Only for a process that lives on past the stage (the resident engine, the
        inline runner), which settles (``settle_in_flight``) before it ends. ``early_dir``: a local folder
        of small files (``write`` writes them too) that readers may use before the commit."""
        self._background = write
        self._early_dir = early_dir

    def commit(self, *, metrics: dict | None = None, info: dict | None = None) -> Manifest:
        """Publish this attempt; if another attempt committed first, return its manifest instead."""
        if self._manifest is not None:
            return self._manifest
        if self._in_flight is not None:
            return self._in_flight
        if self._background is not None:
            # The kill point where the commit is asked for, on the stage's thread (as for a commit made
            # there): its place among the process's commits does not depend on the writer thread.
            failpoint("commit")
            return self._commit_in_background(metrics, info)
        if self._files and _IN_FLIGHT:
            raise_failed_in_flight()  # an earlier commit that failed already stops this one here
            # Commits become durable in the order they were made, but this attempt's files are in place
            # already: only its manifest has to wait for the earlier commits (an update's weights still
            # being written), so it is published by a thread and this process reads the files at once.
            # Background commits exist only in a process that settles before it ends.
            failpoint("commit")
            return self._commit_in_background(metrics, info, files_ready=True)
        return self._publish(metrics, info)

    def _commit_in_background(self, metrics: dict | None, info: dict | None, files_ready: bool = False) -> Manifest:
        write, self._background = self._background, None
        url = self.store.manifest_url(self.prefix)
        pending = _InFlight(url)
        early = self._early_dir
        early_files = [{"name": p.relative_to(early).as_posix(), "size": size, WRITE_DIGEST: digest}
                       for p in sorted(early.rglob("*")) if p.is_file()
                       for size, digest in [_hash_local_file(p, WRITE_DIGEST)]] if early is not None else []
        ready = sorted(self._files.values(), key=lambda f: f["name"]) if files_ready else None
        pending.visible = InFlightManifest(pending, early_dir=early, early_files=early_files, ready_files=ready,
                                           prefix=self.prefix, attempt=self.attempt,
                                           metrics=_check_metrics(metrics, url),
                                           info=_check_info({**self.info, **(info or {})}, url), created_at=_now_iso())
        with _IN_FLIGHT_LOCK:
            earlier = list(_IN_FLIGHT.values())
            _IN_FLIGHT[url] = pending

        def run() -> None:
            try:
                for before in earlier:
                    before.wait()
                if write is not None:
                    with self.staged_dir() as folder:
                        write(folder)
                pending.manifest = self._publish(metrics, info, kill_point=False)
                while True:  # actions queued by after_in_flight, until none is left as this commit leaves
                    with _IN_FLIGHT_LOCK:
                        actions, pending.then = pending.then, []
                        if not actions:
                            _IN_FLIGHT.pop(url, None)
                            break
                    for action in actions:
                        action()
            except BaseException as err:  # noqa: BLE001 - kept, and raised to whoever waits on this commit
                pending.error = err
            finally:
                pending.done.set()

        self._in_flight = pending.visible
        threading.Thread(target=run, name=f"kfrl-commit-{self.prefix}", daemon=True).start()
        return pending.visible

    def _publish(self, metrics: dict | None, info: dict | None, kill_point: bool = True) -> Manifest:
        store = self.store
        uri = store.manifest_url(self.prefix)
        mine = Manifest(
            prefix=self.prefix,
            attempt=self.attempt,
            files=sorted(self._files.values(), key=lambda f: f["name"]),
            metrics=_check_metrics(metrics, uri),
            info=_check_info({**self.info, **(info or {})}, uri),
            created_at=_now_iso(),
        )
        body = mine.to_json().encode("utf-8")
        if kill_point:
            failpoint("commit")
        created = store._retrying("commit", uri, lambda: store._raw_write_if_absent(uri, body))
        if created:
            self._manifest = mine
            return mine
        winner = store.manifest(self.prefix)
        if winner is None:  # the manifest vanished between our write and read: someone deleted it
            raise StoreError(f"{uri} existed when committing {self.attempt} but is gone now; "
                             "something is deleting manifests. Re-run the stage.")
        log.info("%s was already committed by %s; %s is left as garbage", uri, winner.attempt, self.attempt)
        self._manifest = winner
        return winner


# ---------------------------------------------------------------------------------------------
# helpers


def _normalise_root(uri: str) -> str:
    if not isinstance(uri, (str, os.PathLike)):
        raise StoreError(f"store URI must be a string, got {uri!r}")
    uri = os.fspath(uri).strip()
    if not uri:
        raise StoreError("store URI is empty; give a folder path or s3://bucket/prefix")
    if uri.startswith("s3://"):
        bucket_and_prefix = _clean_rel(uri[len("s3://"):])
        if not bucket_and_prefix:
            raise StoreError(f"store URI {uri!r} names no bucket; use s3://bucket[/prefix]")
        return f"s3://{bucket_and_prefix}"
    if uri.startswith("file://"):
        uri = uri[len("file://"):]
    elif "://" in uri:
        raise StoreError(f"store URI {uri!r} has an unsupported scheme; use a local folder, "
                         "file:///abs/path or s3://bucket/prefix")
    return os.path.abspath(os.path.expanduser(uri))


def _make_filesystem(is_s3: bool, connect_timeout_s: float, read_timeout_s: float):
    if is_s3:
        import s3fs

        # Retries live in Store._retrying only: without this, botocore and s3fs would each retry
        # too and an unreachable endpoint would take minutes to report.
        fs = s3fs.S3FileSystem(
            skip_instance_cache=True,
            use_listings_cache=False,
            config_kwargs={"retries": {"total_max_attempts": 1, "mode": "standard"},
                           "connect_timeout": connect_timeout_s, "read_timeout": read_timeout_s},
        )
        fs.retries = 1
        return fs
    import fsspec

    return fsspec.filesystem("file", auto_mkdir=True, skip_instance_cache=True)


def _write_temp_beside(path: str, data: bytes) -> str:
    """``data`` fully written (and synced) to a fresh temp file next to ``path``; returns its path."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = f"{path}.tmp-{uuid.uuid4().hex[:8]}"
    with open(tmp, "wb") as fh:
        fh.write(data)
        fh.flush()
        os.fsync(fh.fileno())
    return tmp


def _atomic_local_write(path: str, data: bytes) -> None:
    tmp = _write_temp_beside(path, data)
    try:
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _local_put_if_absent(path: str, data: bytes) -> bool:
    # Hard-link a complete temp file into place: the link fails if the target exists, and
    # readers never see a half-written manifest.
    tmp = _write_temp_beside(path, data)
    try:
        try:
            os.link(tmp, path)
        except FileExistsError:
            return False
        return True
    finally:
        os.unlink(tmp)


def _s3_put_if_absent(fs, uri: str, data: bytes) -> bool:
    bucket, key = uri[len("s3://"):].split("/", 1)
    try:
        fs.call_s3("put_object", Bucket=bucket, Key=key, Body=data, IfNoneMatch="*")
        return True
    except FileExistsError:
        return False
    except OSError as err:
        client_error = _s3_client_error(err)
        if client_error is not None and (
            client_error.response.get("Error", {}).get("Code") == "PreconditionFailed"
            or client_error.response.get("ResponseMetadata", {}).get("HTTPStatusCode") == 412
        ):
            return False
        raise


def _pick_write_digest() -> str:
    import importlib.util

    return "xxh3_128" if importlib.util.find_spec("xxhash") is not None else "sha256"


WRITE_DIGEST = _pick_write_digest()


def _new_hasher(algorithm: str, data: bytes = b""):
    if algorithm == "xxh3_128":
        try:
            import xxhash
        except ImportError:
            raise StoreError("a file was committed with an XXH3 digest; install xxhash (pip install xxhash) "
                             "to read it") from None
        return xxhash.xxh3_128(data)
    return hashlib.sha256(data)


def _algorithm(entry: dict) -> str:
    return next(name for name in DIGESTS if name in entry)


def entry_digest(entry: dict) -> str:
    """The digest a manifest entry holds (``xxh3_128`` or ``sha256``), prefixed with its algorithm."""
    algorithm = _algorithm(entry)
    return f"{algorithm}:{entry[algorithm]}"


def digest_matches(entry: dict, data: bytes) -> bool:
    """Whether ``data`` is the file a manifest entry describes (size and digest)."""
    return len(data) == entry["size"] and _digest_of(entry, data) == entry[_algorithm(entry)]


def _digest_of(entry: dict, data: bytes) -> str:
    return _new_hasher(_algorithm(entry), data).hexdigest()


def _checked_entry(entry: dict) -> dict:
    out = {"name": entry["name"], "size": int(entry["size"])}
    for algorithm in DIGESTS:
        if algorithm in entry:
            out[algorithm] = str(entry[algorithm])
            return out
    raise KeyError(f"a digest ({' or '.join(DIGESTS)}) for {entry['name']!r}")


def _hash_local_file(path: Path, algorithm: str) -> tuple[int, str]:
    digest, size = _new_hasher(algorithm), 0
    with open(path, "rb") as fh:
        while chunk := fh.read(_CHUNK):
            digest.update(chunk)
            size += len(chunk)
    return size, digest.hexdigest()


def _verify(uri: str, entry: dict, size: int, digest: str, manifest_uri: str) -> None:
    algorithm = _algorithm(entry)
    if size != entry["size"]:
        raise StoreError(f"{uri} is {size} bytes but its manifest {manifest_uri} says {entry['size']}; "
                         "the committed file was changed or truncated. Delete the manifest and re-run "
                         "the stage that wrote it.")
    if digest != entry[algorithm]:
        raise StoreError(f"{uri} has {algorithm} {digest[:12]}... but its manifest {manifest_uri} says "
                         f"{entry[algorithm][:12]}...; the committed file was changed. Delete the "
                         "manifest and re-run the stage that wrote it.")


def _missing_committed_file(uri: str, manifest_uri: str) -> str:
    return (f"{uri} is listed in {manifest_uri} but does not exist; the store was modified after "
            "the commit. Delete the manifest and re-run the stage that wrote it.")


_VERIFIED_IN_PLACE: set[tuple[str, str]] = set()


def _entries(manifest: Manifest, names: list[str] | None) -> list[dict]:
    if names is None:
        return list(manifest.files)
    unknown = sorted(set(names) - set(manifest.names()))
    if unknown:
        raise StoreNotFoundError(f"{unknown} not among the committed files of {manifest.prefix} "
                                 f"(attempt {manifest.attempt}); it has: {', '.join(manifest.names())}")
    return [f for f in manifest.files if f["name"] in set(names)]


def _is_complete_copy(local_dir: Path, marker: Path, manifest: Manifest, source: str, entries: list[dict]) -> bool:
    try:
        recorded = json.loads(marker.read_text())
    except (OSError, ValueError):
        return False
    if recorded.get("attempt") != manifest.attempt or recorded.get("source") != source:
        return False
    # Sizes are cheap to check and catch deleted or truncated local files.
    for entry in entries:
        path = local_dir / entry["name"]
        if not path.is_file() or path.stat().st_size != entry["size"]:
            return False
    return True


def _describe(err: BaseException) -> str:
    text = str(err).strip().rstrip(".") or type(err).__name__  # callers end the sentence
    return f"{type(err).__name__}: {text}"


__all__ = ["Attempt", "CorruptManifestError", "Manifest", "Store", "StoreError", "StoreNotFoundError",
           "MANIFEST_NAME"]
