"""Chaos test of resumable runs: kill `kfrl train` at random moments and break S3 on purpose.

    .venv/bin/python bench/chaos.py --kills 20 --seed 0 --out bench/results/chaos.json
    .venv/bin/python bench/chaos.py --kills 2 --no-s3-scenarios --out /tmp/chaos.json   # quick look
    .venv/bin/python bench/chaos.py --kills 0 --only truncated_gets                       # one S3 scenario

Every run is the same 3-iteration demo (``configs/demo.yaml`` shrunk to 4 prompts x 4 samples, a
checkpoint registered and validation at every iteration) started as ``python -m kfrl.cli train
--runner inline`` subprocesses from the repository root, each in its own process group.

1. Reference: one uninterrupted run on a local store folder with its own MLflow database. Its wall
   time T sets the kill window, its per-iteration ``critic/score/mean`` the expected scores. With
   S3 in play, a clean run through the fault proxy (no faults) sets the kill window of S3 trials.
2. Kill trials (``--kills N``): each on a fresh store (odd trials on S3 through the proxy without
   faults, even ones on a local folder; ``--no-s3``: all local) and a fresh MLflow sqlite file that
   does not exist yet. Up to ``--kills-per-trial`` invocations get SIGKILL (whole process group)
   at a time drawn uniformly in [0, 1.2 T]; then the run is resumed (same ``--run-id``) without
   kills until it exits 0 (5 attempts at most).
   Aimed trials (``--aimed N``): the same, but each killed invocation gets ``KFRL_KILL_AT`` (kfrl's
   own kill points, ``kfrl/faults.py``) at a random point and count, so kills land exactly inside
   MLflow's database creation, a checkpoint upload, a commit, a registration or a LATEST move,
   moments a uniform kill time rarely hits.
3. S3 scenarios (``--no-s3-scenarios`` skips them, ``--only NAME`` picks one): one run each through
   ``tests/s3_fault_proxy.py`` with 5xx errors, dropped connections, lost PUT responses, truncated
   GETs, stalls, a short and a long outage. A failed first invocation is resumed without faults.

After every trial and scenario the run is checked for: lost iterations (MLflow history of
``critic/score/mean`` must have steps exactly [1, 2, 3]; other checked metrics the reference's
steps), repeated iterations (a step twice in a metric's history), corrupt reads (a committed file
that does not match its ``_COMMITTED`` manifest; "sha256"/"xxh3"/"truncated" errors in any stderr),
duplicate or missing registered model versions (exactly one per iteration), scores that differ from
the reference, a LATEST that is not "3", more than one MLflow run for the kfrl run, and invocations
that failed for another reason than a kill (the long outage's first invocation may fail).

Prints progress lines and a JSON summary (also written to ``--out``); exits 0 when every violation
count is 0, else 1. Work folders go to ``--work DIR`` (kept) or a temporary folder that is deleted
at the end unless ``--keep``.
"""
from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))

from s3_fault_proxy import S3FaultProxy  # noqa: E402

PYTHON = sys.executable
ITERATIONS = [1, 2, 3]
MODEL_NAME = "kfrl-demo-policy"
SCORE = "critic/score/mean"
# Metrics whose histories are checked for repeated (and lost) steps; val-core names are added
# from the reference run.
CHECKED_METRICS = [SCORE, "actor/pg_loss", "response_length/mean", "timing_s/step", "training/global_step"]
TRAIN_OVERRIDES = [
    "data.train_batch_size=4", "actor.ppo_mini_batch_size=2", "rollout.n=4", "data.max_response_length=12",
    "actor.ppo_micro_batch_size_per_gpu=8", "trainer.log_generations=4", "trainer.save_freq=1",
    "trainer.test_freq=1",
]
KILL_WINDOW_FACTOR = 1.2
MAX_RESUMES = 5
# kfrl's kill points and the range of the hit counts drawn for them in aimed trials (a 3-iteration
# run commits ~40 times and uploads ~30 files; a count past the run's end means no kill).
AIMED_POINTS = {"startup": (1, 1), "mlflow_init": (1, 1), "upload": (1, 30), "commit": (1, 40),
                "registration": (1, 3), "latest": (1, 3)}
