"""Checkpoints on an object store: ``[checkpoint] dir = "s3://bucket/prefix"`` (or ``gs://``),
through fsspec (s3fs, gcsfs) and torch.distributed.checkpoint's fsspec writer and reader.

A step is the objects under ``<prefix>/step_<N>/``; ``<prefix>/latest`` names the newest. An
object store has no links, no directories and no rename: a "directory" is the objects sharing a
prefix, so a step holding anything below its own files (a key with a further ``/``) is refused
like a directory holding a subdirectory, and moving a cut save aside copies its objects, then
removes them. Each small file is one PUT, which the store makes visible whole or not at all; the
trainer state is written after every other object of the step, so a step without it is a save
that was cut short, never the newest checkpoint. Everything read is checked as a local
checkpoint is: sizes before reading (a ranged read never takes more than the limit), JSON and
DCP metadata through the same checks, data files named only by plain names inside the step.

Credentials and the endpoint come from the environment (``AWS_ACCESS_KEY_ID``,
``AWS_SECRET_ACCESS_KEY``, ``AWS_ENDPOINT_URL``, ``AWS_PROFILE``, ``GOOGLE_APPLICATION_CREDENTIALS``,
...) or the storage library's own files (``~/.aws/credentials``), never from Forge's config: the
URL holds a bucket and a prefix only (checked when the config is read). Listings are not cached:
another process (another rank, a second run) may have written since.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader, FsspecWriter

from forge_lm.checkpoint._safe import DamagedCheckpointError, _SafeMetadata
from forge_lm.errors import ConfigError

_OPTIONS = {"use_listings_cache": False}  # every filesystem instance alike (fsspec caches them by options)
_PACKAGES = {"s3": "s3fs (pip install 'forge-lm[s3]')", "gs": "gcsfs (pip install gcsfs)", "gcs": "gcsfs"}
_KINDS = {"file": "file", "directory": "dir"}  # fsspec's entry types, as the stores name kinds
ATTEMPTS = 3  # a failed upload of a step is tried this many times in all


class ObjectUrl:
    """A place on an object store (``s3://bucket/prefix/step_5``), with what callers use of a
    :class:`pathlib.Path`: ``name``, ``parent``, ``/``, ``with_name``. It is deliberately not
    path-like (no ``__fspath__``): nothing opens it as a local file by mistake."""

    def __init__(self, url: str) -> None:
        self.url = url.rstrip("/")

    @property
    def name(self) -> str:
        return self.url.rpartition("/")[2]

    @property
    def parent(self) -> ObjectUrl:
        return ObjectUrl(self.url.rpartition("/")[0])

    def __truediv__(self, name: str) -> ObjectUrl:
        return ObjectUrl(f"{self.url}/{name}")

    def with_name(self, name: str) -> ObjectUrl:
        return self.parent / name

    def __str__(self) -> str:
        return self.url

    def __repr__(self) -> str:
        return f"ObjectUrl({self.url!r})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, ObjectUrl) and other.url == self.url

    def __hash__(self) -> int:
        return hash(self.url)


def filesystem(url: str) -> tuple[Any, str]:
    """``(fsspec filesystem, bucket/prefix)`` for ``url``; a ConfigError naming the package to
    install when the scheme's library is missing."""
    import fsspec

    scheme = url.partition("://")[0]
    try:
        fsspec.get_filesystem_class(scheme)
    except (ImportError, ValueError):
        raise ConfigError(
            f"[checkpoint] dir = '{url}' needs {_PACKAGES.get(scheme, 'an fsspec filesystem for ' + scheme)}, "
            "which is not installed. Install it, or leave [checkpoint] dir unset to keep checkpoints in the run "
            "directory."
        ) from None
    return fsspec.core.url_to_fs(url, **_OPTIONS)


def _failures() -> tuple[type[BaseException], ...]:
    """What an object store's operations raise when they fail: OSError (the libraries translate
    most errors to it) and botocore's own errors (no credentials, no connection)."""
    try:
        from botocore.exceptions import BotoCoreError
    except ImportError:
        return (OSError,)
    return (OSError, BotoCoreError)


class ObjectFiles:
    """The objects under one prefix (:class:`forge_lm.checkpoint._safe.StepFiles`)."""

    def __init__(self, fs: Any, prefix: str) -> None:
        self.fs, self.prefix = fs, prefix

    def _key(self, name: str) -> str:
        return f"{self.prefix}/{name}"

    def kind(self, name: str) -> str | None:
        try:
            info = self.fs.info(self._key(name))
        except FileNotFoundError:
            return None
        return _KINDS.get(info.get("type"), "other")

    def size(self, name: str) -> int:
        return int(self.fs.info(self._key(name))["size"])

    def read(self, name: str, limit: int) -> bytes:
        data = self.fs.cat_file(self._key(name), start=0, end=limit + 1)
        if len(data) > limit:
            raise DamagedCheckpointError(f"{name} is larger than {limit} bytes")
        return data

    def entries(self) -> list[tuple[str, str | None]]:
        try:
            listed = self.fs.ls(self.prefix, detail=True)
        except FileNotFoundError:
            return []
        return [(_basename(entry["name"]), _KINDS.get(entry.get("type"), "other")) for entry in listed]

    def write_text(self, name: str, text: str) -> None:
        self.fs.pipe_file(self._key(name), text.encode("utf-8"))  # one PUT: visible whole or not at all


class SafeFsspecReader(_SafeMetadata, FsspecReader):
    """torch's fsspec reader, taking its metadata from :func:`forge_lm.checkpoint._safe.read_metadata`."""

    def __init__(self, url: str, files: ObjectFiles) -> None:
        super().__init__(url, **_OPTIONS)
        self.files = files


class ObjectStore:
    """A run's checkpoints under ``url`` (``s3://bucket/prefix``), one prefix per step."""

    remote = True
    attempts = ATTEMPTS
    fix_for_failed_write = (
        "check that the bucket is reachable and that the credentials in the environment may write to it"
    )

    def __init__(self, url: str) -> None:
        self.url = url.rstrip("/")
        self.fs, self.prefix = filesystem(self.url)
        self.root = ObjectUrl(self.url)
        self.top = ObjectFiles(self.fs, self.prefix)
        self.failures = _failures()

    def location(self, name: str) -> ObjectUrl:
        return self.root / name

    def name_of(self, location: Any) -> str | None:
        return location.name if isinstance(location, ObjectUrl) and location.parent == self.root else None

    def check_root(self) -> None:
        pass  # no links on an object store

    def names(self) -> list[str]:
        return [name for name, _ in self.top.entries()]

    def is_step_dir(self, name: str) -> bool:
        return self.top.kind(name) == "dir"

    def files(self, name: str) -> ObjectFiles:
        return ObjectFiles(self.fs, f"{self.prefix}/{name}")

    def check_step(self, name: str) -> None:
        if not self.is_step_dir(name):
            raise DamagedCheckpointError("not a directory; checkpoints are prefixes holding plain objects")
        odd = [entry for entry, kind in self.files(name).entries() if kind != "file"]
        if odd:
            raise DamagedCheckpointError(f"holds {odd[0]!r}, which is not a plain object of the checkpoint")

    def remove(self, name: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            keys = self.fs.find(f"{self.prefix}/{name}")  # every object under the step, or the one object
            if keys:
                self.fs.rm(keys)

    def rename(self, name: str, new_name: str) -> None:
        """Copy every object of ``name`` under ``new_name``, then remove the originals."""
        source, target = f"{self.prefix}/{name}", f"{self.prefix}/{new_name}"
        for key in self.fs.find(source):
            self.fs.copy(key, target + key[len(source) :])
        self.remove(name)

    def save(self, tensors: dict[str, Any], name: str, **options: Any) -> None:
        url = str(self.location(name))
        # No fsync: an upload is durable once it returns, and the writer's fallback (os.sync)
        # would flush every disk of the machine at every file.
        writer = FsspecWriter(url, sync_files=False, **_OPTIONS)
        dcp.save(tensors, checkpoint_id=url, storage_writer=writer, **options)

    def reader(self, name: str) -> SafeFsspecReader:
        return SafeFsspecReader(str(self.location(name)), self.files(name))

    def bytes_of(self, name: str) -> int:
        try:
            return sum(int(info.get("size", 0)) for info in self.fs.find(f"{self.prefix}/{name}", detail=True).values())
        except self.failures:
            return 0

    def free_space(self) -> str:
        return ""  # an object store has no free space to report

    def retry_wait(self, attempt: int) -> float:
        return float(2 ** (attempt - 1))  # 1 s, then 2 s: a store that is briefly unavailable

    def check_reachable(self) -> None:
        """Raise a ConfigError naming ``[checkpoint] dir`` and the fix unless the bucket can be
        listed with the credentials the environment gives: before training, with nothing written."""
        bucket = self.prefix.partition("/")[0]
        try:
            self.fs.ls(bucket)
        except FileNotFoundError:
            raise ConfigError(
                f"[checkpoint] dir = '{self.url}': the bucket '{bucket}' does not exist. Create it, or set "
                "[checkpoint] dir to a bucket that exists."
            ) from None
        except PermissionError as exc:
            raise ConfigError(
                f"[checkpoint] dir = '{self.url}': access to the bucket '{bucket}' was refused ({_one_line(exc)}). "
                "Give the credentials in the environment (AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY, AWS_PROFILE, "
                "~/.aws/credentials) access to it."
            ) from None
        except self.failures as exc:
            raise ConfigError(f"[checkpoint] dir = '{self.url}': {_unreachable(exc)}") from None


def _basename(key: str) -> str:
    return key.rstrip("/").rpartition("/")[2]


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split()) or type(exc).__name__


def _unreachable(exc: BaseException) -> str:
    """What a failed listing says, and the fix (the message names no credential: botocore's
    errors carry none, and only the exception's kind and text are shown)."""
    kind = type(exc).__name__
    if kind in ("NoCredentialsError", "PartialCredentialsError", "CredentialRetrievalError"):
        return (
            "no credentials for the object store were found. Set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (or "
            "AWS_PROFILE, or ~/.aws/credentials) in the environment; Forge's config never holds them."
        )
    if kind in ("EndpointConnectionError", "ConnectTimeoutError", "ReadTimeoutError") or isinstance(
        exc, ConnectionError | TimeoutError
    ):
        return (
            f"the object store cannot be reached ({_one_line(exc)}). Check AWS_ENDPOINT_URL (or the storage "
            "library's config) and the network."
        )
    return f"the object store cannot be listed ({kind}: {_one_line(exc)}). Check the bucket and the credentials."
