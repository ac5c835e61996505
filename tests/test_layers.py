"""The package tree's floors: no tlt_cli module imports one of a higher layer, and none imports the plugins.

Every import of every tlt_cli module is read with `ast` (imports inside functions and under
TYPE_CHECKING included: a type-only import is still a dependency a reader follows) and checked
against LAYERS, lowest first. A module belongs to the layer of the longest prefix that names it;
it may import modules of its own layer and of the layers below. The composition root
(tlt_cli/training/) builds parts from everything below it; integrations/ (TRL) builds on it; the
commands' implementations (among them the trainer table, tlt_cli/trainers.py, which names both
trainers' bodies) and the CLI come last. ALLOWED_UPWARD lists the exceptions, each
with its reason. Below the composition root, the decode packages (RECIPE_FREE) take plain values and
never import the recipe schema (the package tlt_cli/config/). No two modules import each other, however
indirectly, in tlt_cli/ or in the shipped plugins (plugins/, installed as tlt_plugins).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE_ROOT = Path(__file__).resolve().parent.parent / "tlt_cli"
ROOT_PACKAGE = "tlt_cli"

LAYERS: list[tuple[str, tuple[str, ...]]] = [
    (
        "foundations",
        (
            ROOT_PACKAGE,
            "tlt_cli.errors",
            "tlt_cli.config",
            "tlt_cli.recipes",
            "tlt_cli.recipe_help",
            "tlt_cli.checkpoint",
            "tlt_cli.trace",
            "tlt_cli.plugins",
            "tlt_cli.display",
            "tlt_cli.versions",
            "tlt_cli.shared_memory",
            "tlt_cli.process_status",
            "tlt_cli.atomic_files",
            "tlt_cli.memory_hygiene",
        ),
    ),
    ("tasks", ("tlt_cli.tasks",)),
    ("models", ("tlt_cli.models",)),
    ("engine", ("tlt_cli.engine",)),
    # sd_effect.py: SD's measured effect in a run, read from its trace (the driver's summary and `tlt profile`)
    ("speculative", ("tlt_cli.speculative", "tlt_cli.sd_effect")),
    ("rollout", ("tlt_cli.rollout",)),
    # measured per-machine choices: above the rollout, which takes them resolved (rollout/decode_plan.py)
    ("tuning", ("tlt_cli.tuning",)),
    ("drafter", ("tlt_cli.drafter",)),
    ("sglang", ("tlt_cli.sglang",)),
    ("processes", ("tlt_cli.processes",)),
    ("training", ("tlt_cli.training",)),
    ("integrations", ("tlt_cli.integrations",)),
    (
        "commands",
        (
            "tlt_cli.recipe_checks",
            "tlt_cli.preflight",
            "tlt_cli.trainers",
            "tlt_cli.profile",
            "tlt_cli.calibration",
            "tlt_cli.export",
            "tlt_cli.export_policy",
            "tlt_cli.bench",
        ),
    ),
    ("cli", ("tlt_cli.cli", "tlt_cli.__main__")),
]

# (importer, imported) -> why the import runs up the tree
ALLOWED_UPWARD: dict[tuple[str, str], str] = {}

PLUGINS_PACKAGE = "tlt_plugins"
PLUGINS_ROOT = PACKAGE_ROOT.parent / "plugins"

# the recipe schema (a package: the name and its modules), and the packages below the composition root that take
# plain values made from it instead
RECIPE_SCHEMA = "tlt_cli.config"
RECIPE_FREE = ("tlt_cli.engine", "tlt_cli.speculative", "tlt_cli.rollout")


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE_ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def is_module(name: str) -> bool:
    relative = Path(*name.split("."))
    return (PACKAGE_ROOT.parent / relative).with_suffix(".py").is_file() or (
        PACKAGE_ROOT.parent / relative / "__init__.py"
    ).is_file()


def imported_modules(path: Path) -> set[str]:
    """Every module `path` imports (a `from package import module` names the module)."""
    importer = module_name(path)
    package = importer if path.name == "__init__.py" else importer.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([node.module] if node.module else []))
            for alias in node.names:
                candidate = f"{base}.{alias.name}"
                found.add(candidate if is_module(candidate) else base)
    return found


def layer_of(module: str) -> int:
    """The index in LAYERS of the longest prefix naming `module` (the root package names only itself)."""
    best, best_length = None, -1
    for index, (_, prefixes) in enumerate(LAYERS):
        for prefix in prefixes:
            inside = module.startswith(prefix + ".") and prefix != ROOT_PACKAGE
            if (module == prefix or inside) and len(prefix) > best_length:
                best, best_length = index, len(prefix)
    if best is None:
        raise AssertionError(f"{module} is in no layer of tests/test_layers.py; add it to LAYERS.")
    return best


def tlt_modules() -> list[Path]:
    return sorted(PACKAGE_ROOT.rglob("*.py"))


def upward_imports(modules: list[Path]) -> list[str]:
    """'importer (layer) -> imported (higher layer)' for each import that runs up the tree and is not allowed."""
    found = []
    for path in modules:
        importer = module_name(path)
        for imported in sorted(imported_modules(path)):
            if not imported.startswith("tlt_cli") or (importer, imported) in ALLOWED_UPWARD:
                continue
            if layer_of(imported) > layer_of(importer):
                found.append(
                    f"{importer} ({LAYERS[layer_of(importer)][0]}) -> {imported} ({LAYERS[layer_of(imported)][0]})"
                )
    return found


def test_every_module_has_a_layer():
    for path in tlt_modules():
        layer_of(module_name(path))


def test_no_module_imports_a_higher_layer():
    assert upward_imports(tlt_modules()) == []


def test_the_allowed_exceptions_still_exist():
    """An exception whose import is gone is removed from ALLOWED_UPWARD (the list stays the truth)."""
    for importer, imported in ALLOWED_UPWARD:
        path = PACKAGE_ROOT.parent / Path(*importer.split("."))
        path = path / "__init__.py" if path.is_dir() else path.with_suffix(".py")
        assert imported in imported_modules(path), f"{importer} no longer imports {imported}"


def test_the_core_never_imports_the_plugins_package():
    offenders = [
        module_name(path)
        for path in tlt_modules()
        if any(name.split(".")[0] == PLUGINS_PACKAGE for name in imported_modules(path))
        or _names_the_plugins_module(path)
    ]
    assert offenders == []


def _names_the_plugins_module(path: Path) -> bool:
    """Whether the module imports tlt_plugins by name (importlib.import_module / __import__ with a literal)."""
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant):
            function = ast.unparse(node.func)
            value = node.args[0].value
            if function.endswith(("import_module", "__import__")) and str(value).startswith(PLUGINS_PACKAGE):
                return True
    return False


@pytest.mark.parametrize(
    "source, upward",
    [
        ("from tlt_cli.training.worker_loop import worker_main\n", True),
        ("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from tlt_cli.cli import app\n", True),
        ("def body():\n    from tlt_cli.integrations import trl_run\n", True),
        ("from tlt_cli.rollout.types import Completion\nfrom tlt_cli.errors import UserError\n", False),
    ],
)
def test_an_upward_import_is_found(tmp_path, monkeypatch, source, upward):
    """A module of processes/ written with `source` is reported exactly when it reaches above its layer."""
    module = PACKAGE_ROOT / "processes" / "layering_probe.py"
    monkeypatch.setattr(Path, "read_text", lambda self, encoding=None: source)
    assert bool(upward_imports([module])) is upward


def import_circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Each circle of the module import graph (importer -> imported tlt_cli modules), found by depth-first search."""
    circles, state = [], {}

    def visit(module: str, path: list[str]) -> None:
        state[module] = "open"
        for imported in sorted(graph.get(module, ())):
            if state.get(imported) == "open":
                circles.append(path[path.index(imported) :] + [imported])
            elif imported not in state:
                visit(imported, [*path, imported])
        state[module] = "done"

    for module in sorted(graph):
        if module not in state:
            visit(module, [module])
    return circles