SCORE_TOLERANCE = 1e-9
S3_CREDENTIALS = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
                  "AWS_DEFAULT_REGION": "us-east-1"}
# stderr lines that mean a committed file was read back wrong (retried transient warnings excepted).
CORRUPT_PATTERN = re.compile(r"sha256|xxh3|truncated", re.IGNORECASE)
TRANSIENT_WARNING = "transient error on"

# name -> faults set before the run (or `delay_s` seconds into it), and whether the run may fail.
SCENARIOS = {
    "errors_5xx": {"faults": {"error_rate": 0.1}},
    "dropped_connections": {"faults": {"drop_rate": 0.05}},
    "lost_put_responses": {"faults": {"lost_put_response_rate": 0.2, "methods": ("PUT",)}},
    "truncated_gets": {"faults": {"truncate_get_rate": 0.2}},
    "stall": {"faults": {"stall_s": 3.0, "stall_rate": 0.05}},
    "short_outage": {"faults": {"outage_s": 4.0}, "delay_s": 5.0},
    "long_outage": {"faults": {"outage_s": 30.0}, "delay_s": 5.0, "may_fail": True},
}
VIOLATIONS = ("lost_iterations", "repeated_iterations", "corrupt_reads", "duplicate_versions",
              "missing_versions", "score_mismatches", "wrong_latest", "duplicate_mlflow_runs",
              "unexpected_failures")

_STARTED = time.monotonic()


def say(message: str) -> None:
    print(f"[{time.monotonic() - _STARTED:7.1f}s] {message}", flush=True)


# ---------------------------------------------------------------------------------------------
# services


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class Moto:
    """A moto S3 server on loopback, in its own process group."""

    def __init__(self, work: Path):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = open(work / "moto.log", "w")
        self.proc = subprocess.Popen([PYTHON, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(self.port)],
                                     stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True)
        self._wait()

    def _wait(self, timeout_s: float = 60.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"moto exited with {self.proc.returncode}; see {self.log.name}")
            try:
                with urllib.request.urlopen(self.url + "/", timeout=2):
                    return
            except Exception:  # noqa: BLE001 - not up yet
                time.sleep(0.3)
        raise RuntimeError(f"moto not answering at {self.url} after {timeout_s}s")

    def client(self):
        import boto3

        return boto3.client("s3", endpoint_url=self.url, aws_access_key_id="testing",
                            aws_secret_access_key="testing", region_name="us-east-1")

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self.log.close()


# ---------------------------------------------------------------------------------------------
# targets: one run = one store + one MLflow database + one run id


@dataclasses.dataclass
class Target:
    name: str
    folder: Path           # logs, MLflow database, local store
    store_uri: str
    run_id: str
    env: dict
    bucket: str | None = None
    s3: object = None      # boto3 client straight to moto (checks never go through the proxy)

    @property
    def db_path(self) -> Path:
        return self.folder / "mlflow.db"

    @property
    def kind(self) -> str:
        return "s3" if self.bucket else "local"


def base_env() -> dict:
    # No AWS_* (S3 targets set their own) and no KFRL_KILL_AT (kfrl's own kill points): kills come from here.
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_") and k != "KFRL_KILL_AT"}
    env["PYTHONUNBUFFERED"] = "1"
    return env


def local_target(work: Path, name: str) -> Target:
    folder = work / name
    folder.mkdir(parents=True)
    return Target(name, folder, str(folder / "store"), name, base_env())


def s3_target(work: Path, name: str, moto: Moto, proxy: S3FaultProxy) -> Target:
    folder = work / name
    folder.mkdir(parents=True)
    bucket = f"chaos-{name}".lower().replace("_", "-")
    client = moto.client()
    client.create_bucket(Bucket=bucket)
    env = {**base_env(), **S3_CREDENTIALS, "AWS_ENDPOINT_URL": proxy.url}
    return Target(name, folder, f"s3://{bucket}/runs", name, env, bucket=bucket, s3=client)


def train_command(target: Target) -> list[str]:
    return [PYTHON, "-m", "kfrl.cli", "train", "--config", "configs/demo.yaml", "--runner", "inline",
            "--store", target.store_uri, "--tracking-uri", f"sqlite:///{target.db_path}",
            "--run-id", target.run_id, "-n", str(len(ITERATIONS)), *TRAIN_OVERRIDES,
            f"pipeline.pipeline_root={target.folder / 'kfp'}"]


