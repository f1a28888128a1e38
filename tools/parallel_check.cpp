// fp4moe_parallel_check: the multi-GPU check and benchmark of issue 7 (tensor / expert parallelism over NCCL).
//
// One process per GPU: the binary forks itself once per rank before any CUDA call; rank 0 makes the
// ncclUniqueId and hands its 128 bytes to the other ranks through pipes; every rank then opens an NCCL
// communicator on GPU `rank` (NcclGroupComm) and runs, per model shape:
//   checks (T = --check-tokens, eight rank-16 LoRA adapters, tokens cycling over base and adapters 0..7):
//     - single GPU (rank 0): bf16 y, and f32 y whose bf16 rounding equals the bf16 y bit for bit;
//     - TP=world and EP=world (AllReduce): every rank's y bit-identical, bit-identical across two runs,
//       relative L2 vs the single-GPU operator <= --tol, and vs the CPU reference (--ref-tokens tokens) <= 1e-2;
//     - TP ReduceScatter: each rank's rows equal the AllReduce rows bit for bit;
//     - the FNV-1a hashes of the single-GPU, TP and EP outputs go to --json (to compare two launches);
//     - failure agreement (first shape): rank 1 passes a bad y; it throws naming "y", rank 0 returns,
//       leaves y untouched and check_device_errors reports DeviceFault naming "comm"; nothing hangs;
//   timing (CUDA events, median of --iters runs after --warmup): single GPU, TP and EP at each of --tokens,
//     base tokens and all-LoRA tokens.
// Rank 0 prints a summary and writes --json. Exit 0 when every check passes. A watchdog (--timeout) kills
// the ranks instead of hanging.
//
// Shapes: kimi_k3 = kimi_k3_tp8 with the full I = 3072 (= 8 x 384) and --kimi-experts experts (the routing
// covers those experts); qwen3_30b_a3b as in SPEC §1.
#include <cuda_runtime.h>
#include <unistd.h>

#include <algorithm>
#include <cstdarg>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <map>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include "common/device_buffer.h"
#include "fp4moe/model_shapes.h"
#include "fp4moe/moe.h"
#include "fp4moe/parallel.h"
#include "fp4moe/synthetic.h"
#include "parallel_check.h"

using namespace fp4moe;
using namespace fp4moe::parallel_check;

