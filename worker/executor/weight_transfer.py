"""Weights from a trainer process into the engine: CUDA IPC handles as a string, and a broadcast group.

IPC (a trainer on the same GPU): `serialize_named_tensors` turns (name, tensor) pairs into a string of
handles, not data: CUDA tensors by their IPC memory handles, CPU tensors by shared-memory file names. The
engine opens them with `deserialize_named_tensors` and copies from them; the trainer keeps its tensors
alive until the update call returns. Only the rebuild functions of torch.multiprocessing are unpickled.

Broadcast (trainer = rank 0, engines = ranks 1..): a process group of its own over a TCP store, built
from the backend class directly, so a default process group (the trainer's, ours for tensor parallelism)
is neither needed nor touched. Both sides compute the same bucket layout from the update's (names,
dtypes, shapes): tensors packed into flat byte buffers of at most `BUCKET_BYTES`, one broadcast each.
Before the first bucket the trainer broadcasts a digest of the layout and every engine answers whether it
accepts (names, shapes and digest checked); a refusal from any rank stops every rank before any bucket,
so the trainer's `broadcast` raises and no engine changes a weight.
"""

from __future__ import annotations

import base64
import datetime
import hashlib
import io
import pickle
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from multiprocessing.reduction import ForkingPickler

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.multiprocessing import reductions

BUCKET_BYTES = 512 << 20
ALIGN = 256  # each tensor's offset in a bucket: any dtype views back, and copies stay aligned
_DTYPES = {str(d).removeprefix("torch."): d for d in (torch.float32, torch.float16, torch.bfloat16, torch.float64,
                                                        torch.float8_e4m3fn, torch.float8_e5m2, torch.int8,
                                                        torch.uint8, torch.int32, torch.int64, torch.bool)}


# ---- IPC handles


def serialize_named_tensors(named) -> str:
    """(name, tensor) pairs or a dict -> a string of IPC / shared-memory handles (trainer side)."""
    items = list(named.items()) if isinstance(named, dict) else list(named)
    strategy = mp.get_sharing_strategy()
    mp.set_sharing_strategy("file_system")  # CPU storages by file name: a string can carry them, not an fd
    try:
        payload = [(name, _reduce(tensor.detach())) for name, tensor in items]
        buf = io.BytesIO()
        # torch.multiprocessing registers its storage reductions (handles, not data) with ForkingPickler
        ForkingPickler(buf, pickle.HIGHEST_PROTOCOL).dump(payload)
    finally:
        mp.set_sharing_strategy(strategy)
    return base64.b64encode(buf.getvalue()).decode("ascii")


def _reduce(tensor: torch.Tensor):
    rebuild, args = reductions.reduce_tensor(tensor)
    if rebuild is reductions.rebuild_cuda_tensor:  # the device by UUID: the engine may number GPUs otherwise
        args = (*args[:6], _DeviceUUID(str(torch.cuda.get_device_properties(args[6]).uuid)), *args[7:])
    return rebuild, args


@dataclass(frozen=True)
class _DeviceUUID:
    uuid: str


def _device_index(uuid: str) -> int:
    for i in range(torch.cuda.device_count()):
        if str(torch.cuda.get_device_properties(i).uuid) == uuid:
            return i
    raise ValueError(f"the tensors live on GPU {uuid}, which this process does not see")


class _HandleUnpickler(pickle.Unpickler):
    """Only what serialize_named_tensors writes: torch's rebuild functions, storages, sizes and dtypes."""

    def find_class(self, module: str, name: str):
        if module == "torch.multiprocessing.reductions" and name.startswith("rebuild_"):
            return getattr(reductions, name)
        if module == __name__ and name == "_DeviceUUID":
            return _DeviceUUID
        if module == "torch" and (name in ("Tensor", "Size") or isinstance(getattr(torch, name, None), torch.dtype)):
            return getattr(torch, name)
        if module == "torch.storage" and name in ("UntypedStorage", "TypedStorage"):
            return getattr(torch.storage, name)
        if module == "torch" and name in ("UntypedStorage", "TypedStorage"):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"{module}.{name} is not part of a tensor handle")