# ---------------------------------------------------------------------------------------------
# invocations


@dataclasses.dataclass
class Invocation:
    label: str
    rc: int | None
    wall_s: float
    kill_at: float | None = None
    killed: bool = False
    timed_out: bool = False
    last_output: str = ""
    stderr: str = ""
    kill_point: str | None = None

    @property
    def ok(self) -> bool:
        return self.rc == 0

    def error_line(self) -> str:
        lines = [line for line in self.stderr.splitlines() if line.startswith("error:")]
        return lines[-1][:500] if lines else ""

    def stderr_tail(self, chars: int = 2000) -> str:
        return self.stderr[-chars:]

    def brief(self) -> dict:
        out = {"label": self.label, "rc": self.rc, "wall_s": round(self.wall_s, 2)}
        if self.kill_at is not None:
            out.update(kill_at=round(self.kill_at, 2), killed=self.killed, last_output=self.last_output)
        if self.kill_point is not None:
            out.update(kill_point=self.kill_point, killed=self.killed, last_output=self.last_output)
        if self.timed_out:
            out["timed_out"] = True
        return out


def last_line(path: Path) -> str:
    try:
        lines = [line.strip() for line in path.read_text(errors="replace").splitlines() if line.strip()]
    except OSError:
        return ""
    return lines[-1][:200] if lines else ""


def invoke(target: Target, label: str, *, kill_at: float | None = None, timeout_s: float = 600.0,
           on_start=None, kill_point: str | None = None) -> Invocation:
    """Run `kfrl train` once for target; SIGKILL its process group at kill_at seconds if still running,
    or let kfrl kill itself at ``kill_point`` (a ``KFRL_KILL_AT`` value)."""
    out_path, err_path = target.folder / f"{label}.stdout", target.folder / f"{label}.stderr"
    env = {**target.env, "KFRL_KILL_AT": kill_point} if kill_point else target.env
    with open(out_path, "w") as out, open(err_path, "w") as err:
        started = time.monotonic()
        proc = subprocess.Popen(train_command(target), cwd=REPO, env=env, stdout=out, stderr=err,
                                start_new_session=True)
        if on_start is not None:
            on_start()
        inv = Invocation(label, None, 0.0, kill_at=kill_at)
        try:
            proc.wait(timeout=min(kill_at, timeout_s) if kill_at is not None else timeout_s)
        except subprocess.TimeoutExpired:
            inv.last_output = last_line(out_path)
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            inv.killed = kill_at is not None and kill_at < timeout_s
            inv.timed_out = not inv.killed
        except BaseException:  # Ctrl-C on the chaos script: leave no run behind
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            raise
        inv.rc = proc.returncode
        inv.wall_s = time.monotonic() - started
        inv.kill_point = kill_point
        if kill_point and inv.rc == -signal.SIGKILL:
            inv.killed, inv.last_output = True, last_line(out_path)
    inv.stderr = err_path.read_text(errors="replace")
    return inv


def describe(inv: Invocation) -> str:
    if inv.killed:
        where = f"at {inv.kill_point}" if inv.kill_point else f"at {inv.kill_at:.1f}s"
        return f"killed {where} after {inv.wall_s:.1f}s (last output: {inv.last_output or '-'})"
    if inv.timed_out:
        return f"TIMED OUT after {inv.wall_s:.0f}s"
    if inv.ok:
        before = f" before the kill at {inv.kill_at:.1f}s" if inv.kill_at else ""
        before = f" without reaching {inv.kill_point}" if inv.kill_point else before
        return f"finished in {inv.wall_s:.1f}s{before}"
    return f"FAILED rc={inv.rc} in {inv.wall_s:.1f}s: {inv.error_line() or inv.stderr_tail(300).strip()}"


def failure_record(target: Target, inv: Invocation, expected: bool = False) -> dict:
    reason = "timed out" if inv.timed_out else (inv.error_line() or f"exit code {inv.rc}")
    return {"where": target.name, "invocation": inv.label, "rc": inv.rc, "reason": reason,
            "expected": expected, "stderr_tail": inv.stderr_tail()}


