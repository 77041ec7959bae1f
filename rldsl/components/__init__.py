"""All components, one module per slot. Importing this package registers them: it imports every
module in the package, so a new slot's module needs no line here."""
import importlib
import pkgutil

for _module in sorted(m.name for m in pkgutil.iter_modules(__path__)):
    importlib.import_module(f"{__name__}.{_module}")
