// The reference operator's entry points: prepared-weight checks and token chunks (the arithmetic: moe_reference.cpp).
#include <algorithm>
#include <string>

#include "fp4moe/mxfp4.h"
#include "fp4moe/nvfp4.h"
#include "reference/moe_reference.h"
#include "reference/reference.h"
#include "runtime/host_tensor.h"

namespace fp4moe::reference {
using detail::invalid;
namespace {

void check_weights(const PreparedWeights& w) {
  if (w.E < 1 || w.H < 16 || w.I < 16 || w.H % 16 || w.I % 16) invalid("weights", "bad prepared sizes");
  const auto need = [](size_t have, int64_t want, const char* what) {
    if (static_cast<int64_t>(have) != want) invalid("weights", std::string("prepared array ") + what + " has the wrong size");
  };
  const int64_t E = w.E, N1 = w.n1(), H = w.H, I = w.I;
  if (is_fp4(w.format)) {
    const int64_t block = w.format == WeightFormat::MXFP4 ? mxfp4::kBlock : nvfp4::kBlock;
    if (H % block || I % block) invalid("weights", "bad prepared sizes");
    need(w.w1_q.size(), E * N1 * H / 2, "w1_q");
    need(w.w1_sf.size(), E * N1 * H / block, "w1_sf");
    need(w.w2_q.size(), E * H * I / 2, "w2_q");
    need(w.w2_sf.size(), E * H * I / block, "w2_sf");
  } else {
    need(w.w1_bf16.size(), E * N1 * H, "w1_bf16");
    need(w.w2_bf16.size(), E * H * I, "w2_bf16");
  }
  need(w.w1_s2.size(), w.gated ? 2 * E : E, "w1_s2");
  need(w.w2_s2.size(), E, "w2_s2");
  if (!w.bias1.empty()) need(w.bias1.size(), E * N1, "bias1");
  if (!w.bias2.empty()) need(w.bias2.size(), E * H, "bias2");
}

// The rows [t0, t0 + n) of a token-major view (absent views stay absent).
TensorView token_rows(const TensorView& v, int64_t t0, int64_t n) {
  if (!v.present()) return v;
  TensorView r = v;
  r.data = static_cast<char*>(v.data) + t0 * v.stride[0] * static_cast<int64_t>(dtype_size(v.dtype));
  r.shape[0] = n;
  return r;
}

template <class Acc>
void run_precision(const PreparedWeights& w, const MoeArgs& args, const AdapterSnapshot& adapters, int64_t chunk) {
  const int64_t T = args.x.shape[0];
  if (T <= chunk) {
    run_tokens<Acc>(w, args, adapters);
    return;
  }
  // Check every argument of the whole call first, so that no chunk is written when a later one is bad.
  check_tokens<Acc>(w, args, adapters);
  for (int64_t t0 = 0; t0 < T; t0 += chunk) {
    const int64_t n = std::min(chunk, T - t0);
    MoeArgs sub = args;
    sub.x = token_rows(args.x, t0, n);
    sub.y = token_rows(args.y, t0, n);
    sub.routing.logits = token_rows(args.routing.logits, t0, n);
    sub.routing.topk_ids = token_rows(args.routing.topk_ids, t0, n);
    sub.routing.topk_weights = token_rows(args.routing.topk_weights, t0, n);
    sub.adapter_ids = token_rows(args.adapter_ids, t0, n);
    sub.gate_up_lora_delta = token_rows(args.gate_up_lora_delta, t0, n);
    sub.activation_out = token_rows(args.activation_out, t0, n);
    run_tokens<Acc>(w, sub, adapters);
  }
}

}  // namespace

void run_chunked(const PreparedWeights& w, const MoeArgs& args, const AdapterSnapshot& adapters,
                 int64_t max_tokens_per_chunk) {
  check_weights(w);
  if (args.shared_expert) {
    if (!args.shared_expert->valid()) invalid("shared_expert", "not prepared");
    check_weights(args.shared_expert->impl());
  }
  if (max_tokens_per_chunk < 1) invalid("max_tokens_per_chunk", "expected >= 1");
  if (args.precision == Precision::Fp64) run_precision<double>(w, args, adapters, max_tokens_per_chunk);
  else run_precision<float>(w, args, adapters, max_tokens_per_chunk);
}

void run(const PreparedWeights& w, const MoeArgs& args, const AdapterSnapshot& adapters) {
  // Bound the per-pair buffers (T * k * H accumulators) to about 256 MiB; chunks change no result
  // (a token's output does not depend on the other tokens).
  const int64_t k = std::max<int64_t>(args.routing.top_k, 1);
  const int64_t acc = args.precision == Precision::Fp64 ? 8 : 4;
  const int64_t per_token = k * std::max<int64_t>(w.H, 1) * acc * 2;
  run_chunked(w, args, adapters, std::max<int64_t>(1, (int64_t(256) << 20) / per_token));
}

}  // namespace fp4moe::reference