def resume_until_done(target: Target, invocations: list[Invocation], failures: list[dict],
                      timeout_s: float) -> bool:
    """Re-run without kills until an invocation exits 0 (MAX_RESUMES tries); True when one did."""
    if invocations and invocations[-1].ok:
        return True
    for attempt in range(1, MAX_RESUMES + 1):
        inv = invoke(target, f"resume-{attempt}", timeout_s=timeout_s)
        invocations.append(inv)
        say(f"  {target.name} {inv.label}: {describe(inv)}")
        if inv.ok:
            return True
        failures.append(failure_record(target, inv))
    return False


# ---------------------------------------------------------------------------------------------
# reading the store back (straight from disk or moto, never through the proxy)


def store_files(target: Target) -> dict[str, int]:
    """Every file of target's store: path relative to the store root -> size."""
    if target.bucket is None:
        root = Path(target.store_uri)
        if not root.exists():
            return {}
        return {p.relative_to(root).as_posix(): p.stat().st_size for p in root.rglob("*") if p.is_file()}
    prefix = target.store_uri.split("/", 3)[3] + "/"
    files = {}
    for page in target.s3.get_paginator("list_objects_v2").paginate(Bucket=target.bucket, Prefix=prefix):
        for obj in page.get("Contents", []):
            files[obj["Key"][len(prefix):]] = obj["Size"]
    return files


def read_store_file(target: Target, rel: str) -> bytes:
    if target.bucket is None:
        return (Path(target.store_uri) / rel).read_bytes()
    key = target.store_uri.split("/", 3)[3] + "/" + rel
    return target.s3.get_object(Bucket=target.bucket, Key=key)["Body"].read()


def check_manifests(target: Target, files: dict[str, int]) -> tuple[list[str], int]:
    """Committed files that do not match their manifest; and the number of manifests checked."""
    problems, manifests = [], [rel for rel in files if rel.rsplit("/", 1)[-1] == "_COMMITTED"]
    for rel in manifests:
        folder = rel.rsplit("/", 1)[0]
        try:
            manifest = json.loads(read_store_file(target, rel))
        except ValueError as err:
            problems.append(f"{rel}: not JSON ({err})")
            continue
        if not folder.endswith(manifest.get("prefix", "")):
            problems.append(f"{rel}: prefix {manifest.get('prefix')!r} does not match its location")
        for entry in manifest.get("files", []):
            path = f"{folder}/{manifest['attempt']}/{entry['name']}"
            if path not in files:
                problems.append(f"{path}: listed in {rel} but missing")
                continue
            data = read_store_file(target, path)
            if len(data) != entry["size"]:
                problems.append(f"{path}: {len(data)} bytes, manifest says {entry['size']}")
            elif not _digest_ok(entry, data):
                problems.append(f"{path}: digest differs from the manifest")
    return problems, len(manifests)


def corrupt_lines(invocations: list[Invocation]) -> list[str]:
    found = []
    for inv in invocations:
        for line in inv.stderr.splitlines():
            if CORRUPT_PATTERN.search(line) and TRANSIENT_WARNING not in line:
                found.append(f"{inv.label}: {line.strip()[:300]}")
    return found


def _digest_ok(entry: dict, data: bytes) -> bool:
    """The manifest's digest recomputed here, independently of kfrl.store (XXH3-128 or SHA-256)."""
    if "xxh3_128" in entry:
        import xxhash

        return xxhash.xxh3_128(data).hexdigest() == entry["xxh3_128"]
    return hashlib.sha256(data).hexdigest() == entry["sha256"]


def latest_value(target: Target, files: dict[str, int]) -> str | None:
    latest = [rel for rel in files if rel.endswith(f"{target.run_id}/LATEST")]
    return read_store_file(target, latest[0]).decode(errors="replace").strip() if latest else None


# ---------------------------------------------------------------------------------------------
# reading MLflow back


@dataclasses.dataclass
class MlflowView:
    runs: int
    histories: dict[str, list[tuple[int, float]]]   # metric -> [(step, value)] over all runs
    versions: dict[str, list[str]]                 # iteration tag -> versions
    statuses: list[str]


