"""fp4moe.torch_ops: the PyTorch custom operators torch.ops.fp4moe.moe / moe_out.

CPU (PyTorch present): the op equals fp4moe.moe bit for bit; torch.compile(fullgraph=True) with the eager,
aot_eager and inductor backends equals eager, at two token counts; opcheck passes; LoRA and precomputed routing
go through. CUDA (a CUDA build, a GPU): eager vs torch.compile vs CUDA-graph replay (with a workspace: no
allocation, no host synchronization inside the capture) are bit-identical, also with torch.compile's
"reduce-overhead" (CUDA graph trees). Skips cleanly without PyTorch or the extension.
"""
from __future__ import annotations


import pytest

torch = pytest.importorskip("torch", reason="the custom op needs PyTorch")
from fp4moe_under_test import import_fp4moe  # noqa: E402


fp4moe, ops = import_fp4moe("torch_ops")
E, H, I, K = 8, 64, 32, 2


def _weights(device="cpu", seed=0, activation="swiglu"):
    g = torch.Generator().manual_seed(seed)
    w1 = torch.randn(E, 2 * I, H, generator=g) * 0.2
    w2 = torch.randn(E, H, I, generator=g) * 0.2
    q = fp4moe.quantize_weights(w1, w2, gate_up_order="gate_first")
    return fp4moe.prepare_weights(**q, gate_up_order="gate_first", activation=activation, device=device)


def _inputs(T, device="cpu", seed=1):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=g).to(torch.bfloat16).to(device)
    logits = torch.randn(T, E, generator=g).to(device)
    return x, logits


def _same(a, b):
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(torch.int16), b.view(torch.int16))


# ---- CPU -------------------------------------------------------------------------------------------------------

def test_op_equals_api_cpu():
    w = _weights()
    x, logits = _inputs(9)
    ref = fp4moe.moe(x, w, routing_logits=logits, top_k=K, routing_method="renormalize_naive")
    y = ops.moe(x, w, routing_logits=logits, top_k=K, routing_method="renormalize_naive")
    assert ref.abs().max() > 0 and _same(y, ref)
    out = torch.empty_like(y)
    assert ops.moe_out(out, x, w, routing_logits=logits, top_k=K, routing_method=4) is out and _same(out, ref)


@pytest.mark.parametrize("backend", ["eager", "aot_eager", "inductor"])
def test_compile_fullgraph_cpu(backend):
    w = _weights()

    def f(x, logits):
        return ops.moe(x, w, routing_logits=logits, top_k=K, routing_method="RenormalizeNaive", gemm1_alpha=1.5)

    torch._dynamo.reset()
    cf = torch.compile(f, backend=backend, fullgraph=True)
    for T in (5, 17):
        x, logits = _inputs(T, seed=T)
        assert _same(cf(x, logits), f(x, logits))


def test_compile_precomputed_routing_and_lora_cpu():
    w = _weights(seed=3)
    reg = fp4moe.AdapterRegistry(w, 4)
    g = torch.Generator().manual_seed(5)
    r = 4
    reg.load(1, a_gate_up=(torch.randn(E, r, H, generator=g) * 0.1).bfloat16(),
             b_gate_up=(torch.randn(E, 2 * I, r, generator=g) * 0.1).bfloat16(),
             a_down=(torch.randn(E, r, I, generator=g) * 0.1).bfloat16(),
             b_down=(torch.randn(E, H, r, generator=g) * 0.1).bfloat16(), lora_alpha=8.0)
    T = 6
    x, logits = _inputs(T, seed=2)
    ids64 = torch.topk(logits, K, dim=-1).indices  # int64, converted inside the wrapper
    tw = torch.softmax(torch.topk(logits, K, dim=-1).values, dim=-1)
    aid = torch.tensor([-1, 1, 1, -1, 1, -1], dtype=torch.int32)

    def f(x, ids, tw, aid):
        return ops.moe(x, w, topk_ids=ids, topk_weights=tw, top_k=K, routing_method=1, adapters=reg, adapter_ids=aid)

    eager = f(x, ids64, tw, aid)
    base = fp4moe.moe(x, w, topk_ids=ids64, topk_weights=tw, top_k=K, routing_method=1)
    assert not _same(eager, base)  # the adapter did something
    assert _same(eager[0], base[0]) and _same(eager[3], base[3])  # base tokens are untouched
    torch._dynamo.reset()
    assert _same(torch.compile(f, backend="aot_eager", fullgraph=True)(x, ids64, tw, aid), eager)


def test_opcheck_cpu():
    w = _weights()
    x, logits = _inputs(4)
    args = (x, w.handle, logits, None, None, None, K, 4, 1, 1, 1.0, 3, None, None, None, 0, 0, 0, 0.0, 0.0, 0, 1.0,
            0.0, 0.0, False, None, 0, None, None)
    torch.library.opcheck(torch.ops.fp4moe.moe.default, args)


