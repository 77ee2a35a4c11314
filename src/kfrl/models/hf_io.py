"""Thin helpers to load and save Hugging Face model directories (local paths only)."""
from __future__ import annotations

import os
import threading
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from kfrl.models.host_memory import on_host, on_host_later, tensor_identity


def _require_hf_dir(path: str | Path) -> Path:
    """Fail early with a clear message: from_pretrained would treat a bad path as a hub id."""
    path = Path(path)
    if not (path / "config.json").is_file():
        what = "does not exist" if not path.exists() else "has no config.json"
        raise FileNotFoundError(
            f"model path {str(path)!r} {what}; expected a Hugging Face model directory "
            f"containing config.json (plus weights and tokenizer files)"
        )
    return path


def safetensors_files(path: str | Path) -> list[Path]:
    """The safetensors shards of an HF model directory (from its index when sharded)."""
    import json

    path = Path(path)
    index = path / "model.safetensors.index.json"
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    else:
        names = sorted(p.name for p in path.glob("*.safetensors"))
    if not names:
        raise FileNotFoundError(f"no *.safetensors weights in {path}; kfrl's torch and vllm rollout backends read "
                                "safetensors checkpoints")
    return [path / n for n in names]


class CorruptWeightsError(ValueError):
    """A weights file of a model directory cannot be read; the message names the file."""


def check_safetensors(path: str | Path, key: str = "") -> None:
    """Open every safetensors file's header and check that its tensors fit in the file, naming the first
    file that does not (no tensor data is read: cheap even for a 7B model)."""
    import json
    import struct

    path = Path(path)
    where = f" ({key})" if key else ""
    for file in sorted(path.rglob("*.safetensors")):
        size = file.stat().st_size
        try:
            with open(file, "rb") as fh:
                (header_len,) = struct.unpack("<Q", fh.read(8))
                if header_len > size - 8:
                    raise ValueError(f"header of {header_len} bytes in a {size}-byte file")
                header = json.loads(fh.read(header_len))
            end = max((int(t["data_offsets"][1]) for name, t in header.items() if name != "__metadata__"), default=0)
            if 8 + header_len + end > size:
                raise ValueError(f"tensors end at byte {8 + header_len + end} but the file has {size}")
        except (ValueError, KeyError, TypeError, struct.error) as err:
            raise CorruptWeightsError(f"{file}{where} is not a readable safetensors file ({err}): it is corrupt or "
                                      "truncated; copy or save the model again") from None


def _loading(path: Path, load):
    """Run a from_pretrained call; a failure caused by an unreadable weights file names the file."""
    try:
        return load()
    except Exception as err:
        try:
            check_safetensors(path)
        except CorruptWeightsError as corrupt:
            raise corrupt from err
        raise


def load_tokenizer(path: str | Path) -> PreTrainedTokenizerBase:
    return AutoTokenizer.from_pretrained(_require_hf_dir(path))


def decode_batch(tokenizer: PreTrainedTokenizerBase, sequences: list[list[int]], *,
                 skip_special_tokens: bool) -> list[str]:
    """``tokenizer.batch_decode(sequences, skip_special_tokens=...)``. A fast tokenizer that neither cleans up
    tokenization spaces nor overrides decoding gives the same strings from its Rust backend's
    ``decode_batch`` (all sequences in one call, across cores), without transformers' per-sequence calls and
    type checks: the score stage decodes every response of an iteration (256 x 256 tokens: 35 ms through
    ``batch_decode`` on this project's 2-core machine, 25 ms straight; on a GPU host's H100 run, 71 ms of
    the 1.5B score stage's 105 ms under cProfile)."""
    from transformers import PreTrainedTokenizerFast

    cls = type(tokenizer)
    straight = (isinstance(tokenizer, PreTrainedTokenizerFast) and not tokenizer.clean_up_tokenization_spaces
                and cls._decode is PreTrainedTokenizerFast._decode and cls.decode is PreTrainedTokenizerBase.decode
                and cls.batch_decode is PreTrainedTokenizerBase.batch_decode)
    if straight:
        return tokenizer.backend_tokenizer.decode_batch(sequences, skip_special_tokens=skip_special_tokens)
    return tokenizer.batch_decode(sequences, skip_special_tokens=skip_special_tokens)