def deserialize_named_tensors(s: str) -> list[tuple[str, torch.Tensor]]:
    """The string of serialize_named_tensors -> (name, tensor) pairs over the trainer's memory (engine side)."""
    try:
        payload = _HandleUnpickler(io.BytesIO(base64.b64decode(s, validate=True))).load()
    except (ValueError, pickle.UnpicklingError, EOFError) as e:
        raise ValueError(f"not a serialized tensor list: {e}") from None
    except RuntimeError as e:  # a CPU storage's shared memory is gone (opened before, or let go of by the sender)
        raise ValueError(f"cannot open the serialized tensors: {e} (serialize them for each call and keep them "
                         f"alive until it returns)") from None
    out = []
    for name, (rebuild, args) in payload:
        if rebuild is reductions.rebuild_cuda_tensor:
            args = (*args[:6], _device_index(args[6].uuid), *args[7:])
        try:
            out.append((name, rebuild(*args)))
        except RuntimeError as e:  # the sender let go of it before the engine opened it
            raise ValueError(f"cannot open tensor {name!r}: {e} (serialize the tensors for each call and keep "
                             f"them alive until it returns)") from None
    return out


# ---- buckets


@dataclass(frozen=True)
class Slot:
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int  # bytes into its bucket
    nbytes: int


def parse_dtype(d) -> torch.dtype:
    if isinstance(d, torch.dtype):
        return d
    key = str(d).removeprefix("torch.")
    if key not in _DTYPES:
        raise ValueError(f"unknown dtype {d!r}; one of {', '.join(_DTYPES)}")
    return _DTYPES[key]


