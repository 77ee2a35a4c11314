"""How long a run's policy weights stay in the store (``trainer.keep_policy_weights``, ``kfrl gc``).

Every iteration commits the policy (``iter-N/update_actor``: the inference-dtype weights, 2 bytes per
parameter on a GPU). A policy is kept when it is one of the newest ``keep`` iterations up to LATEST, the
initial model (iteration 0: the reference policy), at a ``trainer.save_freq`` multiple, the weights a
kept trainer state was written beside (a resume reads both), or the source of any registered MLflow
version (aliased ones included). Only iterations at or below LATEST are considered: what a running
iteration reads is never touched.

Deleting is ``Store.remove_commit``: the manifest goes first, then the files, so a kill mid-way leaves
files no manifest names (no reader sees them; ``kfrl gc`` removes them later), never a manifest whose
files are gone.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from kfrl.run import ACTOR_STATE, INIT_ITERATION, POLICY_STAGE, Run, stage_prefix
from kfrl.store import MANIFEST_NAME


def policies_to_delete(committed: list[int], latest: int, keep: int, save_freq: int,
                       protected: set[int]) -> list[int]:
    """The committed policy iterations that fall out of the window (a pure rule; ``keep`` 0 keeps all)."""
    if keep <= 0:
        return []
    newest_kept = set(range(latest - keep + 1, latest + 1))
    return [i for i in sorted(committed)
            if i != INIT_ITERATION and i <= latest and i not in newest_kept and i not in protected
            and not (save_freq > 0 and i % save_freq == 0)]


@dataclass
class Retention:
    deleted: list[int] = field(default_factory=list)    # iterations whose policy commit was removed
    kept_for: dict[int, str] = field(default_factory=dict)  # outside the window but kept, and why
    orphans: list[str] = field(default_factory=list)    # files of withdrawn or half-deleted commits, removed


def apply_policy_retention(run: Run, keep: int, save_freq: int, registered: set[int], *, whole_run: bool = False,
                           dry_run: bool = False) -> Retention:
    """Delete the policy commits that fell out of the window (the module docstring). As a run goes (after
    each LATEST) only the iteration that just left the window and the one before it (a delete killed
    last time) are looked at; ``whole_run`` looks at every iteration (``kfrl gc``)."""
    latest = run.latest()
    result = Retention()
    if latest is None or keep <= 0:
        return result
    edge = latest - keep
    candidates = range(INIT_ITERATION + 1, edge + 1) if whole_run else range(max(INIT_ITERATION + 1, edge - 1), edge + 1)
    for iteration in policies_to_delete(list(candidates), latest, keep, save_freq, set(registered)):
        if run.is_committed(ACTOR_STATE, iteration):
            result.kept_for[iteration] = "its trainer state is kept"
            continue
        if not run.is_committed(POLICY_STAGE, iteration):
            continue
        if not dry_run:
            run.store.remove_commit(stage_prefix(iteration, POLICY_STAGE))
        result.deleted.append(iteration)
    for iteration in sorted(set(registered) & set(candidates)):
        result.kept_for[iteration] = "registered in MLflow"
    return result


def orphaned_policy_files(run: Run, latest: int) -> list[str]:
    """Files under ``iter-N/update_actor`` (N < LATEST) that no committed manifest names: left by a
    delete that was killed, or by attempts that never committed. The newest iteration is left alone (a
    writer may be at work there)."""
    orphans = []
    for iteration in sorted(i for i in _iterations_with_files(run) if i < latest):
        prefix = stage_prefix(iteration, POLICY_STAGE)
        manifest = run.store.manifest(prefix)
        named = {f"{manifest.attempt}/{name}" for name in manifest.names()} if manifest else set()
        for name in run.store.list(prefix):
            if name != MANIFEST_NAME and name not in named:
                orphans.append(f"{prefix}/{name}")
    return orphans


def _iterations_with_files(run: Run) -> list[int]:
    return [int(name[5:]) for name in run.store.subdirs("") if name.startswith("iter-") and name[5:].isdigit()]


def collect_garbage(run: Run, keep: int, save_freq: int, registered: set[int], *, dry_run: bool = False) -> Retention:
    """``kfrl gc``: the retention rule over the whole run, then the orphaned files."""
    result = apply_policy_retention(run, keep, save_freq, registered, whole_run=True, dry_run=dry_run)
    latest = run.latest()
    if latest is not None:
        result.orphans = orphaned_policy_files(run, latest)
        if not dry_run:
            for name in result.orphans:
                run.store.delete(name)
    return result
