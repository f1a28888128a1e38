"""Multi-GPU tensor parallelism (TP) and expert parallelism (EP) over NCCL (issue 7; docs/api.md "Multi-GPU").

One process per GPU (``python -m fp4moe.launch --nproc 2 script.py``, torchrun, or your engine's workers),
torch.distributed initialised in each::

    import torch, torch.distributed as dist, fp4moe, fp4moe.distributed as fd
    dist.init_process_group("nccl")                       # or "gloo": only used to share the NCCL id
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    comm = fd.Communicator()                              # NCCL communicator over the default group
    shard = fd.shard_tp(w1, w1_scale, w1_scale2, w2, w2_scale, w2_scale2, rank=comm.rank, world=comm.world)
    w = fp4moe.prepare_weights(**shard, gate_up_order="gate_first", activation="swiglu", device="cuda")
    y = fd.moe_tp(x, w, comm, routing_logits=logits, top_k=8, routing_method="RenormalizeNaive")

The communicator is our own NCCL communicator (ncclCommInitRank through libnccl, opened at run time): rank 0
makes an ncclUniqueId and its 128 bytes are broadcast with torch.distributed.broadcast_object_list, as vLLM's
PyNccl does. libnccl.so.2 is looked up in FP4MOE_NCCL_LIBRARY, which this module sets (when unset) to the
nvidia-nccl pip package's lib folder that PyTorch uses, then on the loader's path. NCCL_NVLS_ENABLE defaults to
0 here (NVLink SHARP stays off: the GPUs' host is shared).

Sums are deterministic: the fp32 partial outputs of the ranks are all-gathered and summed in rank order by our
kernel, then rounded once (never ncclAllReduce). Every rank ends with the same bits.
"""
from __future__ import annotations

import os

from . import _C
from ._api import MoeWeights, moe
from ._errors import ErrorCode, Fp4MoeError, error

_OUTPUTS = {"all_reduce": 0, "allreduce": 0, "reduce_scatter": 1, "reducescatter": 1}


def nccl_library_dir() -> str | None:
    """The lib folder of the nvidia-nccl pip package (PyTorch's NCCL), or None."""
    try:
        import nvidia.nccl as n  # namespace package of the nvidia-nccl-cu* wheels
    except ImportError:
        return None
    for d in list(getattr(n, "__path__", [])) + ([os.path.dirname(n.__file__)] if getattr(n, "__file__", None) else []):
        lib = os.path.join(d, "lib")
        if os.path.exists(os.path.join(lib, "libnccl.so.2")):
            return lib
    return None


def setup_environment() -> None:
    """NCCL_NVLS_ENABLE=0 unless set, FP4MOE_NCCL_LIBRARY from nvidia.nccl unless set. Must run before the
    first NCCL call of the process (libnccl is opened once); this module's functions call it."""
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    if not os.environ.get("FP4MOE_NCCL_LIBRARY"):
        d = nccl_library_dir()
        if d:
            os.environ["FP4MOE_NCCL_LIBRARY"] = d


setup_environment()


def nccl_available() -> bool:
    """Whether this build has the NCCL communicator and libnccl could be opened."""
    setup_environment()
    return bool(_C.nccl_available())


def nccl_unavailable_reason() -> str:
    return str(_C.nccl_unavailable_reason())


def nccl_unique_id() -> bytes:
    """A new ncclUniqueId (128 bytes). Raises Fp4MoeError (Unsupported) without NCCL."""
    setup_environment()
    return _C.nccl_unique_id()


