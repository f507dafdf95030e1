"""Importable stand-in for torchvision, for importing the real sglang on a CPU-only machine.

sglang imports ``torchvision.transforms`` on paths the plugin tests reach (sglang.srt.configs ->
multimodal utils), but PyPI's torchvision wheels are built against CUDA torch and fail to load
beside the CPU build. Every ``torchvision`` module is answered here by an empty module whose
missing attributes are placeholder classes (and so are theirs); nothing in the tests calls into them. It reports version
0.0, so transformers takes none of its newer-torchvision paths.

Only on ``PYTHONPATH`` for the sglang plugin tests (tests/serving/test_sglang_plugin.py).
"""

import importlib.abc
import importlib.machinery
import sys
import types


class _Placeholder(type):
    """A class whose every missing attribute is another placeholder class."""

    def __getattr__(cls, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return _Placeholder(name, (), {"__module__": cls.__module__})


class _StubModule(types.ModuleType):
    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        value = _Placeholder(name, (), {"__module__": self.__name__})
        setattr(self, name, value)
        return value


class _TorchvisionStub(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, fullname, path=None, target=None):
        if fullname == "torchvision" or fullname.startswith("torchvision."):
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        module = _StubModule(spec.name)
        module.__path__ = []
        module.__version__ = "0.0"  # older than anything transformers asks for
        return module

    def exec_module(self, module):
        pass


sys.meta_path.insert(0, _TorchvisionStub())
