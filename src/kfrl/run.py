"""The layout of one training run in the store: the one place that knows where things are.

    {run}/config.yaml                    the resolved config every stage reads
    {run}/data/train, {run}/data/val     the committed datasets
    {run}/iter-{N:06d}/{stage}/          each stage's commit (iteration 0: the initial policy/critic)
    {run}/iter-{N:06d}/actor_state/      the trainer state after the update of N (fp32 weights, optimizer):
    {run}/iter-{N:06d}/critic_state/     only the next update or a resume reads it; the last few are kept
    {run}/LATEST                         the last iteration whose stages are committed and recorded
    {run}/ENGINE.json                    where the run's resident engine listens, while it runs

Weights after iteration N are the ``update_actor`` (``update_critic``) commit of N, or, when that
update was skipped (critic warm-up), of the last iteration before N where it ran.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

from kfrl.store import CorruptManifestError, Manifest, Store, StoreError, StoreNotFoundError

CONFIG_FILE = "config.yaml"
LATEST_FILE = "LATEST"
ENGINE_FILE = "ENGINE.json"
POLICY_STAGE = "update_actor"
CRITIC_STAGE = "update_critic"
ACTOR_STATE = "actor_state"
CRITIC_STATE = "critic_state"
INIT_ITERATION = 0
_ITERATION_DIR = re.compile(r"^iter-(\d{6,})$")


_PARSED_CONFIGS: dict[str, object] = {}


class RunLayoutError(RuntimeError):
    """Something the layout promises is missing; the message names the URI."""


def _check_iteration(iteration) -> int:
    if isinstance(iteration, bool) or not isinstance(iteration, int) or iteration < 0:
        raise ValueError(f"iteration must be a non-negative int, got {iteration!r}")
    return iteration


def stage_prefix(iteration: int, stage: str) -> str:
    """1, ``"rollout"`` → ``"iter-000001/rollout"`` (relative to the run)."""
    return f"iter-{_check_iteration(iteration):06d}/{stage}"


def registry_view(iteration: int) -> str:
    """Where the registered policy version of ``iteration`` is linked for MLflow (relative to the run):
    hard links to the committed files, outside every committed folder, since MLflow writes into the
    folder it loads a local version from (``kfrl.tracking.linked_view``)."""
    return f"registry/iter-{_check_iteration(iteration):06d}"


_STAGE_PREFIX = re.compile(r"^iter-(\d+)/(.+)$")


def split_stage_prefix(prefix: str) -> tuple[int, str] | None:
    """The inverse of ``stage_prefix``: ``"iter-000003/update_actor"`` → (3, ``"update_actor"``); None for
    a prefix outside the iterations (``data/train``)."""
    match = _STAGE_PREFIX.match(prefix)
    return (int(match.group(1)), match.group(2)) if match else None


@dataclass(frozen=True)
class Run:
    """A run's store (rooted at the run) read through its layout."""
    store: Store

    @classmethod
    def at(cls, uri: str, **store_options) -> "Run":
        return cls(Store(uri, **store_options))

    @property
    def uri(self) -> str:
        return self.store.uri

    def url(self, stage: str, iteration: int) -> str:
        return self.store.url(stage_prefix(iteration, stage))

    # --- config -----------------------------------------------------------------------------------
    def has_config(self) -> bool:
        return self.store.exists(CONFIG_FILE)

    def config_text(self) -> str:
        try:
            return self.store.read_text(CONFIG_FILE)
        except StoreNotFoundError as err:
            raise RunLayoutError(f"no {CONFIG_FILE} at {self.store.url(CONFIG_FILE)}: is '{self.uri}' a kfrl run? "
                                 "`kfrl train` creates it") from err

    def config(self):
        """The run's validated config. Parsed once per text in a process: every stage opens it, and
        parsing and validating the YAML costs ~25 ms, ten times an iteration in a resident engine."""
        from kfrl.config import config_from_yaml_text

        text = self.config_text()
        parsed = _PARSED_CONFIGS.get(text)
        if parsed is None:
            parsed = config_from_yaml_text(text, self.store.url(CONFIG_FILE))
            if len(_PARSED_CONFIGS) >= 4:
                _PARSED_CONFIGS.pop(next(iter(_PARSED_CONFIGS)))
            _PARSED_CONFIGS[text] = parsed
        return parsed.model_copy(deep=True)  # a caller's change must not reach the next stage

    def write_config(self, text: str) -> None:
        self.store.write_text(CONFIG_FILE, text)

    # --- commits ----------------------------------------------------------------------------------
    def withdraw_all(self) -> int:
        """Repair: withdraw the config and every commit (data, initial weights, stages), so the run is
        prepared and computed again. Returns the number of commits withdrawn."""
        from kfrl.store import MANIFEST_NAME

        manifests = [name for name in self.store.list("") if name.rsplit("/", 1)[-1] == MANIFEST_NAME]
        for name in manifests:
            self.store.uncommit(name.rsplit("/", 1)[0])
        self.store.delete(CONFIG_FILE)
        return len(manifests)

    def manifest(self, stage: str, iteration: int) -> Manifest | None:
        try:
            return self.store.manifest(stage_prefix(iteration, stage))
        except CorruptManifestError as err:
            raise CorruptManifestError(f"{str(err).partition('. Restore')[0]}. {self._repair_advice(iteration)}") from err

    def _repair_advice(self, iteration: int) -> str:
        latest = self.latest()
        if latest is None or iteration > latest:
            return "Delete it and resume (kfrl train --run-id): the stage runs again."
        return (f"Iteration {iteration} is already recorded (LATEST={latest}), so resuming will not run the stage "
                "again: restore the manifest from a copy (with S3 object versioning, its previous version). To go on "
                f"without it, export the policy of an earlier iteration (kfrl export --iteration {max(iteration - 1, 0)}) "
                "and start a new run from it (model.path).")

    def is_committed(self, stage: str, iteration: int) -> bool:
        return self.store.is_committed(stage_prefix(iteration, stage))

    def checkpoint(self, stage: str, iteration: int) -> tuple[Manifest, int]:
        """(manifest, iteration it was written at) of the weights ``stage`` holds after ``iteration``,
        walking back over iterations where the update was skipped."""
        for it in range(_check_iteration(iteration), INIT_ITERATION - 1, -1):
            manifest = self.manifest(stage, it)
            if manifest is None:
                after = "" if it == iteration else f", which holds the weights after iteration {iteration}"
                raise RunLayoutError(f"{stage} of iteration {it} is not committed ({self.url(stage, it)}){after}")
            if not manifest.info.get("skipped"):
                return manifest, it
        raise RunLayoutError(f"every {stage} of run {self.uri} up to iteration {iteration} was skipped; "
                             "the run has no checkpoint there")

    def iteration_metrics(self, iteration: int, stages: tuple[str, ...]) -> dict[str, float]:
        """The committed metrics of ``stages`` at ``iteration``; later stages win on a shared name."""
        metrics: dict[str, float] = {}
        for stage in stages:
            manifest = self.manifest(stage, iteration)
            if manifest is not None:
                metrics.update({k: float(v) for k, v in manifest.metrics.items()})
        return metrics

    def committed_iterations(self, stage: str) -> list[int]:
        """Iterations with a committed ``stage``, each probed (retention removes old ones: a run's
        iterations up to LATEST need not all hold it)."""
        iterations = [int(match.group(1)) for match in map(_ITERATION_DIR.match, self.store.subdirs("")) if match]
        return sorted(i for i in iterations if self.is_committed(stage, i))

    # --- LATEST -----------------------------------------------------------------------------------
    def latest(self) -> int | None:
        try:
            text = self.store.read_text(LATEST_FILE)
        except StoreNotFoundError:
            return None
        try:
            return int(text.strip())
        except ValueError as err:
            raise StoreError(f"{self.store.url(LATEST_FILE)} should hold an iteration number but holds "
                             f"{text[:40]!r}; fix or delete it") from err

    def set_latest(self, iteration: int) -> None:
        """Move LATEST to ``iteration`` once every commit this process still writes in the background
        (an update's weights) is durable: at once when there is none."""
        from kfrl.store import after_in_flight

        text = f"{_check_iteration(iteration)}\n"
        after_in_flight(lambda: self.store.write_text(LATEST_FILE, text))

    # --- the resident engine ------------------------------------------------------------------------
    def engine(self) -> dict | None:
        """The resident engine's address record (``url``, ``pid``, ``host``), or None."""
        import json

        try:
            return json.loads(self.store.read_text(ENGINE_FILE))
        except StoreNotFoundError:
            return None
        except ValueError:
            return None  # half-written by a killed engine: no engine

    def set_engine(self, record: dict) -> None:
        import json

        self.store.write_text(ENGINE_FILE, json.dumps(record))

    def clear_engine(self) -> None:
        self.store.delete(ENGINE_FILE)
