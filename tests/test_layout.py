"""The package's folders are its layers: no module imports from a layer above its own, and no two modules
import each other, directly or through others (read from the source, so that lazy imports count too)."""

import ast
from pathlib import Path

import pyro_fed

PACKAGE = Path(pyro_fed.__file__).parent

#: the layers, bottom first; a module may import from its own layer and those below it
LAYERS = [
    "messages",
    "engine",
    "data",
    "network",
    "model",
    "algorithms",
    "kernels",
    "output",
    "consensus",
    "testing",
    "__init__",
]


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def layer(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def imports(path: Path) -> set[str]:
    """The pyro_fed modules ``path`` imports (``from .x import y`` names the module ``x``, or ``x.y`` when
    that is a module)."""
    here = module_name(path)
    package = here if path.name == "__init__.py" else here.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if not target.startswith("pyro_fed"):
                continue
            for alias in node.names:
                sub = f"{target}.{alias.name}"
                found.add(
                    sub
                    if (PACKAGE.parent / sub.replace(".", "/")).with_suffix(".py").exists()
                    or (PACKAGE.parent / sub.replace(".", "/")).is_dir()
                    else target
                )
        elif isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith("pyro_fed")}
    return found - {here}


GRAPH = {module_name(p): imports(p) for p in PACKAGE.rglob("*.py")}


def test_every_module_sits_in_a_layer():
    assert {layer(m) for m in GRAPH} <= set(LAYERS), {layer(m) for m in GRAPH} - set(LAYERS)


def test_no_module_imports_from_a_layer_above():
    upward = [
        f"{module} imports {target}"
        for module, targets in GRAPH.items()
        for target in targets
        if LAYERS.index(layer(target)) > LAYERS.index(layer(module))
    ]
    assert not upward, upward


def test_no_import_cycle():
    # a package's __init__ importing its own modules is not a cycle: leave packages' __init__ out
    modules = {
        m: {t for t in ts if t in GRAPH and not (PACKAGE.parent / t.replace(".", "/")).is_dir()}
        for m, ts in GRAPH.items()
        if not (PACKAGE.parent / m.replace(".", "/")).is_dir()
    }
    state: dict[str, int] = {}

    def visit(module, path):
        state[module] = 1
        for target in modules.get(module, ()):
            assert state.get(target) != 1, " -> ".join([*path, module, target])
            if target not in state:
                visit(target, [*path, module])
        state[module] = 2

    for module in modules:
        if module not in state:
            visit(module, [])
    assert len(modules) > 30  # the walk saw the package


def test_the_short_module_names_are_the_modules():
    # pyro_fed.partition, pyro_fed.metrics, ...: the spellings of the README, docs and tutorials
    import importlib

    for short, full in pyro_fed.SHORT_NAMES.items():
        module = importlib.import_module(f"pyro_fed.{full}")
        assert importlib.import_module(f"pyro_fed.{short}") is module
        assert getattr(pyro_fed, short) is module


def test_import_pyro_fed_leaves_arviz_for_later():
    # ArviZ and xarray take seconds to import: loaded by the first conversion, not by import pyro_fed
    import subprocess
    import sys

    code = "import sys, pyro_fed; print(sorted({'arviz', 'xarray'} & set(sys.modules)))"
    loaded = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert loaded.stdout.strip() == "[]", loaded.stdout
