"""``kfrl export``: a run's policy (or critic) checkpoint as a standalone Hugging Face model directory.

A checkpoint in the store is an HF directory plus training state (``optimizer.pt``,
``trainer_state.json``). An export is what serving and evaluation want: ``config.json``,
``generation_config.json``, safetensors weights and the tokenizer, plus ``kfrl_export.json``
saying which run, iteration and committed attempt the files came from.

By default the committed files are copied byte for byte (checked against their manifest; no torch
needed). With ``dtype`` the model is loaded with transformers and saved again in that dtype.

The export is assembled in a hidden sibling of the target and renamed into place at the end, so a
failed export leaves nothing half-written behind.
"""
from __future__ import annotations

import dataclasses
import datetime as _dt
import json
import os
import re
import shutil
import uuid
from pathlib import Path

from kfrl.run import CONFIG_FILE, CRITIC_STAGE, INIT_ITERATION, POLICY_STAGE, Run, RunLayoutError
from kfrl.stages.update import OPTIMIZER_FILE, TRAINER_STATE_FILE
from kfrl.store import DOWNLOAD_MARKER, Manifest, Store

PROVENANCE_FILE = "kfrl_export.json"
PROVENANCE_FORMAT = 1
# Training state, not model: never exported.
EXCLUDED_FILES = {OPTIMIZER_FILE, TRAINER_STATE_FILE, DOWNLOAD_MARKER, PROVENANCE_FILE}
DTYPES = {"bfloat16": "bfloat16", "bf16": "bfloat16", "float16": "float16", "fp16": "float16",
          "half": "float16", "float32": "float32", "fp32": "float32", "float": "float32"}
_WEIGHT_FILE = re.compile(r"(\.safetensors|\.safetensors\.index\.json|\.bin|\.bin\.index\.json|\.pt|\.pth)$")
_MAX_LISTED_RUNS = 10


class ExportError(RuntimeError):
    """An export cannot be done as asked; the message says why and what to do instead."""


@dataclasses.dataclass
class ExportResult:
    path: Path                  # the exported HF model directory
    iteration: int              # the weights are the model after this many iterations
    source: str                 # URI of the committed checkpoint the files came from
    checkpoint_iteration: int   # the iteration whose update committed them (< iteration after skipped updates)
    attempt: str                # the committed attempt of that checkpoint
    model: str = "policy"       # "policy" or "critic"
    dtype: str | None = None    # None: the files as committed, byte for byte
    files: list[str] = dataclasses.field(default_factory=list)
    notes: list[str] = dataclasses.field(default_factory=list)


# ---------------------------------------------------------------------------------------------
# finding a run


def find_run(store_uri: str, run_id: str, experiment: str | None = None) -> str:
    """The URI of run ``run_id`` in the store at ``store_uri``.

    With ``experiment``, the run is ``{store}/{experiment}/{run_id}``. Without, every experiment
    folder of the store is searched for ``{experiment}/{run_id}/config.yaml``; ``run_id`` may also be
    given as ``experiment/run_id``.
    """
    root = Store(store_uri)
    run_id = _one_component(run_id, "run id", allow_pair=experiment is None)
    if "/" in run_id:
        experiment, run_id = run_id.split("/")
    if experiment is not None:
        experiment = _one_component(experiment, "experiment")
        rel = f"{experiment}/{run_id}"
        if root.exists(f"{rel}/{CONFIG_FILE}"):
            return root.url(rel)
        others = [r for r in _experiments_with(root, run_id) if r != experiment]
        hint = (f" A run {run_id!r} exists in experiment(s) {', '.join(others)}: pass --experiment "
                f"{others[0]}." if others else "")
        runs = _list_runs(root, experiment)
        listed = _format_runs(runs, f"experiment {experiment!r} of {root.uri}")
        raise ExportError(f"no run {run_id!r} in experiment {experiment!r} of store {root.uri} "
                          f"(no {root.url(rel + '/' + CONFIG_FILE)}).{hint} {listed}")

    found = _experiments_with(root, run_id)
    if len(found) == 1:
        return root.url(f"{found[0]}/{run_id}")
    if len(found) > 1:
        raise ExportError(f"run id {run_id!r} exists in several experiments of store {root.uri}: "
                          f"{', '.join(f'{e}/{run_id}' for e in found)}; pass --experiment to pick one")
    if root.exists(f"{run_id}/{CONFIG_FILE}"):
        parent, _, name = root.uri.rstrip("/").rpartition("/")
        raise ExportError(f"no run {run_id!r} in store {root.uri}, but {root.url(run_id)} is a run: the store URI "
                          f"names an experiment folder. Use --store {parent} --experiment {name}")
    listed = _format_runs(_list_runs(root), f"store {root.uri}")
    raise ExportError(f"no run {run_id!r} in store {root.uri} (looked for <experiment>/{run_id}/{CONFIG_FILE}). "
                      f"{listed}")


