"""Attacks, one module per family, registered by name in ``gradleak.registry.ATTACKS``.

Every module of this package is imported (and so registers its attacks) when the package is imported:
adding an attack family means adding its module, nothing else here.
"""

import importlib as _importlib
import pkgutil as _pkgutil

for _info in _pkgutil.iter_modules(__path__):
    if not _info.name.startswith("_"):
        _importlib.import_module(f"{__name__}.{_info.name}")