def test_dead_handle_is_an_error():
    w = _weights()
    h = w.handle
    del w
    import gc
    gc.collect()
    x, logits = _inputs(2)
    with pytest.raises(fp4moe.Fp4MoeError) as ei:
        torch.ops.fp4moe.moe(x, h, logits, None, None, None, K, 4, 1, 1, 1.0, 3, None, None, None, 0, 0, 0, 0.0,
                             0.0, 0, 1.0, 0.0, 0.0, False, None, 0, None, None)
    assert ei.value.argument == "weights"


def test_name_lookup_refuses_unknown():
    w = _weights()
    x, logits = _inputs(2)
    with pytest.raises(fp4moe.Fp4MoeError) as ei:
        ops.moe(x, w, routing_logits=logits, top_k=K, routing_method="softmax_magic")
    assert ei.value.argument == "routing_method"


# ---- CUDA ------------------------------------------------------------------------------------------------------

def _cuda_ok():
    if not torch.cuda.is_available():
        return "PyTorch sees no CUDA device"
    info = fp4moe.build_info()
    if not info["with_cuda"] or info["cuda_devices"] == 0:
        return "fp4moe was built without the CUDA backend (or sees no device)"
    return None


cuda = pytest.mark.skipif(_cuda_ok() is not None, reason=str(_cuda_ok()))


@cuda
@pytest.mark.parametrize("T", [1, 37, 300])
def test_cuda_eager_compile_graph_bit_identical(T):
    dev = "cuda"
    w = _weights(dev)
    ws = ops.workspace_for(w, max_tokens=512, top_k=K)
    assert ws is not None and ws.numel() > 0
    x, logits = _inputs(T, dev, seed=T)
    kw = dict(top_k=K, routing_method="RenormalizeNaive")

    eager = ops.moe(x, w, routing_logits=logits, **kw)
    assert eager.abs().max() > 0
    api = fp4moe.moe(x, w, routing_logits=logits, **kw)
    assert _same(eager, api)
    eager_ws = ops.moe(x, w, routing_logits=logits, workspace=ws, **kw)
    assert _same(eager_ws, eager)

    def f(x, logits):
        return ops.moe(x, w, routing_logits=logits, **kw)

    torch._dynamo.reset()
    compiled = torch.compile(f, fullgraph=True)  # inductor
    assert _same(compiled(x, logits), eager)

    # CUDA graph: static input buffers, the workspace and the output allocated outside the capture.
    sx, sl = x.clone(), logits.clone()
    out = torch.empty_like(eager)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):  # warm-up on the capture stream
        ops.moe_out(out, sx, w, routing_logits=sl, workspace=ws, **kw)
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        ops.moe_out(out, sx, w, routing_logits=sl, workspace=ws, **kw)
    out.zero_()
    graph.replay()
    torch.cuda.synchronize()
    assert _same(out, eager)
    # new inputs into the static buffers: the replay follows them
    x2, l2 = _inputs(T, dev, seed=T + 100)
    sx.copy_(x2)
    sl.copy_(l2)
    graph.replay()
    torch.cuda.synchronize()
    assert _same(out, ops.moe(x2, w, routing_logits=l2, **kw))
    fp4moe.check_device_errors(0)


@cuda
def test_cuda_graph_capture_without_workspace_and_reduce_overhead():
    dev = "cuda"
    w = _weights(dev, seed=4)
    x, logits = _inputs(64, dev, seed=9)
    kw = dict(top_k=K, routing_method=1)
    eager = ops.moe(x, w, routing_logits=logits, **kw)
    # No workspace: the backend allocates with cudaMallocAsync on the stream, which capture records.
    graph = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        ops.moe(x, w, routing_logits=logits, **kw)
    torch.cuda.current_stream().wait_stream(s)
    with torch.cuda.graph(graph):
        y = ops.moe(x, w, routing_logits=logits, **kw)
    graph.replay()
    torch.cuda.synchronize()
    assert _same(y, eager)

    def f(x, logits):
        return ops.moe(x, w, routing_logits=logits, **kw)

    torch._dynamo.reset()
    ro = torch.compile(f, mode="reduce-overhead", fullgraph=True)
    for _ in range(3):  # warm-up, record, replay
        got = ro(x, logits)
    torch.cuda.synchronize()
    assert _same(got, eager)


@cuda
def test_cuda_runs_on_current_stream():
    dev = "cuda"
    w = _weights(dev, seed=6)
    x, logits = _inputs(33, dev, seed=6)
    ref = ops.moe(x, w, routing_logits=logits, top_k=K, routing_method=4)
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        y = ops.moe(x, w, routing_logits=logits, top_k=K, routing_method=4)
    s.synchronize()
    assert _same(y, ref)