class Communicator:
    """An NCCL communicator of this process's rank in a torch.distributed group (all ranks must create it
    together: ncclCommInitRank is collective). `device`: this rank's CUDA device (default: the current one).
    `unique_id`: skip torch.distributed and use these 128 bytes (every rank the same; with `rank`, `world`)."""

    def __init__(self, group=None, device=None, *, unique_id: bytes | None = None, rank: int | None = None,
                 world: int | None = None):
        setup_environment()
        if unique_id is None:
            import torch
            import torch.distributed as dist
            if not dist.is_available() or not dist.is_initialized():
                raise error("group", "torch.distributed is not initialised (call init_process_group first, or pass "
                                     "unique_id, rank and world)")
            rank = dist.get_rank(group)
            world = dist.get_world_size(group)
            if device is None:
                device = torch.cuda.current_device()
            torch.cuda.set_device(int(device))
            # Rank 0 makes the id; a failure there is broadcast too, so that no rank waits for an id that never comes.
            payload = [None, ""]
            if rank == 0:
                try:
                    payload = [nccl_unique_id(), ""]
                except Fp4MoeError as e:
                    payload = [None, str(e)]
            src = 0 if group is None else dist.get_global_rank(group, 0)
            dist.broadcast_object_list(payload, src=src, group=group)
            if payload[0] is None:
                raise error("nccl", f"rank 0 could not make an ncclUniqueId: {payload[1]}", ErrorCode.Unsupported)
            unique_id = payload[0]
        else:
            if rank is None or world is None:
                raise error("rank", "with unique_id, give rank and world too")
            if device is None:
                device = 0
        if not isinstance(unique_id, (bytes, bytearray)) or len(unique_id) != 128:
            raise error("unique_id", f"expected 128 bytes (an ncclUniqueId), got {type(unique_id).__name__}")
        self._native = _C.NcclComm(bytes(unique_id), int(world), int(rank), int(device))

    @property
    def rank(self) -> int:
        return int(self._native.rank)

    @property
    def world(self) -> int:
        return int(self._native.world)

    @property
    def device(self) -> int:
        return int(self._native.device)

    @property
    def nccl_comm(self) -> int:
        """The ncclComm_t (an int), for interop."""
        return int(self._native.nccl_comm)

    def destroy(self) -> None:
        """ncclCommDestroy now (also done when the object is collected)."""
        self._native.destroy()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.destroy()

    def __repr__(self):
        return f"fp4moe.distributed.Communicator(rank={self.rank}, world={self.world}, device=cuda:{self.device})"


def _check_comm(comm):
    if not isinstance(comm, Communicator):
        raise error("comm", f"expected fp4moe.distributed.Communicator, got {type(comm).__name__}")


def _output_code(output) -> int:
    key = str(output).lower()
    if isinstance(output, int) and output in (0, 1):
        return int(output)
    if key not in _OUTPUTS:
        raise error("output", f"expected 'all_reduce' or 'reduce_scatter', got {output!r}")
    return _OUTPUTS[key]


def parallel_workspace_size(num_tokens: int, hidden: int, world: int, output="all_reduce") -> int:
    """Bytes of `parallel_workspace` (uint8, on the GPU, 256-byte aligned) for moe_tp / moe_ep; without it
    each call allocates that scratch on the stream (PyTorch's caching allocator is not used)."""
    return int(_C.parallel_workspace_size(int(num_tokens), int(hidden), int(world), _output_code(output)))


def _run(kind, x, weights, comm, output, parallel_workspace, out, kwargs):
    _check_comm(comm)
    if not isinstance(weights, MoeWeights):
        raise error("weights", f"expected fp4moe.MoeWeights, got {type(weights).__name__}")
    code = _output_code(output)
    if out is None:
        import torch
        if not isinstance(x, torch.Tensor):
            raise error("x", f"expected a torch.Tensor on the GPU, got {type(x).__name__}")
        T = int(x.shape[0])
        if code == 1 and T % comm.world:
            raise error("x", f"reduce_scatter needs num_tokens divisible by world={comm.world}, got {T}")
        rows = T // comm.world if code == 1 else T
        out = torch.empty((rows, weights.hidden), dtype=torch.bfloat16, device=x.device)
    from ._tensors import as_arg
    pws = as_arg(parallel_workspace, "parallel_workspace")

    def runner(native, tensors, *params):
        if pws is not None:
            tensors["parallel_workspace"] = pws
        _C.moe_run_parallel(kind, comm._native, code, native, tensors, *params)

    return moe(x, weights, out=out, _runner=runner, **kwargs)


def moe_tp(x, weights: MoeWeights, comm: Communicator, *, output="all_reduce", parallel_workspace=None, out=None,
           **kwargs):
    """Tensor parallelism: `weights` is this rank's TP shard (shard_tp), x [T, H] the full batch on this rank's
    GPU (the same on every rank). Returns y [T, H] (all_reduce) or rows [rank*T/world, ...) (reduce_scatter),
    bfloat16 (or `out`, bfloat16 or float32). Other keywords as fp4moe.moe (adapters: a registry on the shard,
    loaded with TP-sharded adapters). Runs on the current PyTorch stream unless `stream` is given."""
    return _run("tp", x, weights, comm, output, parallel_workspace, out, kwargs)