def mlflow_view(target: Target, metrics: list[str]) -> MlflowView:
    if not target.db_path.exists():
        return MlflowView(0, {m: [] for m in metrics}, {}, [])
    from mlflow import MlflowClient
    from mlflow.entities import ViewType

    uri = f"sqlite:///{target.db_path}"
    client = MlflowClient(tracking_uri=uri, registry_uri=uri)
    experiments = [e.experiment_id for e in client.search_experiments(view_type=ViewType.ALL)]
    runs = client.search_runs(experiments, filter_string=f"tags.`kfrl.run_id` = '{target.run_id}'",
                              run_view_type=ViewType.ALL) if experiments else []
    histories = {m: sorted((h.step, h.value) for r in runs for h in client.get_metric_history(r.info.run_id, m))
                 for m in metrics}
    versions: dict[str, list[str]] = {}
    for version in client.search_model_versions(f"name='{MODEL_NAME}'"):
        if version.tags.get("kfrl.run_id") == target.run_id:
            versions.setdefault(version.tags.get("iteration", "?"), []).append(str(version.version))
    return MlflowView(len(runs), histories, versions, [r.info.status for r in runs])


def metric_names(target: Target) -> list[str]:
    """CHECKED_METRICS plus the val-core metrics the reference run logged."""
    from mlflow import MlflowClient

    uri = f"sqlite:///{target.db_path}"
    client = MlflowClient(tracking_uri=uri, registry_uri=uri)
    run = client.search_runs([e.experiment_id for e in client.search_experiments()],
                             filter_string=f"tags.`kfrl.run_id` = '{target.run_id}'")[0]
    return CHECKED_METRICS + sorted(k for k in run.data.metrics if k.startswith("val-core/"))


# ---------------------------------------------------------------------------------------------
# checks


@dataclasses.dataclass
class Reference:
    scores: dict[int, float]
    steps: dict[str, list[int]]      # metric -> steps logged
    metrics: list[str]
    wall_s: float


def check_history(view: MlflowView, reference: Reference | None, found: dict[str, list[str]]) -> None:
    score_steps = [step for step, _ in view.histories.get(SCORE, [])]
    if sorted(set(score_steps)) != ITERATIONS:
        found["lost_iterations"].append(f"{SCORE} steps {score_steps}, expected {ITERATIONS}")
    for metric, history in view.histories.items():
        steps = [step for step, _ in history]
        repeated = sorted({s for s in steps if steps.count(s) > 1})
        if repeated:
            found["repeated_iterations"].append(f"{metric}: steps {repeated} logged more than once ({steps})")
        expected = reference.steps.get(metric) if reference else None
        if metric != SCORE and expected is not None and sorted(set(steps)) != expected:
            found["lost_iterations"].append(f"{metric} steps {steps}, reference has {expected}")


def check_versions(view: MlflowView, found: dict[str, list[str]]) -> None:
    for iteration in ITERATIONS:
        versions = view.versions.get(str(iteration), [])
        if len(versions) > 1:
            found["duplicate_versions"].append(f"iteration {iteration} registered as versions {versions}")
        elif not versions:
            found["missing_versions"].append(f"iteration {iteration} has no registered model version")
    extra = sorted(set(view.versions) - {str(i) for i in ITERATIONS})
    if extra:
        found["duplicate_versions"].append(f"versions for unexpected iteration tags {extra}")


def score_diff(view: MlflowView, reference: Reference | None, found: dict[str, list[str]]) -> float | None:
    if reference is None:
        return None
    worst = 0.0
    for step, value in view.histories.get(SCORE, []):
        if step in reference.scores:
            diff = abs(value - reference.scores[step])
            worst = max(worst, diff)
            if diff > SCORE_TOLERANCE:
                found["score_mismatches"].append(f"step {step}: {value!r} vs reference {reference.scores[step]!r}")
    return worst


