"""Opening the profile database: engines, SQLite settings, and Alembic migrations.

* :func:`make_engine` - a read-write engine. For SQLite every connection gets WAL journal mode
  (readers never block the writer), ``synchronous=NORMAL``, a 10 s ``busy_timeout`` and foreign
  keys on, and write transactions start with ``BEGIN IMMEDIATE`` so that two writers queue on the
  busy timeout instead of failing on a lock upgrade.
* :func:`open_readonly` - a read-only engine (SQLite ``mode=ro`` URI) for the dashboard, reports and
  :mod:`profiler.queries`.
* :func:`upgrade` - ``alembic upgrade head``, configured in code: the migration scripts are found
  inside the installed package (``profiler/_migrations``, the repository's ``alembic/`` folder
  shipped by the build) or, in a source checkout, in ``alembic/`` itself.
* :func:`current_revision` / :func:`head_revision`.

Every failure a user can cause (a URL that does not parse, a server that does not answer, a path
that is a directory, a file that is not a database) raises :class:`zinf.errors.ProfileError` with
a one-line message that names the URL and the fix.
"""

from __future__ import annotations

import importlib.resources
import json
import os
import sqlite3
import threading
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import sqlalchemy as sa
from sqlalchemy import event, exc as sa_exc
from sqlalchemy.engine import URL, Engine, make_url

from zinf.errors import ProfileError

BUSY_TIMEOUT_MS = 10_000

__all__ = [
    "make_engine",
    "open_readonly",
    "upgrade",
    "current_revision",
    "head_revision",
    "migrations_dir",
    "describe_url",
]


# ---------------------------------------------------------------------------------------- URLs
def _parse(url: str | URL) -> URL:
    if isinstance(url, URL):
        return url
    try:
        return make_url(str(url))
    except (sa_exc.ArgumentError, ValueError) as e:
        raise ProfileError(
            f"profile database URL {url!r} does not parse ({_first_line(e)}); "
            "give a SQLAlchemy URL such as sqlite:///zinf-profile.db"
        ) from None


def describe_url(url: str | URL) -> str:
    """The URL as it may be printed: passwords hidden."""
    try:
        return _parse(url).render_as_string(hide_password=True)
    except ProfileError:
        return str(url)


def _is_sqlite(u: URL) -> bool:
    return u.get_backend_name() == "sqlite"


def _sqlite_path(u: URL) -> Path | None:
    """The file of a SQLite URL; None for an in-memory database."""
    db = u.database
    if not db or db == ":memory:" or u.query.get("mode") == "memory":
        return None
    if db.startswith("file:"):  # a URI filename (uri=true)
        db = db[5:].split("?", 1)[0]
    return Path(db).expanduser()


def _first_line(e: BaseException) -> str:
    orig = getattr(e, "orig", None)
    text = str(orig if orig is not None else e).strip() or type(e).__name__
    return text.splitlines()[0][:300]


def _check_sqlite_path(u: URL, *, create: bool) -> None:
    path = _sqlite_path(u)
    if path is None:
        return
    shown = describe_url(u)
    if path.is_dir():
        raise ProfileError(
            f"profile database {shown} names a directory, not a file; "
            f"use a file inside it, e.g. sqlite:///{(path / 'zinf-profile.db').as_posix()}"
        )
    if create:
        parent = path.parent
        try:
            parent.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise ProfileError(
                f"cannot create the folder {str(parent)!r} for profile database {shown} ({e.strerror or e}); "
                "choose a writable location"
            ) from None
        if not parent.is_dir():
            raise ProfileError(f"the parent of profile database {shown} is not a directory; choose another path")
    elif not path.exists():
        raise ProfileError(
            f"no profile database at {shown}; record a run with the profiler enabled, "
            f"or create it with `zinf db upgrade --db {shown}`"
        )


# ------------------------------------------------------------------------------------ engines
def _json_default(o):
    if isinstance(o, (set, frozenset, tuple)):
        return list(o)
    return str(o)


def _dumps(o) -> str:
    return json.dumps(o, default=_json_default)