def module_graph() -> dict[str, set[str]]:
    """Every tlt_cli module -> the tlt_cli modules it imports (type-only and function-local imports included)."""
    return {
        module_name(path): {name for name in imported_modules(path) if name.startswith("tlt_cli.")}
        - {module_name(path)}
        for path in tlt_modules()
    }


def recipe_schema_imports(modules: list[Path]) -> list[str]:
    """'importer -> tlt_cli.config' for each module of a RECIPE_FREE package that imports the recipe schema (the
    package or one of its modules)."""
    return [
        f"{module_name(path)} -> {RECIPE_SCHEMA}"
        for path in modules
        if module_name(path).startswith(tuple(f"{package}." for package in RECIPE_FREE))
        and any(name == RECIPE_SCHEMA or name.startswith(f"{RECIPE_SCHEMA}.") for name in imported_modules(path))
    ]


def test_the_decode_packages_never_import_the_recipe_schema():
    """training/setup.py turns the recipe into plain values (the speculative plan, sampling settings); below it
    nothing reads the schema."""
    assert recipe_schema_imports(tlt_modules()) == []


@pytest.mark.parametrize(
    "package, source, found",
    [
        ("speculative", "from tlt_cli.config import SpeculativeSection\n", True),
        ("rollout", "def body():\n    from tlt_cli import config\n", True),
        ("engine", "import tlt_cli.config\n", True),
        ("speculative", "from tlt_cli.config.schema import SpeculativeSection\n", True),
        ("rollout", "from tlt_cli.config import loading\n", True),
        ("speculative", "from tlt_cli.errors import UserError\n", False),
        ("sglang", "from tlt_cli.config import RecipeError\n", False),
    ],
)
def test_a_recipe_schema_import_is_found(monkeypatch, package, source, found):
    """A module of `package` written with `source` is reported exactly when a decode package reads the schema."""
    module = PACKAGE_ROOT / package / "layering_probe.py"
    monkeypatch.setattr(Path, "read_text", lambda self, encoding=None: source)
    assert bool(recipe_schema_imports([module])) is found


