// Weight and adapter upload: the canonical host arrays (src/runtime/prepared.h) laid out for the kernels
// (kernels.h, bits of format/nvfp4_prepared.h) and copied to the device.
#include <cstring>
#include <vector>

#include "common/parallel_for.h"
#include "cuda/backend.h"
#include "cuda/backend_parts.h"
#include "cuda/device_guard.h"
#include "cuda/kernels.h"
#include "format/nvfp4_prepared.h"

namespace fp4moe::cuda_backend {
namespace {

template <class T> T* upload(const std::vector<T>& v, std::vector<void*>& allocs, const char* what) {
  if (v.empty()) return nullptr;
  void* p = nullptr;
  const cudaError_t e = cudaMalloc(&p, v.size() * sizeof(T));
  if (e == cudaSuccess) allocs.push_back(p);  // owned before the check, so a failure after it frees it too
  check_cuda(e, what);
  check_cuda(cudaMemcpy(p, v.data(), v.size() * sizeof(T), cudaMemcpyHostToDevice), what);
  return static_cast<T*>(p);
}

// NVFP4 [E][N][K/2] + scales [E][N][K/16] -> kernel layout (kernels.h, bits of format/nvfp4_prepared.h); with mx,
// MXFP4 codes + E8M0 scales [E][N][K/32], each scale byte stored for both k16 steps it covers.
// rowmap: prepared row -> source row.
template <class RowMap>
void layout_nvfp4(const uint8_t* q, const uint8_t* sf, int64_t E, int64_t N, int64_t K, RowMap rowmap,
                  std::vector<uint8_t>& data, std::vector<uint8_t>& sfo, bool mx = false) {
  namespace pf = nvfp4_prepared;
  const int64_t Kp = (K + 63) / 64 * 64, KB = Kp / 64, KQ = K / 2, KS = K / (mx ? 32 : 16);
  data.assign(static_cast<size_t>(E * KB * N * 32), 0);
  sfo.assign(static_cast<size_t>(E * KB * N * 4), 0);
  parallel_for(E, default_threads(8), [&](int64_t e) {  // experts are independent
    for (int64_t p = 0; p < N; ++p) {
      const int64_t src = rowmap(p);
      const uint8_t* qr = q + (e * N + src) * KQ;
      const uint8_t* sr = sf + (e * N + src) * KS;
      for (int64_t kb = 0; kb < KB; ++kb) {
        pf::PreparedScale ps[4];
        uint8_t* ds = sfo.data() + ((e * KB + kb) * N + p) * 4;
        for (int s = 0; s < 4; ++s) {
          if (mx) {  // the values keep their codes: E8M0 has no sign and no zero
            const int64_t c = kb * 2 + s / 2;
            ps[s] = {pf::prepare_mx_scale(c < KS ? sr[c] : 127), false, false};  // padding: zero values
          } else {
            ps[s] = pf::prepare_scale(kb * 4 + s < KS ? sr[kb * 4 + s] : 0);  // padding: zero scale, zero values
          }
          ds[s] = ps[s].code;
        }
        uint8_t* d = data.data() + ((e * KB + kb) * N + p) * 32;
        for (int t = 0; t < 4; ++t) {
          uint32_t word[2] = {0, 0};
          for (int s = 0; s < 4; ++s)
            for (int h = 0; h < 2; ++h) {
              const int64_t old = kb * 32 + s * 8 + t + 4 * h;  // elements 16s + 2t + 8h and + 1
              const uint8_t pair = old < KQ ? qr[old] : 0;
              for (int half = 0; half < 2; ++half) {
                const uint8_t c = pf::prepare_value(static_cast<uint8_t>((pair >> (4 * half)) & 0xf), ps[s]);
                pf::place_value(word[s / 2], 2 * (s % 2) + h, half, c);
              }
            }
          std::memcpy(d + t * 8, word, 8);  // little-endian words, as the kernels load them
        }
      }
    }
  });
}

template <class RowMap>
void layout_bf16(const uint16_t* w, int64_t E, int64_t N, int64_t K, RowMap rowmap, std::vector<uint16_t>& data) {
  const int64_t Kp = (K + 63) / 64 * 64, KB = Kp / 64;
  static constexpr int kQ[4] = {0, 1, 8, 9};
  data.assign(static_cast<size_t>(E * KB * N * 64), 0);
  parallel_for(E, default_threads(8), [&](int64_t e) {  // experts are independent
    for (int64_t p = 0; p < N; ++p) {
      const uint16_t* r = w + (e * N + rowmap(p)) * K;
      for (int64_t kb = 0; kb < KB; ++kb) {
        uint16_t* d = data.data() + ((e * KB + kb) * N + p) * 64;
        for (int t = 0; t < 4; ++t)
          for (int s = 0; s < 4; ++s)
            for (int q = 0; q < 4; ++q) {
              const int64_t k = kb * 64 + s * 16 + 2 * t + kQ[q];
              if (k < K) d[t * 16 + s * 4 + q] = r[k];
            }
      }
    }
  });
}

DeviceMatrix make_matrix(WeightFormat fmt, int64_t N, int64_t K) {
  DeviceMatrix m;
  m.N = N;
  m.K = K;
  m.Kp = (K + 63) / 64 * 64;
  m.expert_data_bytes = (m.Kp / 64) * N * (is_fp4(fmt) ? 32 : 128);
  m.expert_sf_bytes = is_fp4(fmt) ? (m.Kp / 64) * N * 4 : 0;
  return m;
}

}  // namespace

DeviceWeights::~DeviceWeights() {
  DeviceGuard guard(device_id, DeviceGuard::NoThrow{});
  for (void* p : allocations) (void)cudaFree(p);
}

std::shared_ptr<void> prepare_device_weights(const PreparedWeights& w) {
  if (w.E < 1 || w.H % 16 || w.I % 16 || w.H < 16 || w.I < 16)
    throw Error(ErrorCode::InvalidArgument, "weights", "H and I must be positive multiples of 16");
  DeviceGuard guard(w.device_id);
  (void)device_error_flag(w.device_id);  // allocated here, outside any stream capture
  auto dw = std::make_shared<DeviceWeights>();
  dw->device_id = w.device_id;
  dw->format = w.format;
  dw->order = w.order;
  dw->gated = w.gated;
  dw->E = w.E;
  dw->H = w.H;
  dw->I = w.I;
  dw->N1 = w.n1();
  const int64_t E = w.E, H = w.H, I = w.I, N1 = w.n1();
  const bool gate_first = w.order == GateUpOrder::GateFirst;
  // Prepared W1 row p -> canonical row: gated rows interleave (gate j, up j).
  auto map1 = [&](int64_t p) -> int64_t {
    if (!w.gated) return p;
    const int64_t j = p >> 1;
    const bool gate = (p & 1) == 0;
    return gate == gate_first ? j : I + j;
  };
  auto id = [](int64_t p) { return p; };
  dw->w1 = make_matrix(w.format, N1, H);
  dw->w2 = make_matrix(w.format, H, I);
  if (is_fp4(w.format)) {
    const bool mx = w.format == WeightFormat::MXFP4;
    std::vector<uint8_t> d, s;
    layout_nvfp4(w.w1_q.data(), w.w1_sf.data(), E, N1, H, map1, d, s, mx);
    dw->w1.data = upload(d, dw->allocations, "cudaMalloc/cudaMemcpy (w1)");
    dw->w1.sf = upload(s, dw->allocations, "cudaMalloc/cudaMemcpy (w1 scales)");
    layout_nvfp4(w.w2_q.data(), w.w2_sf.data(), E, H, I, id, d, s, mx);
    dw->w2.data = upload(d, dw->allocations, "cudaMalloc/cudaMemcpy (w2)");
    dw->w2.sf = upload(s, dw->allocations, "cudaMalloc/cudaMemcpy (w2 scales)");
  } else {
    std::vector<uint16_t> d;
    layout_bf16(w.w1_bf16.data(), E, N1, H, map1, d);
    dw->w1.data = reinterpret_cast<const uint8_t*>(upload(d, dw->allocations, "cudaMalloc/cudaMemcpy (w1)"));
    layout_bf16(w.w2_bf16.data(), E, H, I, id, d);
    dw->w2.data = reinterpret_cast<const uint8_t*>(upload(d, dw->allocations, "cudaMalloc/cudaMemcpy (w2)"));
  }
  std::vector<float> se(E), so(E), s2(E);
  for (int64_t e = 0; e < E; ++e) {
    if (w.gated) {
      se[e] = w.s1(e, gate_first ? 0 : 1);
      so[e] = w.s1(e, gate_first ? 1 : 0);
    } else {
      se[e] = so[e] = w.s1(e, 0);
    }
    s2[e] = w.w2_s2.empty() ? 1.f : w.w2_s2[e];
  }
  dw->s1_even = upload(se, dw->allocations, "cudaMemcpy (scales)");
  dw->s1_odd = upload(so, dw->allocations, "cudaMemcpy (scales)");
  dw->s2 = upload(s2, dw->allocations, "cudaMemcpy (scales)");
  if (!w.bias1.empty()) {
    std::vector<float> b(static_cast<size_t>(E * N1));
    for (int64_t e = 0; e < E; ++e)
      for (int64_t p = 0; p < N1; ++p) b[e * N1 + p] = w.bias1[e * N1 + map1(p)];
    dw->bias1 = upload(b, dw->allocations, "cudaMemcpy (bias1)");
  }
  if (!w.bias2.empty()) dw->bias2 = upload(w.bias2, dw->allocations, "cudaMemcpy (bias2)");
  return dw;
}

std::shared_ptr<void> prepare_device_adapter(const PreparedAdapter& a, int device_id) {
  DeviceGuard guard(device_id);
  auto da = std::make_shared<DeviceAdapter>();
  da->device_id = device_id;
  da->A1 = upload(a.A1, da->allocations, "cudaMemcpy (adapter A1)");
  da->B1 = upload(a.B1, da->allocations, "cudaMemcpy (adapter B1)");
  da->A2 = upload(a.A2, da->allocations, "cudaMemcpy (adapter A2)");
  da->B2 = upload(a.B2, da->allocations, "cudaMemcpy (adapter B2)");
  da->sA1 = upload(a.sA1, da->allocations, "cudaMemcpy (adapter sA1)");
  da->sB1 = upload(a.sB1, da->allocations, "cudaMemcpy (adapter sB1)");
  da->sA2 = upload(a.sA2, da->allocations, "cudaMemcpy (adapter sA2)");
  da->sB2 = upload(a.sB2, da->allocations, "cudaMemcpy (adapter sB2)");
  return da;
}

}  // namespace fp4moe::cuda_backend
