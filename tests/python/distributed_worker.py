"""One rank of tests/python/test_distributed.py's two-GPU check (started by `python -m fp4moe.launch`).

TP=world and EP=world through fp4moe.distributed against the single-GPU fp4moe.moe on the same weights:
every rank's y bit-identical, bit-identical across two calls, relative L2 vs single GPU <= 5e-3, and the
reduce_scatter rows equal the all_reduce rows. Rank 0 writes a JSON report to argv[1].
"""
import json
import os
import sys

import torch
import torch.distributed as dist

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if os.environ.get("FP4MOE_TEST_INSTALLED") != "1":
    sys.path.insert(0, os.path.join(REPO, "python"))
import fp4moe  # noqa: E402
import fp4moe.distributed as fd  # noqa: E402

E, H, I, K, T = 16, 256, 256, 4, 96


def main(report):
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.cuda.set_device(rank)
    dev = f"cuda:{rank}"
    dist.init_process_group("gloo")  # only shares the NCCL id and the small host checks
    comm = fd.Communicator()
    assert (comm.rank, comm.world, comm.device) == (rank, world, rank)
    g = torch.Generator().manual_seed(7)
    w1 = torch.randn(E, 2 * I, H, generator=g) * 0.1
    w2 = torch.randn(E, H, I, generator=g) * 0.1
    q = fp4moe.quantize_weights(w1, w2, gate_up_order="gate_first")
    x = torch.randn(T, H, generator=g).to(torch.bfloat16).to(dev)
    logits = torch.randn(T, E, generator=g).to(dev)
    kw = dict(routing_logits=logits, top_k=K, routing_method="RenormalizeNaive")

    full = fp4moe.prepare_weights(**q, gate_up_order="gate_first", activation="swiglu", device=dev)
    single = fp4moe.moe(x, full, **kw)
    tp_w = fp4moe.prepare_weights(**fd.shard_tp(**q, rank=rank, world=world), gate_up_order="gate_first",
                                  activation="swiglu", device=dev)
    y_tp = fd.moe_tp(x, tp_w, comm, **kw)
    y_tp2 = fd.moe_tp(x, tp_w, comm, **kw)
    y_rs = fd.moe_tp(x, tp_w, comm, output="reduce_scatter", **kw)
    ws = torch.empty(fd.parallel_workspace_size(T, H, world), dtype=torch.uint8, device=dev)
    y_ws = fd.moe_tp(x, tp_w, comm, parallel_workspace=ws, **kw)
    y_f32 = fd.moe_tp(x, tp_w, comm, out=torch.empty(T, H, dtype=torch.float32, device=dev), **kw)
    ep_q, off, cnt = fd.shard_ep(**q, rank=rank, world=world)
    ep_w = fp4moe.prepare_weights(**ep_q, gate_up_order="gate_first", activation="swiglu", device=dev)
    y_ep = fd.moe_ep(x, ep_w, comm, num_experts_total=E, local_expert_offset=off, **kw)
    fp4moe.check_device_errors(rank)
    torch.cuda.synchronize()

    def bits(t):
        return t.view(torch.int16).cpu()

    # Host tensors: the worker's process group is gloo, which gathers no int16 — widen the bits to int32.
    mine = bits(y_tp).to(torch.int32)
    gathered = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(gathered, mine)
    rows = T // world

    def rel(a, b):
        a, b = a.float().cpu(), b.float().cpu()
        return float((a - b).norm() / b.norm())

    res = {
        "ranks_equal": all(torch.equal(gathered[0], gq) for gq in gathered),
        "tp_repeat_equal": torch.equal(bits(y_tp), bits(y_tp2)),
        "tp_workspace_equal": torch.equal(bits(y_tp), bits(y_ws)),
        "tp_f32_rounds_to_bf16": torch.equal(bits(y_f32.to(torch.bfloat16)), bits(y_tp)),
        "reduce_scatter_rows_equal": torch.equal(bits(y_rs), bits(y_tp)[rank * rows:(rank + 1) * rows]),
        "tp_vs_single": rel(y_tp, single),
        "ep_vs_single": rel(y_ep, single),
    }
    flags = torch.tensor([1.0 if all(v for k, v in res.items() if not k.endswith("single")) else 0.0])
    dist.all_reduce(flags)
    res["all_ranks_ok"] = float(flags) == world
    if rank == 0:
        with open(report, "w") as f:
            json.dump(res, f)
    comm.destroy()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
