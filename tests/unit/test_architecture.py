"""The import graph of `src/moetrain` reads top-down: no cycles, no upward imports, imports at module top.

Layers, lowest first (a module may import only from lower layers, or from its own
package without closing a cycle):

    errors, testing, durable, dtypes, libc  <  args, logging  <  config  <  model, data  <  parallel
    <  interop, runtime  <  observe, checkpoint  <  evaluate  <  train  <  commands  <  bench, cli  <  __main__

Imports inside functions are allowed only for optional third-party extras (a user
without them must still be able to run everything else). The checker runs on the
source text (ast), so an import hidden in a function counts like any other, and it
is itself tested on small synthetic graphs so it cannot pass vacuously.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[2] / "src"
PACKAGE = "moetrain"

LAYERS: list[set[str]] = [
    {"errors", "testing", "durable", "dtypes", "libc", "__init__"},
    {"args", "logging"},
    {"config"},
    {"model", "data"},
    {"parallel"},
    {"interop", "runtime"},
    {"observe", "checkpoint"},
    {"evaluate"},
    {"train"},
    {"commands"},
    {"bench", "cli"},
    {"__main__"},
]
# Third-party packages a user may not have installed (extras): importing them where they
# are used keeps every other command working without them.
OPTIONAL_PACKAGES = {"datasets", "pyarrow", "tokenizers", "transformers", "wandb", "tensorboard", "lm_eval",
                     "torchft", "torchao"}
OPTIONAL_MODULE_PREFIXES = ("torch.utils.tensorboard",)


def layer_of(module: str) -> int:
    unit = module.split(".")[1] if "." in module else "__init__"
    for index, units in enumerate(LAYERS):
        if unit in units:
            return index
    raise AssertionError(f"{module}: its package {unit!r} has no layer in tests/unit/test_architecture.py")


def unit_of(module: str) -> str:
    return module.split(".")[1] if "." in module else "__init__"


def module_name(path: Path) -> str:
    parts = list(path.relative_to(SRC).with_suffix("").parts)
    if parts[-1] == "__init__" and len(parts) > 1:
        parts = parts[:-1]
    return ".".join(parts)


def source_modules() -> dict[str, ast.Module]:
    return {module_name(p): ast.parse(p.read_text(), str(p)) for p in sorted((SRC / PACKAGE).rglob("*.py"))}


def _resolve(module: str, node: ast.ImportFrom, is_package: bool) -> str:
    if node.level == 0:
        return node.module or ""
    base = module.split(".") if is_package else module.split(".")[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def imports_of(module: str, tree: ast.Module, known: set[str], is_package: bool) -> list[tuple[str, bool]]:
    """(imported module, at module top?) for every import statement in `tree`."""
    found: list[tuple[str, bool]] = []

    def visit(node: ast.AST, top: bool) -> None:
        for child in ast.iter_child_nodes(node):
            inner_top = top and not isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda)
            if isinstance(child, ast.Import):
                found.extend((alias.name, top) for alias in child.names)
            elif isinstance(child, ast.ImportFrom):
                target = _resolve(module, child, is_package)
                for alias in child.names:
                    # `from moetrain.model import experts` imports the submodule experts.
                    sub = f"{target}.{alias.name}"
                    found.append((sub if sub in known else target, top))
            visit(child, inner_top)

    visit(tree, True)
    return found


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of the directed graph as a path [a, b, ..., a], or None."""
    state: dict[str, int] = {}  # 1 = on the current path, 2 = done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state:
                cycle = visit(nxt)
                if cycle:
                    return cycle
        path.pop()
        state[node] = 2
        return None

    for start in sorted(graph):
        if start not in state:
            cycle = visit(start)
            if cycle:
                return cycle
    return None


