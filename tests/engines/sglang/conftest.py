"""SGLang's real classes in the engines' venv (``make test-engines`` runs this folder on its own).

SGLang 0.5.23 imports torchvision at module level in its engine and tokenizer manager; PyPI's
torchvision does not load beside vLLM's CPU torch, so a stand-in that only names what SGLang
imports is installed before SGLang is (any call into it raises). Nothing here runs SGLang's
engine (it needs a GPU): these tests check the calls our bridge makes against SGLang's own
signatures, its ``SamplingParams`` checks and its command-line parsing.
"""

from __future__ import annotations

import enum
import importlib.machinery
import sys
import types
from collections.abc import Callable

TORCHVISION_MODULES = (
    "torchvision",
    "torchvision.io",
    "torchvision.transforms",
    "torchvision.transforms.functional",
    "torchvision.transforms.v2",
    "torchvision.transforms.v2.functional",
)


class InterpolationMode(enum.Enum):
    NEAREST = "nearest"
    NEAREST_EXACT = "nearest-exact"
    BILINEAR = "bilinear"
    BICUBIC = "bicubic"
    BOX = "box"
    HAMMING = "hamming"
    LANCZOS = "lanczos"


def _missing(module: str) -> Callable[[str], type]:
    def attribute(name: str) -> type:
        if name.startswith("__"):
            raise AttributeError(name)

        class Missing:
            def __init__(self, *args: object, **kwargs: object) -> None:
                raise NotImplementedError(f"torchvision stand-in: {module}.{name}")

        return Missing

    return attribute


def install_torchvision_stand_in() -> None:
    for name in TORCHVISION_MODULES:
        module = types.ModuleType(name)
        module.__spec__ = importlib.machinery.ModuleSpec(name, None, is_package=True)
        module.__path__ = []
        module.__getattr__ = _missing(name)  # type: ignore[method-assign]
        module.InterpolationMode = InterpolationMode  # type: ignore[attr-defined]
        sys.modules[name] = module
        parent, _, child = name.rpartition(".")
        if parent:
            setattr(sys.modules[parent], child, module)
    sys.modules["torchvision"].__version__ = "0.0.0+stand-in"  # type: ignore[attr-defined]


if "torchvision" not in sys.modules:
    install_torchvision_stand_in()
