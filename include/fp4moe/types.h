// fp4moe public types: enums (values as in FlashInfer 0.6.18), tensor views, errors.
#pragma once
#include <cstdint>
#include <cstring>
#include <initializer_list>
#include <stdexcept>
#include <string>

namespace fp4moe {

// ---- enums -----------------------------------------------------------------------------
enum class RoutingMethod : int32_t {
  Default = 0, Renormalize = 1, DeepSeekV3 = 2, Llama4 = 3, RenormalizeNaive = 4,
  TopK = 5, SigmoidRenorm = 6, MiniMax2 = 7, Sigmoid = 8, TopKSigmoid = 9,
};
enum class ActivationType : int32_t {
  Gelu = 0, Relu = 1, Silu = 2, Swiglu = 3, Geglu = 4, SwigluBias = 5, Relu2 = 6,
  SwigluStep = 7, GegluTanh = 8, Identity = 9, Situ = 10,
};
constexpr bool is_gated(ActivationType a) {
  return a == ActivationType::Swiglu || a == ActivationType::Geglu || a == ActivationType::SwigluBias ||
         a == ActivationType::SwigluStep || a == ActivationType::GegluTanh || a == ActivationType::Situ;
}
const char* to_string(RoutingMethod m);
const char* to_string(ActivationType a);

enum class GateUpOrder : int32_t { GateFirst = 0, UpFirst = 1 };
enum class ActMode : int32_t { A16 = 0, A4 = 1 };
// MXFP4: E2M1 values with one E8M0 power-of-two scale per 32 along K and no global scale (SPEC §2).
enum class WeightFormat : int32_t { NVFP4 = 0, BF16 = 1, MXFP4 = 2 };
// The formats whose weights are 4-bit E2M1 codes (decoded inside the GEMMs).
constexpr bool is_fp4(WeightFormat f) { return f == WeightFormat::NVFP4 || f == WeightFormat::MXFP4; }
enum class ScaleLayout : int32_t { Linear = 0, Swizzled128x4 = 1 };
enum class Backend : int32_t { CPU = 0, CUDA = 1 };
// Fp32: the SPEC's numerics (fp32 accumulation, bf16 roundings where the SPEC puts them).
// Fp64: reference-only; every sum in double and no intermediate rounding (the "ideal" answer).
enum class Precision : int32_t { Fp32 = 0, Fp64 = 1 };

// The CUDA backend's GEMM tiles (MoeArgs::gemm_tile): every tile gives the same bits (SPEC §4), so forcing one is
// for tuning and tests; docs/architecture.md describes them.
enum class GemmTile : int32_t {
  Auto = -1,         // the plan's choice, by the rows an expert
  SplitKDecode = 0,  // up to 8 tokens a tile, the weights as the mma A operand, K split over blocks when few
  WeightsAsA32 = 1,  // up to 32 tokens a tile, the weights as the mma A operand
  TokensAsA64 = 2,   // 64 tokens a tile, the tokens as the mma A operand
  Wgmma64 = 3,       // 64 tokens a tile, sm_90a wgmma with the decoded weights as its register A operand
  WeightsAsA16 = 4,  // up to 16 tokens a tile, the weights as the mma A operand
  WgmmaWs128 = 5,    // 128 tokens x 256 weight rows, sm_90a wgmma, warp-specialised (a producer warpgroup)
  WgmmaWs64 = 6,     // 64 tokens x 256 weight rows, the same warp-specialised tile for fewer rows an expert
  WgmmaWs32 = 7,     // 32 tokens x 256 weight rows, the same
};
const char* to_string(GemmTile t);

enum class DType : int32_t { F32 = 0, BF16 = 1, U8 = 2, I32 = 3, E4M3 = 4, F64 = 5, F16 = 6, I64 = 7 };
size_t dtype_size(DType t);
const char* to_string(DType t);

// ---- bf16 on the host -----------------------------------------------------------------------
// Round-to-nearest-even fp32 -> bf16 (NaN stays NaN, quiet).
inline uint16_t f32_to_bf16_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40u);
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}
inline float bf16_bits_to_f32(uint16_t b) {
  uint32_t u = static_cast<uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
inline float round_bf16(float f) { return bf16_bits_to_f32(f32_to_bf16_bits(f)); }

// ---- tensors -------------------------------------------------------------------------------
// A non-owning view of a strided tensor (strides in elements). data == nullptr means "absent".
struct TensorView {
  static constexpr int kMaxDims = 4;
  void* data = nullptr;
  DType dtype = DType::F32;
  Backend device = Backend::CPU;
  int device_id = 0;
  int ndim = 0;
  int64_t shape[kMaxDims] = {0, 0, 0, 0};
  int64_t stride[kMaxDims] = {0, 0, 0, 0};

  bool present() const { return data != nullptr; }
  int64_t numel() const {
    int64_t n = 1;
    for (int i = 0; i < ndim; ++i) n *= shape[i];
    return n;
  }
  bool is_contiguous() const {
    int64_t s = 1;
    for (int i = ndim - 1; i >= 0; --i) {
      if (shape[i] != 1 && stride[i] != s) return false;
      s *= shape[i];
    }
    return true;
  }
  std::string shape_str() const;
  template <class T> T* as() const { return static_cast<T*>(data); }
};

// A contiguous view over memory the caller owns.
TensorView make_view(void* data, DType dtype, std::initializer_list<int64_t> shape,
                     Backend device = Backend::CPU, int device_id = 0);

// ---- errors (SPEC §6) ----------------------------------------------------------------------
enum class ErrorCode : int32_t {
  InvalidArgument = 1,  // a shape, dtype, stride, device or value is wrong
  Unsupported = 2,      // legal in the SPEC but not supported by this backend/build
  OutOfMemory = 3,
  CudaError = 4,        // a CUDA call failed
  DeviceFault = 5,      // a value only on the GPU was bad (out-of-range id): reported by the next checked call
  NotFound = 6,         // adapter slot empty, file missing
  ArchMismatch = 7,     // binary carries no cubin for this GPU
};
const char* to_string(ErrorCode c);

class Error : public std::runtime_error {
 public:
  Error(ErrorCode code, std::string argument, const std::string& what)
      : std::runtime_error(argument.empty() ? what : ("argument '" + argument + "': " + what)),
        code_(code), argument_(std::move(argument)) {}
  ErrorCode code() const { return code_; }
  // The name of the offending argument ("" when the error is not about one argument).
  const std::string& argument() const { return argument_; }

 private:
  ErrorCode code_;
  std::string argument_;
};

}  // namespace fp4moe