def make_engine(url: str | URL, *, readonly: bool = False) -> Engine:
    """An engine for ``url``; for SQLite with WAL, NORMAL sync, busy timeout and foreign keys.

    Creating it connects once, so an unreachable server or a file that is not a database fails
    here, as a :class:`ProfileError`.
    """
    u = _parse(url)
    shown = describe_url(u)
    kwargs: dict = {"json_serializer": _dumps}
    if _is_sqlite(u):
        _check_sqlite_path(u, create=not readonly)
        path = _sqlite_path(u)
        if readonly and path is not None:
            # sqlite:///file:/abs/path?mode=ro&uri=true - the driver opens it read-only.
            uri = "file:" + sqlite3_uri_path(path.resolve())
            u = URL.create("sqlite", database=uri, query={"mode": "ro", "uri": "true"})
        if path is None:
            # one in-memory database shared by the engine's connections
            kwargs["poolclass"] = sa.pool.StaticPool
            kwargs["connect_args"] = {"check_same_thread": False}
    try:
        engine = sa.create_engine(u, **kwargs)
    except (sa_exc.ArgumentError, sa_exc.NoSuchModuleError, ImportError) as e:
        raise ProfileError(
            f"cannot use profile database {shown}: {_first_line(e)}; "
            "use sqlite:///PATH or install the database driver"
        ) from None
    if engine.dialect.name == "sqlite":
        _install_sqlite_settings(engine, readonly=readonly)
    try:
        with engine.connect() as conn:
            if engine.dialect.name == "sqlite":
                # reading the schema fails here when the file is not a database
                conn.exec_driver_sql("SELECT count(*) FROM sqlite_master").scalar()
            else:
                conn.exec_driver_sql("SELECT 1")
    except sa_exc.DBAPIError as e:
        engine.dispose()
        raise _connect_error(shown, e) from None
    return engine


def sqlite3_uri_path(path: Path) -> str:
    """``path`` escaped for a SQLite URI filename."""
    s = path.as_posix()
    for ch, rep in (("%", "%25"), ("?", "%3f"), ("#", "%23")):
        s = s.replace(ch, rep)
    return s


def _connect_error(shown: str, e: BaseException) -> ProfileError:
    msg = _first_line(e)
    low = msg.lower()
    if "not a database" in low or "file is encrypted" in low or "malformed" in low:
        return ProfileError(
            f"profile database {shown} is not a SQLite database ({msg}); "
            "point the profiler at a new file or move that one away"
        )
    if "unable to open" in low or "readonly" in low or "read-only" in low:
        return ProfileError(
            f"cannot open profile database {shown} ({msg}); check that the file and its folder exist and are readable/writable"
        )
    if "locked" in low or "busy" in low:
        return ProfileError(
            f"profile database {shown} is locked by another writer ({msg}); retry, or stop the process holding it"
        )
    return ProfileError(f"cannot connect to profile database {shown} ({msg}); check that the server is up and the URL is right")


def _install_sqlite_settings(engine: Engine, *, readonly: bool) -> None:
    @event.listens_for(engine, "connect")
    def _on_connect(dbapi_conn, _record):  # pragma: no cover - exercised through every connection
        # autocommit at the driver level: transactions are begun by the "begin" listener below
        dbapi_conn.isolation_level = None
        cur = dbapi_conn.cursor()
        try:
            cur.execute(f"PRAGMA busy_timeout = {BUSY_TIMEOUT_MS}")
            if readonly:
                cur.execute("PRAGMA query_only = ON")
            else:
                try:
                    cur.execute("PRAGMA journal_mode = WAL")
                except sqlite3.DatabaseError:
                    # "not a database" etc.: surface it from the caller's first statement instead
                    pass
                cur.execute("PRAGMA synchronous = NORMAL")
            cur.execute("PRAGMA foreign_keys = ON")
        finally:
            cur.close()

    @event.listens_for(engine, "begin")
    def _on_begin(conn):  # pragma: no cover - exercised through every transaction
        conn.exec_driver_sql("BEGIN" if readonly else "BEGIN IMMEDIATE")


def open_readonly(url: str | URL) -> Engine:
    """A read-only engine (SQLite: ``mode=ro``), for readers running beside a training process."""
    return make_engine(url, readonly=True)


@contextmanager
def reading(url_or_engine: str | URL | Engine) -> Iterator[sa.Connection]:
    """A read-only connection: from ``url`` (opened and disposed here) or from a given engine."""
    if isinstance(url_or_engine, Engine):
        with url_or_engine.connect() as conn:
            yield conn
        return
    engine = open_readonly(url_or_engine)
    try:
        with engine.connect() as conn:
            yield conn
    finally:
        engine.dispose()


