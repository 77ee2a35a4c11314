"""Host memory for snapshots of GPU state: the weights after every update, the trainer state every k-th.

A snapshot copies tensors off the accelerator so that files can be written from the copy while the
model moves on. Three costs decide whether it stalls the stages beside it, all measured on one H200
machine (``bench/host_memory.py``, a VM whose memory grows as it is used):

- **Getting the memory.** ``torch.empty(..., pin_memory=True)`` asks the driver for page-locked memory
  (``cudaHostAlloc``) and holds the driver's lock while the pages are found: 2 GiB took 1.5 s, during
  which every CUDA call of the process's other threads waited (a 1.46 s gap in a thread launching
  kernels). Ordinary pages touched first (0.21 s for 2 GiB, in 64 MiB pieces: at most a 6 ms gap) and
  then page-locked in place (``cudaHostRegister``: 0.09 s for 2 GiB, one call per tensor) cost a
  fifth of that, and the longest gap is one tensor's registration.
- **The copy.** Into page-locked memory: 48-51 GiB/s, asynchronous. Into ordinary pages: 12-14 GiB/s,
  and the copying thread blocks.
- **When.** A trainer state is 12 bytes per parameter (6 GB at 0.5B): its buffers are built ahead,
  on a thread, while iterations run (``HostBuffers.reserve``), so the first snapshot finds them ready.

``HostBuffers`` keeps each kind's buffers for reuse: after the first snapshot of a kind nothing is
allocated or page-locked again. Page-locked tensors stay registered until ``release`` (a set whose
layout changed) or the end of the process.
"""
from __future__ import annotations

import logging
import mmap
import threading

import torch

log = logging.getLogger(__name__)

TOUCH_PIECE = 64 * 2**20  # bytes touched per call: the GIL and the allocator are held per call
SMALL_TENSOR = 2**20  # below this a tensor is copied through ordinary pages: registering costs more

# Page-locked host tensors of this process: data pointer -> (the mmap holding the pages, bytes).
_LOCKED: dict[int, tuple[mmap.mmap, int]] = {}
_LOCKED_LOCK = threading.Lock()
_REGISTER_FAILED = {"warned": False}


def _cudart():
    return torch.cuda.cudart()


def host_empty(shape, dtype: torch.dtype, *, page_locked: bool, small_too: bool = False) -> torch.Tensor:
    """An uninitialised host tensor, its pages touched. ``page_locked`` (for copies from a CUDA device;
    ignored without one, and for small tensors unless ``small_too``): its own pages, registered with the
    driver. A copy into ordinary pages blocks the copying thread until the stream reaches it, so a copy
    meant to run behind the host (``on_host_later``) page-locks small tensors too."""
    shape = tuple(shape)
    nbytes = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
    if (not page_locked or nbytes == 0 or (nbytes < SMALL_TENSOR and not small_too)
            or not torch.cuda.is_available()):
        out = torch.empty(shape, dtype=dtype)
        if out.numel():
            _touch(out.view(-1).view(torch.uint8))
        return out
    pages = mmap.mmap(-1, nbytes)  # page-aligned and not shared with any other allocation
    flat = torch.frombuffer(pages, dtype=torch.uint8, count=nbytes)
    _touch(flat)
    pointer = flat.data_ptr()
    status = _cudart().cudaHostRegister(pointer, nbytes, 0)
    if int(status) == 0:
        with _LOCKED_LOCK:
            _LOCKED[pointer] = (pages, nbytes)
    elif not _REGISTER_FAILED["warned"]:
        _REGISTER_FAILED["warned"] = True
        log.warning("cudaHostRegister failed (%s): snapshots copy through ordinary pages (about 4x slower)", status)
    return flat.view(dtype).view(shape)


def _touch(flat: torch.Tensor) -> None:
    for start in range(0, flat.numel(), TOUCH_PIECE):
        flat[start:start + TOUCH_PIECE].zero_()


def is_page_locked(tensor: torch.Tensor) -> bool:
    with _LOCKED_LOCK:
        return tensor.data_ptr() in _LOCKED


def release(tensor: torch.Tensor) -> None:
    """Unregister a tensor from ``host_empty`` (its pages are freed once nothing refers to them)."""
    with _LOCKED_LOCK:
        held = _LOCKED.pop(tensor.data_ptr(), None)
    if held is not None:
        _cudart().cudaHostUnregister(tensor.data_ptr())


def tensor_identity(t: torch.Tensor) -> tuple:
    """Equal for two tensors that are views of the same memory with the same layout (tied weights:
    ``state_dict()`` returns a new tensor object per name, so ``id`` cannot tell)."""
    return (t.device.type, t.device.index, t.data_ptr(), tuple(t.shape), tuple(t.stride()), t.dtype)


