"""What every stage shares: where the run lives, its config, its committed inputs, its models."""
from __future__ import annotations

import hashlib
import os
import shutil
from collections import OrderedDict
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path

from kfrl.config import Config
from kfrl.models import cache_dir
from kfrl.run import CRITIC_STAGE, INIT_ITERATION, POLICY_STAGE, Run, RunLayoutError, split_stage_prefix
from kfrl.store import Manifest, Store, entry_digest


def stage_seed(run_seed: int, stage: str, iteration: int, stream: int = 0) -> int:
    """The one seed derivation: stable and distinct per (trainer.seed, stage, iteration, stream), so a
    retried or resumed stage draws exactly what the first attempt drew."""
    digest = hashlib.sha256(f"{run_seed}/{stage}/{iteration}/{stream}".encode()).digest()
    return int.from_bytes(digest[:4], "little") & 0x7FFFFFFF


class StageInputError(RunLayoutError):
    """A stage's input is missing or unusable; the message names the URI and the stage to run first."""


def quiet_transformers() -> None:
    """Per-call progress bars ("Loading weights", "Writing model shards") drown the run's own progress."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()


# Inference models and tokenizers loaded in this process, keyed by local checkpoint dir and dtype:
# fused stages (and the inline runner) load each set of weights once. Each model sits in a slot
# (its kind, run, stage, and whether it is the initial checkpoint); loading newer weights into a slot
# drops the older ones, so a long run holds the current policy, its decoder, the reference, the
# critic and a reward model, never stale policies. Training copies are never cached (updates mutate them).
_MODEL_CACHE: "OrderedDict[tuple, object]" = OrderedDict()
_MODEL_SLOTS: dict[tuple, tuple] = {}
MODEL_CACHE_SIZE = 5
# Tokenizers keyed by the content of their files: every checkpoint of a run shares one.
_TOKENIZER_CACHE: "OrderedDict[tuple, object]" = OrderedDict()
TOKENIZER_CACHE_SIZE = 4
# Files of a checkpoint that only the next update reads.
TRAINING_STATE_FILES = ("optimizer.pt", "trainer_state.json")


@dataclass
class StageContext:
    run_uri: str
    iteration: int
    run: Run = field(repr=False)
    config: Config = field(repr=False)

    @classmethod
    def open(cls, run_uri: str, iteration: int) -> "StageContext":
        config = Run.at(run_uri).config()
        # Reopened with the run's own retry budget and timeouts (store.*), which only its config knows.
        return cls(run_uri=run_uri, iteration=iteration, run=Run.at(run_uri, **config.store.options()), config=config)

    @property
    def store(self) -> Store:
        return self.run.store

    def seed(self, stage: str, stream: int = 0, iteration: int | None = None) -> int:
        """``stage_seed`` for this run and iteration (or ``iteration``)."""
        return stage_seed(self.config.trainer.seed, stage, self.iteration if iteration is None else iteration, stream)

    # --- committed inputs ------------------------------------------------------------------------
    def manifest(self, stage: str, iteration: int | None = None) -> Manifest:
        it = self.iteration if iteration is None else iteration
        manifest = self.run.manifest(stage, it)
        if manifest is None:
            raise StageInputError(f"stage '{stage}' of iteration {it} is not committed ({self.run.url(stage, it)}); "
                                  f"it must run before this one")
        return manifest

    def produced(self, stage: str) -> Manifest | None:
        """The stage's manifest when it produced data this iteration; None when it was skipped."""
        manifest = self.manifest(stage)
        return None if manifest.info.get("skipped") else manifest

    def read_groups(self, *stages: str):
        """Join of the named stages' column groups for this iteration (skipped stages left out)."""
        from kfrl import batch

        tables = {}
        for stage in stages:
            manifest = self.produced(stage)
            if manifest is not None:
                tables[stage] = batch.read_group(self.store, manifest, stage)
        return batch.join(tables)

    # --- devices and models ---------------------------------------------------------------------
    @cached_property
    def device(self) -> str:
        from kfrl.engines import pick_device

        return pick_device(self.config.trainer.device)

    @cached_property
    def compute_dtype(self):
        from kfrl.engines import compute_dtype

        return compute_dtype(self.config.model.dtype, self.device)

    def checkpoint_manifest(self, stage: str, weights_iteration: int) -> Manifest:
        """The checkpoint ``stage`` committed at ``weights_iteration``, or at the last iteration before it
        where the update ran (an update skipped during critic warm-up leaves the weights as they were)."""
        try:
            return self.run.checkpoint(stage, weights_iteration)[0]
        except RunLayoutError as err:
            raise StageInputError(f"{err}; it must run before this one") from err

    def policy_manifest(self, weights_iteration: int) -> Manifest:
        """Weights after ``weights_iteration`` iterations (0 = the initial model)."""
        return self.checkpoint_manifest(POLICY_STAGE, weights_iteration)

    def critic_manifest(self, weights_iteration: int) -> Manifest:
        """The critic after ``weights_iteration`` iterations (0 = its initialisation)."""
        return self.checkpoint_manifest(CRITIC_STAGE, weights_iteration)

    def checkpoint_dir(self, manifest: Manifest, *, training_state: bool = False, weights: bool = True) -> Path:
        """A local folder holding a committed checkpoint: a local store's own folder (checked, not
        copied), else a download into the machine's cache that keeps, per run and stage, the initial
        and the newest checkpoint only. ``training_state``: with the optimizer and trainer state (a
        checkpoint written before the two kinds were split). ``weights=False``: config, generation
        config and tokenizer only (what a stage needs beside weights it already holds in memory)."""
        if not weights and not training_state and getattr(manifest, "early_dir", None) is not None:
            return manifest.early_dir  # still being written in the background: its config and tokenizer are here
        if manifest.info.get("init_from") == "policy":
            # A critic initialised from the actor's initial weights (the value head is added on load).
            return self.checkpoint_dir(self.policy_manifest(INIT_ITERATION), training_state=training_state,
                                       weights=weights)
        source = manifest.info.get("source")
        if source and not manifest.files:
            # The initial model was referenced in place (an HF directory in a store), not copied.
            if "://" not in source:
                return Path(source)
            remote = Store(source, **self.store.options())
            key = hashlib.sha1(source.encode()).hexdigest()[:16]
            local = cache_dir() / "models" / key
            if not (local / "config.json").exists():
                tmp = local.with_name(local.name + f".tmp{os.getpid()}")
                for name in remote.list(""):
                    target = tmp / name
                    target.parent.mkdir(parents=True, exist_ok=True)
                    target.write_bytes(remote.read_bytes(name))
                try:
                    os.replace(tmp, local)
                except OSError:  # another process finished the same download first
                    shutil.rmtree(tmp, ignore_errors=True)
            return local
        names = None if training_state else [n for n in manifest.names() if n not in TRAINING_STATE_FILES]
        if not weights:
            names = [n for n in (names or manifest.names()) if not _is_weights_file(n)]
        if not self.store.is_s3:
            return self.store.committed_dir(manifest, names=names)
        slot, iteration = _checkpoint_slot(self.store.url(manifest.prefix), manifest.prefix)
        root = cache_dir() / "checkpoints"
        folder = f"{slot}-{iteration:06d}-{manifest.attempt}" + ("" if weights else "-meta")
        local = self.store.download(manifest, root / folder, names=names)
        prune_checkpoint_cache(root, slot, iteration)
        return local

    def load_tokenizer(self, manifest: Manifest):
        from kfrl.models.hf_io import load_tokenizer, tokenizer_saved_as

        quiet_transformers()
        # Tokenizer files are the same in every checkpoint of a run: key by their content.
        files = getattr(manifest, "early_files", None) or manifest.files  # early: a commit still being written
        entries = [f for f in files if is_tokenizer_file(f["name"])]
        key = tuple(sorted((f["name"], entry_digest(f)) for f in entries)) \
            or (self.store.url(manifest.prefix), manifest.attempt)

        def load():
            # The first commit after the initial one carries the tokenizer as this process saved it, in other
            # bytes than the user's files of iteration 0: the object it saved is that tokenizer (0.3 s of
            # loading a 150k vocabulary saved, once per run, in the rollout after the first update).
            saved = tokenizer_saved_as(entries)
            return saved if saved is not None else load_tokenizer(self.checkpoint_dir(manifest, weights=False))

        return _cached_in(_TOKENIZER_CACHE, key, load, TOKENIZER_CACHE_SIZE)

    def load_model(self, manifest: Manifest, *, for_training: bool = False, dtype=None):
        """Inference: compute dtype (bf16 on CUDA). Training: ``dtype`` (fp32 master weights by default;
        autocast does bf16). An adapter commit (LoRA) is loaded as its base with the adapter merged."""
        import torch

        from kfrl.models.hf_io import load_causal_lm

        quiet_transformers()
        if for_training:
            return load_causal_lm(self.checkpoint_dir(manifest), dtype=dtype or torch.float32, device=self.device)
        return _cached(self._model_key("policy", manifest.prefix, manifest.attempt),
                       lambda: self._load_merged(manifest, load_causal_lm).eval(),
                       slot=self._slot("policy", manifest.prefix))

    def _load_merged(self, manifest: Manifest, load, **kwargs):
        """``load(folder, dtype=compute dtype, device=...)`` of a full checkpoint, or of an adapter commit's
        base (the run's initial commit of the same stage) with the adapter merged into it."""
        from kfrl.models.lora import merge_into

        model, adapter, scaling = self._load_base_and_adapter(manifest, load, **kwargs)
        if adapter is not None:
            merge_into(model, adapter, scaling)
        return model

    def _load_base_and_adapter(self, manifest: Manifest, load, **kwargs):
        """(model, adapter, scaling): a full checkpoint loaded with ``load`` (compute dtype, this device)
        and (None, None), or an adapter commit's base (the run's initial commit of the same stage) and
        its adapter (``read_adapter``)."""
        from kfrl.models.lora import read_adapter

        if not manifest.info.get("adapter"):
            return load(self.checkpoint_dir(manifest), dtype=self.compute_dtype, device=self.device, **kwargs), None, None
        stage = split_stage_prefix(manifest.prefix)[1]
        model = load(self.checkpoint_dir(self.checkpoint_manifest(stage, INIT_ITERATION)), dtype=self.compute_dtype,
                     device=self.device, **kwargs)
        return (model, *read_adapter(self.checkpoint_dir(manifest), device=self.device))

    def rollout_engine(self, manifest: Manifest, *, micro_batch_size: int | None = None):
        """The configured rollout backend (``kfrl.engines.rollout``) holding ``manifest``'s weights;
        ``engine.name`` says which backend ``rollout.name`` resolved to."""
        from kfrl.engines.rollout import checkpoint_eos_ids, pad_token_id, resolve_backend

        cfg = self.config.rollout
        # No weights read here: the backend's model may be in memory already (handed off by the update).
        local = self.checkpoint_dir(manifest, weights=False)
        backend = resolve_backend(cfg.name, self.device, local)
        tokenizer = self.load_tokenizer(manifest)
        micro = cfg.micro_batch_size if micro_batch_size is None else micro_batch_size
        if backend == "hf":
            from kfrl.engines.rollout_hf import HFRollout

            return HFRollout(self.load_model(manifest), tokenizer, micro_batch_size=micro,
                             logprob_micro_batch_size=cfg.log_prob_micro_batch_size_per_gpu,
                             cache_implementation=cfg.hf_cache)
        eos = checkpoint_eos_ids(local, tokenizer)
        if backend == "vllm":
            from kfrl.engines.rollout_vllm import vllm_engine

            data, lora_rank = self.config.data, self.config.model.lora_rank
            # LoRA: the base (the initial commit) stays in the engine; the commit's adapter is served on it.
            model_dir = self.checkpoint_dir(self.policy_manifest(INIT_ITERATION)) if lora_rank else \
                self.checkpoint_dir(manifest)
            adapter_dir = self.checkpoint_dir(manifest) if manifest.info.get("adapter") else None
            return vllm_engine(model_dir, eos, adapter_dir=adapter_dir,
                               dtype="bfloat16" if self.device == "cuda" else "float32",
                               gpu_memory_utilization=cfg.gpu_memory_utilization, seed=self.config.trainer.seed,
                               max_model_len=data.max_prompt_length + data.max_response_length,
                               enforce_eager=cfg.enforce_eager, max_lora_rank=lora_rank)
        from kfrl.engines.decoder import Decoder
        from kfrl.engines.rollout_torch import TorchRollout

        def load_decoder():
            if manifest.info.get("adapter"):  # the base with the adapter as low-rank updates, as a hand-off builds it
                from kfrl.models.hf_io import load_causal_lm
                from kfrl.models.lora import decoder_over_base

                return decoder_over_base(*self._load_base_and_adapter(manifest, load_causal_lm), self.compute_dtype)
            return Decoder.from_pretrained(self.checkpoint_dir(manifest), device=self.device, dtype=self.compute_dtype)

        decoder = _cached(self._model_key("decoder", manifest.prefix, manifest.attempt), load_decoder,
                          slot=self._slot("decoder", manifest.prefix))
        return TorchRollout(decoder, eos, pad_token_id(tokenizer, eos), micro_batch_size=micro,
                            use_cuda_graphs=not cfg.enforce_eager)

    def load_critic(self, manifest: Manifest, *, for_training: bool = False, dtype=None):
        """The value model (see ``load_model`` for dtypes and adapters); a new value head is seeded by
        trainer.seed."""
        import torch

        from kfrl.models.hf_io import load_value_model

        quiet_transformers()
        seed = self.config.trainer.seed
        if for_training:
            return load_value_model(self.checkpoint_dir(manifest), dtype=dtype or torch.float32, device=self.device,
                                    head_seed=seed)
        return _cached(self._model_key("critic", manifest.prefix, manifest.attempt),
                       lambda: self._load_merged(manifest, load_value_model, head_seed=seed).eval(),
                       slot=self._slot("critic", manifest.prefix))

    def rewards(self, tokenizer):
        """The run's reward (``kfrl.rewards.manager.Rewards``); a reward model comes from the model cache."""
        from kfrl.rewards.manager import Rewards

        reward_model = self.load_reward_model() if self.config.reward.name == "model" else None
        return Rewards(self.config, tokenizer, reward_model=reward_model, autocast_dtype=self.compute_dtype)

    def load_reward_model(self):
        """(model, tokenizer) of reward.model_path: a local HF sequence-classification directory."""
        from kfrl.models.hf_io import load_reward_model, load_tokenizer

        quiet_transformers()
        path = str(Path(self.config.reward.model_path).expanduser())
        model = _cached(("reward", path, str(self.compute_dtype), self.device),
                        lambda: load_reward_model(path, dtype=self.compute_dtype, device=self.device).eval(),
                        slot=("reward",))
        return model, _cached_in(_TOKENIZER_CACHE, (path,), lambda: load_tokenizer(path), TOKENIZER_CACHE_SIZE)

    def release_inference_copies(self, kinds: tuple[str, ...], prefix: str) -> tuple[str, ...]:
        """Drop this process's inference copies (policy, decoder, critic) that the update committing at
        ``prefix`` replaces, so that the update runs without them in device memory: a copy holds as many
        weights as the training copy, and the update's peak is where it would hurt. ``hand_off`` builds
        their successors from the new weights. The initial policy stays when it is the reference.
        Returns the kinds dropped; after a failed update the next stage loads them from the store."""
        released = []
        for kind in kinds:
            slot = self._slot(kind, prefix)
            for held in (slot, slot[:2] + (True,)):
                if held[2] and self._initial_policy_is_reference(kind):
                    continue
                key = _MODEL_SLOTS.get(held)
                if key is not None and _MODEL_CACHE.pop(key, None) is not None:
                    _MODEL_SLOTS.pop(held)
                    released.append(kind)
        return tuple(dict.fromkeys(released))

    def hand_off(self, kinds: tuple[str, ...], prefix: str, attempt: str, model,
                 released: tuple[str, ...] = ()) -> list[str]:
        """Give an update's new weights (``model``, the training copy) to this process as inference
        copies of ``kinds``, filed under the new commit (``prefix``, ``attempt``), so the next stages find
        them without reading the store: a copy for each kind ``release_inference_copies`` dropped, and a
        policy beside a kept reference. Returns the kinds given."""
        import torch

        from kfrl.models.lora import is_lora_model, merged_state

        given = []
        merged = None  # a LoRA copy's merged weights, computed once for all the kinds that take them
        for kind in kinds:
            slot = self._slot(kind, prefix)
            beside_reference = (self._initial_policy_is_reference(kind)
                                and _MODEL_SLOTS.get(slot[:2] + (True,)) in _MODEL_CACHE)
            if kind not in released and not beside_reference:
                continue  # this process has not used weights of this kind: nothing to keep current
            with torch.no_grad():
                if merged is None and is_lora_model(model) and kind != "decoder":
                    merged = merged_state(model)
                copy = _inference_copy(kind, model, self.compute_dtype, merged)
            _cached(self._model_key(kind, prefix, attempt), lambda: copy, slot=slot)
            given.append(kind)
        return given

    def _initial_policy_is_reference(self, kind: str) -> bool:
        """The initial policy copy is the reference policy (with LoRA the reference is the training copy
        with adapters off, so no copy is kept)."""
        return kind == "policy" and self.config.use_ref and not self.config.model.lora_rank

    def _model_key(self, kind: str, prefix: str, attempt: str) -> tuple:
        """A cached model's key: the commit it holds (not a local path, which may need a download)."""
        return (kind, self.store.url(prefix), attempt, str(self.compute_dtype), self.device)

    def _slot(self, kind: str, prefix: str) -> tuple:
        slot, iteration = _checkpoint_slot(self.store.url(prefix), prefix)
        return (kind, slot, iteration == INIT_ITERATION)