def _one_component(value, what: str, allow_pair: bool = False) -> str:
    text = str(value or "").strip().strip("/")
    parts = text.split("/")
    if not text or any(p in ("", ".", "..") for p in parts) or len(parts) > (2 if allow_pair else 1):
        form = "a name like 20250101-120000-ab12 (or experiment/run_id)" if allow_pair else "a single folder name"
        raise ExportError(f"{what} {value!r} is not valid; give {form}")
    return text


def _experiments_with(root: Store, run_id: str) -> list[str]:
    return [exp for exp in root.subdirs() if root.exists(f"{exp}/{run_id}/{CONFIG_FILE}")]


def _list_runs(root: Store, experiment: str | None = None) -> list[str]:
    """``experiment/run_id`` of every run below the store root (or of one experiment)."""
    runs = []
    for exp in [experiment] if experiment else root.subdirs():
        runs += [f"{exp}/{run}" for run in root.subdirs(exp) if root.exists(f"{exp}/{run}/{CONFIG_FILE}")]
    return runs


def _format_runs(runs: list[str], where: str) -> str:
    if not runs:
        return f"There are no runs in {where}; check the store URI (--store) and the experiment name."
    # Run ids start with their UTC start time, so the newest sort last.
    newest = sorted(runs, key=lambda r: r.split("/")[-1])[-_MAX_LISTED_RUNS:]
    more = f" (the {len(newest)} newest of {len(runs)})" if len(runs) > len(newest) else ""
    return f"Runs in {where}{more}: {', '.join(newest)}."


# ---------------------------------------------------------------------------------------------
# export


def export_policy(run_uri: str, to: str | Path, *, iteration: int | None = None, dtype: str | None = None,
                  critic: bool = False, overwrite: bool = False, adapter: bool = False) -> ExportResult:
    """Write the run's policy (or, with ``critic``, its value model) as an HF directory at ``to``.

    A LoRA run's checkpoints are adapters on its initial model: by default the merged model is written
    (the one the iteration registered, byte for byte, when it has one); ``adapter``: the PEFT adapter
    folder instead (``adapter_config.json``, ``adapter_model.safetensors``, the tokenizer), for
    ``PeftModel.from_pretrained(base, folder)``.

    ``iteration``: None = the run's last completed iteration (LATEST); N = the model after N
    iterations (0 = the initial model). An update skipped at N (critic warm-up) leaves the weights
    of the last update before it in force; those are exported and the result says so.
    """
    dtype = _normalise_dtype(dtype)
    target = _check_target(to, overwrite)
    run = Run.at(run_uri)
    if not run.has_config():
        raise ExportError(f"{run.uri} is not a kfrl run (no {CONFIG_FILE} there); find the run with "
                          "`kfrl export --run ID [--experiment NAME] --store URI`")
    config = run.config()
    stage, model_kind = (CRITIC_STAGE, "critic") if critic else (POLICY_STAGE, "policy")
    notes: list[str] = []
    if critic and not run.is_committed(CRITIC_STAGE, INIT_ITERATION):
        from kfrl.stages import skip_reason

        why = skip_reason(CRITIC_STAGE, config) or "its critic was never initialised"
        raise ExportError(f"run {run.uri} has no critic to export ({why}); export the policy instead "
                          "(leave out --critic)")

    latest = run.latest()
    if iteration is None:
        if latest is None:
            raise ExportError(f"run {run.uri} has no completed iteration yet (no LATEST); pass --iteration 0 "
                              "to export the initial model, or wait for iteration 1 to finish")
        iteration = latest
    if isinstance(iteration, str) and iteration.strip().isdigit():
        iteration = int(iteration)
    if isinstance(iteration, bool) or not isinstance(iteration, int) or iteration < 0:
        raise ExportError(f"iteration must be a whole number >= 0 (0 = the initial model), got {iteration!r}")

    if not run.is_committed(stage, iteration):
        have = _describe_iterations(run.committed_iterations(stage))
        what = "" if stage == POLICY_STAGE else f" for the critic ({stage})"
        raise ExportError(f"iteration {iteration} is not committed{what} in run {run.uri}; the run has "
                          f"{have}" + (f" (LATEST is {latest})" if latest is not None else ""))
    if latest is not None and iteration > latest:
        notes.append(f"iteration {iteration} is past LATEST ({latest}): its checkpoint is committed but the "
                     "iteration was not recorded yet")
    try:
        manifest, checkpoint_iteration = run.checkpoint(stage, iteration)
    except RunLayoutError as err:
        raise ExportError(f"{err}; the run has no checkpoint to export there") from err
    if checkpoint_iteration != iteration:
        notes.append(f"the {model_kind} update was skipped at "
                     f"{_describe_iterations(list(range(checkpoint_iteration + 1, iteration + 1)))} "
                     f"({_skip_reason(run, stage, iteration)}); the weights in force after iteration "
                     f"{iteration} are iteration {checkpoint_iteration}'s checkpoint")

    tmp = target.with_name(f".{target.name}.kfrl-export-{uuid.uuid4().hex[:8]}")
    try:
        tmp.mkdir(parents=True)
        if manifest.info.get("adapter"):
            source, attempt, resave, fetched_from = _assemble_lora(run, manifest, config, tmp, dtype=dtype,
                                                                   critic=critic, adapter=adapter, notes=notes)
        elif adapter:
            raise ExportError(f"the {model_kind} of run {run.uri} at iteration {iteration} is no LoRA adapter (the run "
                              "trains every weight: model.lora_rank=0, or iteration 0 is the base); leave out --adapter")
        else:
            source, attempt, resave, fetched_from = _assemble(run, manifest, config, tmp, dtype=dtype,
                                                              critic=critic, notes=notes)
        files = sorted(p.relative_to(tmp).as_posix() for p in tmp.rglob("*") if p.is_file())
        _check_output(tmp, files, model_kind, dtype, notes)
        if adapter:
            model_kind += " adapter"
        provenance = {
            "format": PROVENANCE_FORMAT,
            "run_uri": run.uri,
            "model": model_kind,
            "iteration": iteration,
            "checkpoint_iteration": checkpoint_iteration,
            "source": source,
            "source_manifest": run.store.manifest_url(fetched_from.prefix),
            "source_attempt": attempt,
            "source_committed_at": fetched_from.created_at,
            "dtype": dtype,
            "conversion": resave if isinstance(resave, str) else
            ("resaved with transformers" if resave else "byte-for-byte copy"),
            "notes": notes,
            "kfrl_version": _kfrl_version(),
            "created_at": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        }
        (tmp / PROVENANCE_FILE).write_text(json.dumps(provenance, indent=1) + "\n")
        files.append(PROVENANCE_FILE)
        _place(tmp, target, overwrite)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return ExportResult(path=target, iteration=iteration, source=source, checkpoint_iteration=checkpoint_iteration,
                        attempt=attempt, model=model_kind, dtype=dtype, files=sorted(files), notes=notes)


