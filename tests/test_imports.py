"""No import cycle among tlt_cli modules, every module imports on its own, and the recipe schema stays light.

The graph test reads every module's imports from its source (function-level imports included,
`if TYPE_CHECKING:` blocks left out) and fails on a cycle, naming it. The import test imports each
module alone in a process of its own: one interpreter loads the third-party packages tlt uses
(torch and transformers take seconds) and nothing of tlt, then forks a child per module, so every
child starts with no tlt_cli module loaded and a broken import order shows up as that module's
failure.
"""

import ast
import subprocess
import sys
import textwrap
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "tlt_cli"
HEAVY = ("torch", "transformers", "deepspeed", "tlt_cli.processes", "tlt_cli.sglang", "tlt_cli.plugins")


def module_files() -> dict[str, Path]:
    """Dotted module name -> source file, for every module of tlt_cli (packages as their __init__)."""
    modules = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return modules


def imported_names(path: Path) -> set[str]:
    """Every module name `path` imports (and `from x import y` as x.y too), outside `if TYPE_CHECKING:`."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    type_only = {
        id(node)
        for block in ast.walk(tree)
        if isinstance(block, ast.If) and "TYPE_CHECKING" in ast.unparse(block.test)
        for statement in block.body
        for node in ast.walk(statement)
    }
    names = set()
    for node in ast.walk(tree):
        if id(node) in type_only:
            continue
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            assert node.level == 0, f"{path}: use absolute imports"
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


def import_graph() -> dict[str, set[str]]:
    """tlt_cli module -> the tlt_cli modules it imports (a name resolves to its longest module prefix)."""
    modules = module_files()
    graph = {}
    for module, path in modules.items():
        targets = set()
        for name in imported_names(path):
            while name and name not in modules:
                name = name.rpartition(".")[0]
            if name and name != module:
                targets.add(name)
        graph[module] = targets
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle as [a, b, ..., a], or None (depth-first search with an explicit path)."""
    state: dict[str, str] = {}
    for start in sorted(graph):
        if start in state:
            continue
        path, iterators = [start], [iter(sorted(graph[start]))]
        state[start] = "open"
        while path:
            following = next(iterators[-1], None)
            if following is None:
                state[path.pop()] = "done"
                iterators.pop()
            elif state.get(following) == "open":
                return [*path[path.index(following) :], following]
            elif following not in state:
                state[following] = "open"
                path.append(following)
                iterators.append(iter(sorted(graph[following])))
    return None


def test_no_import_cycle_among_tlt_cli_modules():
    cycle = find_cycle(import_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_the_cycle_finder_names_a_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set(), "c": {"a", "b"}}) is None


IMPORT_EACH = textwrap.dedent("""
    import importlib, os, sys, traceback
    third_party, modules = sys.argv[1].split(","), sys.argv[2].split(",")
    for name in third_party:  # module or module:attribute (transformers loads its classes on first access)
        module, _, attribute = name.partition(":")
        try:
            getattr(importlib.import_module(module), attribute) if attribute else importlib.import_module(module)
        except (ImportError, AttributeError):
            pass  # an optional dependency (sglang): the modules that need it fail on their own
    assert not [name for name in sys.modules if name.startswith("tlt_cli")], "the parent must not load tlt_cli"
    for module in modules:
        pid = os.fork()
        if pid == 0:
            try:
                importlib.import_module(module)
            except BaseException:
                print(f"FAILED {module}: {traceback.format_exc().strip().splitlines()[-1]}", flush=True)
                os._exit(1)
            os._exit(0)
        os.waitpid(pid, 0)
""")


def third_party_names(paths: list[Path]) -> list[str]:
    """What tlt_cli imports from outside itself and the standard library, as module or module:attribute."""
    names = set()
    for path in paths:
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                names.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module:
                names.update(f"{node.module}:{alias.name}" for alias in node.names)
    return sorted(
        name for name in names if name.partition(":")[0].split(".")[0] not in {"tlt_cli", *sys.stdlib_module_names}
    )


def test_every_module_imports_alone_in_a_fresh_process():
    # __main__ runs the CLI when imported: it is checked by the graph test only
    modules = [module for module in module_files() if not module.endswith("__main__")]
    third_party = third_party_names(list(module_files().values()))
    result = subprocess.run(
        [sys.executable, "-c", IMPORT_EACH, ",".join(third_party), ",".join(modules)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    failed = [line for line in result.stdout.splitlines() if line.startswith("FAILED ")]
    assert failed == [], "modules that fail to import alone:\n" + "\n".join(failed)


def test_the_recipe_schema_imports_nothing_heavy():
    code = "import sys, tlt_cli.config; print(','.join(sorted(sys.modules)))"
    loaded = (
        subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
        .stdout.strip()
        .split(",")
    )
    assert [name for name in loaded if name.startswith(HEAVY)] == []
    assert [name for name in loaded if name.startswith("tlt_cli.")] == [
        "tlt_cli.atomic_files",
        "tlt_cli.config",
        "tlt_cli.config.choices",
        "tlt_cli.config.loading",
        "tlt_cli.config.ranges",
        "tlt_cli.config.schema",
        "tlt_cli.errors",
    ]
