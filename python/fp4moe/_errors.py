"""fp4moe's exception class and error codes (pure Python, no dependency on the extension)."""
from __future__ import annotations

import enum


class ErrorCode(enum.IntEnum):
    """Values of fp4moe::ErrorCode (include/fp4moe/types.h)."""
    InvalidArgument = 1
    Unsupported = 2
    OutOfMemory = 3
    CudaError = 4
    DeviceFault = 5
    NotFound = 6
    ArchMismatch = 7


# The C++ layer names nested fields ("routing.logits"); the Python API names its keyword arguments.
_CPP_TO_PY_ARGUMENT = {
    "routing.logits": "routing_logits",
    "routing.bias": "routing_bias",
    "routing.topk_ids": "topk_ids",
    "routing.topk_weights": "topk_weights",
    "routing.top_k": "top_k",
    "routing.method": "routing_method",
    "routing.n_group": "n_group",
    "routing.topk_group": "topk_group",
    "routing.routed_scaling_factor": "routed_scaling_factor",
    "activation.type": "activation",
    "activation.alpha": "gemm1_alpha",
    "activation.beta": "gemm1_beta",
    "activation.clamp_limit": "gemm1_clamp_limit",
    "y": "out",
    "order": "gate_up_order",
    "layer": "weights",
    "topk_ids_out": "topk_ids",
    "topk_weights_out": "topk_weights",
}


class Fp4MoeError(ValueError):
    """An error reported by fp4moe.

    Attributes:
        code: an ErrorCode (InvalidArgument, Unsupported, ArchMismatch, ...).
        argument: the Python name of the offending argument ("" when the error is not about one).
        cpp_argument: the argument's name in the C++ API (e.g. "routing.logits").
    """

    def __init__(self, message: str, code: int = ErrorCode.InvalidArgument, argument: str = ""):
        try:
            code = ErrorCode(int(code))
        except ValueError:
            pass  # an unknown code stays an int
        cpp_argument = argument or ""
        py_argument = _CPP_TO_PY_ARGUMENT.get(cpp_argument, cpp_argument)
        if cpp_argument and py_argument != cpp_argument:
            prefix = f"argument '{cpp_argument}':"
            if message.startswith(prefix):
                message = f"argument '{py_argument}':" + message[len(prefix):]
        super().__init__(message)
        self.code = code
        self.argument = py_argument
        self.cpp_argument = cpp_argument

    def __reduce__(self):  # picklable (multiprocessing workers re-raise it)
        return (_rebuild, (str(self), int(self.code), self.cpp_argument or self.argument, self.argument))


def _rebuild(message: str, code: int, argument: str, py_argument: str | None = None) -> "Fp4MoeError":
    e = Fp4MoeError.__new__(Fp4MoeError)
    ValueError.__init__(e, message)
    e.code = ErrorCode(code) if code in ErrorCode._value2member_map_ else code
    e.argument = py_argument if py_argument is not None else _CPP_TO_PY_ARGUMENT.get(argument, argument)
    e.cpp_argument = argument
    return e


def renamed(e: Fp4MoeError, names: dict) -> Fp4MoeError:
    """e with its argument renamed by `names` (a C++ field of a call -> the Python parameter it comes from, e.g.
    prepare_weights' "hidden" -> "w1", whose shape gives it); e itself when its argument is not in `names`."""
    new = names.get(e.argument)
    if not new:
        return e
    msg = str(e)
    prefix = f"argument '{e.argument}':"
    if msg.startswith(prefix):
        msg = f"argument '{new}':" + msg[len(prefix):]
    out = Fp4MoeError.__new__(Fp4MoeError)
    ValueError.__init__(out, msg)
    out.code, out.argument, out.cpp_argument = e.code, new, e.cpp_argument
    return out


def error(argument: str, what: str, code: ErrorCode = ErrorCode.InvalidArgument) -> Fp4MoeError:
    """An error raised by the Python layer, worded like the C++ ones."""
    msg = f"argument '{argument}': {what}" if argument else what
    e = Fp4MoeError.__new__(Fp4MoeError)
    ValueError.__init__(e, msg)
    e.code, e.argument, e.cpp_argument = code, argument, argument
    return e
