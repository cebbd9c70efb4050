"""One module per HF ``model_type``; importing this package registers every family in it."""

import importlib
import pkgutil

import flodl_hf.heads  # noqa: F401  (the default task models register themselves first)

for _info in sorted(pkgutil.iter_modules(__path__), key=lambda m: m.name):
    importlib.import_module(f"{__name__}.{_info.name}")