def _skip_reason(run: Run, stage: str, iteration: int) -> str:
    manifest = run.manifest(stage, iteration)
    return str(manifest.info.get("skipped")) if manifest is not None else "skipped"


def _normalise_dtype(dtype: str | None) -> str | None:
    if dtype is None or str(dtype).strip().lower() in ("", "auto", "none"):
        return None
    key = str(dtype).strip().lower().removeprefix("torch.")
    if key not in DTYPES:
        raise ExportError(f"dtype {dtype!r} is not supported; use bfloat16, float16 or float32 "
                          "(or leave it out to copy the checkpoint as committed)")
    return DTYPES[key]


def _check_target(to: str | Path, overwrite: bool) -> Path:
    text = os.fspath(to)
    if "://" in text:
        raise ExportError(f"export target {text!r} must be a local directory (exports are not written to a store)")
    target = Path(text).expanduser().absolute()
    if target.exists() and not target.is_dir():
        raise ExportError(f"export target {target} exists and is not a directory; choose another path")
    if target.is_dir() and any(target.iterdir()) and not overwrite:
        raise ExportError(f"export target {target} is not empty; choose an empty or new directory, or pass "
                          "overwrite=True to replace its contents")
    return target


def _describe_iterations(iterations: list[int]) -> str:
    if not iterations:
        return "no committed iterations"
    ranges, start = [], iterations[0]
    for prev, cur in zip(iterations, iterations[1:] + [None]):
        if cur != prev + 1:
            ranges.append(str(start) if start == prev else f"{start}..{prev}")
            start = cur
    return ("iteration " if len(iterations) == 1 else "iterations ") + ", ".join(ranges)