# --------------------------------------------------------------------------------- migrations
def migrations_dir() -> Path:
    """The folder holding ``env.py`` and ``versions/``.

    Installed (wheel): ``profiler/_migrations``, found through :mod:`importlib.resources`. Source
    checkout or editable install: the repository's top-level ``alembic/`` folder.
    """
    candidates: list[Path] = []
    try:
        res = importlib.resources.files("profiler").joinpath("_migrations")
        candidates.append(Path(str(res)))
    except (ModuleNotFoundError, TypeError):  # pragma: no cover - profiler is always importable here
        pass
    candidates.append(Path(__file__).resolve().parent.parent / "alembic")
    for c in candidates:
        if (c / "env.py").is_file() and (c / "versions").is_dir():
            return c
    raise ProfileError(
        "the profile database migrations are missing (looked in "
        + ", ".join(str(c) for c in candidates)
        + "); reinstall zinf"
    )


def _alembic_config(url: str | URL, connection: sa.Connection | None = None):
    from alembic.config import Config

    cfg = Config()
    cfg.set_main_option("script_location", str(migrations_dir()))
    cfg.set_main_option("path_separator", "os")
    # '%' is interpolation syntax in the ini-style config
    cfg.set_main_option("sqlalchemy.url", _parse(url).render_as_string(hide_password=False).replace("%", "%%"))
    if connection is not None:
        cfg.attributes["connection"] = connection
    cfg.attributes["configure_logger"] = False
    return cfg


_upgrade_lock = threading.Lock()


def upgrade(url: str | URL | Engine, revision: str = "head") -> str | None:
    """Create the database (and, for SQLite, its file and folder) or migrate it to ``revision``.

    ``url`` may also be an engine from :func:`make_engine` (e.g. of an in-memory database).
    Returns the revision the database is at afterwards.
    """
    from alembic import command
    from alembic.util.exc import CommandError

    own = not isinstance(url, Engine)
    engine = make_engine(url) if own else url
    shown = describe_url(engine.url)
    try:
        with _upgrade_lock, engine.connect() as conn:
            cfg = _alembic_config(engine.url, conn)
            try:
                command.upgrade(cfg, revision)
            except CommandError as e:
                raise ProfileError(
                    f"cannot migrate profile database {shown}: {_first_line(e)}; "
                    "it was written by a newer zinf - upgrade zinf or use another file"
                ) from None
            except sa_exc.DBAPIError as e:
                raise _connect_error(shown, e) from None
            if conn.in_transaction():
                conn.commit()
        return current_revision(engine)
    finally:
        if own:
            engine.dispose()


def current_revision(url_or_engine: str | URL | Engine) -> str | None:
    """The Alembic revision the database is at (None for an empty database)."""
    from alembic.runtime.migration import MigrationContext

    own = not isinstance(url_or_engine, Engine)
    if own:
        u = _parse(url_or_engine)
        path = _sqlite_path(u) if _is_sqlite(u) else None
        if path is not None and not path.exists():
            return None  # asking must not create the file
        engine = make_engine(u, readonly=path is not None)
    else:
        engine = url_or_engine
    try:
        with engine.connect() as conn:
            return MigrationContext.configure(conn).get_current_revision()
    except sa_exc.DBAPIError as e:
        raise _connect_error(describe_url(engine.url), e) from None
    finally:
        if own:
            engine.dispose()


def head_revision() -> str:
    """The newest revision the installed migrations know."""
    from alembic.script import ScriptDirectory

    script = ScriptDirectory(str(migrations_dir()))
    head = script.get_current_head()
    assert head is not None
    return head


def pid_start_ticks(pid: int) -> int | None:
    """Start time of process ``pid`` in clock ticks since boot (Linux), to tell a reused pid apart."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read().decode("ascii", "replace")
    except OSError:
        return None
    # the command name (field 2) may contain spaces and parentheses: split after the last ')'
    rest = data[data.rfind(")") + 2 :].split()
    try:
        return int(rest[19])  # field 22
    except (IndexError, ValueError):
        return None


def pid_alive(pid: int | None, start_ticks: int | None = None) -> bool | None:
    """Whether ``pid`` is a live (non-zombie) process on this host; None when it cannot be told."""
    if not pid or pid <= 0:
        return None
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    except OSError:
        return None
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read().decode("ascii", "replace")
        state = data[data.rfind(")") + 2 :].split()[0]
        if state in ("Z", "X"):
            return False
    except (OSError, IndexError):
        return True
    if start_ticks is not None:
        now = pid_start_ticks(pid)
        if now is not None and now != start_ticks:
            return False  # the pid was reused by another process
    return True
