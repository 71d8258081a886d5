"""Every third-party module imported at module top in src/ is a declared dependency of the package.

`pip install moetrain` installs only `[project.dependencies]`; a module-top import of anything
else makes the plain install fail at import time (extras are imported inside the function that
needs them, which tests/unit/test_architecture.py allows only for the optional packages).
"""

from __future__ import annotations

import ast
import re
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# Import names that differ from the distribution names declared in pyproject.toml.
DISTRIBUTION_OF = {"yaml": "pyyaml", "PIL": "pillow", "sklearn": "scikit-learn", "jinja2": "jinja2"}


def declared_distributions(pyproject: str) -> set[str]:
    meta = tomllib.loads(pyproject)["project"]
    return {_normalise(re.split(r"[<>=!~\[; ]", spec, maxsplit=1)[0]) for spec in meta.get("dependencies", [])}


def _normalise(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name.strip()).lower()


def top_level_imports(source: str) -> set[str]:
    """Top-level package names imported by the module's own statements (not inside functions or classes)."""
    names: set[str] = set()
    for node in ast.parse(source).body:
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names


def undeclared(sources: dict[str, str], declared: set[str]) -> list[str]:
    own = {"moetrain", "__future__"}
    problems = []
    for path, source in sorted(sources.items()):
        for name in sorted(top_level_imports(source) - own - set(sys.stdlib_module_names)):
            if _normalise(DISTRIBUTION_OF.get(name, name)) not in declared:
                problems.append(f"{path}: imports {name} at module top, not in [project.dependencies]")
    return problems


def test_every_module_top_import_in_src_is_a_declared_dependency():
    sources = {str(p.relative_to(ROOT)): p.read_text() for p in sorted((ROOT / "src").rglob("*.py"))}
    assert len(sources) > 40
    problems = undeclared(sources, declared_distributions((ROOT / "pyproject.toml").read_text()))
    assert not problems, "\n".join(problems)


def test_checker_finds_an_undeclared_import_and_ignores_function_level_ones():
    pyproject = '[project]\nname = "x"\ndependencies = ["torch>=2.9", "Py_YAML>=6"]\n'
    declared = declared_distributions(pyproject)
    assert declared == {"torch", "py-yaml"}
    sources = {
        "a.py": "import torch.nn\nfrom safetensors import safe_open\nimport json\nfrom . import b\n",
        "b.py": "def f():\n    import wandb\n",
    }
    assert undeclared(sources, declared) == ["a.py: imports safetensors at module top, not in [project.dependencies]"]