def _assemble(run: Run, manifest: Manifest, config, out: Path, *, dtype: str | None, critic: bool,
              notes: list[str]) -> tuple[str, str, bool, Manifest]:
    """Fill ``out`` with the model; returns (source URI, attempt, whether re-saved, manifest read)."""
    seed = config.trainer.seed
    value_head_new = False
    if manifest.info.get("init_from") == "policy":
        # A critic initialised from the actor's initial weights; stages add a seeded value head on load.
        manifest = run.manifest(POLICY_STAGE, INIT_ITERATION)
        if manifest is None:
            raise ExportError(f"the critic of {run.uri} starts from the initial policy, which is not committed "
                              f"({run.url(POLICY_STAGE, INIT_ITERATION)}); the run is damaged")
        value_head_new = True
    in_place = manifest.info.get("source") if not manifest.files else None
    source = str(in_place) if in_place else run.store.url(manifest.prefix)

    staging = out / ".kfrl-source"
    needs_model_code = dtype is not None or critic
    fetch_to = staging if needs_model_code else out
    if in_place:
        _copy_in_place(str(in_place), fetch_to)
    else:
        kept = [f for f in manifest.files if f["name"] not in EXCLUDED_FILES]
        run.store.download(dataclasses.replace(manifest, files=kept), fetch_to)
        (fetch_to / DOWNLOAD_MARKER).unlink(missing_ok=True)
    if not (fetch_to / "config.json").is_file():
        raise ExportError(f"the checkpoint at {source} has no config.json; it is not an HF model directory")

    resave = False
    if critic:
        architectures = json.loads((staging / "config.json").read_text()).get("architectures") or []
        value_head_new = value_head_new or not any(a.endswith("ForTokenClassification") for a in architectures)
    if dtype is not None or value_head_new:
        if value_head_new:
            notes.append(f"the critic checkpoint has no value head yet; it was initialised with seed "
                         f"trainer.seed={seed}, as the run's stages do")
        _resave(staging, out, dtype=dtype, critic=critic, value_head_new=value_head_new, seed=seed)
        resave = True
    elif needs_model_code:  # a trained critic in its committed dtype: no conversion needed
        for path in staging.iterdir():
            os.replace(path, out / path.name)
    shutil.rmtree(staging, ignore_errors=True)
    return source, manifest.attempt, resave, manifest


def _assemble_lora(run: Run, manifest: Manifest, config, out: Path, *, dtype: str | None, critic: bool,
                   adapter: bool, notes: list[str]) -> tuple[str, str, bool | str, Manifest]:
    """``_assemble`` for an adapter commit (LoRA): the adapter folder, the merged model the iteration
    registered (byte for byte), or the base (the run's initial commit) with the adapter merged here."""
    from kfrl.stages.context import is_tokenizer_file
    from kfrl.models.lora import ADAPTER_CONFIG, ADAPTER_WEIGHTS, MERGED_FOLDER

    source = run.store.url(manifest.prefix)
    if adapter:
        if dtype is not None:
            raise ExportError("--dtype applies to a merged export; an adapter is exported as trained (fp32): "
                              "leave out --dtype, or --adapter")
        kept = [f for f in manifest.files if f["name"] in (ADAPTER_CONFIG, ADAPTER_WEIGHTS) or is_tokenizer_file(f["name"])]
        run.store.download(dataclasses.replace(manifest, files=kept), out)
        (out / DOWNLOAD_MARKER).unlink(missing_ok=True)
        notes.append(f"a LoRA adapter; its base is the run's initial model ({config.model.path})")
        return source, manifest.attempt, False, manifest
    merged = [f for f in manifest.files if f["name"].startswith(MERGED_FOLDER + "/")]
    staging = out / ".kfrl-source"
    if merged and dtype is None:  # what the iteration registered with MLflow
        run.store.download(dataclasses.replace(manifest, files=merged), staging)
        for path in (staging / MERGED_FOLDER).iterdir():
            os.replace(path, out / path.name)
        shutil.rmtree(staging, ignore_errors=True)
        return f"{source}/{MERGED_FOLDER}", manifest.attempt, False, manifest
    base_manifest = run.manifest(CRITIC_STAGE if critic else POLICY_STAGE, INIT_ITERATION)
    _assemble(run, base_manifest, config, staging / "base", dtype=None, critic=critic, notes=notes)
    kept = [f for f in manifest.files if f["name"] in (ADAPTER_CONFIG, ADAPTER_WEIGHTS)]
    run.store.download(dataclasses.replace(manifest, files=kept), staging / "adapter")
    _merge_adapter(staging / "base", staging / "adapter", out, dtype=dtype, critic=critic)
    shutil.rmtree(staging, ignore_errors=True)
    return source, manifest.attempt, "the initial model with the LoRA adapter merged, saved with transformers", manifest


