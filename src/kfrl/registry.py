"""The model registry side of kfrl: ``models:/`` URIs as a run's ``model.path``, and the promotion gate
(``kfrl promote``) that moves an alias to a run's newest version when its validation metric is better.

Registered versions carry the validation metrics of their iteration as tags (``val-core/...``, with
``@`` written ``_at_`` as MLflow requires), so a comparison needs no metric history.
"""
from __future__ import annotations

import re
from dataclasses import asdict, dataclass, field
from pathlib import Path

from kfrl.tracking import (ITERATION_TAG, RUN_ID_TAG, VALIDATION_PREFIX, TrackingError, is_local_uri,
                           mlflow_metric_name, require_no_quote, resolve_tracking_uri)

_MODELS_URI = re.compile(r"^models:/(?P<name>[^/@]+)(?:/(?P<version>\d+)|@(?P<alias>[\w.-]+))$")


class PromotionRefused(TrackingError):
    """Nothing to compare: no such run, no registered version, or no validation metric."""


def is_models_uri(path: str) -> bool:
    return path.startswith("models:/")


def parse_models_uri(uri: str) -> tuple[str, str | None, str | None]:
    """``models:/name/3`` → (name, "3", None); ``models:/name@champion`` → (name, None, "champion")."""
    match = _MODELS_URI.match(uri)
    if match is None:
        raise ValueError(f"{uri!r} is not a model version URI: use models:/<name>/<version> or "
                         "models:/<name>@<alias>")
    return match["name"], match["version"], match["alias"]


def _client(tracking_uri: str):
    from mlflow import MlflowClient

    uri = resolve_tracking_uri(tracking_uri)
    return MlflowClient(tracking_uri=uri, registry_uri=uri), uri


def resolve_model_version(uri: str, tracking_uri: str):
    """The ``ModelVersion`` a ``models:/`` URI names; a missing model, version or alias is named."""
    from mlflow.exceptions import MlflowException

    name, version, alias = parse_models_uri(uri)
    client, resolved = _client(tracking_uri)
    try:
        if alias:
            return client.get_model_version_by_alias(name, alias)
        return client.get_model_version(name, version)
    except MlflowException as err:
        what = f"alias @{alias}" if alias else f"version {version}"
        raise FileNotFoundError(f"model.path {uri}: registered model {name!r} has no {what} in the MLflow registry "
                                f"at {resolved} ({err.message.splitlines()[0]})") from None


def model_version_source(uri: str, tracking_uri: str, cache: Path) -> tuple[str, dict]:
    """Where the weights of a ``models:/`` URI are: (an HF directory path or a store URI, facts for the
    run's records). A source in the run's artifacts (``runs:/``, ``mlflow-artifacts:``) is downloaded
    into ``cache`` once per version."""
    version = resolve_model_version(uri, tracking_uri)
    facts = {"model_uri": uri, "model_name": version.name, "model_version": str(version.version)}
    source = version.source
    if source.startswith(("runs:/", "mlflow-artifacts:", "models:/")):
        import hashlib
        import shutil

        from mlflow.artifacts import download_artifacts

        resolved = resolve_tracking_uri(tracking_uri)
        target = cache / "registry" / hashlib.sha1(f"{resolved} {source}".encode()).hexdigest()[:16]
        if not (target / "config.json").is_file():
            partial = target.with_name(target.name + ".partial")
            shutil.rmtree(partial, ignore_errors=True)
            partial.mkdir(parents=True)
            # The source itself: runs:/ resolves against tracking_uri (models:/ would use the global registry).
            fetched = Path(download_artifacts(artifact_uri=source, dst_path=str(partial), tracking_uri=resolved))
            shutil.rmtree(target, ignore_errors=True)
            fetched.rename(target)
            shutil.rmtree(partial, ignore_errors=True)
        return str(target), facts
    if is_local_uri(source):
        return source.removeprefix("file://"), facts
    return source, facts