def plugin_graph() -> dict[str, set[str]]:
    """Every module of plugins/ (named as installed, tlt_plugins.<name>) -> the plugin modules it imports
    (function-local imports included)."""
    names = {f"{PLUGINS_PACKAGE}.{path.stem}": path for path in PLUGINS_ROOT.glob("*.py") if path.stem != "__init__"}
    graph = {}
    for name, path in names.items():
        imported = set()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                imported.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = PLUGINS_PACKAGE + (f".{node.module}" if node.module else "") if node.level else node.module
                imported.update({base, *(f"{base}.{alias.name}" for alias in node.names)})
        graph[name] = (imported & set(names)) - {name}
    return graph


def test_no_import_circle_in_the_plugins():
    """The drafter sidecar and its TRL driver used to import each other; the TRL driver is now handed the plugin."""
    assert plugin_graph() and import_circles(plugin_graph()) == []


def test_no_module_import_circle():
    """The engine and speculative decoding used to import each other; no two modules may, however indirectly."""
    assert import_circles(module_graph()) == []


def test_an_import_circle_is_found():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert import_circles(graph) == [["a", "b", "c", "a"]]


# modules that touch files, processes or the machine: the engine (tensors in, tensors out) imports none of them
INPUT_OUTPUT_MODULES = {"fcntl", "os", "json", "pathlib", "tempfile", "shutil", "hashlib", "platform", "subprocess"}


def test_the_engine_is_pure_tensors():
    """Measurements and their caches live in tlt_cli/tuning/; engine/ only computes."""
    engine_files = sorted((PACKAGE_ROOT / "engine").rglob("*.py"))
    found = {
        f"{module_name(path)} imports {name}"
        for path in engine_files
        for name in imported_modules(path)
        if name.split(".")[0] in INPUT_OUTPUT_MODULES
    }
    assert engine_files and found == set()


# the commands' implementations that share the commands' floor; none imports another (a benchmark measures over the
# composition root and the packages below it, as the commands it measures do)
COMMAND_PACKAGES = ("tlt_cli.bench", "tlt_cli.calibration", "tlt_cli.profile")


def command_crossings(modules: list[Path]) -> list[str]:
    """'importer -> imported' for each import from one command package into another."""
    found = []
    for path in modules:
        importer = module_name(path)
        home = next((package for package in COMMAND_PACKAGES if importer.startswith(f"{package}.")), None)
        for imported in sorted(imported_modules(path)):
            other = next((package for package in COMMAND_PACKAGES if imported.startswith(package)), None)
            if home is not None and other is not None and other != home:
                found.append(f"{importer} -> {imported}")
    return found


def test_no_command_package_imports_another():
    assert command_crossings(tlt_modules()) == []


def test_a_command_crossing_is_found(monkeypatch):
    module = PACKAGE_ROOT / "bench" / "layering_probe.py"
    monkeypatch.setattr(Path, "read_text", lambda self, encoding=None: "from tlt_cli.calibration import measure\n")
    assert command_crossings([module]) == ["tlt_cli.bench.layering_probe -> tlt_cli.calibration.measure"]