def _walk(value, visit):
    """``value`` (nested dicts/lists/tuples of tensors, as a state dict or an optimizer state) rebuilt
    with ``visit(tensor)`` in place of each tensor, in a fixed order."""
    if isinstance(value, torch.Tensor):
        return visit(value)
    if isinstance(value, dict):
        return {key: _walk(item, visit) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_walk(item, visit) for item in value)
    return value


def snapshot_layout(tensors, dtype: torch.dtype | None = None) -> list[tuple[tuple, torch.dtype, bool]]:
    """(shape, host dtype, page-locked) of each distinct tensor ``on_host`` would copy, in its order:
    what ``HostBuffers.reserve`` builds ahead of a snapshot."""
    seen: set[tuple] = set()
    layout = []

    def visit(value: torch.Tensor):
        key = tensor_identity(value)
        if key not in seen:
            seen.add(key)
            target = dtype if dtype is not None and value.is_floating_point() else value.dtype
            layout.append((tuple(value.shape), target, value.device.type != "cpu"))
        return value

    _walk(tensors, visit)
    return layout


class HostBuffers:
    """Host tensors kept for a snapshot that repeats (the weights after every update, the trainer state
    every k-th): each snapshot copies into the tensors the one before it used, so none allocates (or
    page-locks) host memory once the first has. A snapshot still being written holds its set; the next
    takes another (``take``/``give_back``), so a slow write never has its memory changed under it.
    ``reserve`` builds a set on a thread ahead of the first snapshot; ``take`` waits for it.

    ``spare_up_to`` (the weights' pools): when a ``take`` leaves no free set and fewer than that many
    exist, one more is built on a thread (the layout of the sets given back), so that a snapshot due
    while the two before it are still being written finds a set ready instead of allocating one on the
    critical path (3.1 GB for a 1.5B model's bf16 weights: a 2.38 s host copy was measured where the
    disk fell behind, against 0.01-0.02 s)."""

    def __init__(self, spare_up_to: int = 0) -> None:
        self._lock = threading.Lock()
        self._free: list[list[torch.Tensor]] = []
        self._reserving: threading.Thread | None = None
        self._layout: list[tuple[tuple, torch.dtype, bool]] | None = None  # of the sets given back
        self.spare_up_to = spare_up_to
        self.sets = 0  # sets allocated so far (two in steady state: one being written, one being filled)
        self.spares_built = 0

    def take(self) -> list[torch.Tensor]:
        with self._lock:
            if self._free:
                taken = self._free.pop()
                self._build_spare_if_short()
                return taken
            reserving = self._reserving
        if reserving is not None:  # a set is being built: waiting for it beats building another here
            reserving.join()
            return self.take()
        with self._lock:
            self.sets += 1
            return []

    def give_back(self, buffers: list[torch.Tensor]) -> None:
        with self._lock:
            if buffers:
                self._layout = [(tuple(t.shape), t.dtype, is_page_locked(t)) for t in buffers]
            self._free.append(buffers)

    def reserve(self, layout: list[tuple[tuple, torch.dtype, bool]]) -> bool:
        """Build a set for ``layout`` (``snapshot_layout``) on a thread, unless this pool already has a
        set or is building one. Returns whether it started."""
        with self._lock:
            if self.sets or self._reserving is not None:
                return False
            self._build(layout)
            return True

    def _build_spare_if_short(self) -> None:
        if (not self._free and self._reserving is None and self._layout is not None
                and self.sets < self.spare_up_to):
            self._build(self._layout)
            self.spares_built += 1

    def _build(self, layout) -> None:
        """(Holding the lock.) One more set for ``layout``, built on a thread."""
        self.sets += 1

        def build() -> None:
            built = []
            try:
                for shape, dtype, page_locked in layout:
                    built.append(host_empty(shape, dtype, page_locked=page_locked))
            finally:  # a partial set is still a head start: on_host fills in the rest
                with self._lock:
                    self._free.append(built)
                    self._reserving = None

        self._reserving = threading.Thread(target=build, name="kfrl-host-buffers", daemon=True)
        self._reserving.start()


_HOST_BUFFERS: dict[str, HostBuffers] = {}
_POOLS_LOCK = threading.Lock()


def host_buffers(name: str, spare_up_to: int = 0) -> HostBuffers:
    """This process's ``HostBuffers`` for the snapshots called ``name`` (e.g. ``weights/actor``);
    ``spare_up_to`` applies when the pool is made here."""
    with _POOLS_LOCK:
        if name not in _HOST_BUFFERS:
            _HOST_BUFFERS[name] = HostBuffers(spare_up_to)
        return _HOST_BUFFERS[name]


