"""User code named by its file: ``--model file.py:Class``, ``--dataset file.py:function``.

Such a file is imported as the module ``distsgd.user.m<hex of its absolute path>``, which any
process can import again by that name (a finder on ``sys.meta_path`` turns the name back into
the path). So objects built from it (a model class, a ``torch.utils.data.Dataset`` instance)
pickle by reference and unpickle in worker processes started by spawn or a fork server, just as
objects of an installed package would. **Loading a file runs its code**, like any import: name
only files you trust.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import sys
from collections.abc import Sequence
from importlib.machinery import ModuleSpec
from pathlib import Path
from types import ModuleType
from typing import Any

__path__: list[str] = []  # a package: its submodules are user files, found by _Finder

_PREFIX = __name__ + ".m"


def module_name(path: Path) -> str:
    return _PREFIX + str(Path(path).resolve()).encode().hex()


class _Finder(importlib.abc.MetaPathFinder):
    """Finds ``distsgd.user.m<hex>`` at the path the name encodes."""

    def find_spec(
        self, fullname: str, path: Sequence[str] | None = None, target: ModuleType | None = None
    ) -> ModuleSpec | None:
        if not fullname.startswith(_PREFIX):
            return None
        try:
            file = bytes.fromhex(fullname[len(_PREFIX) :]).decode()
        except ValueError:
            return None
        return importlib.util.spec_from_file_location(fullname, file)


if not any(isinstance(f, _Finder) for f in sys.meta_path):
    sys.meta_path.append(_Finder())


def names_file(spec: str) -> bool:
    """Whether ``spec`` names a Python file (``path/file.py:Name``), which loading it would run."""
    return spec.rpartition(":")[0].endswith(".py")


def load(spec: str, error: type[Exception], what: str) -> Any:
    """The object named by ``path/file.py:Name``; ``error`` (a DistsgdError subclass) for a
    missing file, a failing import or a missing name. ``what``: "model", "dataset", ..."""
    path_text, _, name = spec.rpartition(":")
    path = Path(path_text)
    if not names_file(spec) or not name:
        raise error(f"cannot read {what} '{spec}': give path/file.py:Name")
    if not path.is_file():
        raise error(f"{what} file not found: {path}")
    import importlib

    try:
        module = importlib.import_module(module_name(path))
    except (Exception, SystemExit) as exc:  # the user's code: whatever it raised (sys.exit too), in one line
        first = (str(exc).strip().splitlines() or [""])[0]
        raise error(f"importing {path} failed: {type(exc).__name__}: {first}") from None
    found = getattr(module, name, None)
    if found is None or not callable(found):
        raise error(f"{path} has no class or function named '{name}'")
    return found
