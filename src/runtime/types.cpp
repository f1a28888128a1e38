// Names of enums, tensor-view helpers.
#include <sstream>

#include "fp4moe/types.h"

namespace fp4moe {

const char* to_string(RoutingMethod m) {
  switch (m) {
    case RoutingMethod::Default: return "Default";
    case RoutingMethod::Renormalize: return "Renormalize";
    case RoutingMethod::DeepSeekV3: return "DeepSeekV3";
    case RoutingMethod::Llama4: return "Llama4";
    case RoutingMethod::RenormalizeNaive: return "RenormalizeNaive";
    case RoutingMethod::TopK: return "TopK";
    case RoutingMethod::SigmoidRenorm: return "SigmoidRenorm";
    case RoutingMethod::MiniMax2: return "MiniMax2";
    case RoutingMethod::Sigmoid: return "Sigmoid";
    case RoutingMethod::TopKSigmoid: return "TopKSigmoid";
  }
  return "?";
}

const char* to_string(ActivationType a) {
  switch (a) {
    case ActivationType::Gelu: return "Gelu";
    case ActivationType::Relu: return "Relu";
    case ActivationType::Silu: return "Silu";
    case ActivationType::Swiglu: return "Swiglu";
    case ActivationType::Geglu: return "Geglu";
    case ActivationType::SwigluBias: return "SwigluBias";
    case ActivationType::Relu2: return "Relu2";
    case ActivationType::SwigluStep: return "SwigluStep";
    case ActivationType::GegluTanh: return "GegluTanh";
    case ActivationType::Identity: return "Identity";
    case ActivationType::Situ: return "Situ";
  }
  return "?";
}

const char* to_string(GemmTile t) {
  switch (t) {
    case GemmTile::Auto: return "Auto";
    case GemmTile::SplitKDecode: return "SplitKDecode";
    case GemmTile::WeightsAsA32: return "WeightsAsA32";
    case GemmTile::TokensAsA64: return "TokensAsA64";
    case GemmTile::Wgmma64: return "Wgmma64";
    case GemmTile::WeightsAsA16: return "WeightsAsA16";
    case GemmTile::WgmmaWs128: return "WgmmaWs128";
    case GemmTile::WgmmaWs64: return "WgmmaWs64";
    case GemmTile::WgmmaWs32: return "WgmmaWs32";
  }
  return "?";
}

const char* to_string(DType t) {
  switch (t) {
    case DType::F32: return "float32";
    case DType::BF16: return "bfloat16";
    case DType::U8: return "uint8";
    case DType::I32: return "int32";
    case DType::E4M3: return "float8_e4m3fn";
    case DType::F64: return "float64";
    case DType::F16: return "float16";
    case DType::I64: return "int64";
  }
  return "?";
}

const char* to_string(ErrorCode c) {
  switch (c) {
    case ErrorCode::InvalidArgument: return "InvalidArgument";
    case ErrorCode::Unsupported: return "Unsupported";
    case ErrorCode::OutOfMemory: return "OutOfMemory";
    case ErrorCode::CudaError: return "CudaError";
    case ErrorCode::DeviceFault: return "DeviceFault";
    case ErrorCode::NotFound: return "NotFound";
    case ErrorCode::ArchMismatch: return "ArchMismatch";
  }
  return "?";
}

size_t dtype_size(DType t) {
  switch (t) {
    case DType::F32: case DType::I32: return 4;
    case DType::BF16: case DType::F16: return 2;
    case DType::U8: case DType::E4M3: return 1;
    case DType::F64: case DType::I64: return 8;
  }
  return 0;
}

std::string TensorView::shape_str() const {
  if (!present()) return "absent";
  std::ostringstream os;
  os << to_string(dtype) << "[";
  for (int i = 0; i < ndim; ++i) os << (i ? ", " : "") << shape[i];
  os << "]";
  if (device == Backend::CUDA) os << " on cuda:" << device_id;
  return os.str();
}

TensorView make_view(void* data, DType dtype, std::initializer_list<int64_t> shape, Backend device, int device_id) {
  TensorView v;
  if (static_cast<int>(shape.size()) > TensorView::kMaxDims)
    throw Error(ErrorCode::InvalidArgument, "shape", "at most 4 dimensions");
  v.data = data;
  v.dtype = dtype;
  v.device = device;
  v.device_id = device_id;
  v.ndim = static_cast<int>(shape.size());
  int i = 0;
  for (int64_t s : shape) v.shape[i++] = s;
  int64_t st = 1;
  for (int d = v.ndim - 1; d >= 0; --d) {
    v.stride[d] = st;
    st *= v.shape[d];
  }
  return v;
}

}  // namespace fp4moe
