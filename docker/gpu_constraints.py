"""Requirements and constraints for the GPU image (run by docker/gpu.Dockerfile's builder stage).

constraints.txt pins the CPU/dev install, which is resolved without vLLM. vLLM pins some of the same
packages itself (vllm 0.33.0: transformers<5.21, fastapi<0.137, lark==1.2.2; its mistral-common:
numpy<2.4 on Python <= 3.12), so `pip install -c constraints.txt ".[gpu]"` has no solution. Instead:

  requirements PYPROJECT EXTRA [PIN ...]
      The requirement lines to install: the project's dependencies, those of EXTRA, then the PINs
      (torch==..., vllm==...).
  constraints REPORT CONSTRAINTS [PIN ...]
      CONSTRAINTS without every pin that a requirement in REPORT rules out, then the PINs. REPORT is
      `pip install --dry-run --report` of those requirements without constraints, so what is left
      out is exactly what vLLM's world does not allow; every other pin applies. The pins left out
      are listed on stderr, for the build log.

Standard library and `packaging` only (pip's own copy when packaging is not installed).
"""
from __future__ import annotations

import json
import re
import sys
from pathlib import Path

try:
    from packaging.markers import default_environment
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name
except ImportError:  # the builder's venv before anything brings packaging
    from pip._vendor.packaging.markers import default_environment
    from pip._vendor.packaging.requirements import Requirement
    from pip._vendor.packaging.utils import canonicalize_name

PIN = re.compile(r"^\s*([A-Za-z0-9][A-Za-z0-9._-]*)\s*==\s*([^\s;#]+)")


def requirements(pyproject: Path, extra: str, pins: list[str]) -> list[str]:
    import tomllib  # Python 3.11+, as in the image; the constraints mode runs on older ones too
    project = tomllib.loads(pyproject.read_text())["project"]
    return list(project.get("dependencies", [])) + list(project.get("optional-dependencies", {})[extra]) + pins


def ruled_out(report: dict, constraints: dict[str, str], environment: dict[str, str]) -> dict[str, list[str]]:
    """For each pinned name, the requirements in the report whose specifier excludes the pin."""
    out: dict[str, list[str]] = {}
    for item in report["install"]:
        metadata = item["metadata"]
        extras = [""] + list(item.get("requested_extras") or [])
        for line in metadata.get("requires_dist") or []:
            req = Requirement(line)
            if req.marker and not any(req.marker.evaluate(dict(environment, extra=e)) for e in extras):
                continue
            name = canonicalize_name(req.name)
            if name in constraints and not req.specifier.contains(constraints[name], prereleases=True):
                out.setdefault(name, []).append(f"{metadata['name']} {metadata['version']}: {line}")
    return out


def constraints(report_path: Path, constraints_path: Path, pins: list[str]) -> tuple[list[str], dict[str, list[str]]]:
    lines = constraints_path.read_text().splitlines()
    pinned = {canonicalize_name(m[1]): m[2] for m in map(PIN.match, lines) if m}
    ours = {canonicalize_name(PIN.match(p)[1]) for p in pins}
    dropped = ruled_out(json.loads(report_path.read_text()), pinned, default_environment())
    kept = [line for line in lines
            if not ((m := PIN.match(line)) and canonicalize_name(m[1]) in dropped.keys() | ours)]
    return kept + pins, dropped


def main(argv: list[str]) -> int:
    if len(argv) >= 3 and argv[0] == "requirements":
        print("\n".join(requirements(Path(argv[1]), argv[2], argv[3:])))
        return 0
    if len(argv) >= 3 and argv[0] == "constraints":
        lines, dropped = constraints(Path(argv[1]), Path(argv[2]), argv[3:])
        for name, why in sorted(dropped.items()):
            print(f"gpu_constraints: not pinning {name} (constraints.txt) for {'; '.join(why)}", file=sys.stderr)
        print("\n".join(lines))
        return 0
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
