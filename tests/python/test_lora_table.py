"""bench/lora_table.py: the LoRA rows of a bench JSON against its base rows (no GPU needed)."""
import importlib.util
import json
import pathlib
import sys

import pytest

_BENCH = pathlib.Path(__file__).resolve().parents[2] / "bench"
sys.path.insert(0, str(_BENCH))
_spec = importlib.util.spec_from_file_location("lora_table", _BENCH / "lora_table.py")
lora_table = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(lora_table)


def _case(shape, T, case, us, over_floor, status="ok"):
    return {"shape": shape, "T": T, "lora_case": case, "lora": case != "base", "status": status, "median_us": us,
            "time_over_floor": over_floor}


_DOC = {"cases": [
    _case("kimi_k3_tp8", 1, "base", 30.0, 6.0),
    _case("kimi_k3_tp8", 1, "per_expert8", 36.0, 6.6),
    _case("kimi_k3_tp8", 8, "base", 70.0, 2.0),
    _case("kimi_k3_tp8", 8, "per_expert8", 0.0, 0.0, status="error"),
    _case("qwen3_30b_a3b+situ", 1, "base", 20.0, 4.0),
    _case("qwen3_30b_a3b+situ", 1, "per_expert8", 30.0, 5.0),
    _case("qwen3_30b_a3b+situ", 8, "per_expert8", 80.0, 2.5),  # no base row at T=8
    _case("qwen3_30b_a3b+situ", 1, "one_adapter", 22.0, 4.2),
]}


def test_cells_are_floor_ratio_overhead_and_waste():
    lines = lora_table.table(_DOC, "per_expert8")
    assert lines[0] == "| shape | T=1 | T=8 |"
    assert lines[2] == "| kimi_k3_tp8 | 6.60 +20% (1.10) | – |"  # the error row is left out
    assert lines[3] == "| qwen3_30b_a3b | 5.00 +50% (1.25) | – |"  # variant suffix dropped; no base at T=8
    assert len(lines) == 4


def test_command_line_every_case_in_file_order(tmp_path, capsys):
    f = tmp_path / "fp4moe.json"
    f.write_text(json.dumps(_DOC))
    lora_table.main([str(f)])
    out = capsys.readouterr().out
    assert out.index("per_expert8:") < out.index("one_adapter:") and "base:" not in out
    assert "| qwen3_30b_a3b | 4.20 +10% (1.05) |" in out
    with pytest.raises(SystemExit):
        lora_table.main([])
