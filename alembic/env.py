"""Alembic environment of the zinf profile database.

Normally run through :func:`profiler.store.upgrade`, which builds the Alembic config in code and
hands over an open connection in ``config.attributes["connection"]`` (made by
:func:`profiler.store.make_engine`, so SQLite gets WAL, busy timeout and foreign keys).

From a checkout it also works with the ``alembic`` command and the repository's ``alembic.ini``::

    alembic -x url=sqlite:///zinf-profile.db upgrade head
    alembic -x url=sqlite:///scratch.db revision --autogenerate -m "add a column"

The URL comes from ``config.attributes["connection"]``, else ``-x url=...``, else the
``sqlalchemy.url`` option, else ``$ZINF_PROFILE_DB``.
"""

from __future__ import annotations

import os
from logging.config import fileConfig

from alembic import context

from profiler.schema import metadata as target_metadata

config = context.config

if config.config_file_name is not None and config.attributes.get("configure_logger", True):
    fileConfig(config.config_file_name, disable_existing_loggers=False)


def _url() -> str:
    url = context.get_x_argument(as_dictionary=True).get("url") or config.get_main_option("sqlalchemy.url")
    url = url or os.environ.get("ZINF_PROFILE_DB")
    if not url:
        raise SystemExit("no database URL: pass -x url=sqlite:///PATH (or set ZINF_PROFILE_DB)")
    return url


def _configure(**kw) -> None:
    context.configure(
        target_metadata=target_metadata,
        render_as_batch=True,  # SQLite cannot ALTER most things: autogenerate batch operations
        compare_type=True,
        **kw,
    )


def run_migrations_offline() -> None:
    _configure(url=_url(), literal_binds=True, dialect_opts={"paramstyle": "named"})
    with context.begin_transaction():
        context.run_migrations()


def run_migrations_online() -> None:
    connection = config.attributes.get("connection")
    if connection is not None:
        _configure(connection=connection)
        with context.begin_transaction():
            context.run_migrations()
        return
    from profiler.store import make_engine

    engine = make_engine(_url())
    try:
        with engine.connect() as conn:
            _configure(connection=conn)
            with context.begin_transaction():
                context.run_migrations()
            if conn.in_transaction():
                conn.commit()
    finally:
        engine.dispose()


if context.is_offline_mode():
    run_migrations_offline()
else:
    run_migrations_online()
