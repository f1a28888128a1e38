"""bench/compare_peers.py: fp4moe's bench JSON beside peers' times (no GPU needed)."""
import importlib.util
import json
import pathlib
import sys

import pytest

_BENCH = pathlib.Path(__file__).resolve().parents[2] / "bench"
sys.path.insert(0, str(_BENCH))
_spec = importlib.util.spec_from_file_location("compare_peers", _BENCH / "compare_peers.py")
compare_peers = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(compare_peers)

_FP4MOE = {"cases": [
    {"shape": "kimi_k3_tp8", "T": 1, "lora": False, "lora_case": "base", "status": "ok", "median_us": 30.0,
     "floor_us": 5.0},
    {"shape": "kimi_k3_tp8", "T": 1, "lora": True, "lora_case": "per_expert8", "status": "ok", "median_us": 45.0,
     "floor_us": 6.0},
    {"shape": "kimi_k3_tp8", "T": 1024, "lora": False, "lora_case": "base", "status": "ok", "median_us": 600.0,
     "floor_us": 200.0},
    {"shape": "qwen3_30b_a3b", "T": 8, "lora": False, "lora_case": "base", "status": "error", "median_us": 0.0,
     "floor_us": 30.0},
]}


def test_rows_ratios_and_the_fastest_in_bold():
    marlin = [{"shape": "kimi_k3_tp8", "T": 1, "median_us": 40.0}, {"shape": "kimi_k3_tp8", "T": 1024, "median_us": 500.0}]
    humming = {"cases": [{"shape": "kimi_k3_tp8", "T": 1024, "median_us": 480.0},
                         {"shape": "kimi_k3_tp8", "T": 1, "median_us": 1.0, "status": "error"}]}
    lines = compare_peers.table(_FP4MOE, [("Marlin", marlin), ("Humming", humming)])
    assert lines[0].startswith("| shape | T | floor µs | fp4moe µs | × floor | Marlin µs | fp4moe / Marlin |")
    assert len(lines) == 4  # header, rule, two rows: the error row and the LoRA row are left out
    assert lines[2] == "| kimi_k3_tp8 | 1 | 5.0 | **30.0** | 6.00 | 40.0 | 0.75 | – | – |"
    assert lines[3] == "| kimi_k3_tp8 | 1024 | 200.0 | 600.0 | 3.00 | 500.0 | 1.20 | **480.0** | 1.25 |"


def test_lora_case_rows_and_variant_suffix():
    doc = {"cases": [dict(c, shape=c["shape"] + "+situ") for c in _FP4MOE["cases"]]}
    lines = compare_peers.table(doc, [("p", [{"shape": "kimi_k3_tp8", "T": 1, "median_us": 50.0}])], "per_expert8")
    assert lines[2:] == ["| kimi_k3_tp8 | 1 | 6.0 | **45.0** | 7.50 | 50.0 | 0.90 |"]


def test_results_key():
    peer = {"peer": "p", "results": [{"shape": "kimi_k3_tp8", "T": 1, "median_us": 20.0}]}
    lines = compare_peers.table(_FP4MOE, [("p", peer)])
    assert lines[2] == "| kimi_k3_tp8 | 1 | 5.0 | 30.0 | 6.00 | **20.0** | 1.50 |"


def test_command_line(tmp_path, capsys):
    f = tmp_path / "fp4moe.json"
    p = tmp_path / "marlin.json"
    f.write_text(json.dumps(_FP4MOE))
    p.write_text(json.dumps([{"shape": "kimi_k3_tp8", "T": 1024, "median_us": 700.0}]))
    compare_peers.main([str(f), f"Marlin={p}"])
    out = capsys.readouterr().out
    assert "| kimi_k3_tp8 | 1024 | 200.0 | **600.0** | 3.00 | 700.0 | 0.86 |" in out
    with pytest.raises(SystemExit):
        compare_peers.main([str(f), str(p)])  # a peer without NAME=