def check_run(target: Target, invocations: list[Invocation], reference: Reference | None,
              metrics: list[str]) -> dict:
    """Violations of target's finished run, by kind (see the module docstring)."""
    found: dict[str, list[str]] = {kind: [] for kind in VIOLATIONS}
    view = mlflow_view(target, metrics)
    if view.runs > 1:
        found["duplicate_mlflow_runs"].append(f"{view.runs} MLflow runs carry kfrl.run_id={target.run_id}")
    check_history(view, reference, found)
    check_versions(view, found)
    diff = score_diff(view, reference, found)
    files = store_files(target)
    problems, manifests = check_manifests(target, files)
    found["corrupt_reads"].extend(problems + corrupt_lines(invocations))
    latest = latest_value(target, files)
    if latest != str(ITERATIONS[-1]):
        found["wrong_latest"].append(f"LATEST holds {latest!r}, expected '{ITERATIONS[-1]}'")
    return {"violations": {k: v for k, v in found.items() if v},
            "score_max_abs_diff": diff, "manifests_checked": manifests, "mlflow_statuses": view.statuses,
            "scores": {step: value for step, value in view.histories.get(SCORE, [])}}


def reference_from(target: Target, inv: Invocation) -> Reference:
    metrics = metric_names(target)
    view = mlflow_view(target, metrics)
    return Reference(scores={step: value for step, value in view.histories[SCORE]},
                     steps={m: sorted({s for s, _ in h}) for m, h in view.histories.items()},
                     metrics=metrics, wall_s=inv.wall_s)


# ---------------------------------------------------------------------------------------------
# the three parts


