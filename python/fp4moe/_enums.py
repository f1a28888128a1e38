"""Enums with FlashInfer 0.6.18's values (include/fp4moe/types.h), and the parsing of user spellings."""
from __future__ import annotations

import enum
import operator

from ._errors import error


class RoutingMethod(enum.IntEnum):
    Default = 0
    Renormalize = 1
    DeepSeekV3 = 2
    Llama4 = 3
    RenormalizeNaive = 4
    TopK = 5
    SigmoidRenorm = 6
    MiniMax2 = 7
    Sigmoid = 8
    TopKSigmoid = 9


class ActivationType(enum.IntEnum):
    Gelu = 0
    Relu = 1
    Silu = 2
    Swiglu = 3
    Geglu = 4
    SwigluBias = 5
    Relu2 = 6
    SwigluStep = 7
    GegluTanh = 8
    Identity = 9
    Situ = 10


GATED_ACTIVATIONS = frozenset({ActivationType.Swiglu, ActivationType.Geglu, ActivationType.SwigluBias,
                               ActivationType.SwigluStep, ActivationType.GegluTanh, ActivationType.Situ})


def is_gated(a: ActivationType) -> bool:
    return ActivationType(a) in GATED_ACTIVATIONS


# Internal enums of the C++ API (not FlashInfer's).
class GateUpOrder(enum.IntEnum):
    GateFirst = 0
    UpFirst = 1


class ActMode(enum.IntEnum):
    A16 = 0
    A4 = 1


class WeightFormat(enum.IntEnum):
    NVFP4 = 0
    BF16 = 1
    MXFP4 = 2


class ScaleLayout(enum.IntEnum):
    Linear = 0
    Swizzled128x4 = 1


class LoraLayout(enum.IntEnum):
    PerExpert = 0
    PeftFused = 1
    SharedOuter = 2


class Precision(enum.IntEnum):
    Fp32 = 0
    Fp64 = 1


class GemmTile(enum.IntEnum):
    """The CUDA backend's GEMM tiles (fp4moe::GemmTile); every tile gives the same bits."""
    Auto = -1          # the plan's choice
    SplitKDecode = 0   # up to 8 tokens a tile, weights as the mma A operand, K split over blocks
    WeightsAsA32 = 1   # up to 32 tokens a tile, weights as the mma A operand
    TokensAsA64 = 2    # 64 tokens a tile, tokens as the mma A operand
    Wgmma64 = 3        # 64 tokens a tile, sm_90a wgmma with the weights as register A
    WeightsAsA16 = 4   # up to 16 tokens a tile, weights as the mma A operand
    WgmmaWs128 = 5     # 128 tokens x 256 weight rows, sm_90a wgmma, warp-specialised
    WgmmaWs64 = 6      # 64 tokens x 256 weight rows, the same warp-specialised tile
    WgmmaWs32 = 7      # 32 tokens x 256 weight rows, the same


# fp4moe::DType values (dtype hints passed to the extension).
class DType(enum.IntEnum):
    F32 = 0
    BF16 = 1
    U8 = 2
    I32 = 3
    E4M3 = 4
    F64 = 5
    F16 = 6
    I64 = 7


def _norm(s: str) -> str:
    return s.replace("_", "").replace("-", "").lower()


def parse_enum(enum_cls: type[enum.IntEnum], value, argument: str, aliases: dict[str, int] | None = None):
    """An enum member from a member, an int, or a (case/underscore-insensitive) name."""
    if isinstance(value, enum_cls):
        return value
    if isinstance(value, bool):  # bool is an int; True is never a meaningful enum value
        raise error(argument, f"expected a {enum_cls.__name__} or its name, got {value!r}")
    if isinstance(value, int):
        try:
            return enum_cls(value)
        except ValueError:
            raise error(argument, f"expected a {enum_cls.__name__} value in "
                                  f"{[int(m) for m in enum_cls]}, got {value}") from None
    if isinstance(value, str):
        key = _norm(value)
        if aliases and key in aliases:
            return enum_cls(aliases[key])
        for m in enum_cls:
            if _norm(m.name) == key:
                return m
        names = [m.name for m in enum_cls] + sorted(aliases or ())
        raise error(argument, f"expected one of {names}, got {value!r}")
    if hasattr(type(value), "__index__") and not isinstance(value, (bytes, bytearray)):  # NumPy / 0-d tensor ints
        try:
            return parse_enum(enum_cls, operator.index(value), argument)
        except TypeError:
            pass
    # Foreign enums with the same values (e.g. flashinfer's ActivationType) carry .value.
    if hasattr(value, "value") and isinstance(value.value, int):
        return parse_enum(enum_cls, int(value.value), argument)
    raise error(argument, f"expected a {enum_cls.__name__}, an int or a name, got {type(value).__name__}")


GATE_UP_ORDER_ALIASES = {"gatefirst": 0, "upfirst": 1, "gateup": 0, "upgate": 1}
MODE_ALIASES = {"a16": 0, "w4a16": 0, "a4": 1, "w4a4": 1}
SCALE_LAYOUT_ALIASES = {"linear": 0, "swizzled": 1, "swizzled128x4": 1, "128x4": 1}
FORMAT_ALIASES = {"nvfp4": 0, "fp4": 0, "bf16": 1, "bfloat16": 1, "mxfp4": 2}
LORA_LAYOUT_ALIASES = {"perexpert": 0, "sglang": 0, "vllm": 0, "peftfused": 1, "peft": 1, "fused": 1,
                       "sharedouter": 2}
PRECISION_ALIASES = {"fp32": 0, "float32": 0, "fp64": 1, "float64": 1}
GEMM_TILE_ALIASES = {"plan": -1, "decode": 0, "wgmma": 3}
