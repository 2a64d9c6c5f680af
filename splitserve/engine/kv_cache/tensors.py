"""The paged KV memory: per layer, K and V each [num_blocks, block_size, num_kv_heads, head_dim]
(flash-attn's paged layout), all views of one contiguous allocation so that a transport can
register the whole cache as a single region. An FP8 cache (kv_cache/fp8.py) holds bytes, each
head's row head_dim + 1 long (the values, then their scale's exponent).

With `shm_path`, that allocation lives in a shared-memory file (/dev/shm) instead of anonymous
memory, so that a worker on the same host can map it and pull a request's blocks with one memcpy
per segment (DESIGN.md §1 step 6, `kv_transfer.shm`). The process that created the file unlinks
it on `close()`."""

from __future__ import annotations

import os
import weakref
from dataclasses import dataclass, field

import torch

from splitserve.engine.kv_cache import fp8 as kv_fp8


def _release_shm_file(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def _create_shm_file(path: str, nbytes: int) -> None:
    # O_EXCL: never silently share (or truncate) a file that another live worker still maps.
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.ftruncate(fd, nbytes)  # a sparse tmpfs file: zero-filled, pages allocated on first touch
    finally:
        os.close(fd)


@dataclass
class KVCacheTensors:
    storage: torch.Tensor  # [num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim (+1 for fp8)]
    shm_path: str | None = None  # the file backing `storage`, when it is shared memory
    # set when this process created the file: unlinks it on close(), garbage collection or exit
    _unlink: weakref.finalize | None = field(default=None, repr=False, compare=False)

    @classmethod
    def allocate(cls, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: str | torch.device = "cpu",
                 shm_path: str | None = None, fp8: bool = False) -> "KVCacheTensors":
        """`dtype`: the model's; with `fp8` the cache holds FP8 rows (kv_cache/fp8.py) instead."""
        if fp8:
            dtype, head_dim = kv_fp8.STORAGE_DTYPE, kv_fp8.row_bytes(head_dim)
        shape = (num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim)
        if shm_path is None:
            return cls(torch.zeros(shape, dtype=dtype, device=device))
        if torch.device(device).type != "cpu":
            raise ValueError(f"shm_path needs a CPU KV cache, not device {device!r}")
        numel = num_layers * 2 * num_blocks * block_size * num_kv_heads * head_dim
        _create_shm_file(shm_path, numel * torch.empty((), dtype=dtype).element_size())
        try:
            flat = torch.from_file(shm_path, shared=True, size=numel, dtype=dtype)
        except BaseException:
            os.unlink(shm_path)
            raise
        storage = flat.view(shape)
        kv = cls(storage, shm_path=shm_path)
        kv._unlink = weakref.finalize(kv, _release_shm_file, shm_path)
        return kv

    def close(self) -> None:
        """Unlink the shared-memory file if this process created it. Mappings already made (here
        or by peers) stay valid until dropped; the memory is freed when the last one goes."""
        if self._unlink is not None:
            self._unlink()  # runs once; later calls are no-ops

    @staticmethod
    def bytes_per_block(num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                        fp8: bool = False) -> int:
        row = kv_fp8.row_bytes(head_dim) if fp8 else head_dim * torch.empty((), dtype=dtype).element_size()
        return num_layers * 2 * block_size * num_kv_heads * row

    @property
    def fp8(self) -> bool:
        return self.storage.dtype == kv_fp8.STORAGE_DTYPE

    @property
    def dtype_name(self) -> str:
        """The KV dtype as configs and logs name it: the model's, or fp8_e4m3."""
        return kv_fp8.NAME if self.fp8 else str(self.storage.dtype).removeprefix("torch.")

    @property
    def layers(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return [(self.storage[i, 0], self.storage[i, 1]) for i in range(self.storage.shape[0])]

    @property
    def num_blocks(self) -> int:
        return self.storage.shape[2]


SHM_PREFIX = "/dev/shm/splitserve-kv-"  # + "<owner pid>-<uuid>"


def sweep_stale_shm(prefix: str = SHM_PREFIX) -> list[str]:
    """Unlink shared-memory KV files whose owning process is gone (a worker killed with
    SIGKILL never runs its cleanup, and /dev/shm is RAM). Returns what was removed."""
    directory, stem = os.path.split(prefix)
    removed = []
    try:
        names = os.listdir(directory)
    except OSError:
        return removed
    for name in names:
        pid = name[len(stem):].split("-", 1)[0] if name.startswith(stem) else ""
        if pid.isdigit() and not _alive(int(pid)):
            try:
                os.unlink(os.path.join(directory, name))
                removed.append(name)
            except OSError:
                pass
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