def _inference_copy(kind: str, model, dtype, state: dict | None = None):
    """A new inference copy of a training model in ``dtype``, built as loading it from a checkpoint
    would build it (buffers such as rotary frequencies computed, not cast), then given its weights."""
    import torch

    from kfrl.models.lora import base_model_of, decoder_over_adapters, is_lora_model, merged_state

    if kind == "decoder":
        from kfrl.engines.decoder import Decoder

        if is_lora_model(model):  # over the training copy's own base: no second copy of it
            return decoder_over_adapters(model, dtype)
        return Decoder.from_hf_model(model, dtype=dtype, state=state)
    if state is None and is_lora_model(model):
        state = merged_state(model)
    base = base_model_of(model)
    device = next(model.parameters()).device
    with torch.device(device):
        copy = type(base)._from_config(base.config, dtype=dtype)
    copy.load_state_dict(state if state is not None else model.state_dict())
    return copy.eval().requires_grad_(False)


def _is_weights_file(name: str) -> bool:
    return name.endswith((".safetensors", ".safetensors.index.json", ".bin", ".pt"))


def is_tokenizer_file(name: str) -> bool:
    return name.startswith("tokenizer") or name in (
        "special_tokens_map.json", "vocab.json", "merges.txt", "added_tokens.json", "chat_template.jinja")