def load_causal_lm(path: str | Path, dtype: torch.dtype | None = None, device: str = "cpu") -> PreTrainedModel:
    """Load a causal LM from a local HF directory onto `device` (dtype as saved when None)."""
    path = _require_hf_dir(path)
    model = _loading(path, lambda: AutoModelForCausalLM.from_pretrained(path, dtype=dtype or "auto"))
    return model.to(device)


# safetensors dtype names (the format's spec); tensors of other dtypes are not written by kfrl.
_SAFETENSORS_DTYPES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
    torch.bool: "BOOL",
}
MAX_SHARD_BYTES = 5 * 2**30  # Hugging Face's default shard size
WRITE_THREADS = max(1, min(4, (os.cpu_count() or 1) // 2))  # more writers than cores only slow the rest down
WRITE_CHUNK = 64 * 2**20
PACED_CHUNK = 32 * 2**20


class PacedWriter:
    """A file written front to back whose data goes to the disk as it is written, for large files
    nobody waits on (the trainer state, written on a thread beside running stages).

    On ext4 every fsync commits the journal, and with it writes out the data other files have dirtied:
    a stage's manifest fsync'd beside a 6 GB buffered write waited up to 0.25-0.95 s on one H200
    machine (``bench/fsync_beside_write.py``), and an iteration makes dozens of such commits. Here each
    ``PACED_CHUNK`` starts its write-out as soon as it is written and the writer waits for the chunk
    before it (``sync_file_range``), so at most two chunks of this file are ever dirty and a commit
    beside it waits for one chunk at most. The chunk is not smaller because every system call hands
    the GIL back: with 8 MiB chunks beside busy stages the write crawled at ~0.35 GB/s. While
    ``PACING_OFF`` is set (someone waits for the write), and where ``sync_file_range`` does not exist
    (not Linux), a plain write. File-like enough for ``torch.save``."""

    def __init__(self, path: str | Path, chunk: int = PACED_CHUNK, *, paced: bool = True) -> None:
        self.path = Path(path)
        self.error: OSError | None = None  # the write's own failure (``torch.save`` reports another)
        self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        self._chunk = chunk
        self._written = 0
        self._started = 0  # bytes whose write-out has been started
        self._previous = (0, 0)  # the chunk before the last one started: (offset, length)
        self._sync_range = _sync_file_range() if paced else None

    def write(self, data) -> int:
        view = memoryview(data).cast("B")
        total = len(view)
        while view:
            try:
                done = os.write(self._fd, view[:self._chunk])
            except OSError as error:
                self.error = error
                raise
            view = view[done:]
            self._written += done
            if self._written - self._started >= self._chunk:
                self._pace(self._started, self._written - self._started)
                self._started = self._written
        return total

    def _pace(self, offset: int, length: int) -> None:
        if self._sync_range is None or not length or PACING_OFF.is_set():
            return
        self._sync_range(self._fd, offset, length, _SYNC_WRITE)
        before, before_length = self._previous
        if before_length:  # wait for the chunk before this one
            self._sync_range(self._fd, before, before_length, _SYNC_WAIT_BEFORE | _SYNC_WRITE | _SYNC_WAIT_AFTER)
        self._previous = (offset, length)

    def flush(self) -> None:
        pass

    def close(self) -> None:
        if self._fd >= 0:
            try:
                self._pace(self._started, self._written - self._started)
            finally:
                os.close(self._fd)
                self._fd = -1

    def __enter__(self) -> "PacedWriter":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def torch_save(obj, path: str | Path, *, paced: bool = False) -> None:
    """``torch.save(obj, path)`` (through ``PacedWriter`` when ``paced``). A failed write of the file is
    raised as the ``OSError`` it was, naming the file: torch reports a full disk as "unexpected pos"."""
    import torch

    with PacedWriter(path, paced=paced) as out:
        try:
            torch.save(obj, out)
        except RuntimeError as error:
            if out.error is None:
                raise
            raise OSError(out.error.errno, f"writing {out.path} failed: {out.error.strerror}") from error


_SYNC_WAIT_BEFORE, _SYNC_WRITE, _SYNC_WAIT_AFTER = 1, 2, 4
# Set while something waits for the paced writes to end (the end of a run): they go on at full speed.
PACING_OFF = threading.Event()


def _sync_file_range():
    """libc's ``sync_file_range`` (Linux), or None."""
    import ctypes

    try:
        call = ctypes.CDLL(None, use_errno=True).sync_file_range
    except (AttributeError, OSError):
        return None
    call.argtypes = [ctypes.c_int, ctypes.c_longlong, ctypes.c_longlong, ctypes.c_uint]
    return call


def write_safetensors(tensors: dict[str, torch.Tensor], folder: str | Path, *,
                      max_shard_bytes: int = MAX_SHARD_BYTES, paced: bool = False) -> list[Path]:
    """Write ``tensors`` as ``model.safetensors`` (or ``model-0000k-of-0000n.safetensors`` shards plus
    ``model.safetensors.index.json`` beyond ``max_shard_bytes``), the layout ``from_pretrained`` reads.

    The bytes go out with ``pwrite`` calls at each tensor's offset, from ``WRITE_THREADS`` threads,
    straight from the tensor's memory (copied to the host first when it is on an accelerator): no
    serialised copy of the whole file is built, and the tensors may be a host snapshot written on a
    background thread while the model moves on. ``paced``: one writer, front to back, through
    ``PacedWriter`` (for a large file written beside running stages)."""
    import json
    import struct
    from concurrent.futures import ThreadPoolExecutor

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    shards: list[list[str]] = [[]]
    size = 0
    for name, tensor in tensors.items():
        nbytes = tensor.numel() * tensor.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += nbytes
    names = (["model.safetensors"] if len(shards) == 1 else
             [f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors" for k in range(len(shards))])
    for file_name, keys in zip(names, shards):
        header: dict = {"__metadata__": {"format": "pt"}}
        offset = 0
        for key in keys:
            tensor = tensors[key]
            if tensor.dtype not in _SAFETENSORS_DTYPES:
                raise TypeError(f"tensor {key} has dtype {tensor.dtype}, which kfrl does not write to safetensors")
            nbytes = tensor.numel() * tensor.element_size()
            header[key] = {"dtype": _SAFETENSORS_DTYPES[tensor.dtype], "shape": list(tensor.shape),
                           "data_offsets": [offset, offset + nbytes]}
            offset += nbytes
        encoded = json.dumps(header, separators=(",", ":")).encode()
        encoded += b" " * (-len(encoded) % 8)  # the data starts 8-byte aligned, as the reference writer does
        start = 8 + len(encoded)
        # Each tensor's bytes, in file order (copied to the host first when on an accelerator).
        data = [memoryview(tensors[key].detach().to("cpu").contiguous().reshape(-1).view(torch.uint8).numpy())
                for key in keys if tensors[key].numel()]
        if paced:
            with PacedWriter(folder / file_name) as out:
                out.write(struct.pack("<Q", len(encoded)) + encoded)
                for host in data:
                    out.write(host)
            continue
        fd = os.open(folder / file_name, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            os.pwrite(fd, struct.pack("<Q", len(encoded)) + encoded, 0)
            pieces = []  # (bytes, file offset), at most WRITE_CHUNK each, so threads share a big tensor too
            at = start
            for host in data:
                pieces += [(host[i:i + WRITE_CHUNK], at + i) for i in range(0, len(host), WRITE_CHUNK)]
                at += len(host)

            def put(piece) -> None:
                chunk, at = piece
                while chunk:  # pwrite may write less than asked
                    written = os.pwrite(fd, chunk, at)
                    chunk, at = chunk[written:], at + written

            # Several writers at disjoint offsets: some file systems (gVisor's, overlays) take one
            # stream of writes at a fraction of their throughput.
            with ThreadPoolExecutor(WRITE_THREADS) as pool:
                list(pool.map(put, pieces))
        finally:
            os.close(fd)
    if len(shards) > 1:
        weight_map = {key: file_name for file_name, keys in zip(names, shards) for key in keys}
        total = sum(t.numel() * t.element_size() for t in tensors.values())
        (folder / "model.safetensors.index.json").write_text(
            json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
    return [folder / n for n in names]


def unique_state(state: dict[str, torch.Tensor], dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """``state`` with tied tensors kept once (under the first name, e.g. the embedding rather than the
    LM head, as ``save_pretrained`` does) and floating tensors cast to ``dtype`` when given."""
    seen: set[tuple] = set()
    out = {}
    for name, tensor in state.items():
        key = tensor_identity(tensor)
        if key in seen:
            continue
        seen.add(key)
        out[name] = tensor.detach().to(dtype) if dtype is not None and tensor.is_floating_point() else tensor
    return out


def config_files(model: PreTrainedModel, dtype: torch.dtype | None = None) -> dict[str, bytes]:
    """``config.json`` (saying ``dtype`` when given, and the model's class as ``save_pretrained`` does)
    and, for a generative model, ``generation_config.json``: name → bytes, ready to write anywhere."""
    import tempfile

    config = model.config
    config.architectures = [type(model).__name__]  # what AutoModel loaders read
    saved_dtype = config.dtype
    with tempfile.TemporaryDirectory(prefix="kfrl-config-") as tmp:
        if dtype is not None:
            config.dtype = dtype  # config.json says what the file holds
        try:
            config.save_pretrained(tmp)
        finally:
            config.dtype = saved_dtype
        generation = getattr(model, "generation_config", None)
        if generation is not None and model.can_generate():
            generation.save_pretrained(tmp)
        return {p.name: p.read_bytes() for p in Path(tmp).iterdir() if p.is_file()}


def host_weights(model: PreTrainedModel, dtype: torch.dtype | None = None,
                 state: dict[str, torch.Tensor] | None = None, *,
                 buffers: list[torch.Tensor] | None = None, later: bool = False):
    """The tensors a checkpoint of ``model`` (or of ``state``) holds, tied ones once, cast to ``dtype``,
    in host memory (page-locked when they come from an accelerator; see ``on_host``, also for ``buffers``).
    ``later``: a copy (never the model's own tensors, also on the CPU) queued beside the stages that
    follow, returned as a ``HostCopy`` (``on_host_later``), for a write that outlives the call."""
    tensors = unique_state(state if state is not None else model.state_dict())
    if later:
        return on_host_later(tensors, dtype, buffers)
    if buffers is not None or any(t.device.type != "cpu" for t in tensors.values()):
        tensors = on_host(tensors, dtype, buffers)
    return unique_state(tensors, dtype)


def write_hf_dir(out_dir: str | Path, configs: dict[str, bytes], weights: dict[str, torch.Tensor] | None,
                 tokenizer: PreTrainedTokenizerBase | None = None, *, link_tokenizer_from: Path | None = None,
                 paced: bool = False) -> Path:
    """An HF model directory from ``config_files`` and ``host_weights`` (None: no weights file): what
    ``save_hf`` writes, split so that the files can be written on another thread from a snapshot while
    the model moves on. ``link_tokenizer_from``: see ``save_tokenizer``'s ``link_from``."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    for name, data in configs.items():
        (out_dir / name).write_bytes(data)
    if weights is not None:
        write_safetensors(weights, out_dir, paced=paced)
    if tokenizer is not None:
        save_tokenizer(tokenizer, out_dir, link_from=link_tokenizer_from)
    return out_dir


def save_hf(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase | None, out_dir: str | Path,
            dtype: torch.dtype | None = None, state: dict[str, torch.Tensor] | None = None, *,
            paced: bool = False) -> Path:
    """Save an HF model directory: config, generation config, safetensors weights (from ``state`` when
    given, else the model's own; cast to ``dtype`` when given: the model itself is left as it is) and
    the tokenizer (when given) into out_dir. ``paced``: see ``write_safetensors``."""
    return write_hf_dir(out_dir, config_files(model, dtype), host_weights(model, dtype, state), tokenizer,
                        paced=paced)


# Saved tokenizer files per tokenizer object: every weights commit carries the tokenizer (twice, with
# the MLmodel component) and serialising a 150k-entry vocabulary costs ~50 ms a time.
_TOKENIZER_FILES: dict[int, tuple[object, dict[str, bytes], str]] = {}


def tokenizer_saved_as(entries: list[dict]) -> PreTrainedTokenizerBase | None:
    """The tokenizer object this process saved (``save_tokenizer``) as exactly the files that the manifest
    ``entries`` describe (names, sizes and digests), or None."""
    from kfrl.store import digest_matches

    for tokenizer, files, _digest in _TOKENIZER_FILES.values():
        if entries and {entry["name"] for entry in entries} == set(files) and all(
                digest_matches(entry, files[entry["name"]]) for entry in entries):
            return tokenizer
    return None


def save_tokenizer(tokenizer: PreTrainedTokenizerBase, out_dir: str | Path, *, link_from: Path | None = None) -> None:
    """``tokenizer.save_pretrained(out_dir)``, serialised once per tokenizer object and copied after.
    ``link_from``: a folder on ``out_dir``'s file system where the files are written once (under a
    digest of their content) and hard-linked from: no data is written again, which matters beside a
    multi-GB write that has the kernel throttle every writer (the files are ~10 MB for a 150k vocabulary)."""
    import hashlib
    import tempfile

    out_dir = Path(out_dir)
    held = _TOKENIZER_FILES.get(id(tokenizer))
    if held is None or held[0] is not tokenizer:
        with tempfile.TemporaryDirectory(prefix="kfrl-tokenizer-") as tmp:
            # The chat template goes into tokenizer_config.json (not only chat_template.jinja)
            # so that older transformers releases, as used by some inference images, find it too.
            tokenizer.save_pretrained(tmp, save_jinja_files=False)
            files = {p.relative_to(tmp).as_posix(): p.read_bytes() for p in Path(tmp).rglob("*") if p.is_file()}
        digest = hashlib.sha256()
        for name in sorted(files):
            digest.update(name.encode() + b"\0" + hashlib.sha256(files[name]).digest())
        _TOKENIZER_FILES.clear()  # one tokenizer per run: no growth across runs in one process
        held = _TOKENIZER_FILES[id(tokenizer)] = (tokenizer, files, digest.hexdigest()[:16])
    _, files, digest = held
    source = Path(link_from) / digest if link_from is not None else None
    for name, data in files.items():
        target = out_dir / name
        target.parent.mkdir(parents=True, exist_ok=True)
        target.unlink(missing_ok=True)  # never write through a hard link into the shared copy
        if source is not None:
            try:
                if not (source / name).is_file():
                    (source / name).parent.mkdir(parents=True, exist_ok=True)
                    staged = (source / name).with_name(f".{target.name}.{os.getpid()}.tmp")
                    staged.write_bytes(data)
                    os.replace(staged, source / name)  # whole or absent, for a concurrent reader
                os.link(source / name, target)
                continue
            except OSError:  # another file system, or no hard links there: write the bytes
                pass
        target.write_bytes(data)


def load_value_model(path: str | Path, dtype: torch.dtype | None = None, device: str = "cpu",
                     head_seed: int = 0) -> PreTrainedModel:
    """A value model (the LM body + a scalar token-classification head, as veRL's critic).

    From a causal-LM directory the head is new: it is initialised under ``head_seed`` so every
    stage that builds it from the same directory gets the same head. Dropout on the head is off
    (veRL sets classifier_dropout=0 too), so training values are deterministic.
    """
    from transformers import AutoConfig, AutoModelForTokenClassification

    path = _require_hf_dir(path)
    config = AutoConfig.from_pretrained(path, num_labels=1)
    config.classifier_dropout = 0.0
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(head_seed)
        model = _loading(path, lambda: AutoModelForTokenClassification.from_pretrained(
            path, config=config, dtype=dtype or "auto"))
    return model.to(device)


def load_reward_model(path: str | Path, dtype: torch.dtype | None = None, device: str = "cpu") -> PreTrainedModel:
    """A sequence-classification reward model (one logit per sequence) from a local HF directory."""
    from transformers import AutoModelForSequenceClassification

    path = _require_hf_dir(path)
    model = _loading(path, lambda: AutoModelForSequenceClassification.from_pretrained(
        path, num_labels=1, dtype=dtype or "auto"))
    return model.to(device)
