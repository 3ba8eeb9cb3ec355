"""Build hook: ships this folder inside the wheel as the package data ``profiler/_migrations``.

pyproject.toml names it as the ``build_py`` command (``[tool.setuptools.cmdclass]``, found through
``[tool.setuptools.package-dir]``). ``packages.find`` only finds real directories, so the mapped
packages are added here, at build time, for wheels and sdists; an editable install is left alone
(it runs from the checkout, where ``profiler.store.migrations_dir`` finds ``alembic/`` itself).

Alembic never imports this module, and the folder has no ``__init__.py`` on purpose: a top-level
package named ``alembic`` would shadow the Alembic library.
"""

from setuptools.command.build_py import build_py as _build_py

PACKAGES = {"profiler._migrations": "alembic", "profiler._migrations.versions": "alembic/versions"}


class build_py(_build_py):  # noqa: N801 - setuptools' command name
    def finalize_options(self) -> None:
        super().finalize_options()
        if getattr(self, "editable_mode", False):
            return
        packages = list(self.packages or [])
        self.packages = packages + [p for p in PACKAGES if p not in packages]
        self.package_dir = {**(self.package_dir or {}), **PACKAGES}
        # package-data (script.py.mako) is declared in pyproject.toml