def bucket_layout(names, dtypes, shapes, bucket_bytes: int = BUCKET_BYTES) -> list[list[Slot]]:
    """Tensors packed into buckets of at most bucket_bytes (a larger tensor gets one of its own), in order,
    one-dimensional tensors (norms, biases) first: a folded linear is written with its norm known."""
    if not (len(names) == len(dtypes) == len(shapes)):
        raise ValueError(f"{len(names)} names, {len(dtypes)} dtypes and {len(shapes)} shapes: one each per tensor")
    specs = [(n, parse_dtype(d), tuple(int(x) for x in s)) for n, d, s in zip(names, dtypes, shapes, strict=True)]
    specs.sort(key=lambda spec: len(spec[2]) != 1)  # stable: the given order within each group
    buckets: list[list[Slot]] = []
    used = bucket_bytes
    for name, dtype, shape in specs:
        nbytes = torch.Size(shape).numel() * dtype.itemsize
        offset = -(-used // ALIGN) * ALIGN
        if not buckets or offset + nbytes > bucket_bytes:
            buckets.append([])
            offset = 0
        buckets[-1].append(Slot(name, dtype, shape, offset, nbytes))
        used = offset + nbytes
    return buckets


def bucket_size(bucket: list[Slot]) -> int:
    return bucket[-1].offset + bucket[-1].nbytes


def layout_digest(buckets: list[list[Slot]]) -> int:
    text = repr([[(s.name, str(s.dtype), s.shape, s.offset) for s in b] for b in buckets]).encode()
    return int.from_bytes(hashlib.blake2b(text, digest_size=8).digest(), "little", signed=True)


# ---- the group


class WeightGroup:
    """A process group of trainer (rank 0) and engines, outside torch.distributed's default group."""

    def __init__(self, master_address: str, master_port: int, rank: int, world_size: int,
                 group_name: str = "weight_update_group", backend: str | None = None,
                 device: torch.device | None = None, timeout_s: float = 600.0):
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is outside a group of {world_size}")
        self.device = device or (torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available()
                                 else torch.device("cpu"))
        self.backend = backend or ("nccl" if self.device.type == "cuda" else "gloo")
        if self.backend not in ("nccl", "gloo"):
            raise ValueError(f"backend {self.backend!r}: nccl or gloo")
        if self.backend == "gloo":  # gloo moves host memory; the buckets then go through the CPU
            self.device = torch.device("cpu")
        elif self.device.type != "cuda":
            raise ValueError("the nccl backend needs a CUDA device; use gloo on the CPU")
        self.rank, self.world_size, self.group_name = rank, world_size, group_name
        timeout = datetime.timedelta(seconds=timeout_s)
        store = dist.TCPStore(master_address, master_port, world_size, is_master=rank == 0, timeout=timeout)
        store = dist.PrefixStore(group_name, store)
        if self.backend == "nccl":
            options = dist.ProcessGroupNCCL.Options()
            options._timeout = timeout
            self.pg = dist.ProcessGroupNCCL(store, rank, world_size, options)
        else:
            self.pg = dist.ProcessGroupGloo(store, rank, world_size, timeout)

    def broadcast(self, tensor: torch.Tensor) -> None:
        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        self.pg.broadcast([tensor], opts).wait()

    def any_refuses(self, refuse: bool) -> bool:
        flag = torch.tensor([int(refuse)], dtype=torch.int64, device=self.device)
        opts = dist.AllreduceOptions()
        opts.reduceOp = dist.ReduceOp.MAX
        self.pg.allreduce([flag], opts).wait()
        return bool(flag.item())

    def exchange(self, values: list[int]) -> list[int]:
        """Rank 0's integers, on every rank."""
        t = torch.tensor(values, dtype=torch.int64, device=self.device)
        self.broadcast(t)
        return [int(v) for v in t.tolist()]

    def destroy(self) -> None:
        shutdown = getattr(self.pg, "shutdown", None)
        if shutdown is not None:
            shutdown()


class WeightBroadcaster:
    """The trainer's side (rank 0): `broadcast(named_tensors)` sends an update in the engines' buckets.
    The engines must be told the same (names, dtypes, shapes) (update_weights_from_distributed)."""

    def __init__(self, master_address: str, master_port: int, world_size: int,
                 group_name: str = "weight_update_group", backend: str | None = None,
                 device: torch.device | None = None, bucket_bytes: int = BUCKET_BYTES):
        self.group = WeightGroup(master_address, master_port, 0, world_size, group_name, backend, device)
        self.bucket_bytes = bucket_bytes

    @staticmethod
    def metadata(named) -> dict:
        """The update's names, dtypes and shapes, as the engines' update_weights_from_distributed takes them."""
        items = list(named.items()) if isinstance(named, dict) else list(named)
        return {"names": [n for n, _ in items], "dtypes": [str(t.dtype).removeprefix("torch.") for _, t in items],
                "shapes": [list(t.shape) for _, t in items]}

    def broadcast(self, named) -> None:
        items = dict(named)
        meta = self.metadata(items)
        buckets = bucket_layout(meta["names"], meta["dtypes"], meta["shapes"], self.bucket_bytes)
        self.group.exchange([self.bucket_bytes, layout_digest(buckets)])
        if self.group.any_refuses(False):
            raise ValueError("an engine refused the weight update (names, shapes or layout do not match); "
                             "its error says which, and every engine keeps its weights")
        device = self.group.device
        for bucket in buckets:
            buf = torch.empty(bucket_size(bucket), dtype=torch.uint8, device=device)
            for slot in bucket:
                t = items[slot.name].detach()
                buf[slot.offset: slot.offset + slot.nbytes].copy_(t.to(device).contiguous().view(-1).view(torch.uint8))
            self.group.broadcast(buf)

    def destroy(self) -> None:
        self.group.destroy()


def receive_buckets(group: WeightGroup, names, dtypes, shapes, refuse: str | None,
                    check=None) -> Iterator[tuple[str, torch.Tensor]]:
    """The engine's side: agree with the trainer now (or refuse, the reason raised as ValueError on every
    engine), then an iterator of (name, tensor) per received tensor, views of its bucket on the group's
    device (the CPU for gloo: copied from there into the weights, with no second copy on the GPU).
    check(slots) raises ValueError for tensors the engine cannot take. The layout uses the trainer's bucket size."""
    bucket_bytes, digest = group.exchange([0, 0])
    buckets: list[list[Slot]] = []
    if refuse is None:
        try:
            buckets = bucket_layout(names, dtypes, shapes, bucket_bytes)
            if check is not None:
                check([s for b in buckets for s in b])
        except ValueError as e:
            refuse = str(e)
    if refuse is None and digest != layout_digest(buckets):
        refuse = ("the trainer broadcasts another list of tensors than the names, dtypes and shapes given "
                  "(its bucket layout differs)")
    if group.any_refuses(refuse is not None):
        raise ValueError(refuse or "another engine of the group refused the weight update; nothing was changed")
    return _received(group, buckets)


def _received(group: WeightGroup, buckets: list[list[Slot]]) -> Iterator[tuple[str, torch.Tensor]]:
    for bucket in buckets:
        buf = torch.empty(bucket_size(bucket), dtype=torch.uint8, device=group.device)
        group.broadcast(buf)
        for slot in bucket:
            yield slot.name, buf[slot.offset: slot.offset + slot.nbytes].view(slot.dtype).view(slot.shape)


def named_list(named) -> list[tuple[str, torch.Tensor]]:
    """A dict or (name, tensor) pairs -> pairs, one-dimensional tensors first (as bucket_layout orders)."""
    items: Iterable = named.items() if isinstance(named, dict) else named
    pairs = [(str(n), t) for n, t in items]
    if not all(isinstance(t, torch.Tensor) for _, t in pairs):
        raise ValueError("named tensors must be (name, torch.Tensor) pairs")
    return sorted(pairs, key=lambda p: p[1].dim() != 1)
