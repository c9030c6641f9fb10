"""Where studies live: a journal file by default, or a storage URL that processes and machines share.

Accepted ``--storage`` / ``tune(storage=...)`` forms:

    (none)                           the journal file $AUTOFUSE_HOME/studies.journal
    journal:///abs/path.journal      an Optuna journal file (also journal:rel/path, or a plain
                                     path ending in .journal); needs a file system all users see
    sqlite:///path/studies.db        SQLite through Optuna's RDBStorage (one machine)
    postgresql://user:pw@host/db     PostgreSQL through RDBStorage (several machines)
    mysql+pymysql://user:pw@host/db  MySQL through RDBStorage

RDB storage needs SQLAlchemy (and a database driver: psycopg2 for PostgreSQL), installed by
the ``distributed`` extra; they are imported only when such a URL is used.
"""

from __future__ import annotations

import importlib.util
import os
import pathlib
import time

import optuna

from autofuse.errors import StorageError

FORMS = ("journal:///path/file.journal (or a path ending in .journal), sqlite:///path/file.db, "
         "postgresql://user:password@host:port/database, mysql+pymysql://user:password@host/database")
RDB_SCHEMES = ("sqlite", "postgresql", "mysql")
INSTALL = "pip install 'autofuse[distributed]'"
# Two processes opening a fresh database at once race to create Optuna's tables; the loser retries.
OPEN_ATTEMPTS = 4


def default_journal() -> pathlib.Path:
    home = pathlib.Path(os.environ.get("AUTOFUSE_HOME") or "~/.cache/autofuse").expanduser()
    home.mkdir(parents=True, exist_ok=True)
    return home / "studies.journal"


def open_storage(url) -> optuna.storages.BaseStorage:
    """The Optuna storage that ``url`` names (see the module docstring); an Optuna storage passes through."""
    if isinstance(url, optuna.storages.BaseStorage):
        return url
    if url is None:
        return _journal(default_journal())
    if not isinstance(url, (str, os.PathLike)):
        raise StorageError(f"a study storage is a URL string or an Optuna storage, got {type(url).__name__}; accepted: {FORMS}")
    text = os.fspath(url)
    if text.startswith("journal:"):
        path = text[len("journal:"):]
        path = path[2:] if path.startswith("//") else path  # journal:///abs/path -> /abs/path
        if path:
            return _journal(pathlib.Path(path))
    elif "://" not in text and text.endswith(".journal"):
        return _journal(pathlib.Path(text))
    if text.startswith("postgres:") or text.startswith("postgres+"):  # Heroku's spelling; SQLAlchemy's is postgresql
        text = "postgresql" + text[len("postgres"):]
    scheme, _, rest = text.partition("://")
    dialect = scheme.split("+")
    if rest and dialect[0] in RDB_SCHEMES:
        return _rdb(text, dialect)
    raise StorageError(f"study storage {masked(text)!r} is not a form autofuse accepts: {FORMS}")


def _journal(path: pathlib.Path) -> optuna.storages.JournalStorage:
    path = path.expanduser()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        backend = optuna.storages.journal.JournalFileBackend(str(path))
    except OSError as exc:
        raise StorageError(f"journal file {path} cannot be opened: {exc.strerror or exc}") from None
    return optuna.storages.JournalStorage(backend)


def _rdb(url: str, dialect: list[str]) -> optuna.storages.RDBStorage:
    shown = masked(url)
    _require("sqlalchemy", "SQLAlchemy", url)
    if dialect == ["postgresql"]:
        # SQLAlchemy's default driver changed (psycopg2 before 2.1, psycopg 3 since): name the installed one.
        driver = next((name for name in ("psycopg2", "psycopg") if importlib.util.find_spec(name)), None)
        if driver is None:
            _require("psycopg2", "psycopg2 (psycopg2-binary) or psycopg", url)
        url = url.replace("postgresql://", f"postgresql+{driver}://", 1)
    # SQLite's default 5 s busy timeout is short for several writers; a lost connection is re-made.
    engine = {"connect_args": {"timeout": 60}} if dialect[0] == "sqlite" else {"pool_pre_ping": True}
    for attempt in range(OPEN_ATTEMPTS):
        try:
            return optuna.storages.RDBStorage(url, engine_kwargs=engine)
        except ImportError as exc:  # the database's driver is missing
            raise StorageError(f"study storage {shown} needs a database driver that is not installed ({exc}); "
                               f"for PostgreSQL: {INSTALL}, for mysql+pymysql: pip install pymysql") from None
        except Exception as exc:  # noqa: BLE001 - SQLAlchemy's errors, e.g. refused connection, bad password
            if attempt + 1 == OPEN_ATTEMPTS or not _is_schema_race(exc):
                first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
                raise StorageError(f"study storage {shown} cannot be opened: {first}") from None
            time.sleep(0.5 * (attempt + 1))
    raise AssertionError("unreachable")


def _is_schema_race(exc: Exception) -> bool:
    text = str(exc).lower()
    return any(marker in text for marker in ("already exists", "duplicate key", "unique constraint", "database is locked"))


def _require(module: str, package: str, url: str) -> None:
    if importlib.util.find_spec(module) is None:
        raise StorageError(f"study storage {masked(url)} needs {package}, which is not installed: {INSTALL}")


def masked(url: str) -> str:
    """``url`` with its password replaced by ***, so it can be printed."""
    scheme, sep, rest = url.partition("://")
    credentials, at, host = rest.rpartition("@")
    if not sep or not at or ":" not in credentials:
        return url
    return f"{scheme}://{credentials.split(':', 1)[0]}:***@{host}"
