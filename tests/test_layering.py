"""The package's layers: the data's path is the import graph, and nothing reaches back up it."""

from __future__ import annotations

import ast
import graphlib
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "dynamo_prep"

# card -> discovery -> (formatter, tokenizer) -> preprocessor -> request plane -> HTTP.
FLOORS: dict[str, int] = {
    "dynamo_prep.models": 0,
    "dynamo_prep.logging": 0,
    "dynamo_prep.lifecycle": 0,
    "dynamo_prep.limits": 0,
    "dynamo_prep.threads": 0,
    "dynamo_prep.loopwatch": 0,
    "dynamo_prep.protocol": 0,
    "dynamo_prep.options": 0,
    "dynamo_prep.card": 1,
    "dynamo_prep.prompt": 1,
    "dynamo_prep.tokenizer": 2,
    "dynamo_prep.formatter": 2,
    "dynamo_prep.preprocessor": 3,
    "dynamo_prep.parsing": 3,
    "dynamo_prep.engines": 4,
    "dynamo_prep.discovery": 5,
    "dynamo_prep.routing": 5,
    "dynamo_prep.worker": 6,
    "dynamo_prep.frontend": 7,
    "dynamo_prep.cli": 8,
    "dynamo_prep": 9,
}


def floor_of(module: str) -> int:
    parts = module.split(".")
    for end in range(len(parts), 0, -1):
        floor = FLOORS.get(".".join(parts[:end]))
        if floor is not None:
            return floor
    raise AssertionError(f"{module} has no floor in FLOORS")


def module_name(path: Path) -> str:
    relative = path.relative_to(PACKAGE.parent).with_suffix("")
    parts = list(relative.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imports(path: Path) -> set[str]:
    """Every dynamo_prep module ``path`` imports, at its top or inside a function (lazily):
    ``from package import module`` names the module, ``from module import name`` the module."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.update(_imported(node.module, alias.name) for alias in node.names)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
    return {name for name in found if name == "dynamo_prep" or name.startswith("dynamo_prep.")}


def _imported(module: str, name: str) -> str:
    submodule = f"{module}.{name}"
    return submodule if submodule in MODULE_NAMES else module


MODULES = sorted(PACKAGE.rglob("*.py"))
MODULE_NAMES = frozenset(module_name(path) for path in MODULES)


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(PACKAGE)))
def test_no_module_imports_from_a_higher_floor(path: Path) -> None:
    name = module_name(path)
    own = floor_of(name)
    upward = sorted(target for target in imports(path) if floor_of(target) > own)
    assert not upward, f"{name} (floor {own}) imports from higher floors: {upward}"


def test_every_module_has_a_floor() -> None:
    for path in MODULES:
        floor_of(module_name(path))


def test_no_modules_import_each_other() -> None:
    """The import graph has no cycle, direct (a <-> b) or longer (a -> b -> c -> a)."""
    graph = {module_name(path): imports(path) - {module_name(path)} for path in MODULES}
    try:
        graphlib.TopologicalSorter(graph).prepare()
    except graphlib.CycleError as exc:
        cycle = exc.args[1]
        raise AssertionError(f"an import cycle: {' -> '.join(cycle)}") from None


# -- rooms: sizes, and the HTTP app's assembly ------------------------------------------------------------

FRONTEND = PACKAGE / "frontend"
FRONTEND_MAX_LINES = 600
PACKAGE_MAX_LINES = 800


def _lines(path: Path) -> int:
    return len(path.read_text(encoding="utf-8").splitlines())


def _oversized(paths: list[Path], limit: int) -> list[str]:
    return [f"{path.relative_to(PACKAGE)} ({_lines(path)} lines)" for path in paths if _lines(path) > limit]


def test_no_frontend_module_is_over_600_lines() -> None:
    assert not _oversized(sorted(FRONTEND.rglob("*.py")), FRONTEND_MAX_LINES)


def test_no_module_is_over_800_lines() -> None:
    assert not _oversized(MODULES, PACKAGE_MAX_LINES)


def test_the_http_app_is_assembly_only() -> None:
    """``frontend/app.py`` builds the shared state and collects the surfaces' routes: it defines no
    request handler (no ``async def``, no class), the handlers live in ``frontend/api/``."""
    tree = ast.parse((FRONTEND / "app.py").read_text(encoding="utf-8"))
    handlers = [node.name for node in ast.walk(tree) if isinstance(node, ast.AsyncFunctionDef | ast.ClassDef)]
    assert not handlers, f"frontend/app.py defines {handlers}: move them to a surface of frontend/api/"


def test_every_api_surface_is_served() -> None:
    """Every module of ``frontend/api/`` that exports ``routes`` is one of ``app.SURFACES``."""
    import importlib  # noqa: PLC0415

    from dynamo_prep.frontend.app import SURFACES  # noqa: PLC0415

    api = FRONTEND / "api"
    modules = [importlib.import_module(module_name(path)) for path in sorted(api.glob("*.py"))]
    surfaces = {module.__name__ for module in modules if hasattr(module, "routes")}
    assert surfaces == {surface.__name__ for surface in SURFACES}


# An engine's name may be written (as a string literal) in at most this many modules outside its
# own folder: the registry's table, and at most one more (docs/engines.md).
MAX_MODULES_NAMING_AN_ENGINE = 2


def _engine_names() -> tuple[str, ...]:
    from dynamo_prep.engines.registry import ENGINES  # noqa: PLC0415

    return ENGINES


@pytest.mark.parametrize("engine", _engine_names())
def test_an_engines_name_is_written_in_its_own_folder(engine: str) -> None:
    own = PACKAGE / "engines" / engine
    naming = sorted(
        str(path.relative_to(PACKAGE))
        for path in MODULES
        if not path.is_relative_to(own)
        and any(
            isinstance(node, ast.Constant) and node.value == engine
            for node in ast.walk(ast.parse(path.read_text(encoding="utf-8")))
        )
    )
    assert len(naming) <= MAX_MODULES_NAMING_AN_ENGINE, f"{engine!r} is written in {naming}"