def _merge_adapter(base: Path, adapter: Path, out: Path, *, dtype: str | None, critic: bool) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoModelForTokenClassification

    from kfrl.models.lora import merge_into, read_adapter
    from kfrl.stages.context import quiet_transformers

    quiet_transformers()
    loader = AutoModelForTokenClassification if critic else AutoModelForCausalLM
    model = loader.from_pretrained(base, dtype=getattr(torch, dtype) if dtype else "auto")
    tensors, scaling = read_adapter(adapter)
    merge_into(model, tensors, scaling)
    model.save_pretrained(out, safe_serialization=True)
    for path in sorted(p for p in base.iterdir() if p.is_file()):
        if not (out / path.name).exists() and not _WEIGHT_FILE.search(path.name):
            shutil.copyfile(path, out / path.name)


def _copy_in_place(source: str, dest: Path) -> None:
    """Copy an HF directory that the run references in place (not committed into the run's store)."""
    dest.mkdir(parents=True, exist_ok=True)
    if "://" not in source:
        src = Path(source)
        if not (src / "config.json").is_file():
            raise ExportError(f"the run's initial model is referenced at {source}, which is not an HF model "
                              "directory (anymore)")
        names = [p.relative_to(src).as_posix() for p in src.rglob("*") if p.is_file()]
    else:
        src = Store(source)
        names = src.list("")
    names = [n for n in names if n.split("/")[-1] not in EXCLUDED_FILES
             and not any(part.startswith(".") for part in n.split("/"))]
    if not names:
        raise ExportError(f"the run's initial model is referenced at {source}, which holds no files")
    for name in names:
        target = dest / name
        target.parent.mkdir(parents=True, exist_ok=True)
        if isinstance(src, Path):
            shutil.copyfile(src / name, target)
        else:
            src.get_file(name, target)


def _resave(src: Path, out: Path, *, dtype: str | None, critic: bool, value_head_new: bool, seed: int) -> None:
    """Load the model in ``src`` with transformers and save it into ``out`` (in ``dtype``); other
    files of ``src`` (tokenizer, extras) are copied as they are."""
    import torch
    from transformers import AutoModelForCausalLM, AutoModelForTokenClassification

    from kfrl.models.hf_io import load_value_model
    from kfrl.stages.context import quiet_transformers

    quiet_transformers()
    torch_dtype = getattr(torch, dtype) if dtype else None
    if critic and value_head_new:
        model = load_value_model(src, dtype=torch_dtype, head_seed=seed)
    elif critic:
        model = AutoModelForTokenClassification.from_pretrained(src, dtype=torch_dtype or "auto")
    else:
        model = AutoModelForCausalLM.from_pretrained(src, dtype=torch_dtype or "auto")
    model.save_pretrained(out, safe_serialization=True)
    del model
    for path in sorted(p for p in src.rglob("*") if p.is_file()):
        rel = path.relative_to(src)
        if (out / rel).exists() or _WEIGHT_FILE.search(path.name):
            continue
        (out / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(path, out / rel)


def _check_output(out: Path, files: list[str], model_kind: str, dtype: str | None, notes: list[str]) -> None:
    if not any(f.endswith(".safetensors") for f in files):
        if any(_WEIGHT_FILE.search(f) for f in files):
            notes.append("the weights are not in safetensors format; pass dtype (--dtype) to convert them")
        else:
            raise ExportError(f"the {model_kind} checkpoint has no model weights; nothing loadable to export")
    if "tokenizer_config.json" not in files:
        notes.append("the checkpoint has no tokenizer files (tokenizer_config.json); load a tokenizer separately")


def _place(tmp: Path, target: Path, overwrite: bool) -> None:
    """Rename the finished export into place; a replaced directory is removed only after that worked."""
    if not target.exists():
        os.rename(tmp, target)
        return
    if not any(target.iterdir()):
        target.rmdir()
        os.rename(tmp, target)
        return
    if not overwrite:  # it filled up while we were exporting
        raise ExportError(f"export target {target} is not empty; choose an empty or new directory, or pass "
                          "overwrite=True to replace its contents")
    old = target.with_name(f".{target.name}.kfrl-replaced-{uuid.uuid4().hex[:8]}")
    os.rename(target, old)
    try:
        os.rename(tmp, target)
    except BaseException:
        os.rename(old, target)
        raise
    shutil.rmtree(old, ignore_errors=True)


def _kfrl_version() -> str:
    try:
        from importlib.metadata import version

        return version("kfrl")
    except Exception:  # noqa: BLE001 - provenance only
        return "unknown"


__all__ = ["ExportError", "ExportResult", "PROVENANCE_FILE", "export_policy", "find_run"]
