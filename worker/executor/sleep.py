"""Sleep mode: the weights and the KV cache live in regions whose memory goes back to the driver and comes back
at the same addresses, so a colocated trainer gets the GPU between rollouts and the captured CUDA graphs replay
after wake-up without a re-capture.

A region is one reserved range of virtual addresses (cuMemAddressReserve) with physical memory mapped into it in
chunks (cuMemCreate, cuMemMap, cuMemSetAccess), called through libcuda with ctypes; torch tensors are views of
one uint8 tensor over the range (`__cuda_array_interface__`, whose owner frees the range once the last view is
gone). Sleeping unmaps and releases the chunks and keeps the range reserved; waking creates and maps new chunks
at the same offsets. The weights region holds every tensor of the model (parameters, buffers and tensor
attributes such as the RoPE table), moved in after loading; the KV region holds the paged KV cache.

    level 1: weights copied to pinned host memory, then both regions released; wake copies them back.
    level 2: both released; only the model's buffers (not parameters: the RoPE table) go to host memory. Wake
             maps zeroed weights: new ones come from a weight update (update_weights_from_disk / _tensor /
             _distributed), as in vLLM, where the trainer pushes its weights after wake-up.
    wake_up(tags): "weights" and / or "kv_cache" (both by default); a woken KV cache is zeroed.

CUDA only: the driver calls, the pinned host copy and the memory returned to the driver. On the CPU a region
is one resizable host storage: sleeping copies what the level keeps to a host backup and resizes the storage
to 0 bytes (the memory goes back to the allocator), waking resizes it back and restores it in place, so the
tensors that view it stay the same objects, as they do on the GPU.
"""

from __future__ import annotations

import ctypes
import time

import torch

TAGS = ("weights", "kv_cache")
ALIGN = 512  # bytes between tensors in a region, as torch's caching allocator aligns its blocks
WEIGHT_CHUNK_BYTES = 1 << 30  # the weights region maps 1 GiB at a time while the loaded copy is freed behind it

_CUDA_SUCCESS = 0
_CUDA_ERROR_OUT_OF_MEMORY = 2
_ALLOCATION_TYPE_PINNED = 1
_LOCATION_TYPE_DEVICE = 1
_ACCESS_READWRITE = 3
_GRANULARITY_MINIMUM = 0


def check_level(level) -> int:
    if isinstance(level, bool) or level not in (1, 2):
        raise ValueError(f"sleep level must be 1 (weights to host memory, KV cache freed) or 2 (weights and KV "
                         f"cache freed), got {level!r}")
    return int(level)


def check_tags(tags) -> tuple[str, ...]:
    """None: both; a string names one tag; else a list of tags among TAGS."""
    if tags is None:
        return TAGS
    if isinstance(tags, str):
        tags = [tags]
    if not isinstance(tags, (list, tuple, set)) or not tags:
        raise ValueError(f"tags must be a non-empty list among {', '.join(TAGS)}, got {tags!r}")
    bad = [t for t in tags if t not in TAGS]
    if bad:
        raise ValueError(f"wake-up tags must be among {', '.join(TAGS)}, got {', '.join(map(repr, bad))}")
    return tuple(t for t in TAGS if t in tags)