@dataclass
class Promotion:
    promoted: bool
    model: str
    alias: str
    metric: str
    reason: str
    candidate: dict = field(default_factory=dict)
    champion: dict | None = None

    def to_dict(self) -> dict:
        return asdict(self)


def _metric_tags(version) -> dict[str, float]:
    found = {}
    for key, value in version.tags.items():
        if key.startswith(VALIDATION_PREFIX):
            try:
                found[key] = float(value)
            except ValueError:
                continue
    return found


def _pick_metric(tags: dict[str, float], metric: str | None, where: str) -> str:
    if metric:
        name = mlflow_metric_name(metric)
        if name not in tags:
            raise PromotionRefused(f"{where} has no validation metric {metric!r}; it has: "
                                   f"{', '.join(sorted(tags)) or 'none (validation did not run at that iteration)'}")
        return name
    rewards = sorted(key for key in tags if "/reward/mean_at_" in key)
    if len(rewards) == 1:
        return rewards[0]
    if len(tags) == 1:
        return next(iter(tags))
    if not tags:
        raise PromotionRefused(f"{where} has no validation metric: the run did not validate at that iteration "
                               "(data.val_files and trainer.test_freq); nothing to compare")
    raise PromotionRefused(f"{where} has several validation metrics; choose one with --metric: "
                           f"{', '.join(sorted(tags))}")


def promote(tracking_uri: str, kfrl_run_id: str, *, alias: str = "champion", metric: str | None = None,
            min_delta: float = 0.0) -> Promotion:
    """Move ``alias`` to the newest version ``kfrl_run_id`` registered when its validation metric beats
    the current holder's by more than ``min_delta`` (higher is better), or when no version holds it."""
    from mlflow.exceptions import MlflowException

    require_no_quote("run id", kfrl_run_id)
    client, resolved = _client(tracking_uri)
    versions = client.search_model_versions(f"tag.`{RUN_ID_TAG}`='{kfrl_run_id}'")
    if not versions:
        raise PromotionRefused(f"kfrl run {kfrl_run_id} registered no model version in the MLflow registry at "
                               f"{resolved}: is it the right run and tracking URI?")
    candidate = max(versions, key=lambda v: (int(v.tags.get(ITERATION_TAG, -1)), int(v.version)))
    where = f"version {candidate.version} of {candidate.name} (iteration {candidate.tags.get(ITERATION_TAG)})"
    tags = _metric_tags(candidate)
    name = _pick_metric(tags, metric, where)
    mine = {"version": str(candidate.version), "run_id": kfrl_run_id, "value": tags[name],
            "iteration": int(candidate.tags.get(ITERATION_TAG, -1))}
    try:
        holder = client.get_model_version_by_alias(candidate.name, alias)
    except MlflowException:
        holder = None
    theirs = None
    if holder is not None:
        held = _metric_tags(holder)
        theirs = {"version": str(holder.version), "run_id": holder.tags.get(RUN_ID_TAG),
                  "value": held.get(name), "iteration": int(holder.tags.get(ITERATION_TAG, -1))}
    if holder is None:
        promoted, reason = True, f"no version held @{alias}"
    elif str(holder.version) == str(candidate.version):
        promoted, reason = False, f"version {candidate.version} already holds @{alias}"
    elif theirs["value"] is None:
        promoted, reason = True, f"the holder of @{alias} (version {holder.version}) has no {name} to compare"
    elif mine["value"] > theirs["value"] + min_delta:
        promoted, reason = True, f"{mine['value']:.6g} > {theirs['value']:.6g} + {min_delta:g}"
    else:
        promoted, reason = False, f"{mine['value']:.6g} <= {theirs['value']:.6g} + {min_delta:g}"
    if promoted:
        client.set_registered_model_alias(candidate.name, alias, str(candidate.version))
    return Promotion(promoted=promoted, model=candidate.name, alias=alias, metric=name, reason=reason,
                     candidate=mine, champion=theirs)