namespace {

// ---- small CUDA helpers (inside the rank processes only) ------------------------------------------------
#define CK(call)                                                                                     \
  do {                                                                                               \
    cudaError_t e_ = (call);                                                                         \
    if (e_ != cudaSuccess) {                                                                         \
      std::fprintf(stderr, "CUDA error %s at %s:%d: %s\n", #call, __FILE__, __LINE__, cudaGetErrorString(e_)); \
      std::exit(3);                                                                                  \
    }                                                                                                \
  } while (0)

double rel_l2(const std::vector<double>& a, const std::vector<double>& ref) {
  double num = 0, den = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    if (!std::isfinite(a[i])) return INFINITY;
    num += (a[i] - ref[i]) * (a[i] - ref[i]);
    den += ref[i] * ref[i];
  }
  return den > 0 ? std::sqrt(num / den) : std::sqrt(num);
}

// FNV-1a (64 bit) of an output's bf16 bits, as a JSON string: two launches gave the same y when these match.
std::string fnv1a_json(const std::vector<uint16_t>& v) {
  uint64_t h = 1469598103934665603ull;
  for (uint16_t x : v) {
    h = (h ^ (x & 0xffu)) * 1099511628211ull;
    h = (h ^ (x >> 8)) * 1099511628211ull;
  }
  char b[24];
  std::snprintf(b, sizeof b, "\"%016llx\"", static_cast<unsigned long long>(h));
  return b;
}

std::vector<double> widen(const std::vector<uint16_t>& b, const std::vector<int64_t>* rows = nullptr, int64_t H = 0) {
  std::vector<double> v;
  if (!rows) {
    for (uint16_t x : b) v.push_back(bf16_bits_to_f32(x));
    return v;
  }
  for (int64_t t : *rows)
    for (int64_t h = 0; h < H; ++h) v.push_back(bf16_bits_to_f32(b[t * H + h]));
  return v;
}

double median(std::vector<float> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

// One model shape as the check runs it.
ModelShape shape_named(const std::string& name, const Options& o) {
  if (name == "kimi_k3") {
    ModelShape m = *find_model_shape("kimi_k3_tp8");
    m.name = "kimi_k3";
    m.I = 384 * 8;
    m.E = m.E_loc = o.kimi_experts;
    return m;
  }
  const ModelShape* m = find_model_shape(name);
  if (!m) throw Error(ErrorCode::InvalidArgument, "shapes", "unknown shape " + name);
  return *m;
}

struct Json {
  std::ostringstream os;
  bool first = true;
  void kv(const std::string& k, const std::string& raw) {
    os << (first ? "" : ",\n") << "  \"" << k << "\": " << raw;
    first = false;
  }
  void num(const std::string& k, double v) {
    char b[64];
    std::snprintf(b, sizeof b, "%.6g", std::isfinite(v) ? v : -1.0);
    kv(k, b);
  }
};

// ---- one rank ------------------------------------------------------------------------------------------
class Rank {
 public:
  Rank(const Options& o, int rank, Communicator& comm, cudaStream_t s) : o_(o), rank_(rank), comm_(comm), s_(s) {}
  bool ok = true;
  Json json;

  void say(const char* fmt, ...) __attribute__((format(printf, 2, 3))) {
    if (rank_ != 0) return;
    va_list ap;
    va_start(ap, fmt);
    std::vprintf(fmt, ap);
    va_end(ap);
    std::fflush(stdout);
  }
  void expect(bool cond, const std::string& what) {
    if (!cond) ok = false;
    say("%s %s\n", cond ? "PASS" : "FAIL", what.c_str());
  }

  // Every rank's values (rank order) on every rank: an NCCL all-gather of a few floats.
  std::vector<float> gather(const std::vector<float>& mine) {
    DeviceBuffer in = DeviceBuffer::from(mine), out(mine.size() * sizeof(float) * o_.world);
    comm_.allgather(in.get(), out.get(), static_cast<int64_t>(mine.size() * sizeof(float)));
    return out.download<float>(mine.size() * o_.world, s_);
  }
  // y bits of every rank on rank 0 (all-gather of the bytes).
  std::vector<std::vector<uint16_t>> gather_y(const DeviceBuffer& y, size_t n) {
    DeviceBuffer out(n * 2 * o_.world);
    comm_.allgather(y.get(), out.get(), static_cast<int64_t>(n * 2));
    std::vector<uint16_t> all = out.download<uint16_t>(n * o_.world, s_);
    std::vector<std::vector<uint16_t>> r;
    for (int q = 0; q < o_.world; ++q) r.emplace_back(all.begin() + q * n, all.begin() + (q + 1) * n);
    return r;
  }
  void barrier() { comm_.barrier(); }

  void run_shape(const std::string& name, bool first) {
    const ModelShape ms = shape_named(name, o_);
    const int W = o_.world;
    const int64_t E = ms.E, H = ms.H, I = ms.I, k = ms.k;
    const int64_t Tmax = std::max<int64_t>(o_.check_tokens, *std::max_element(o_.tokens.begin(), o_.tokens.end()));
    auto t0 = std::chrono::steady_clock::now();
    const uint64_t seed = 1234;
    SyntheticLayer L = make_synthetic_layer(ms, E, seed);
    const WeightsDesc full = L.desc();
    std::vector<SyntheticAdapter> ads;
    for (int i = 0; i < 8; ++i) ads.push_back(make_synthetic_adapter(L, 16, seed + 100 + i));
    // TP shard, EP window, and (rank 0) the full layer on GPU and CPU.
    OwnedWeights tps = shard_weights_tp(full, rank_, W);
    MoeWeights wtp = prepare_weights(tps.desc(), Backend::CUDA, rank_);
    AdapterRegistry rtp(wtp, 8);
    const ExpertWindow win = expert_window(E, rank_, W);
    OwnedWeights eps = slice_experts(full, win.offset, win.count);
    MoeWeights wep = prepare_weights(eps.desc(), Backend::CUDA, rank_);
    AdapterRegistry rep(wep, 8);
    for (int i = 0; i < 8; ++i) {
      LoraAdapterDesc d = ads[i].desc();
      ShardedAdapter a = shard_adapter_tp(d, I, rank_, W);
      rtp.load(i, a.desc);
      ShardedAdapter b = slice_adapter_experts(d, E, win.offset, win.count);
      rep.load(i, b.desc);
    }
    MoeWeights wfull, wcpu;
    std::unique_ptr<AdapterRegistry> rfull, rcpu;
    if (rank_ == 0) {
      wfull = prepare_weights(full, Backend::CUDA, 0);
      rfull = std::make_unique<AdapterRegistry>(wfull, 8);
      for (int i = 0; i < 8; ++i) rfull->load(i, ads[i].desc());
      if (o_.cpu_ref) {
        wcpu = prepare_weights(full, Backend::CPU);
        rcpu = std::make_unique<AdapterRegistry>(wcpu, 8);
        for (int i = 0; i < 8; ++i) rcpu->load(i, ads[i].desc());
      }
    }
    // Inputs (the same on every rank).
    const std::vector<uint16_t> x = random_bf16(Tmax * H, seed + 1);
    const std::vector<float> logits = random_f32(Tmax * E, seed + 2);
    const std::vector<float> rbias = random_f32(E, seed + 3, 0.1f);
    std::vector<int32_t> ids_mixed(Tmax), ids_lora(Tmax);
    for (int64_t t = 0; t < Tmax; ++t) {
      ids_mixed[t] = static_cast<int32_t>(t % 9) - 1;  // base, adapters 0..7
      ids_lora[t] = static_cast<int32_t>(t % 8);
    }
    DeviceBuffer dx = DeviceBuffer::from(x), dlog = DeviceBuffer::from(logits), dbias = DeviceBuffer::from(rbias),
                 dmixed = DeviceBuffer::from(ids_mixed), dlora = DeviceBuffer::from(ids_lora);
    DeviceBuffer dalpha = DeviceBuffer::from(L.alpha), dbeta = DeviceBuffer::from(L.beta);
    const bool deepseek = ms.routing == RoutingMethod::DeepSeekV3;
    const bool situ = ms.activation == ActivationType::Situ;
    const int64_t s1 = sizeof(float);

    // args for T tokens on `dev` with E_loc experts at `off` (alpha/beta sliced for EP).
    auto args_for = [&](int64_t T, int dev, const AdapterRegistry* reg, const DeviceBuffer* aids, int64_t off,
                        int64_t E_loc) {
      MoeArgs a;
      a.x = make_view(dx.get(), DType::BF16, {T, H}, Backend::CUDA, dev);
      a.routing.method = ms.routing;
      a.routing.top_k = k;
      a.routing.n_group = ms.n_group;
      a.routing.topk_group = ms.topk_group;
      a.routing.routed_scaling_factor = ms.routed_scaling_factor;
      a.routing.logits = make_view(dlog.get(), DType::F32, {T, E}, Backend::CUDA, dev);
      if (deepseek) a.routing.bias = make_view(dbias.get(), DType::F32, {E}, Backend::CUDA, dev);
      a.num_experts_total = E;
      a.local_expert_offset = off;
      a.activation.type = ms.activation;
      if (situ) {
        a.activation.alpha = make_view(static_cast<char*>(dalpha.get()) + off * s1, DType::F32, {E_loc}, Backend::CUDA, dev);
        a.activation.beta = make_view(static_cast<char*>(dbeta.get()) + off * s1, DType::F32, {E_loc}, Backend::CUDA, dev);
      }
      if (reg) {
        a.adapters = reg;
        a.adapter_ids = make_view(aids->get(), DType::I32, {T}, Backend::CUDA, dev);
      }
      a.stream = s_;
      return a;
    };
    const auto t_prep = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    say("\n== %s: H=%lld I=%lld E=%lld k=%lld, world=%d (TP: I/rank=%lld; EP: %lld experts/rank), prepared in %.1f s\n",
        name.c_str(), (long long)H, (long long)I, (long long)E, (long long)k, W, (long long)(I / W),
        (long long)win.count, t_prep);
    const std::string P = name + ".";

    // ---- checks ----
    const int64_t T = o_.check_tokens;
    const size_t n = static_cast<size_t>(T * H);
    DeviceBuffer y_single(n * 2), y_single_f32(n * 4), y_tp(n * 2), y_tp2(n * 2), y_ep(n * 2), y_ep2(n * 2);
    std::vector<uint16_t> single;
    if (rank_ == 0) {
      MoeArgs a = args_for(T, 0, rfull.get(), &dmixed, 0, E);
      a.y = make_view(y_single.get(), DType::BF16, {T, H}, Backend::CUDA, 0);
      moe_run(wfull, a);
      a.y = make_view(y_single_f32.get(), DType::F32, {T, H}, Backend::CUDA, 0);
      moe_run(wfull, a);
      check_device_errors(0);
      single = y_single.download<uint16_t>(n, s_);
      const std::vector<float> f = y_single_f32.download<float>(n, s_);
      size_t diff = 0;
      for (size_t i = 0; i < n; ++i) diff += f32_to_bf16_bits(f[i]) != single[i];
      expect(diff == 0, P + "single GPU: bf16(f32 y) == bf16 y bit for bit (" + std::to_string(diff) + " differ)");
      json.num(P + "single_f32_vs_bf16_mismatches", static_cast<double>(diff));
    }
    auto run_tp = [&](DeviceBuffer& y, ParallelOutput out = ParallelOutput::AllReduce) {
      MoeArgs a = args_for(T, rank_, &rtp, &dmixed, 0, E);
      const int64_t rows = out == ParallelOutput::AllReduce ? T : T / W;
      a.y = make_view(y.get(), DType::BF16, {rows, H}, Backend::CUDA, rank_);
      moe_run_tp(wtp, a, comm_, out);
    };
    auto run_ep = [&](DeviceBuffer& y) {
      MoeArgs a = args_for(T, rank_, &rep, &dmixed, win.offset, win.count);
      a.y = make_view(y.get(), DType::BF16, {T, H}, Backend::CUDA, rank_);
      moe_run_ep(wep, a, comm_);
    };
    run_tp(y_tp);
    run_tp(y_tp2);
    run_ep(y_ep);
    run_ep(y_ep2);
    check_device_errors(rank_);
    const auto tp_all = gather_y(y_tp, n), tp2_all = gather_y(y_tp2, n), ep_all = gather_y(y_ep, n),
               ep2_all = gather_y(y_ep2, n);
    // ReduceScatter: each rank's rows of the AllReduce result.
    float rs_diff = 0;
    if (T % W == 0) {
      DeviceBuffer y_rs(n * 2 / W);
      run_tp(y_rs, ParallelOutput::ReduceScatter);
      const std::vector<uint16_t> rs = y_rs.download<uint16_t>(n / W, s_), mine = y_tp.download<uint16_t>(n, s_);
      for (size_t i = 0; i < n / W; ++i) rs_diff += rs[i] != mine[rank_ * (n / W) + i];
    }
    const std::vector<float> rs_all = gather({rs_diff});
    if (rank_ == 0) {
      bool same_tp = true, same_ep = true;
      for (int q = 1; q < W; ++q) {
        same_tp = same_tp && tp_all[q] == tp_all[0];
        same_ep = same_ep && ep_all[q] == ep_all[0];
      }
      expect(same_tp, P + "TP: every rank's y bit-identical");
      expect(same_ep, P + "EP: every rank's y bit-identical");
      expect(tp_all[0] == tp2_all[0] && tp_all[1 % W] == tp2_all[1 % W], P + "TP: bit-identical across two runs");
      expect(ep_all[0] == ep2_all[0] && ep_all[1 % W] == ep2_all[1 % W], P + "EP: bit-identical across two runs");
      float rs_sum = 0;
      for (float v : rs_all) rs_sum += v;
      expect(T % W == 0 && rs_sum == 0, P + "TP ReduceScatter rows == AllReduce rows bit for bit");
      const std::vector<double> sd = widen(single);
      const double e_tp = rel_l2(widen(tp_all[0]), sd), e_ep = rel_l2(widen(ep_all[0]), sd);
      char b[256];
      std::snprintf(b, sizeof b, "%sTP=%d vs single GPU (LoRA, T=%lld): rel L2 %.3e <= %.1e", P.c_str(), W,
                    (long long)T, e_tp, o_.tol);
      expect(e_tp <= o_.tol, b);
      std::snprintf(b, sizeof b, "%sEP=%d vs single GPU (LoRA, T=%lld): rel L2 %.3e <= %.1e", P.c_str(), W,
                    (long long)T, e_ep, o_.tol);
      expect(e_ep <= o_.tol, b);
      json.num(P + "tp_vs_single_rel_l2", e_tp);
      json.num(P + "ep_vs_single_rel_l2", e_ep);
      // The outputs' bits, to compare launches (issue 8: identical across two launches).
      json.kv(P + "single_y_fnv1a", fnv1a_json(single));
      json.kv(P + "tp_y_fnv1a", fnv1a_json(tp_all[0]));
      json.kv(P + "ep_y_fnv1a", fnv1a_json(ep_all[0]));
      double ref_norm = 0;
      for (double v : sd) ref_norm += v * v;
      expect(ref_norm > 0, P + "single-GPU output is not all zeros");
      if (o_.cpu_ref) {
        // The CPU reference (Fp32) on a few tokens spread over the batch.
        std::vector<int64_t> toks;
        const int64_t nr = std::min<int64_t>(o_.ref_tokens, T);
        for (int64_t i = 0; i < nr; ++i) toks.push_back(nr == 1 ? 0 : i * (T - 1) / (nr - 1));
        std::vector<uint16_t> rx(nr * H), ry(nr * H);
        std::vector<float> rl(nr * E);
        std::vector<int32_t> rid(nr);
        for (int64_t i = 0; i < nr; ++i) {
          std::copy_n(x.begin() + toks[i] * H, H, rx.begin() + i * H);
          std::copy_n(logits.begin() + toks[i] * E, E, rl.begin() + i * E);
          rid[i] = ids_mixed[toks[i]];
        }
        std::vector<float> rb = rbias, al = L.alpha, be = L.beta;
        MoeArgs a;
        a.x = make_view(rx.data(), DType::BF16, {nr, H});
        a.routing.method = ms.routing;
        a.routing.top_k = k;
        a.routing.n_group = ms.n_group;
        a.routing.topk_group = ms.topk_group;
        a.routing.routed_scaling_factor = ms.routed_scaling_factor;
        a.routing.logits = make_view(rl.data(), DType::F32, {nr, E});
        if (deepseek) a.routing.bias = make_view(rb.data(), DType::F32, {E});
        a.num_experts_total = E;
        a.activation.type = ms.activation;
        if (situ) {
          a.activation.alpha = make_view(al.data(), DType::F32, {E});
          a.activation.beta = make_view(be.data(), DType::F32, {E});
        }
        a.adapters = rcpu.get();
        a.adapter_ids = make_view(rid.data(), DType::I32, {nr});
        a.y = make_view(ry.data(), DType::BF16, {nr, H});
        const auto c0 = std::chrono::steady_clock::now();
        moe_run(wcpu, a);
        const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - c0).count();
        const std::vector<double> refd = widen(ry);
        const double r_single = rel_l2(widen(single, &toks, H), refd), r_tp = rel_l2(widen(tp_all[0], &toks, H), refd),
                     r_ep = rel_l2(widen(ep_all[0], &toks, H), refd);
        std::snprintf(b, sizeof b, "%svs CPU reference (%lld tokens, %.1f s): single %.3e, TP %.3e, EP %.3e <= %.1e",
                      P.c_str(), (long long)nr, secs, r_single, r_tp, r_ep, o_.ref_tol);
        expect(r_single <= o_.ref_tol && r_tp <= o_.ref_tol && r_ep <= o_.ref_tol, b);
        json.num(P + "single_vs_cpu_rel_l2", r_single);
        json.num(P + "tp_vs_cpu_rel_l2", r_tp);
        json.num(P + "ep_vs_cpu_rel_l2", r_ep);
      }
    }

    // ---- failure agreement: rank 1 passes a bad y; nobody hangs, rank 0 leaves y untouched ----
    if (first && W > 1) {
      DeviceBuffer y_bad(n * 2);
      CK(cudaMemsetAsync(y_bad.get(), 0xff, n * 2, s_));
      MoeArgs a = args_for(T, rank_, &rtp, &dmixed, 0, E);
      a.y = make_view(y_bad.get(), DType::BF16, {T, rank_ == 1 ? H - 16 : H}, Backend::CUDA, rank_);
      std::string thrown = "-", flagged = "-";
      try {
        moe_run_tp(wtp, a, comm_);
      } catch (const Error& e) {
        thrown = e.argument();
      }
      try {
        check_device_errors(rank_);
      } catch (const Error& e) {
        flagged = e.argument();
      }
      const std::vector<uint16_t> yb = y_bad.download<uint16_t>(n, s_);
      const bool untouched = std::count(yb.begin(), yb.end(), 0xffff) == static_cast<std::ptrdiff_t>(n);
      // code per rank: 1 = threw "y", 2 = flagged "comm", +4 when y untouched
      const float code = (thrown == "y" ? 1.f : 0.f) + (flagged == "comm" ? 2.f : 0.f) + (untouched ? 4.f : 0.f);
      const std::vector<float> codes = gather({code});
      if (rank_ == 0) {
        expect(codes[0] == 6.f && codes[1] == 5.f,
               P + "failure agreement: rank 1 throws 'y', rank 0 flags 'comm' (DeviceFault), y untouched, no hang "
                   "(codes " + std::to_string(int(codes[0])) + "," + std::to_string(int(codes[1])) + ")");
      }
      // The communicator still works afterwards.
      run_tp(y_tp2);
      const auto again = gather_y(y_tp2, n);
      if (rank_ == 0) expect(again[0] == tp_all[0], P + "after the failure, TP gives the same bits again");
    }

    // ---- timing ----
    if (!o_.timing) return;
    say("%-14s %6s %6s %12s %12s %12s %9s %9s\n", "timing", "T", "lora", "single_us", "tp_us", "ep_us", "tp_x", "ep_x");
    for (int64_t Tt : o_.tokens) {
      for (int lora = 0; lora < 2; ++lora) {
        const size_t nt = static_cast<size_t>(Tt * H);
        DeviceBuffer yt(nt * 2);
        auto time = [&](const std::function<void()>& call) {
          for (int i = 0; i < o_.warmup; ++i) call();
          std::vector<cudaEvent_t> ev(2 * o_.iters);
          for (auto& e : ev) CK(cudaEventCreate(&e));
          for (int i = 0; i < o_.iters; ++i) {
            CK(cudaEventRecord(ev[2 * i], s_));
            call();
            CK(cudaEventRecord(ev[2 * i + 1], s_));
          }
          CK(cudaStreamSynchronize(s_));
          std::vector<float> ms_;
          for (int i = 0; i < o_.iters; ++i) {
            float m = 0;
            CK(cudaEventElapsedTime(&m, ev[2 * i], ev[2 * i + 1]));
            ms_.push_back(m * 1000.f);
          }
          for (auto& e : ev) (void)cudaEventDestroy(e);
          return median(ms_);
        };
        const DeviceBuffer* aid = lora ? &dlora : nullptr;
        double t_single = 0;
        barrier();
        if (rank_ == 0)
          t_single = time([&] {
            MoeArgs a = args_for(Tt, 0, lora ? rfull.get() : nullptr, aid, 0, E);
            a.y = make_view(yt.get(), DType::BF16, {Tt, H}, Backend::CUDA, 0);
            moe_run(wfull, a);
          });
        barrier();
        const double t_tp = time([&] {
          MoeArgs a = args_for(Tt, rank_, lora ? &rtp : nullptr, aid, 0, E);
          a.y = make_view(yt.get(), DType::BF16, {Tt, H}, Backend::CUDA, rank_);
          moe_run_tp(wtp, a, comm_);
        });
        barrier();
        const double t_ep = time([&] {
          MoeArgs a = args_for(Tt, rank_, lora ? &rep : nullptr, aid, win.offset, win.count);
          a.y = make_view(yt.get(), DType::BF16, {Tt, H}, Backend::CUDA, rank_);
          moe_run_ep(wep, a, comm_);
        });
        check_device_errors(rank_);
        const std::vector<float> all = gather({static_cast<float>(t_tp), static_cast<float>(t_ep)});
        double tp_max = 0, ep_max = 0;
        for (int q = 0; q < W; ++q) {
          tp_max = std::max<double>(tp_max, all[2 * q]);
          ep_max = std::max<double>(ep_max, all[2 * q + 1]);
        }
        say("%-14s %6lld %6s %12.1f %12.1f %12.1f %9.2f %9.2f\n", name.c_str(), (long long)Tt, lora ? "all" : "none",
            t_single, tp_max, ep_max, t_single / tp_max, t_single / ep_max);
        const std::string key = P + "T" + std::to_string(Tt) + (lora ? ".lora" : ".base");
        json.num(key + ".single_us", t_single);
        json.num(key + ".tp_us", tp_max);
        json.num(key + ".ep_us", ep_max);
      }
    }
  }

 private:
  const Options& o_;
  int rank_;
  Communicator& comm_;
  cudaStream_t s_;
};

}  // namespace

