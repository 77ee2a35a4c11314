"""Every package kfrl imports is one it declares: a dependency that arrives only through another one
(fastapi through mlflow-skinny, say) disappears the day that one drops it."""
from __future__ import annotations

import ast
import importlib.metadata as metadata
import re
import sys
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
INSTALLED_CODE = [REPO / "src" / "kfrl", REPO / "components", REPO / "pipelines"]  # what the package installs


def imported_top_level_modules(folders) -> dict[str, set[str]]:
    """{top-level module: files importing it}, for absolute imports outside the standard library."""
    found: dict[str, set[str]] = {}
    for folder in folders:
        for path in folder.rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
                names = []
                if isinstance(node, ast.Import):
                    names = [alias.name for alias in node.names]
                elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                    names = [node.module]
                for name in names:
                    top = name.split(".")[0]
                    if top not in sys.stdlib_module_names and top not in {"kfrl", "components", "pipelines"}:
                        found.setdefault(top, set()).add(path.name if REPO not in path.parents else str(path.relative_to(REPO)))
    return found


def declared_distributions() -> set[str]:
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    requirements = list(project["dependencies"])
    for extra in project.get("optional-dependencies", {}).values():
        requirements += extra
    return {re.split(r"[\s<>=!~;\[]", requirement, maxsplit=1)[0].lower().replace("_", "-")
            for requirement in requirements}


def test_every_imported_package_is_declared():
    distributions_of = metadata.packages_distributions()
    declared = declared_distributions()
    undeclared = {}
    for module, files in imported_top_level_modules(INSTALLED_CODE).items():
        candidates = {name.lower().replace("_", "-") for name in distributions_of.get(module, [module])}
        if not candidates & declared:
            undeclared[module] = sorted(files)[:3]
    assert not undeclared, f"imported but not declared in pyproject.toml: {undeclared}"


def test_the_check_sees_an_undeclared_import(tmp_path):
    (tmp_path / "module.py").write_text("import fastapi\nfrom yaml import safe_load\nimport json\n")
    assert set(imported_top_level_modules([tmp_path])) == {"fastapi", "yaml"}
