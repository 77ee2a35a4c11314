"""Where code lives: the packages depend on one another in one direction only.

``kfrl.driver`` (how a run is driven) uses the stages; the stages use the engines and the
distributed mechanism; nothing below imports what is above it. Imports inside functions count:
a lazy import is still a dependency a reader has to follow.
"""
from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src" / "kfrl"

# package -> the kfrl packages it must never import (directly or lazily)
FORBIDDEN = {
    "distributed": {"stages", "driver"},
    "engines": {"stages", "driver", "distributed.multinode"},
    "models": {"stages", "driver", "distributed"},
    "stages": {"driver"},
    "algos": {"stages", "driver", "distributed", "engines"},
}


def imported_modules(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return {name for name in names if name.startswith("kfrl.")}


def test_no_package_imports_a_layer_above_it():
    offences = []
    for package, forbidden in FORBIDDEN.items():
        for path in sorted((SRC / package).rglob("*.py")):
            for module in imported_modules(path):
                for target in forbidden:
                    if module == f"kfrl.{target}" or module.startswith(f"kfrl.{target}."):
                        offences.append(f"{path.relative_to(SRC.parent)} imports {module}")
    assert not offences, "\n".join(offences)


def test_driving_a_run_lives_in_one_package():
    """No module at the package root drives runs: the runners, the controller, submission and the
    engine live in kfrl.driver."""
    root_modules = {path.stem for path in SRC.glob("*.py")}
    assert not root_modules & {"controller", "runners", "submit", "dryrun", "engine_server", "engine_client"}
    driver = {str(path.relative_to(SRC / "driver")) for path in (SRC / "driver").rglob("*.py")}
    assert {"controller.py", "local.py", "cluster.py", "submit.py", "kfp_entry.py",
            "engine/server.py", "engine/client.py", "engine/workload.py"} <= driver
