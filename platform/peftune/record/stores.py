"""Where a sweep's record and Tune's state live: the tracking URI and the storage path, resolved and checked before
anything starts (a URI MLflow or pyarrow cannot open is refused in one line, naming it)."""

from __future__ import annotations

import os
from pathlib import Path
from urllib.parse import urlparse

from peftune.base.errors import UserError, one_line

DEFAULT_TRACKING_URI = "sqlite:///mlflow.db"
DEFAULT_STORAGE_PATH = "ray_results"  # where Ray Tune keeps a sweep's state and checkpoints, by default


def storage_uri(storage_path: str | Path) -> str:
    """``--storage-path`` as Ray Tune and the lease name it: an object-store URI as it is, a local path absolute."""
    text = str(storage_path)
    return text if "://" in text else str(Path(text).expanduser().resolve())


# schemes pyarrow opens only by reaching a service (a bucket's region, a JVM for HDFS): not opened here, where
# an offline check of the flag must not wait on the network; Ray reports their errors when it uses them
REMOTE_SCHEMES = ("s3", "gs", "gcs", "hdfs", "viewfs", "abfs", "abfss", "hf")


def check_storage_uri(storage: str) -> None:
    """Refuse a storage URI that pyarrow, which Ray Tune stores through, cannot open (``garbage://x``), before
    the data is read, the lease, Ray or the record: Tune would fail with pyarrow's traceback once the sweep had
    started. pyarrow is imported only for a URI (seconds of imports a directory does not wait for)."""
    if "://" not in storage:
        return  # a directory
    scheme = urlparse(storage).scheme.lower()
    if scheme in REMOTE_SCHEMES or scheme.startswith("fsspec+"):
        return
    import pyarrow
    import pyarrow.fs

    try:
        pyarrow.fs.FileSystem.from_uri(storage)  # file://, mock:// and an unknown scheme: answered locally
    except (pyarrow.ArrowException, ValueError, OSError) as error:
        raise UserError(
            f"--storage-path {storage[:200]}: pyarrow (Ray Tune's storage) cannot open it ({one_line(error, 200)}); "
            f"expected a directory, file:///absolute/path, or s3://, gs://, abfs://, hdfs:// ..."
        ) from None


def sqlite_path(uri: str) -> Path | None:
    if not uri.startswith("sqlite:///"):
        return None
    return Path(uri[len("sqlite:///") :])


def resolve_tracking_uri(uri: str | None = None) -> str:
    """The argument, else ``MLFLOW_TRACKING_URI``, else ``sqlite:///mlflow.db``; a relative SQLite path made absolute.

    The writer and the reader resolve alike, so ``peftune report`` finds what ``peftune sweep``
    wrote when both run in the same directory with the same environment.
    """
    uri = uri or os.environ.get("MLFLOW_TRACKING_URI") or DEFAULT_TRACKING_URI
    path = sqlite_path(uri)
    if path is not None and not path.is_absolute():
        uri = "sqlite:///" + str(Path.cwd() / path)
    return uri


# the store schemes MLflow's tracking client takes ("" and file: a local directory of mlruns)
TRACKING_SCHEMES = ("", "file", "sqlite", "postgresql", "mysql", "mssql", "http", "https", "databricks")


def check_tracking_uri(uri: str) -> str:
    """Refuse a URI MLflow cannot open (``garbage://x``) before anything starts."""
    scheme = urlparse(uri).scheme.split("+")[0]  # postgresql+psycopg://...
    if scheme not in TRACKING_SCHEMES:
        raise UserError(
            f"tracking URI {uri[:80]!r}: unsupported scheme {scheme[:20]!r}; expected one of "
            f"sqlite:///path, file:///path, http(s)://host, postgresql://..., mysql://..."
        )
    return check_sqlite_file(uri)


SQLITE_HEADER = b"SQLite format 3\x00"  # the first 16 bytes of every SQLite database file


def check_sqlite_file(uri: str) -> str:
    """Refuse a ``sqlite:///`` URI naming an existing file that is not a SQLite database (a CSV, notes, an
    empty file): MLflow would write its tables into it, or fail deep in SQLAlchemy."""
    path = sqlite_path(uri)
    if path is not None and path.is_file():
        with open(path, "rb") as file:
            if file.read(len(SQLITE_HEADER)) != SQLITE_HEADER:
                raise UserError(
                    f"tracking URI {uri[:200]}: {path} is an existing file but not a SQLite database; "
                    "expected an MLflow SQLite store or a path that does not exist yet"
                )
    return uri


def existing_store_uri(uri: str | None = None) -> str:
    """:func:`resolve_tracking_uri` for commands that only read: a local store must already exist.

    MLflow creates a missing SQLite database (and its directory) on first use, so a mistyped path
    would otherwise be read as an empty store, and leave a stray file behind.
    """
    uri = check_tracking_uri(resolve_tracking_uri(uri))
    path = sqlite_path(uri)
    if path is None and urlparse(uri).scheme in ("", "file"):
        path = Path(urlparse(uri).path if "://" in uri else uri)
    if path is not None and not path.exists():
        raise FileNotFoundError(f"tracking store {uri[:200]} does not exist; check --tracking-uri")
    return uri