def violations(modules: dict[str, ast.Module], packages: set[str]) -> tuple[dict[str, set[str]], list[str]]:
    """The project-internal import graph and every rule it breaks."""
    known = set(modules)
    graph: dict[str, set[str]] = {m: set() for m in modules}
    problems: list[str] = []
    for module, tree in modules.items():
        for target, top in imports_of(module, tree, known, module in packages):
            root = target.split(".")[0]
            internal = root == PACKAGE
            if not top:
                optional = root in OPTIONAL_PACKAGES or target.startswith(OPTIONAL_MODULE_PREFIXES)
                if internal or not optional:
                    problems.append(f"{module}: imports {target} inside a function (imports belong at module top; "
                                    "only optional extras may be imported where used)")
            if not internal or target == PACKAGE:
                continue
            if target not in known:
                problems.append(f"{module}: imports {target}, which is not a module of the package")
                continue
            graph[module].add(target)
            if unit_of(module) != unit_of(target) and layer_of(target) >= layer_of(module):
                problems.append(f"{module} (layer {layer_of(module)}) imports {target} (layer {layer_of(target)}): "
                                "imports must point down the layers")
    cycle = find_cycle(graph)
    if cycle:
        problems.append("import cycle: " + " -> ".join(cycle))
    return graph, problems


def package_modules() -> set[str]:
    return {module_name(p) for p in (SRC / PACKAGE).rglob("__init__.py")}


def test_import_graph_has_no_cycle_no_upward_import_and_no_import_inside_functions():
    graph, problems = violations(source_modules(), package_modules())
    assert len(graph) > 40  # the whole package was read
    assert not problems, "\n".join(problems)


def _synthetic(sources: dict[str, str]) -> dict[str, ast.Module]:
    return {name: ast.parse(text) for name, text in sources.items()}


def test_checker_reports_a_cycle_hidden_in_a_function():
    modules = _synthetic({
        "moetrain.model.a": "from moetrain.model import b\n",
        "moetrain.model.b": "def f():\n    from moetrain.model.a import x\n",
    })
    _, problems = violations(modules, set())
    assert any("inside a function" in p for p in problems)
    assert any(p.startswith("import cycle: ") and "moetrain.model.a" in p for p in problems)


def test_checker_reports_an_upward_and_a_sideways_import():
    modules = _synthetic({
        "moetrain.config": "from moetrain.model.init import SCHEMES\n",
        "moetrain.model.init": "SCHEMES = {}\n",
        "moetrain.data.loader": "from moetrain.model.init import SCHEMES\n",
    })
    _, problems = violations(modules, set())
    assert any("moetrain.config (layer 2) imports moetrain.model.init (layer 3)" in p for p in problems)
    assert any("moetrain.data.loader (layer 3) imports moetrain.model.init (layer 3)" in p for p in problems)


def test_checker_allows_optional_extras_in_functions_and_relative_imports_resolve():
    modules = _synthetic({
        "moetrain.data.tokenizer": "def load():\n    from tokenizers import Tokenizer\n",
        "moetrain.data.corpus": "from .tokenizer import load\nimport torch\n",
        "moetrain.train.run": "def f():\n    import numpy\n",
    })
    graph, problems = violations(modules, set())
    assert graph["moetrain.data.corpus"] == {"moetrain.data.tokenizer"}
    assert problems == ["moetrain.train.run: imports numpy inside a function (imports belong at module top; "
                        "only optional extras may be imported where used)"]


@pytest.mark.parametrize("module, layer", [("moetrain.errors", 0), ("moetrain.libc", 0), ("moetrain.config", 2),
                                           ("moetrain.model.moe", 3), ("moetrain.parallel.mesh", 4),
                                           ("moetrain.interop.hf_io", 5), ("moetrain.runtime.run_dir", 5),
                                           ("moetrain.observe.metrics", 6), ("moetrain.checkpoint.storage", 6),
                                           ("moetrain.evaluate.harness", 7), ("moetrain.train.run", 8),
                                           ("moetrain.commands.eval", 9), ("moetrain.cli", 10)])
def test_layers_are_ordered_as_documented(module, layer):
    assert layer_of(module) == layer