def on_host(tensors, dtype: torch.dtype | None = None, buffers: list[torch.Tensor] | None = None):
    """``tensors`` (a nested dict/list of tensors, as a state dict or an optimizer state) copied to host
    memory, floating tensors cast to ``dtype`` when given. From an accelerator the copies go into
    page-locked memory (``host_empty``), all queued before one synchronisation. ``buffers`` (a set from
    ``HostBuffers.take``): the k-th tensor copied goes into its k-th tensor when shape and dtype match,
    and new tensors are kept there for the next snapshot. Tied tensors stay one tensor. On the CPU the
    result is a copy too (the caller may keep it while the originals change)."""
    out, devices = _copy_to_host(tensors, dtype, buffers, behind=None)
    for device in devices:
        if device.type == "cuda":
            torch.cuda.current_stream(device).synchronize()
    return out


def _copy_to_host(tensors, dtype, buffers, *, behind):
    """``on_host``'s copies, queued; returns (the host tensors, the accelerators copied from).
    ``behind``: the stream the copies are queued on, whose sources are kept from the allocator until it
    has run them (every host tensor is then page-locked, so that no copy blocks the host)."""
    memo: dict[tuple, torch.Tensor] = {}
    devices = set()
    lock_all = behind is not None and not _REGISTER_FAILED["warned"]

    def host_tensor(value: torch.Tensor, target: torch.dtype, index: int) -> torch.Tensor:
        page_locked = value.device.type != "cpu"
        if buffers is not None and index < len(buffers):
            held = buffers[index]
            if held.shape == value.shape and held.dtype == target and (
                    not (lock_all and page_locked) or is_page_locked(held) or held.numel() == 0):
                return held
            release(held)
        host = host_empty(value.shape, target, page_locked=page_locked, small_too=lock_all)
        if buffers is not None:
            buffers[index:index + 1] = [host]
        return host

    def copy(value: torch.Tensor) -> torch.Tensor:
        key = tensor_identity(value)
        if key not in memo:
            target = dtype if dtype is not None and value.is_floating_point() else value.dtype
            if value.device.type == "cpu" and buffers is None:
                memo[key] = value.detach().to(target, copy=True)
            else:
                host = host_tensor(value, target, len(memo))
                host.copy_(value.detach(), non_blocking=value.device.type != "cpu")
                if value.device.type != "cpu":
                    devices.add(value.device)
                    if behind is not None:
                        value.record_stream(behind)
                memo[key] = host
        return memo[key]

    return _walk(tensors, copy), devices


class HostCopy:
    """Tensors on their way to host memory (``on_host_later``): ``result()`` waits for the copies and
    returns the host tensors; ``wait()`` only waits."""

    def __init__(self, tensors, done=None):
        self._tensors = tensors
        self._done = done  # a CUDA event recorded after the last copy; None: copied already

    def wait(self) -> None:
        if self._done is not None:
            self._done.synchronize()

    def result(self):
        self.wait()
        return self._tensors


_COPY_STREAMS: dict = {}


def copy_stream(device) -> "torch.cuda.Stream":
    """This process's one stream per device for copies to host memory beside the compute stream (a new
    stream each time would leave a cuBLAS workspace behind per stream; see
    ``kfrl.engines.rollout_torch.warmup_stream``)."""
    device = torch.device(device)
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _COPY_STREAMS:
        _COPY_STREAMS[index] = torch.cuda.Stream(device=index)
    return _COPY_STREAMS[index]


def on_host_later(tensors, dtype: torch.dtype | None = None, buffers: list[torch.Tensor] | None = None) -> HostCopy:
    """``on_host`` without waiting for the copies. From one CUDA device they are queued on its
    ``copy_stream``, after the work queued so far on the current stream, so the kernels queued next run
    beside them instead of behind them (a 1.5B model's weights in bf16 take ~75 ms over PCIe). The
    sources' memory is kept from the allocator until the copies ran (``record_stream``); the sources
    must not be changed before ``wait()`` returns, which is the caller's to ensure. Elsewhere (the CPU,
    several devices) the copy is made now."""
    devices: set = set()
    _walk(tensors, lambda t: devices.add(t.device) or t)
    accelerators = [d for d in devices if d.type == "cuda"]
    if len(accelerators) != 1:
        return HostCopy(on_host(tensors, dtype, buffers))
    stream = copy_stream(accelerators[0])
    stream.wait_stream(torch.cuda.current_stream(accelerators[0]))
    with torch.cuda.stream(stream):
        out, _ = _copy_to_host(tensors, dtype, buffers, behind=stream)
    done = torch.cuda.Event()
    done.record(stream)
    return HostCopy(out, done)