def _checkpoint_slot(url: str, prefix: str) -> tuple[str, int]:
    """(a name shared by every checkpoint of one run's stage, the iteration) of a checkpoint prefix."""
    split = split_stage_prefix(prefix)
    iteration, stage = split if split else (0, prefix)
    stage_url = url[: -len(prefix)] + stage
    return hashlib.sha1(stage_url.encode()).hexdigest()[:16], iteration


def prune_checkpoint_cache(root: Path, slot: str, newest: int) -> None:
    """Remove cached downloads of ``slot`` older than iteration ``newest``, except the initial one
    (the reference policy): the cache holds what the next stages read, not the run's history."""
    for entry in root.glob(f"{slot}-*"):
        parts = entry.name.split("-")
        if len(parts) >= 3 and parts[1].isdigit() and 0 < int(parts[1]) < newest:
            shutil.rmtree(entry, ignore_errors=True)


def _cached_in(cache: "OrderedDict", key: tuple, load, size: int):
    if key in cache:
        cache.move_to_end(key)
        return cache[key]
    value = cache[key] = load()
    while len(cache) > size:
        cache.popitem(last=False)
    return value


def _cached(key: tuple, load, slot: tuple | None = None):
    if slot is not None:
        stale = _MODEL_SLOTS.get(slot)
        if stale is not None and stale != key:
            _MODEL_CACHE.pop(stale, None)  # newer weights for this slot: the old ones are never read again
        _MODEL_SLOTS[slot] = key
    return _cached_in(_MODEL_CACHE, key, load, MODEL_CACHE_SIZE)