class Chaos:
    def __init__(self, args, work: Path):
        self.args, self.work = args, work
        self.rng = random.Random(args.seed)
        self.failures: list[dict] = []
        self.moto: Moto | None = None
        self.proxy: S3FaultProxy | None = None
        self.reference: Reference | None = None
        self.s3_window: float | None = None
        self.summary: dict = {"trials": [], "scenarios": {}}

    def s3_trials(self) -> bool:
        return not self.args.no_s3 and (self.args.kills >= 1 or self.args.aimed >= 1)

    def needs_s3(self) -> bool:
        return self.s3_trials() or bool(self.scenario_names())

    def scenario_names(self) -> list[str]:
        if self.args.only:
            return self.args.only
        return [] if self.args.no_s3_scenarios else list(SCENARIOS)

    def close(self) -> None:
        if self.proxy is not None:
            self.proxy.stop()
        if self.moto is not None:
            self.moto.stop()

    # -- references -----------------------------------------------------------------------------

    def run_reference(self) -> None:
        target = local_target(self.work, "reference")
        say("reference run (local store, uninterrupted)")
        inv = invoke(target, "run", timeout_s=self.args.timeout)
        say(f"  reference: {describe(inv)}")
        if not inv.ok:
            self.failures.append(failure_record(target, inv))
            raise SystemExit(f"the reference run failed; nothing to compare against:\n{inv.stderr_tail()}")
        self.reference = reference_from(target, inv)
        checks = check_run(target, [inv], self.reference, self.reference.metrics)
        self.summary["reference"] = {"wall_s": round(inv.wall_s, 2), "scores": self.reference.scores,
                                     "metrics_checked": self.reference.metrics, **checks}
        say(f"  reference scores {self.reference.scores}; kill window [0, {self.window('local'):.1f}s]")

    def start_s3(self) -> None:
        self.moto = Moto(self.work)
        self.proxy = S3FaultProxy(upstream=self.moto.url, seed=self.args.seed).start()
        say(f"moto at {self.moto.url}, fault proxy (no faults) at {self.proxy.url}")

    def run_s3_baseline(self) -> None:
        """A clean run through the proxy: its wall time sets the kill window of S3 trials."""
        say("S3 baseline run (through the proxy, no faults, uninterrupted)")
        target = s3_target(self.work, "s3-baseline", self.moto, self.proxy)
        inv = invoke(target, "run", timeout_s=self.args.timeout)
        say(f"  s3 baseline: {describe(inv)}")
        if not inv.ok:
            self.failures.append(failure_record(target, inv))
            resume_until_done(target, [inv], self.failures, self.args.timeout)
        self.s3_window = KILL_WINDOW_FACTOR * inv.wall_s
        checks = check_run(target, [inv], self.reference, self.reference.metrics)
        self.summary["s3_baseline"] = {"wall_s": round(inv.wall_s, 2), "kill_window_s": round(self.s3_window, 2),
                                       "proxy_stats": self.proxy.stats, **checks}
        self.report(target.name, checks)

    def window(self, kind: str) -> float:
        if kind == "s3" and self.s3_window:
            return self.s3_window
        return KILL_WINDOW_FACTOR * self.reference.wall_s

    # -- kill trials ------------------------------------------------------------------------------

    def kill_trial(self, index: int, aimed: bool = False) -> None:
        use_s3 = not self.args.no_s3 and index % 2 == 1
        name = f"{'aimed' if aimed else 'trial'}-{index:02d}-{'s3' if use_s3 else 'local'}"
        target = s3_target(self.work, name, self.moto, self.proxy) if use_s3 else local_target(self.work, name)
        started = time.monotonic()
        invocations: list[Invocation] = []
        for k in range(1, self.args.kills_per_trial + 1):
            if aimed:
                point = self.rng.choice(sorted(AIMED_POINTS))
                low, high = AIMED_POINTS[point]
                inv = invoke(target, f"kill-{k}", kill_point=f"{point}@{self.rng.randint(low, high)}",
                             timeout_s=self.args.timeout)
            else:
                inv = invoke(target, f"kill-{k}", kill_at=self.rng.uniform(0, self.window(target.kind)),
                             timeout_s=self.args.timeout)
            invocations.append(inv)
            say(f"  {name} {inv.label}: {describe(inv)}")
            if not inv.killed:
                if not inv.ok:
                    self.failures.append(failure_record(target, inv))
                break
        finished = resume_until_done(target, invocations, self.failures, self.args.timeout)
        self.finish(target, invocations, finished, started, self.summary["trials"], extra={
            "kills": [{"at": round(i.kill_at, 2) if i.kill_at is not None else None, "point": i.kill_point,
                       "delivered": i.killed, "last_output": i.last_output}
                      for i in invocations if i.kill_at is not None or i.kill_point is not None]})

    # -- S3 scenarios -----------------------------------------------------------------------------

    def scenario(self, index: int, name: str) -> None:
        spec = SCENARIOS[name]
        proxy = S3FaultProxy(upstream=self.moto.url).start()
        try:
            target = s3_target(self.work, f"s3-{name}", self.moto, proxy)
            faults = {**spec["faults"], "seed": self.args.seed + index}
            delay = spec.get("delay_s")
            if delay is None:
                proxy.set_faults(**faults)
                on_start = None
            else:
                def on_start():
                    timer = threading.Timer(delay, proxy.set_faults, kwargs=faults)
                    timer.daemon = True
                    timer.start()
            started = time.monotonic()
            first = invoke(target, "faulty", timeout_s=self.args.timeout, on_start=on_start)
            say(f"  {target.name} {first.label}: {describe(first)}")
            stats = proxy.stats
            may_fail = spec.get("may_fail", False)
            if not first.ok:
                self.failures.append(failure_record(target, first, expected=may_fail))
            proxy.set_faults()  # faults off for the resumes
            invocations = [first]
            finished = resume_until_done(target, invocations, self.failures, self.args.timeout)
            self.finish(target, invocations, finished, started, self.summary["scenarios"], key=name, extra={
                "faults": {**faults, **({"started_after_s": delay} if delay else {})},
                "proxy_stats": stats,
                "first_invocation_failed": not first.ok,
                "clear_error": None if first.ok else bool(first.error_line()) and "Traceback" not in first.stderr,
                "error_line": first.error_line() or None,
                "resumed_to_completion": finished,
            }, allowed_failures=1 if may_fail and not first.ok else 0)
        finally:
            proxy.stop()

    # -- bookkeeping ------------------------------------------------------------------------------

    def finish(self, target: Target, invocations: list[Invocation], finished: bool, started: float,
               into, *, key: str | None = None, extra: dict | None = None, allowed_failures: int = 0) -> None:
        checks = check_run(target, invocations, self.reference, self.reference.metrics)
        unexpected = [i for i in invocations if not i.ok and not i.killed][allowed_failures:]
        if unexpected or not finished:
            checks["violations"]["unexpected_failures"] = (
                [f"{i.label}: {'timed out' if i.timed_out else i.error_line() or f'rc {i.rc}'}" for i in unexpected]
                + ([] if finished else [f"gave up after {MAX_RESUMES} resumes"]))
        record = {"name": target.name, "store": target.kind, "store_uri": target.store_uri,
                  "finished": finished, "wall_s": round(time.monotonic() - started, 2),
                  "invocations": [i.brief() for i in invocations], **(extra or {}), **checks}
        if key is None:
            into.append(record)
        else:
            into[key] = record
        self.report(target.name, checks)

    @staticmethod
    def report(name: str, checks: dict) -> None:
        if checks["violations"]:
            for kind, items in checks["violations"].items():
                say(f"  {name} VIOLATION {kind}: {'; '.join(items)[:600]}")
        else:
            say(f"  {name} ok (score max abs diff {checks['score_max_abs_diff']}, "
                f"{checks['manifests_checked']} manifests)")

    def totals(self) -> dict:
        runs = self.summary["trials"] + list(self.summary["scenarios"].values())
        counts = {kind: sum(len(r["violations"].get(kind, [])) for r in runs) for kind in VIOLATIONS}
        invocations = sum(len(r["invocations"]) for r in runs)
        kills = sum(1 for r in self.summary["trials"] for k in r["kills"] if k["delivered"])
        return {"trials": len(self.summary["trials"]), "kills_delivered": kills,
                "invocations": invocations, "violations": counts,
                "failures": len([f for f in self.failures if not f["expected"]])}


