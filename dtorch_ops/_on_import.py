"""Registrations that wait for a costly module to be imported by someone else."""
import importlib.abc
import importlib.util
import sys


class _RegisterOnImport(importlib.abc.MetaPathFinder):
    """Runs a registration when a module is first imported (at once if it already is).

    For modules too costly to import with dtorch_ops (torch.distributed.tensor ~0.6 s,
    inductor several seconds) whose objects cannot be used before they are imported: a DTensor
    cannot exist before its module, and inductor lowers nothing before its lowering module.
    """

    def __init__(self, registrations):
        self._pending = dict(registrations)  # module name -> register(module)

    def find_spec(self, name, path, target=None):
        register = self._pending.pop(name, None)
        if register is None:
            return None
        if not self._pending:
            try:
                sys.meta_path.remove(self)
            except ValueError:  # another thread's import removed it first
                pass
        spec = importlib.util.find_spec(name)
        if spec is None or spec.loader is None:
            return spec
        exec_module = spec.loader.exec_module

        def exec_then_register(module):
            exec_module(module)
            register(module)

        spec.loader.exec_module = exec_then_register
        return spec


def register_on_import(registrations) -> None:
    """registrations: module name -> register(module), run once that module is imported."""
    waiting = {}
    for name, register in registrations.items():
        if name in sys.modules:
            register(sys.modules[name])
        else:
            waiting[name] = register
    if waiting:
        sys.meta_path.insert(0, _RegisterOnImport(waiting))
