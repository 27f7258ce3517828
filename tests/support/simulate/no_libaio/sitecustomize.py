"""Put this folder on PYTHONPATH to simulate a machine without libaio: DeepSpeed's async-IO op
builders (every accelerator's) report themselves incompatible and refuse to load, as they do there."""
import importlib.abc
import importlib.util
import sys

_MODULES = {"deepspeed.ops.op_builder.async_io", "deepspeed.ops.op_builder.cpu.async_io"}


def _no_aio(module) -> None:
    def is_compatible(self, verbose=False):
        return False

    def load(self, verbose=True):
        raise RuntimeError("Unable to JIT load the async_io op due to it not being compatible due to "
                           "hardware/software issue. None")
    module.AsyncIOBuilder.is_compatible = is_compatible
    module.AsyncIOBuilder.load = load


class _PatchAfterImport(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name not in _MODULES:
            return None
        sys.meta_path.remove(self)
        try:
            spec = importlib.util.find_spec(name)
        finally:
            sys.meta_path.insert(0, self)
        run_module = spec.loader.exec_module

        def exec_module(module):
            run_module(module)
            _no_aio(module)
        spec.loader.exec_module = exec_module
        return spec


sys.meta_path.insert(0, _PatchAfterImport())