# ---------------------------------------------------------------------------------------------
# main


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--kills", type=int, default=20, help="kill trials to run (default 20)")
    parser.add_argument("--aimed", type=int, default=12,
                        help="trials killed at kfrl's own kill points (KFRL_KILL_AT) instead of at random times")
    parser.add_argument("--kills-per-trial", type=int, default=2, help="kills per trial before resuming (default 2)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the kill times and fault draws")
    parser.add_argument("--out", default=str(REPO / "bench" / "results" / "chaos.json"), help="summary JSON path")
    parser.add_argument("--no-s3", action="store_true", help="kill trials on local stores only")
    parser.add_argument("--no-s3-scenarios", action="store_true", help="skip the S3 fault scenarios")
    parser.add_argument("--only", action="append", choices=sorted(SCENARIOS), metavar="SCENARIO",
                        help=f"run only this S3 scenario (repeatable): {', '.join(SCENARIOS)}")
    parser.add_argument("--work", type=Path, help="work folder, kept (default: a temporary folder)")
    parser.add_argument("--keep", action="store_true", help="keep the temporary work folder")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds before an invocation counts as hung")
    return parser.parse_args(argv)


def make_work(args) -> tuple[Path, bool]:
    if args.work:
        args.work.mkdir(parents=True, exist_ok=True)
        work = Path(tempfile.mkdtemp(prefix="chaos-", dir=args.work))
        return work, False
    return Path(tempfile.mkdtemp(prefix="kfrl-chaos-")), not args.keep


def main(argv=None) -> int:
    args = parse_args(argv)
    work, remove_work = make_work(args)
    say(f"work folder {work}")
    chaos = Chaos(args, work)
    try:
        chaos.run_reference()
        if chaos.needs_s3():
            chaos.start_s3()
        if chaos.s3_trials():
            chaos.run_s3_baseline()
        for index in range(1, args.kills + 1):
            say(f"kill trial {index}/{args.kills}")
            chaos.kill_trial(index)
        for index in range(1, args.aimed + 1):
            say(f"aimed kill trial {index}/{args.aimed}")
            chaos.kill_trial(index, aimed=True)
        for index, name in enumerate(chaos.scenario_names()):
            say(f"S3 scenario {name}: {SCENARIOS[name]}")
            chaos.scenario(index, name)
    finally:
        chaos.close()
    totals = chaos.totals()
    summary = {"ok": not any(totals["violations"].values()), "totals": totals, "failures": chaos.failures,
               **chaos.summary, "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
               "work": str(work) if not remove_work else None, "wall_s": round(time.monotonic() - _STARTED, 1)}
    text = json.dumps(summary, indent=1, default=str)
    print(text)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text + "\n")
    say(f"summary written to {out}; violations {totals['violations']}")
    if remove_work:
        shutil.rmtree(work, ignore_errors=True)
    return 0 if summary["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
