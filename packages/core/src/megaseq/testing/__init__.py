"""``megaseq.testing`` moved to its own package, ``megaseq-testkit`` (``import megaseq_testkit``).

This alias keeps plugins written against megaseq-core 0.1's import working for one release, with a
``DeprecationWarning``: ``megaseq.testing`` and every ``megaseq.testing.X`` are ``megaseq_testkit`` and
``megaseq_testkit.X``, the same module objects. Move by installing ``megaseq-testkit`` as a test dependency
and replacing ``megaseq.testing`` with ``megaseq_testkit`` in the imports.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
import warnings

from megaseq.errors import UserError

warnings.warn(
    "megaseq.testing moved to megaseq-testkit: install it and import megaseq_testkit instead "
    "(this alias goes in the next release)",
    DeprecationWarning,
    stacklevel=2,
)

try:
    _kit = importlib.import_module("megaseq_testkit")
except ModuleNotFoundError as error:
    if error.name != "megaseq_testkit":
        raise
    raise UserError("megaseq.testing moved to megaseq-testkit: pip install megaseq-testkit, "
                    "and import megaseq_testkit") from None


class _Alias(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Serves ``megaseq.testing.X`` as the module ``megaseq_testkit.X`` itself, so that both names see one
    module's state (one plugin manager cache, one set of suites)."""

    def find_spec(self, fullname, path=None, target=None):  # type: ignore[no-untyped-def]
        if fullname.startswith(__name__ + "."):
            return importlib.util.spec_from_loader(fullname, self)
        return None

    def create_module(self, spec):  # type: ignore[no-untyped-def]
        return importlib.import_module("megaseq_testkit" + spec.name[len(__name__):])

    def exec_module(self, module):  # type: ignore[no-untyped-def]
        pass


sys.meta_path.insert(0, _Alias())
sys.modules[__name__] = _kit