namespace fp4moe::parallel_check {

int rank_main(const Options& o, int rank, const std::vector<int>& write_fds, int read_fd) {
  alarm(static_cast<unsigned>(o.timeout));  // the watchdog: SIGALRM ends this rank (the parent kills the rest)
  try {
    std::vector<uint8_t> id(kNcclUniqueIdBytes);
    if (rank == 0) {
      id = nccl_unique_id();
      for (int fd : write_fds)
        if (write(fd, id.data(), id.size()) != static_cast<ssize_t>(id.size())) throw std::runtime_error("pipe write");
    } else {
      size_t got = 0;
      while (got < id.size()) {
        const ssize_t r = read(read_fd, id.data() + got, id.size() - got);
        if (r <= 0) throw std::runtime_error("rank 0 did not send the ncclUniqueId");
        got += static_cast<size_t>(r);
      }
    }
    CK(cudaSetDevice(rank));
    cudaStream_t s;
    CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    NcclGroupComm g(id, o.world, rank, rank, s);
    Rank R(o, rank, g.comm(), s);
    if (rank == 0) {
      cudaDeviceProp p{};
      CK(cudaGetDeviceProperties(&p, 0));
      std::printf("fp4moe_parallel_check: world=%d, GPU 0: %s; NCCL_NVLS_ENABLE=%s\n", o.world, p.name,
                  std::getenv("NCCL_NVLS_ENABLE") ? std::getenv("NCCL_NVLS_ENABLE") : "(unset)");
    }
    bool first = true;
    for (const std::string& sh : o.shapes) {
      R.run_shape(sh, first);
      first = false;
    }
    CK(cudaStreamSynchronize(s));
    if (rank == 0) {
      R.json.kv("passed", R.ok ? "true" : "false");
      if (!o.json.empty()) {
        FILE* f = std::fopen(o.json.c_str(), "w");
        if (f) {
          std::fprintf(f, "{\n%s\n}\n", R.json.os.str().c_str());
          std::fclose(f);
        }
      }
      std::printf("\n%s\n", R.ok ? "ALL CHECKS PASSED" : "SOME CHECKS FAILED");
    }
    g.destroy();
    return R.ok ? 0 : 1;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "[rank %d] error: %s\n", rank, e.what());
    return 2;
  }
}

}  // namespace fp4moe::parallel_check
