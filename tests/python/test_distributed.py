"""fp4moe.distributed and fp4moe.launch (issue 7, docs/api.md "Multi-GPU").

CPU (CI): the launcher's argument handling, environment (RANK..., NCCL_NVLS_ENABLE=0) and failure handling
with real processes; the NCCL entry points without NCCL raise Unsupported with the reason; shard_tp /
shard_ep slice the right rows (the fp32 sum of the TP shards' outputs equals the full layer's output).
Two GPUs (PyTorch, a CUDA build): the launcher starts two ranks that run TP=2 and EP=2 against the
single-GPU call (tests/python/distributed_worker.py).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from fp4moe_under_test import REPO, import_fp4moe  # noqa: E402
fp4moe, fd, launch = import_fp4moe("distributed", "launch")


def _env():
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO / "python")] + [p for p in [env.get("PYTHONPATH")] if p])
    return env


def _launch(args, timeout=120):
    return subprocess.run([sys.executable, "-m", "fp4moe.launch"] + args, env=_env(), capture_output=True,
                          text=True, timeout=timeout)


# ---- launcher ---------------------------------------------------------------------------------------------------

def test_launch_parse_args(tmp_path):
    script = tmp_path / "s.py"
    script.write_text("pass\n")
    a = launch.parse_args(["--nproc", "2", str(script), "--x", "1"])
    assert a.nproc == 2 and a.target == str(script) and a.args == ["--x", "1"] and not a.module
    assert launch.command(a)[1:] == [str(script), "--x", "1"]
    m = launch.parse_args(["--nproc_per_node", "3", "-m", "pkg.mod", "a"])
    assert m.module and launch.command(m)[1:] == ["-m", "pkg.mod", "a"]
    for bad in (["--nproc", "0", str(script)], ["--nproc", "2"], ["--nproc", "2", str(tmp_path / "missing.py")],
                ["--nproc", "2", "--master-port", "70000", str(script)], ["--nproc", "2", "--timeout", "-1", str(script)],
                [str(script)]):
        with pytest.raises(SystemExit):
            launch.parse_args(bad)


def test_launch_environment():
    env = launch.rank_env({"NCCL_NVLS_ENABLE": "1", "KEEP": "y"}, 1, 2, "127.0.0.1", 1234)
    assert env["RANK"] == "1" and env["LOCAL_RANK"] == "1" and env["WORLD_SIZE"] == "2"
    assert env["LOCAL_WORLD_SIZE"] == "2" and env["MASTER_ADDR"] == "127.0.0.1" and env["MASTER_PORT"] == "1234"
    assert env["NCCL_NVLS_ENABLE"] == "0" and env["KEEP"] == "y"
    assert 0 < launch.free_port() < 65536


def test_launch_runs_every_rank(tmp_path):
    script = tmp_path / "w.py"
    script.write_text(textwrap.dedent(f"""
        import os, sys
        open(os.path.join({str(tmp_path)!r}, "rank" + os.environ["RANK"]), "w").write(
            " ".join([os.environ["WORLD_SIZE"], os.environ["NCCL_NVLS_ENABLE"], os.environ["MASTER_PORT"]] + sys.argv[1:]))
    """))
    env_before = os.environ.get("NCCL_NVLS_ENABLE")
    r = _launch(["--nproc", "3", str(script), "arg"])
    assert r.returncode == 0, r.stderr
    seen = [(tmp_path / f"rank{i}").read_text().split() for i in range(3)]
    assert all(s[0] == "3" and s[1] == "0" and s[3] == "arg" for s in seen)
    assert len({s[2] for s in seen}) == 1  # one master port for all
    assert os.environ.get("NCCL_NVLS_ENABLE") == env_before


def test_launch_stops_the_others_when_one_fails(tmp_path):
    script = tmp_path / "f.py"
    script.write_text("import os, sys, time\nif os.environ['RANK'] == '1': sys.exit(3)\ntime.sleep(60)\n")
    r = _launch(["--nproc", "2", str(script)], timeout=60)
    assert r.returncode == 3 and "rank 1 exited with 3" in r.stderr


def test_launch_timeout(tmp_path):
    script = tmp_path / "h.py"
    script.write_text("import time\ntime.sleep(60)\n")
    r = _launch(["--nproc", "2", "--timeout", "1", str(script)], timeout=60)
    assert r.returncode == 124 and "timeout" in r.stderr


# ---- NCCL plumbing without NCCL -----------------------------------------------------------------------------------

def test_nccl_entry_points_without_nccl():
    if fd.nccl_available():
        uid = fd.nccl_unique_id()
        assert isinstance(uid, bytes) and len(uid) == 128
        with pytest.raises(fp4moe.Fp4MoeError) as e:
            fd.Communicator(unique_id=b"x" * 12, rank=0, world=2)
        assert e.value.argument == "unique_id"
        return
    why = fd.nccl_unavailable_reason()
    assert "nccl" in why.lower()
    with pytest.raises(fp4moe.Fp4MoeError) as e:
        fd.nccl_unique_id()
    assert e.value.code == fp4moe.ErrorCode.Unsupported and "nccl" in str(e.value).lower()
    with pytest.raises(fp4moe.Fp4MoeError) as e:
        fd.Communicator(unique_id=bytes(128), rank=0, world=2)
    assert e.value.code == fp4moe.ErrorCode.Unsupported


def test_nccl_library_env_is_used(tmp_path):
    # A fresh process: FP4MOE_NCCL_LIBRARY naming a folder without libnccl makes the reason mention it (when the
    # build has NCCL at all); setup_environment keeps a caller's value and defaults NCCL_NVLS_ENABLE to 0.
    code = textwrap.dedent("""
        import os, sys
        import fp4moe.distributed as fd
        print(os.environ["FP4MOE_NCCL_LIBRARY"], os.environ["NCCL_NVLS_ENABLE"])
        print(fd.nccl_available())
        print(fd.nccl_unavailable_reason().replace("\\n", " "))
    """)
    env = _env()
    env["FP4MOE_NCCL_LIBRARY"] = str(tmp_path)
    env.pop("NCCL_NVLS_ENABLE", None)
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert lines[0] == f"{tmp_path} 0"
    if lines[1] == "False" and "FP4MOE_WITH_NCCL undefined" not in lines[2]:
        assert str(tmp_path) in lines[2]


def test_parallel_workspace_size_and_window():
    assert fd.parallel_workspace_size(4, 64, 2) == 3 * (256 + 64) * 4
    assert fd.parallel_workspace_size(4, 64, 2, "reduce_scatter") == (256 + 64 + 256 + 128) * 4
    with pytest.raises(fp4moe.Fp4MoeError):
        fd.parallel_workspace_size(3, 64, 2, "reduce_scatter")
    with pytest.raises(fp4moe.Fp4MoeError):
        fd.parallel_workspace_size(4, 64, 2, "sideways")
    assert fd.expert_window(8, 2, 3) == (6, 2) and fd.expert_window(256, 3, 8) == (96, 32)


# ---- sharding helpers (CPU) ---------------------------------------------------------------------------------------

def test_shard_tp_partials_sum_to_the_full_layer():
    E, H, I, K, T = 4, 64, 64, 2, 8
    rng = np.random.default_rng(3)
    w1 = (rng.standard_normal((E, 2 * I, H)) * 0.2).astype(np.float32)
    w2 = (rng.standard_normal((E, H, I)) * 0.2).astype(np.float32)
    q = fp4moe.quantize_weights(w1, w2, gate_up_order="gate_first")
    from fp4moe._tensors import BF16
    x = rng.standard_normal((T, H)).astype(np.float32).astype(BF16)
    logits = rng.standard_normal((T, E)).astype(np.float32)
    kw = dict(routing_logits=logits, top_k=K, routing_method="renormalize", num_threads=1)
    full = fp4moe.prepare_weights(**q, gate_up_order="gate_first", activation="swiglu")
    ref = fp4moe.moe(x, full, out=np.zeros((T, H), np.float32), **kw)
    total = np.zeros((T, H), np.float32)
    for r in range(2):
        s = fd.shard_tp(**q, rank=r, world=2)
        assert s["w1"].shape == (E, I, H // 2) and s["w2"].shape == (E, H, I // 4)
        assert s["w1_scale"].shape == (E, I, H // 16) and s["w2_scale"].shape == (E, H, I // 32)
        np.testing.assert_array_equal(s["w1"][:, :I // 2], q["w1"][:, r * I // 2:(r + 1) * I // 2])
        np.testing.assert_array_equal(s["w1"][:, I // 2:], q["w1"][:, I + r * I // 2:I + (r + 1) * I // 2])
        w = fp4moe.prepare_weights(**s, gate_up_order="gate_first", activation="swiglu")
        total = total + fp4moe.moe(x, w, out=np.zeros((T, H), np.float32), **kw)  # rank order
    err = np.linalg.norm(total - ref) / np.linalg.norm(ref)
    assert np.linalg.norm(ref) > 0 and err < 1e-5, err
    with pytest.raises(fp4moe.Fp4MoeError):
        fd.shard_tp(**q, rank=0, world=3)  # 64 / 3
    with pytest.raises(fp4moe.Fp4MoeError):
        fd.shard_tp(**q, rank=2, world=2)
    s, off, cnt = fd.shard_ep(**q, rank=1, world=3)
    assert (off, cnt) == (2, 1) and s["w1"].shape[0] == 1
    np.testing.assert_array_equal(s["w2"], q["w2"][2:3])


# ---- two GPUs ------------------------------------------------------------------------------------------------------

def _two_gpus():
    try:
        import torch
    except ImportError:
        return "PyTorch is not installed"
    if not torch.cuda.is_available() or torch.cuda.device_count() < 2:
        return "needs two CUDA devices"
    if not fd.nccl_available():
        return "NCCL unavailable: " + fd.nccl_unavailable_reason()
    return None


@pytest.mark.skipif(_two_gpus() is not None, reason=str(_two_gpus()))
def test_tp2_and_ep2_match_single_gpu(tmp_path):
    report = tmp_path / "report.json"
    r = _launch(["--nproc", "2", "--timeout", "150", str(REPO / "tests/python/distributed_worker.py"), str(report)],
                timeout=180)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    res = json.loads(report.read_text())
    print(res)
    assert res["ranks_equal"] and res["tp_repeat_equal"] and res["tp_workspace_equal"], res
    assert res["tp_f32_rounds_to_bf16"] and res["reduce_scatter_rows_equal"] and res["all_ranks_ok"], res
    assert res["tp_vs_single"] <= 5e-3 and res["ep_vs_single"] <= 5e-3, res