def moe_ep(x, weights: MoeWeights, comm: Communicator, *, num_experts_total: int, local_expert_offset: int,
           output="all_reduce", parallel_workspace=None, out=None, **kwargs):
    """Expert parallelism: `weights` holds experts [offset, offset + count) = expert_window(E, rank, world);
    every rank routes all tokens. A shared expert (full) is applied on rank 0 only. As moe_tp otherwise."""
    kwargs["num_experts_total"] = num_experts_total
    kwargs["local_expert_offset"] = local_expert_offset
    return _run("ep", x, weights, comm, output, parallel_workspace, out, kwargs)


def expert_window(num_experts_total: int, rank: int, world: int) -> tuple[int, int]:
    """(offset, count) of rank's experts: contiguous, the first E % world ranks get one more."""
    off, cnt = _C.expert_window(int(num_experts_total), int(rank), int(world))
    return int(off), int(cnt)


def _cat(parts, dim):
    import sys
    t = sys.modules.get("torch")
    if t is not None and isinstance(parts[0], t.Tensor):
        return t.cat(parts, dim=dim).contiguous()
    import numpy as np
    return np.ascontiguousarray(np.concatenate(parts, axis=dim))


def shard_tp(w1, w1_scale, w1_scale2, w2, w2_scale, w2_scale2, *, rank: int, world: int, gated: bool = True,
             bias1=None, bias2=None) -> dict:
    """This rank's TP shard of NVFP4 expert weights with linear block scales (torch or NumPy):
    w1 [E, N1, H/2], w1_scale [E, N1, H/16] (N1 = 2I gated, either half order), w2 [E, H, I/2],
    w2_scale [E, H, I/16]. Rows [rank*Is, (rank+1)*Is) of each W1 half, the same columns of W2 (Is = I/world, a
    multiple of 16); scale2 unchanged; bias1 sliced like W1's rows, bias2 kept on rank 0 only (added once).
    Returns the keyword arguments of fp4moe.prepare_weights (w1, w1_scale, ...)."""
    if world < 1 or not 0 <= rank < world:
        raise error("rank", f"expected 0 <= rank < world, got rank={rank}, world={world}")
    N1 = int(w1.shape[1])
    I = N1 // 2 if gated else N1
    if I % world or (I // world) % 16:
        raise error("world", f"I={I} split over world={world} must give a multiple of 16 per rank")
    Is = I // world
    rows = [(rank * Is, (rank + 1) * Is)] + ([(I + rank * Is, I + (rank + 1) * Is)] if gated else [])
    rsel = lambda t: _cat([t[:, a:b] for a, b in rows], 1)  # noqa: E731
    out = {
        "w1": rsel(w1), "w1_scale": rsel(w1_scale), "w1_scale2": w1_scale2,
        "w2": _cat([w2[:, :, rank * Is // 2:(rank + 1) * Is // 2]], 2),
        "w2_scale": _cat([w2_scale[:, :, rank * Is // 16:(rank + 1) * Is // 16]], 2),
        "w2_scale2": w2_scale2,
    }
    if bias1 is not None:
        out["bias1"] = rsel(bias1)
    if bias2 is not None and rank == 0:
        out["bias2"] = bias2
    return out


def shard_ep(w1, w1_scale, w1_scale2, w2, w2_scale, w2_scale2, *, rank: int, world: int, bias1=None,
             bias2=None) -> tuple[dict, int, int]:
    """This rank's experts (expert_window) of the weights: (prepare_weights kwargs, offset, count)."""
    E = int(w1.shape[0])
    off, cnt = expert_window(E, rank, world)
    sl = lambda t: None if t is None else t[off:off + cnt]  # noqa: E731
    out = {"w1": sl(w1), "w1_scale": sl(w1_scale), "w1_scale2": sl(w1_scale2), "w2": sl(w2),
           "w2_scale": sl(w2_scale), "w2_scale2": sl(w2_scale2)}
    if bias1 is not None:
        out["bias1"] = sl(bias1)
    if bias2 is not None:
        out["bias2"] = sl(bias2)
    return out, off, cnt


__all__ = ["Communicator", "expert_window", "moe_ep", "moe_tp", "nccl_available", "nccl_library_dir",
           "nccl_unavailable_reason", "nccl_unique_id", "parallel_workspace_size", "setup_environment",
           "shard_ep", "shard_tp"]