def _align(n: int, to: int) -> int:
    return -(-n // to) * to


# ---- the CUDA driver's virtual memory calls

class _Location(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class _AllocationProp(ctypes.Structure):  # CUmemAllocationProp: 32 bytes
    _fields_ = [("type", ctypes.c_int), ("requestedHandleTypes", ctypes.c_int), ("location", _Location),
                ("win32HandleMetaData", ctypes.c_void_p), ("compressionType", ctypes.c_ubyte),
                ("gpuDirectRDMACapable", ctypes.c_ubyte), ("usage", ctypes.c_ushort),
                ("reserved", ctypes.c_ubyte * 4)]


class _AccessDesc(ctypes.Structure):  # CUmemAccessDesc
    _fields_ = [("location", _Location), ("flags", ctypes.c_int)]


class _Driver:
    """libcuda.so.1's virtual memory management calls, each checked; loaded once per process."""

    _instance: _Driver | None = None

    def __init__(self):
        lib = ctypes.CDLL("libcuda.so.1")
        u64, size, p = ctypes.c_uint64, ctypes.c_size_t, ctypes.POINTER
        sigs = {
            "cuGetErrorString": [ctypes.c_int, p(ctypes.c_char_p)],
            "cuMemGetAllocationGranularity": [p(size), p(_AllocationProp), ctypes.c_int],
            "cuMemAddressReserve": [p(u64), size, size, u64, u64],
            "cuMemAddressFree": [u64, size],
            "cuMemCreate": [p(u64), size, p(_AllocationProp), u64],
            "cuMemRelease": [u64],
            "cuMemMap": [u64, size, size, u64, u64],
            "cuMemUnmap": [u64, size],
            "cuMemSetAccess": [u64, size, p(_AccessDesc), size],
        }
        for name, args in sigs.items():
            fn = getattr(lib, name)
            fn.argtypes, fn.restype = args, ctypes.c_int
            setattr(self, name[2:], fn)  # self.MemCreate(...)

    @classmethod
    def get(cls) -> _Driver:
        if cls._instance is None:
            cls._instance = cls()
        return cls._instance

    def check(self, result: int, what: str) -> None:
        if result == _CUDA_SUCCESS:
            return
        text = ctypes.c_char_p()
        self.GetErrorString(result, ctypes.byref(text))
        message = f"{what} failed: CUDA error {result} ({(text.value or b'unknown').decode()})"
        if result == _CUDA_ERROR_OUT_OF_MEMORY:
            raise torch.cuda.OutOfMemoryError(message)
        raise RuntimeError(message)

    @staticmethod
    def prop(device: int) -> _AllocationProp:
        prop = _AllocationProp()
        prop.type = _ALLOCATION_TYPE_PINNED
        prop.location = _Location(_LOCATION_TYPE_DEVICE, device)
        return prop

    def granularity(self, device: int) -> int:
        out = ctypes.c_size_t()
        self.check(self.MemGetAllocationGranularity(ctypes.byref(out), ctypes.byref(self.prop(device)),
                                                    _GRANULARITY_MINIMUM), "cuMemGetAllocationGranularity")
        return out.value

    def create_and_map(self, device: int, ptr: int, size: int) -> int:
        """Physical memory of `size` bytes on `device`, mapped read-write at `ptr`; -> its handle."""
        handle = ctypes.c_uint64()
        self.check(self.MemCreate(ctypes.byref(handle), size, ctypes.byref(self.prop(device)), 0),
                   f"cuMemCreate of {size / (1 << 30):.2f} GiB")
        try:
            self.check(self.MemMap(ptr, size, 0, handle.value, 0), "cuMemMap")
            try:
                access = _AccessDesc(_Location(_LOCATION_TYPE_DEVICE, device), _ACCESS_READWRITE)
                self.check(self.MemSetAccess(ptr, size, ctypes.byref(access), 1), "cuMemSetAccess")
            except BaseException:
                self.MemUnmap(ptr, size)
                raise
        except BaseException:
            self.MemRelease(handle.value)
            raise
        return handle.value

    def unmap_and_release(self, ptr: int, size: int, handle: int) -> None:
        self.check(self.MemUnmap(ptr, size), "cuMemUnmap")
        self.check(self.MemRelease(handle), "cuMemRelease")


class _Reservation:
    """A reserved virtual range and the chunks mapped into it; the owner of every tensor over it (their
    `__cuda_array_interface__` source), so the range is freed only after the region and its last view."""

    def __init__(self, device: int, capacity: int):
        self.driver = _Driver.get()
        self.device = device
        self.granularity = self.driver.granularity(device)
        self.capacity = _align(max(capacity, 1), self.granularity)
        ptr = ctypes.c_uint64()
        self.driver.check(self.driver.MemAddressReserve(ctypes.byref(ptr), self.capacity, 0, 0, 0),
                          f"cuMemAddressReserve of {self.capacity / (1 << 30):.2f} GiB")
        self.ptr = ptr.value
        self.chunks: list[list[int]] = []  # [offset, size, handle (0 while released)]

    @property
    def __cuda_array_interface__(self) -> dict:
        return {"shape": (self.capacity,), "typestr": "|u1", "data": (self.ptr, False), "version": 3}

    def map(self, offset: int, size: int) -> None:
        handle = self.driver.create_and_map(self.device, self.ptr + offset, size)
        self.chunks.append([offset, size, handle])

    def release(self) -> None:
        for chunk in self.chunks:
            if chunk[2]:
                self.driver.unmap_and_release(self.ptr + chunk[0], chunk[1], chunk[2])
                chunk[2] = 0

    def restore(self) -> None:
        """New physical memory behind every chunk, at the same addresses; all or nothing."""
        try:
            for chunk in self.chunks:
                if not chunk[2]:
                    chunk[2] = self.driver.create_and_map(self.device, self.ptr + chunk[0], chunk[1])
        except BaseException:
            self.release()
            raise

    def __del__(self):
        if getattr(self, "ptr", None) is None or _Driver is None:  # a failed reserve, or interpreter shutdown
            return
        try:
            self.release()
            self.driver.MemAddressFree(self.ptr, self.capacity)
        except Exception:  # noqa: S110 - nothing to report to at teardown
            pass
        self.ptr = None


# ---- regions

class Region:
    """Tensors placed one after another (ALIGN apart) in memory that can be released and restored in place.
    `bytes` is a uint8 tensor over the whole region; tensors are typed views of its storage."""

    def __init__(self, device: torch.device, capacity: int | None, chunk_bytes: int | None = None):
        """capacity: the most bytes it will ever hold (None: no limit, on the CPU only). chunk_bytes: how much
        physical memory to map at a time (None: what each allocation needs)."""
        self.device = device
        self.chunk_bytes = chunk_bytes
        self.used = 0
        self.asleep = False
        self.backup: torch.Tensor | None = None  # host copy of the kept ranges while asleep (pinned on CUDA)
        self.backup_ranges: list[tuple[int, int]] = []
        if device.type == "cuda":
            self.reservation = _Reservation(device.index, capacity)
            self.capacity = self.reservation.capacity
            self.mapped = 0
            self.bytes = None  # made at the first mapping: torch asks the driver which device the address is on
        else:
            self.reservation = None
            self.capacity = capacity
            self.bytes = torch.empty(0, dtype=torch.uint8)
            self.host_bytes = capacity or 0  # the storage's size while awake
            self._resize_host(self.host_bytes)  # once: growing copies what it holds

    def _resize_host(self, nbytes: int) -> None:
        storage = self.bytes.untyped_storage()
        storage.resize_(nbytes)
        self.bytes.set_(storage, 0, (nbytes,), (1,))

    @property
    def mapped_bytes(self) -> int:
        """Device memory this region holds now."""
        if self.asleep:
            return 0
        return self.mapped if self.reservation is not None else self.bytes.untyped_storage().nbytes()

    def alloc(self, nbytes: int) -> int:
        """Room for nbytes: -> its offset, backed by memory (mapped here on CUDA)."""
        if self.asleep:
            raise RuntimeError("the region is asleep")
        offset = _align(self.used, ALIGN)
        end = offset + nbytes
        if self.capacity is not None and end > self.capacity:
            raise torch.cuda.OutOfMemoryError(
                f"a sleep-mode region of {self.capacity / (1 << 30):.2f} GiB cannot take {nbytes} more bytes")
        if self.reservation is not None:
            while self.mapped < end:
                size = _align(max(end - self.mapped, self.chunk_bytes or 0), self.reservation.granularity)
                size = min(size, self.capacity - self.mapped)
                torch.cuda.empty_cache()  # the caching allocator's free blocks back to the driver first
                self.reservation.map(self.mapped, size)
                self.mapped += size
                if self.bytes is None:
                    self.bytes = torch.as_tensor(self.reservation, device=self.device)
        elif end > self.host_bytes:
            self._resize_host(end)
            self.host_bytes = end
        self.used = end
        return offset

    def view(self, offset: int, dtype: torch.dtype, size, stride, storage_offset: int = 0) -> torch.Tensor:
        """A tensor over the region's storage starting `offset` bytes in (a multiple of dtype's size)."""
        return torch.empty(0, dtype=dtype, device=self.device).set_(
            self.bytes.untyped_storage(), offset // dtype.itemsize + storage_offset, size, stride)

    def zeros(self, shape, dtype: torch.dtype) -> torch.Tensor:
        """A new zeroed contiguous tensor in the region."""
        shape = tuple(shape)
        strides, step = [], 1
        for n in reversed(shape):
            strides.insert(0, step)
            step *= n
        offset = self.alloc(step * dtype.itemsize)
        return self.view(offset, dtype, shape, tuple(strides)).zero_()

    def release(self, keep: list[tuple[int, int]] | None) -> None:
        """Free the region's memory; keep: the byte ranges to copy to host memory first (None: all of it)."""
        if self.reservation is not None:
            torch.cuda.synchronize(self.device)  # nothing launched may still read the memory
        ranges = [r for r in ([(0, self.used)] if keep is None else keep) if r[1]]
        total = sum(n for _, n in ranges)
        if total:
            pin = self.reservation is not None
            if self.backup is None or self.backup.numel() != total:
                self.backup = None  # the old one goes before the new one is pinned
                self.backup = torch.empty(total, dtype=torch.uint8, pin_memory=pin)
            at = 0
            for offset, n in ranges:
                self.backup[at : at + n].copy_(self.bytes[offset : offset + n], non_blocking=pin)
                at += n
            if pin:
                torch.cuda.synchronize(self.device)
        else:
            self.backup = None
        self.backup_ranges = ranges
        if self.reservation is not None:
            self.reservation.release()
        else:
            self._resize_host(0)
        self.asleep = True

    def restore(self) -> None:
        """Memory back at the same addresses: the kept ranges copied back, everything else zeroed. The pinned
        backup of the whole region stays for the next sleep (pinning gigabytes takes seconds)."""
        if self.reservation is not None:
            torch.cuda.synchronize(self.device)
            self.reservation.restore()
        else:
            self._resize_host(self.host_bytes)
        whole = self.backup_ranges == [(0, self.used)]
        if not whole:
            self.bytes[: self.used].zero_()
        at = 0
        for offset, n in self.backup_ranges:
            self.bytes[offset : offset + n].copy_(self.backup[at : at + n], non_blocking=self.reservation is not None)
            at += n
        if self.reservation is not None:
            torch.cuda.synchronize(self.device)
        if not whole:
            self.backup = None
        self.asleep = False


# ---- the model's tensors and the KV cache in regions

def _model_tensors(model: torch.nn.Module):
    """(module, kind, name, tensor) for every parameter, buffer and tensor attribute of every module."""
    for module in model.modules():
        for name, p in module._parameters.items():
            if p is not None:
                yield module, "param", name, p
        for name, b in module._buffers.items():
            if b is not None:
                yield module, "buffer", name, b
        for name, v in vars(module).items():
            if isinstance(v, torch.Tensor) and not isinstance(v, torch.nn.Parameter):
                yield module, "attr", name, v


def _current(module, kind: str, name: str) -> torch.Tensor:
    if kind == "param":
        return module._parameters[name]
    if kind == "buffer":
        return module._buffers[name]
    return vars(module)[name]


def _replace(module, kind: str, name: str, new: torch.Tensor) -> None:
    if kind == "param":
        module._parameters[name].data = new  # the same Parameter object: tied weights stay tied
    elif kind == "buffer":
        module._buffers[name] = new
    else:
        vars(module)[name] = new


class SleepMode:
    """A model runner's weights and KV regions, and what is asleep. One per engine (EngineConfig.enable_sleep_mode)."""

    def __init__(self, device: torch.device):
        self.device = device
        self.weights: Region | None = None
        self.kv: Region | None = None
        self.buffer_ranges: list[tuple[int, int]] = []  # weights-region bytes kept at level 2 (buffers, not params)
        self.asleep: set[str] = set()
        self.level = 0  # of the last sleep
        self.seconds: dict[str, float] = {}  # the last sleep's and wake-up's duration

    # ---- placement (bring-up)

    @torch.no_grad()
    def adopt_model(self, model: torch.nn.Module) -> None:
        """Move every tensor of the loaded model into the weights region, one storage at a time: each loaded
        storage is freed once copied, and the region maps 1 GiB at a time after returning the allocator's free
        blocks, so the peak is about the model plus one chunk, not two models."""
        groups: dict[int, list[tuple]] = {}  # storage address -> (module, kind, name, geometry)
        is_param: dict[int, bool] = {}
        sizes: dict[int, int] = {}
        for module, kind, name, t in _model_tensors(model):
            if t.device != self.device or t.untyped_storage().nbytes() == 0:
                continue
            key = t.untyped_storage().data_ptr()
            # the geometry as loaded: a tied weight is met twice as one Parameter, already moved the second time
            groups.setdefault(key, []).append((module, kind, name, t.dtype, t.size(), t.stride(), t.storage_offset()))
            is_param[key] = is_param.get(key, False) or kind == "param"
            sizes[key] = t.untyped_storage().nbytes()
        t = None  # holds no loaded storage past its copy
        capacity = sum(_align(n, ALIGN) for n in sizes.values())
        chunk = WEIGHT_CHUNK_BYTES if self.device.type == "cuda" else None
        self.weights = region = Region(self.device, capacity, chunk)
        for key, members in groups.items():
            first = _current(*members[0][:3])
            storage = first.untyped_storage()
            nbytes = storage.nbytes()
            offset = region.alloc(nbytes)
            region.bytes[offset : offset + nbytes].copy_(
                torch.empty(0, dtype=torch.uint8, device=self.device).set_(storage, 0, (nbytes,), (1,)))
            del first, storage
            for module, kind, name, dtype, size, stride, storage_offset in members:
                _replace(module, kind, name, region.view(offset, dtype, size, stride, storage_offset))
            if not is_param[key]:
                self.buffer_ranges.append((offset, nbytes))
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def allocate_kv(self, shape, dtype: torch.dtype) -> torch.Tensor:
        """A zeroed tensor in the KV region (the paged KV cache; per-sequence state may share the region)."""
        if self.kv is None:  # addresses for the whole card: reserving them costs no memory
            capacity = torch.cuda.mem_get_info(self.device)[1] if self.device.type == "cuda" else None
            self.kv = Region(self.device, capacity)
        return self.kv.zeros(shape, dtype)

    def mapped_bytes(self) -> int:
        """Device memory held outside torch's caching allocator (the KV budget counts it as the weights)."""
        return sum(r.mapped_bytes for r in (self.weights, self.kv) if r is not None)

    # ---- sleep and wake

    @property
    def is_sleeping(self) -> bool:
        return bool(self.asleep)

    def check_sleep(self, level) -> int:
        level = check_level(level)
        if self.asleep:
            raise ValueError(f"the engine is already asleep ({', '.join(sorted(self.asleep))} released at level "
                             f"{self.level}); wake it up first")
        return level

    def sleep(self, level: int) -> None:
        level = self.check_sleep(level)
        start = time.perf_counter()
        if self.weights is not None:
            self.weights.release(None if level == 1 else self.buffer_ranges)
        if self.kv is not None:
            self.kv.release([])
        if self.device.type == "cuda":
            torch.cuda.empty_cache()  # the step's cached temporaries go back too
        self.asleep = set(TAGS)
        self.level = level
        self.seconds["sleep"] = time.perf_counter() - start

    def wake_up(self, tags=None) -> tuple[str, ...]:
        """-> the tags woken. Tags already awake are left as they are; a call that wakes nothing is refused."""
        tags = check_tags(tags)
        todo = [t for t in tags if t in self.asleep]
        if not todo:
            raise ValueError(f"nothing to wake: {', '.join(tags)} {'is' if len(tags) == 1 else 'are'} not asleep")
        start = time.perf_counter()
        for tag in todo:
            region = self.weights if tag == "weights" else self.kv
            if region is not None:
                region.restore()
            self.asleep.discard(tag)
        self.seconds["wake_up"] = time.perf_counter() - start
        return tuple(todo)

