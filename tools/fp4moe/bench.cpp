// `fp4moe bench`: times the CUDA backend on the model shapes of SPEC §1 (docs/api.md, "Benchmarks").
//
// Method: the copy and bf16-GEMM ceilings are measured in the same run;
// each case is one moe_run captured in a CUDA graph (one graph per input set: the sets differ in x and
// logits, so in routing) and replayed; CUDA events bracket the replay alone. Before every timed replay a
// read-only pass over a 256 MB buffer (cublasSasum) evicts the weights from the 60 MB L2: a read leaves
// clean lines, so the op pays no write-back for the flush (a memset flush would leave ~60 MB of dirty
// lines to be written back during the op). At least --runs replays per case (default 50), more for short
// cases up to a measured-time target; median, p10, p90 reported.
#include "bench.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <ctime>
#include <deque>
#include <future>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include "fp4moe/build_info.h"
#include "fp4moe/model_shapes.h"
#include "fp4moe/moe.h"
#include "runtime/plan.h"
#include "fp4moe/synthetic.h"
#include "common/parallel_for.h"
#include "runtime/json.h"
#ifdef FP4MOE_WITH_CUDA
#include <cuda_runtime.h>
#ifdef FP4MOE_BENCH_HAVE_CUBLAS
#include <cublas_v2.h>
#endif
#endif

namespace fp4moe {
namespace {

const std::vector<int64_t> kDefaultTokens = {1, 8, 64, 256, 1024, 4096, 16384};
constexpr int kLoraAdapters = 8;
constexpr int64_t kLoraRank = 16;

int usage() {
  std::fputs(
      "usage: fp4moe bench [options]\n"
      "  --shapes a,b        model shapes of SPEC §1 (default: all): kimi_k3_tp8, qwen3_30b_a3b, qwen3_30b_a3b_tp4,\n"
      "                      deepseek_v3_ep8, mixtral_8x7b, gpt_oss_120b\n"
      "  --tokens 1,64       token counts (default 1,8,64,256,1024,4096,16384)\n"
      "  --runs N            timed replays per case, at least (default 50; the median needs >= 50 to be reported\n"
      "                      as the suite's number)\n"
      "  --max-runs N        upper bound when short cases repeat to reach --min-time (default 400)\n"
      "  --min-time S        keep repeating (up to --max-runs) until S seconds of op time are measured (default 0.05)\n"
      "  --sets N            input sets (x, logits) rotated between replays (default 3)\n"
      "  --format nvfp4|bf16 expert weight format (default nvfp4)\n"
      "  --no-lora           skip the LoRA rows (eight rank-16 adapters, every token adapted)\n"
      "  --lora-only         only the LoRA rows (for profiling the LoRA kernels)\n"
      "  --activation A      run every shape with activation A instead of its own: swiglu, situ (alpha 4, beta 25)\n"
      "                      or swiglubias (1.702, 1, clamp 7); the shape's name gets +A\n"
      "  --mode a16|a4       activation mode (default a16); a4: FC1/FC2 input scales 1/448 and 12/2688 (x is N(0,1)),\n"
      "                      the shape's name gets +a4\n"
      "  --tile NAME         force a GEMM tile (GemmTile: SplitKDecode, WeightsAsA32, TokensAsA64, Wgmma64, or 0..3),\n"
      "                      default: the plan's choice\n"
      "  --workspace-budget M  workspace budget in MiB (MoeArgs::workspace_budget; default: the library's, plan.h)\n"
      "  --quick             tokens 1,64,1024 and no extra repeats\n"
      "  --json FILE         write the results as JSON\n"
      "  --device N          CUDA device (default 0)\n",
      stderr);
  return 2;
}

struct Options {
  std::vector<const ModelShape*> shapes;
  std::vector<int64_t> tokens = kDefaultTokens;
  int runs = 50, max_runs = 400, sets = 3, device = 0, gemm_tile = -1;
  int64_t workspace_budget = 0;  // bytes, 0 = the library's default
  double min_time_s = 0.05;
  bool lora = true, base = true, quick = false;
  WeightFormat format = WeightFormat::NVFP4;
  std::string json_path;
  ActMode mode = ActMode::A16;
  std::deque<ModelShape> variants;  // shapes with --activation / --mode applied (o.shapes points here then)
  std::deque<std::string> variant_names;
};

// Throws std::invalid_argument with a message naming the option.
Options parse_options(int argc, char** argv) {
  Options o;
  bool tokens_given = false, max_runs_given = false;
  std::string activation;
  auto need = [&](int& i) -> std::string {
    if (i + 1 >= argc) throw std::invalid_argument(std::string(argv[i]) + ": expected a value");
    return argv[++i];
  };
  auto as_int = [](const std::string& opt, const std::string& v, int64_t lo, int64_t hi) {
    std::vector<int64_t> x;
    try {
      x = bench::parse_int_list(v);
    } catch (const std::invalid_argument&) {
      throw std::invalid_argument(opt + ": expected an integer, got '" + v + "'");
    }
    if (x.size() != 1 || x[0] < lo || x[0] > hi)
      throw std::invalid_argument(opt + ": expected an integer in [" + std::to_string(lo) + ", " + std::to_string(hi) +
                                  "], got '" + v + "'");
    return x[0];
  };
  for (int i = 0; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--shapes") {
      for (const std::string& n : bench::split_list(need(i))) {
        const ModelShape* s = find_model_shape(n);
        if (!s) throw std::invalid_argument("--shapes: unknown model shape '" + n + "'");
        o.shapes.push_back(s);
      }
    } else if (a == "--tokens") {
      const std::string v = need(i);
      try {
        o.tokens = bench::parse_int_list(v);
      } catch (const std::invalid_argument& e) {
        throw std::invalid_argument("--tokens: " + std::string(e.what()));
      }
      for (int64_t t : o.tokens)
        if (t < 1 || t > (int64_t{1} << 20)) throw std::invalid_argument("--tokens: expected 1..1048576, got " + std::to_string(t));
      tokens_given = true;
    } else if (a == "--runs") {
      o.runs = static_cast<int>(as_int(a, need(i), 1, 100000));
    } else if (a == "--max-runs") {
      o.max_runs = static_cast<int>(as_int(a, need(i), 1, 100000));
      max_runs_given = true;
    } else if (a == "--sets") {
      o.sets = static_cast<int>(as_int(a, need(i), 1, 16));
    } else if (a == "--device") {
      o.device = static_cast<int>(as_int(a, need(i), 0, 1024));
    } else if (a == "--min-time") {
      const std::string v = need(i);
      char* end = nullptr;
      o.min_time_s = std::strtod(v.c_str(), &end);
      if (end == v.c_str() || *end || !(o.min_time_s >= 0 && o.min_time_s <= 60))
        throw std::invalid_argument("--min-time: expected seconds in [0, 60], got '" + v + "'");
    } else if (a == "--format") {
      const std::string v = need(i);
      if (v == "nvfp4") o.format = WeightFormat::NVFP4;
      else if (v == "bf16") o.format = WeightFormat::BF16;
      else throw std::invalid_argument("--format: expected nvfp4 or bf16, got '" + v + "'");
    } else if (a == "--no-lora") {
      o.lora = false;
    } else if (a == "--lora-only") {
      o.base = false;
    } else if (a == "--activation") {
      activation = need(i);
      ModelShape probe{};
      if (!bench::activation_variant(activation, probe))
        throw std::invalid_argument("--activation: expected swiglu, situ or swiglubias, got '" + activation + "'");
    } else if (a == "--mode") {
      const std::string v = need(i);
      if (v == "a16") o.mode = ActMode::A16;
      else if (v == "a4") o.mode = ActMode::A4;
      else throw std::invalid_argument("--mode: expected a16 or a4, got '" + v + "'");
    } else if (a == "--tile") {
      const std::string v = need(i);  // a GemmTile name (SplitKDecode, WeightsAsA32, TokensAsA64, Wgmma64) or its value
      o.gemm_tile = -1;
      for (int t = 0; t < kNumGemmConfigs; ++t)
        if (v == to_string(static_cast<GemmTile>(t))) o.gemm_tile = t;
      if (o.gemm_tile < 0) o.gemm_tile = static_cast<int>(as_int(a, v, 0, kNumGemmConfigs - 1));
    } else if (a == "--workspace-budget") {
      o.workspace_budget = as_int(a, need(i), 1, int64_t{1} << 20) << 20;
    } else if (a == "--quick") {
      o.quick = true;
    } else if (a == "--json") {
      o.json_path = need(i);
    } else {
      throw std::invalid_argument("unknown option '" + a + "'");
    }
  }
  if (o.shapes.empty())
    for (const auto& s : kModelShapes) o.shapes.push_back(&s);
  if (!activation.empty() || o.mode == ActMode::A4) {
    for (const ModelShape*& sp : o.shapes) {
      ModelShape v = *sp;
      std::string name(v.name);
      if (!activation.empty()) {
        bench::activation_variant(activation, v);
        name += "+" + activation;
      }
      if (o.mode == ActMode::A4) name += "+a4";
      o.variant_names.push_back(name);
      v.name = o.variant_names.back();
      o.variants.push_back(v);
      sp = &o.variants.back();
    }
  }
  if (o.quick) {
    if (!tokens_given) o.tokens = {1, 64, 1024};
    if (!max_runs_given) o.max_runs = o.runs;
  }
  o.max_runs = std::max(o.max_runs, o.runs);
  if (!o.lora && !o.base) throw std::invalid_argument("--no-lora and --lora-only: nothing left to run");
  return o;
}

#ifdef FP4MOE_WITH_CUDA
// ---- JSON output (a writer only; values are numbers, strings, booleans) --------------------------------
std::string jnum(double v) {
  if (!std::isfinite(v)) return "null";
  char b[40];
  std::snprintf(b, sizeof b, "%.6g", v);
  return b;
}
std::string jint(int64_t v) { return std::to_string(v); }
std::string jbool(bool v) { return v ? "true" : "false"; }

struct JObj {
  std::vector<std::pair<std::string, std::string>> kv;
  JObj& add(const std::string& k, const std::string& raw) {
    kv.emplace_back(k, raw);
    return *this;
  }
  std::string dump() const {
    std::string r = "{";
    for (size_t i = 0; i < kv.size(); ++i) r += (i ? ", " : "") + json::quote(kv[i].first) + ": " + kv[i].second;
    return r + "}";
  }
};

// ---- one case's results --------------------------------------------------------------------------------
struct CaseResult {
  std::string shape;
  int64_t T = 0;
  bool lora = false;
  std::string status = "ok";  // ok | unsupported | error
  std::string message;
  bool graph = true;
  int runs = 0;
  double median_us = 0, p10_us = 0, p90_us = 0, min_us = 0, mean_us = 0;
  double local_slots = 0, touched_experts = 0, adapted_slots = 0, touched_pairs = 0;  // means over the input sets
  double weight_bytes = 0, lora_bytes = 0, io = 0, flops = 0;
  bench::Metrics m;
  std::string output_check;
};

std::string fmt(const char* f, double v) {
  char b[64];
  std::snprintf(b, sizeof b, f, v);
  return b;
}

std::string markdown_table(const std::vector<CaseResult>& rs) {
  std::string t =
      "| shape | T | LoRA | median us | p10 | p90 | weights MB | GB/s | /copy | TFLOP/s | /gemm | floor us | x floor |"
      " LoRA / base |\n"
      "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n";
  for (const auto& r : rs) {
    t += "| " + r.shape + " | " + std::to_string(r.T) + " | " + (r.lora ? "8x r16" : "-") + " | ";
    if (r.status != "ok") {
      t += r.status + " | | | | | | | | | | |\n";
      continue;
    }
    const double mb = (r.weight_bytes + r.lora_bytes) / 1e6, over = bench::lora_over_base(rs, r);
    t += fmt("%.1f", r.median_us) + " | " + fmt("%.1f", r.p10_us) + " | " + fmt("%.1f", r.p90_us) + " | " +
         fmt("%.1f", mb) + " | " + fmt("%.0f", r.m.gbps) + " | " + fmt("%.2f", r.m.ratio_copy) + " | " +
         fmt("%.1f", r.m.tflops) + " | " + fmt("%.2f", r.m.ratio_gemm) + " | " + fmt("%.1f", r.m.floor_us) + " | " +
         fmt("%.2f", r.m.time_over_floor) + " | " + (over > 0 ? fmt("%.3f", over) : std::string("-")) + " |\n";
  }
  return t;
}

std::string case_json(const CaseResult& r) {
  JObj o;
  o.add("shape", json::quote(r.shape)).add("T", jint(r.T)).add("lora", jbool(r.lora)).add("status", json::quote(r.status));
  if (!r.message.empty()) o.add("message", json::quote(r.message));
  if (r.status == "ok") {
    o.add("graph", jbool(r.graph)).add("runs", jint(r.runs));
    o.add("median_us", jnum(r.median_us)).add("p10_us", jnum(r.p10_us)).add("p90_us", jnum(r.p90_us));
    o.add("min_us", jnum(r.min_us)).add("mean_us", jnum(r.mean_us));
    o.add("local_slots", jnum(r.local_slots)).add("touched_experts", jnum(r.touched_experts));
    if (r.lora) o.add("adapted_slots", jnum(r.adapted_slots)).add("touched_adapter_experts", jnum(r.touched_pairs));
    o.add("weight_bytes", jnum(r.weight_bytes)).add("lora_bytes", jnum(r.lora_bytes)).add("io_bytes", jnum(r.io));
    o.add("flops", jnum(r.flops));
    o.add("gbps", jnum(r.m.gbps)).add("ratio_copy", jnum(r.m.ratio_copy));
    o.add("tflops", jnum(r.m.tflops)).add("ratio_gemm", jnum(r.m.ratio_gemm));
    o.add("floor_mem_us", jnum(r.m.floor_mem_us)).add("floor_compute_us", jnum(r.m.floor_compute_us));
    o.add("floor_us", jnum(r.m.floor_us)).add("time_over_floor", jnum(r.m.time_over_floor));
    o.add("output_check", json::quote(r.output_check));
  }
  return o.dump();
}

std::string utc_now() {
  const std::time_t t = std::time(nullptr);
  std::tm tm{};
  gmtime_r(&t, &tm);
  char b[32];
  std::strftime(b, sizeof b, "%Y-%m-%dT%H:%M:%SZ", &tm);
  return b;
}

// Random N(0, 1) values in parallel chunks (each chunk its own seed: deterministic for a given n).
// gen(len, seed) -> std::vector<T> is random_bf16 or random_f32.
template <class T, class Gen>
std::vector<T> parallel_random(int64_t n, uint64_t seed, Gen gen) {
  const int64_t chunk = int64_t(1) << 22;
  const int64_t nchunks = (n + chunk - 1) / chunk;
  std::vector<T> out(static_cast<size_t>(n));
  parallel_for(nchunks, default_threads(16), [&](int64_t c) {
    const int64_t b = c * chunk, len = std::min(chunk, n - b);
    const std::vector<T> v = gen(len, seed * 1000003 + static_cast<uint64_t>(c));
    std::copy(v.begin(), v.end(), out.begin() + b);
  });
  return out;
}

void ck(cudaError_t e, const char* what) {
  if (e != cudaSuccess) throw Error(ErrorCode::CudaError, "", std::string(what) + ": " + cudaGetErrorString(e));
}
#define CK(call) ck((call), #call)

#ifdef FP4MOE_BENCH_HAVE_CUBLAS
void cb(cublasStatus_t s, const char* what) {
  if (s != CUBLAS_STATUS_SUCCESS) throw Error(ErrorCode::CudaError, "", std::string(what) + ": cuBLAS status " + std::to_string(int(s)));
}
#define CB(call) cb((call), #call)
#endif

// A device allocation (move-only).
class DevMem {
 public:
  DevMem() = default;
  explicit DevMem(size_t bytes) : bytes_(bytes) {
    const cudaError_t e = cudaMalloc(&p_, std::max<size_t>(bytes, 256));
    if (e != cudaSuccess) {
      (void)cudaGetLastError();
      throw Error(e == cudaErrorMemoryAllocation ? ErrorCode::OutOfMemory : ErrorCode::CudaError, "",
                  "cudaMalloc of " + std::to_string(bytes) + " bytes: " + cudaGetErrorString(e));
    }
  }
  DevMem(DevMem&& o) noexcept : p_(o.p_), bytes_(o.bytes_) { o.p_ = nullptr; o.bytes_ = 0; }
  DevMem& operator=(DevMem&& o) noexcept {
    std::swap(p_, o.p_);
    std::swap(bytes_, o.bytes_);
    return *this;
  }
  DevMem(const DevMem&) = delete;
  DevMem& operator=(const DevMem&) = delete;
  ~DevMem() {
    if (p_) (void)cudaFree(p_);
  }
  template <class T> static DevMem from(const std::vector<T>& v) {
    DevMem d(v.size() * sizeof(T));
    if (!v.empty()) CK(cudaMemcpy(d.p_, v.data(), v.size() * sizeof(T), cudaMemcpyHostToDevice));
    return d;
  }
  void* get() const { return p_; }
  template <class T> T* as() const { return static_cast<T*>(p_); }
  size_t bytes() const { return bytes_; }

 private:
  void* p_ = nullptr;
  size_t bytes_ = 0;
};

// Event pairs, reused across cases.
class EventPool {
 public:
  ~EventPool() {
    for (auto e : ev_) (void)cudaEventDestroy(e);
  }
  cudaEvent_t at(size_t i) {
    while (ev_.size() <= i) {
      cudaEvent_t e;
      CK(cudaEventCreate(&e));
      ev_.push_back(e);
    }
    return ev_[i];
  }

 private:
  std::vector<cudaEvent_t> ev_;
};

float elapsed_ms(cudaEvent_t a, cudaEvent_t b) {
  float ms = 0;
  CK(cudaEventElapsedTime(&ms, a, b));
  return ms;
}

// The device-side helpers of one run: stream, events, L2 flush, cuBLAS.
struct Device {
  int id = 0;
  cudaStream_t stream = nullptr;
  EventPool events;
  DevMem flush_buf;
  std::string flush_method;
#ifdef FP4MOE_BENCH_HAVE_CUBLAS
  cublasHandle_t blas = nullptr;
  DevMem flush_result;
#endif
  explicit Device(int dev) : id(dev) {
    CK(cudaSetDevice(dev));
    CK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
    flush_buf = DevMem(size_t(256) << 20);
    CK(cudaMemset(flush_buf.get(), 0x3c, flush_buf.bytes()));  // 0x3c3c3c3c: a finite float
#ifdef FP4MOE_BENCH_HAVE_CUBLAS
    CB(cublasCreate(&blas));
    CB(cublasSetStream(blas, stream));
    flush_result = DevMem(256);
    flush_method = "read of 256 MB (cublasSasum) before each timed replay, not timed";
#else
    flush_method = "cudaMemsetAsync of 256 MB before each timed replay, not timed (no cuBLAS in this build)";
#endif
  }
  ~Device() {
#ifdef FP4MOE_BENCH_HAVE_CUBLAS
    if (blas) (void)cublasDestroy(blas);
#endif
    if (stream) (void)cudaStreamDestroy(stream);
  }
  void flush_l2() {
#ifdef FP4MOE_BENCH_HAVE_CUBLAS
    CB(cublasSetPointerMode(blas, CUBLAS_POINTER_MODE_DEVICE));
    CB(cublasSasum(blas, static_cast<int>(flush_buf.bytes() / 4), flush_buf.as<float>(), 1, flush_result.as<float>()));
#else
    CK(cudaMemsetAsync(flush_buf.get(), 0x3c, flush_buf.bytes(), stream));
#endif
  }
};

// ---- ceilings -------------------------------------------------------------------------------------------
struct Ceilings {
  double copy_gbps = 0;
  int64_t copy_bytes = 0;
  double gemm_tflops = 0;
  std::string gemm_method;
};

double measure_copy(Device& d, int64_t& bytes_out) {
  for (size_t mb : {4096, 1024}) {
    try {
      const size_t bytes = mb << 20;
      DevMem a(bytes), b(bytes);
      CK(cudaMemset(a.get(), 0x5a, bytes));
      std::vector<double> ts;
      for (int i = 0; i < 12; ++i) {
        CK(cudaEventRecord(d.events.at(0), d.stream));
        CK(cudaMemcpyAsync(b.get(), a.get(), bytes, cudaMemcpyDeviceToDevice, d.stream));
        CK(cudaEventRecord(d.events.at(1), d.stream));
        CK(cudaEventSynchronize(d.events.at(1)));
        if (i >= 2) ts.push_back(elapsed_ms(d.events.at(0), d.events.at(1)));
      }
      bytes_out = static_cast<int64_t>(bytes);
      return 2.0 * double(bytes) / (bench::percentile(ts, 50) * 1e-3) / 1e9;  // read + write
    } catch (const Error& e) {
      if (e.code() != ErrorCode::OutOfMemory) throw;
    }
  }
  return 0;
}

// bf16 x bf16 -> bf16, fp32 accumulation, 8192^3 on random data (operands: windows of the random pool).
double measure_gemm(Device& d, const DevMem& pool, std::string& method) {
#ifdef FP4MOE_BENCH_HAVE_CUBLAS
  const int n = 8192;
  const size_t elems = size_t(n) * n;
  if (pool.bytes() < 2 * elems * 2) throw Error(ErrorCode::InvalidArgument, "pool", "random pool too small for the GEMM");
  const uint16_t* A = pool.as<uint16_t>();
  const uint16_t* B = A + elems;
  DevMem C(elems * 2);
  const float alpha = 1.f, beta = 0.f;
  CB(cublasSetPointerMode(d.blas, CUBLAS_POINTER_MODE_HOST));
  std::vector<double> ts;
  for (int i = 0; i < 23; ++i) {
    CK(cudaEventRecord(d.events.at(0), d.stream));
    CB(cublasGemmEx(d.blas, CUBLAS_OP_N, CUBLAS_OP_N, n, n, n, &alpha, A, CUDA_R_16BF, n, B, CUDA_R_16BF, n, &beta,
                    C.get(), CUDA_R_16BF, n, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
    CK(cudaEventRecord(d.events.at(1), d.stream));
    CK(cudaEventSynchronize(d.events.at(1)));
    if (i >= 3) ts.push_back(elapsed_ms(d.events.at(0), d.events.at(1)));
  }
  method = "cublasGemmEx bf16 x bf16 -> bf16, fp32 accumulation, 8192^3, random N(0,1) data, median of 20";
  return 2.0 * double(n) * n * n / (bench::percentile(ts, 50) * 1e-3) / 1e12;
#else
  (void)d;
  (void)pool;
  method = "unavailable (built without cuBLAS)";
  return 0;
#endif
}

// ---- the cases of one shape ----------------------------------------------------------------------------
struct Pools {
  DevMem x;            // bf16 N(0,1)
  int64_t x_elems = 0;
  std::vector<float> logits_host;  // f32 N(0,1)
  DevMem logits;
  int64_t set_shift_x = 0, set_shift_logits = 0;  // offset between input sets (elements)
};

struct ShapeCtx {
  const ModelShape* shape = nullptr;
  int64_t E_loc = 0, E_total = 0;
  bool gated = true;
  MoeWeights w;
  DevMem alpha, beta, clamp, bias;
  std::vector<float> bias_host;
  std::unique_ptr<AdapterRegistry> registry;  // nullptr: no LoRA rows
  std::string lora_status;                    // "" or why there are no LoRA rows
  DevMem adapter_ids;
};

// The call's arguments; o: the run's format, mode, forced tile and workspace budget. Null buffers give a call of
// shapes only (workspace_size).
MoeArgs make_args(const ShapeCtx& c, int64_t T, const void* x, const void* logits, void* y, const DevMem& ws,
                  bool lora, const Options& o, cudaStream_t stream, int dev) {
  const ModelShape& s = *c.shape;
  const ActMode mode = o.mode;
  MoeArgs a;
  a.gemm_tile = static_cast<GemmTile>(o.gemm_tile);
  a.workspace_budget = o.workspace_budget;
  a.x = make_view(const_cast<void*>(x), DType::BF16, {T, s.H}, Backend::CUDA, dev);
  a.routing.method = s.routing;
  a.routing.top_k = s.k;
  a.routing.logits = make_view(const_cast<void*>(logits), DType::F32, {T, c.E_total}, Backend::CUDA, dev);
  if (s.routing == RoutingMethod::DeepSeekV3) a.routing.bias = make_view(c.bias.get(), DType::F32, {c.E_total}, Backend::CUDA, dev);
  a.routing.n_group = s.n_group;
  a.routing.topk_group = s.topk_group;
  a.routing.routed_scaling_factor = s.routed_scaling_factor;
  a.num_experts_total = c.E_total;
  a.local_expert_offset = 0;
  a.activation.type = s.activation;
  a.activation.alpha = make_view(c.alpha.get(), DType::F32, {c.E_loc}, Backend::CUDA, dev);
  a.activation.beta = make_view(c.beta.get(), DType::F32, {c.E_loc}, Backend::CUDA, dev);
  if (c.clamp.get()) a.activation.clamp_limit = make_view(c.clamp.get(), DType::F32, {c.E_loc}, Backend::CUDA, dev);
  a.mode = mode;
  if (mode == ActMode::A4) {  // x ~ N(0, 1): amax ~6 over the pool; FC2 inputs O(1) with tails to ~10 (as fp4moe check)
    a.fc1_input_scale = 1.f / 448.f;
    a.fc2_input_scale = 12.f / (448.f * 6.f);
  }
  if (lora) {
    a.adapters = c.registry.get();
    a.adapter_ids = make_view(c.adapter_ids.get(), DType::I32, {T}, Backend::CUDA, dev);
  }
  a.y = make_view(y, DType::BF16, {T, s.H}, Backend::CUDA, dev);
  a.workspace = make_view(ws.get(), DType::U8, {static_cast<int64_t>(ws.bytes())}, Backend::CUDA, dev);
  a.stream = stream;
  return a;
}

// Host routing of one input set (the reference's routing: the same function the kernels compute).
std::vector<int32_t> host_route(const ShapeCtx& c, int64_t T, const float* logits) {
  const ModelShape& s = *c.shape;
  RoutingArgs r;
  r.method = s.routing;
  r.top_k = s.k;
  r.logits = make_view(const_cast<float*>(logits), DType::F32, {T, c.E_total});
  if (s.routing == RoutingMethod::DeepSeekV3)
    r.bias = make_view(const_cast<float*>(c.bias_host.data()), DType::F32, {c.E_total});
  r.n_group = s.n_group;
  r.topk_group = s.topk_group;
  r.routed_scaling_factor = s.routed_scaling_factor;
  std::vector<int32_t> ids(static_cast<size_t>(T * s.k));
  std::vector<float> wts(ids.size());
  route(r, c.E_total, make_view(ids.data(), DType::I32, {T, s.k}), make_view(wts.data(), DType::F32, {T, s.k}));
  return ids;
}

struct Graph {
  cudaGraphExec_t exec = nullptr;
  Graph() = default;
  Graph(const Graph&) = delete;
  Graph& operator=(const Graph&) = delete;
  ~Graph() {
    if (exec) (void)cudaGraphExecDestroy(exec);
  }
};

// Captures moe_run(args) on the stream; nullptr exec (and the error cleared) if capture fails.
void capture(Graph& g, const MoeWeights& w, const MoeArgs& args, cudaStream_t stream, std::string& why) {
  cudaGraph_t graph = nullptr;
  if (cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal) != cudaSuccess) {
    why = cudaGetErrorString(cudaGetLastError());
    return;
  }
  try {
    moe_run(w, args);
  } catch (const std::exception& e) {
    why = e.what();
  }
  const cudaError_t end = cudaStreamEndCapture(stream, &graph);
  if (end == cudaSuccess && why.empty()) {
    const cudaError_t inst = cudaGraphInstantiate(&g.exec, graph, 0);
    if (inst != cudaSuccess) {
      why = std::string("cudaGraphInstantiate: ") + cudaGetErrorString(inst);
      g.exec = nullptr;
    }
  } else if (why.empty()) {
    why = std::string("cudaStreamEndCapture: ") + cudaGetErrorString(end);
  }
  if (graph) (void)cudaGraphDestroy(graph);
  (void)cudaGetLastError();
}

CaseResult run_case(Device& d, ShapeCtx& c, const Pools& pools, int64_t T, bool lora, const Options& o,
                    DevMem& ws, const std::vector<bench::Touch>& touches) {
  const ModelShape& s = *c.shape;
  CaseResult r;
  r.shape = std::string(s.name);
  r.T = T;
  r.lora = lora;
  if (lora && !c.registry) {
    r.status = "unsupported";
    r.message = c.lora_status;
    return r;
  }
  DevMem y(static_cast<size_t>(T * s.H * 2));
  const int sets = o.sets;
  std::vector<MoeArgs> args;
  // Eager calls: warm-up, and the backend's refusals surface here (outside any capture). The workspace
  // comes from workspace_size (LoRA: sized for the largest rank the backend takes); should the
  // backend ask for more, the call is retried once with twice the size.
  for (int attempt = 0;; ++attempt) {
    try {
      size_t need = workspace_size(c.w, make_args(c, T, nullptr, nullptr, nullptr, DevMem(), lora, o, d.stream, d.id));
      if (attempt > 0) need = std::max(need, 2 * ws.bytes());
      if (ws.bytes() < need) {
        ws = DevMem();
        ws = DevMem((need + 255) / 256 * 256);
      }
      args.clear();
      for (int k = 0; k < sets; ++k)
        args.push_back(make_args(c, T, pools.x.as<uint16_t>() + k * pools.set_shift_x,
                                 pools.logits.as<float>() + k * pools.set_shift_logits, y.get(), ws, lora, o, d.stream, d.id));
      for (int k = 0; k < sets; ++k) moe_run(c.w, args[k]);
      CK(cudaStreamSynchronize(d.stream));
      check_device_errors(d.id);
      break;
    } catch (const Error& e) {
      (void)cudaGetLastError();
      if (attempt == 0 && e.code() == ErrorCode::InvalidArgument && e.argument() == "workspace") continue;
      r.status = e.code() == ErrorCode::Unsupported ? "unsupported" : "error";
      r.message = std::string(to_string(e.code())) + ": " + e.what();
      return r;
    }
  }

  std::vector<Graph> graphs(static_cast<size_t>(sets));
  std::string why;
  for (int k = 0; k < sets && why.empty(); ++k) capture(graphs[k], c.w, args[k], d.stream, why);
  if (!why.empty()) {
    r.graph = false;
    r.message = "graph capture failed, timed eager calls: " + why;
  }
  auto launch = [&](int k) {
    if (r.graph) CK(cudaGraphLaunch(graphs[k].exec, d.stream));
    else moe_run(c.w, args[k]);
  };

  try {
    for (int i = 0; i < 2 * sets; ++i) {  // warm-up of the graphs
      d.flush_l2();
      launch(i % sets);
    }
    CK(cudaStreamSynchronize(d.stream));
    std::vector<double> ts;
    double measured_s = 0;
    int done = 0;
    const int batch = 50;
    while (done < o.runs || (done < o.max_runs && measured_s < o.min_time_s)) {
      const int n = std::min(batch, (done < o.runs ? o.runs : o.max_runs) - done);
      for (int i = 0; i < n; ++i) {
        d.flush_l2();
        CK(cudaEventRecord(d.events.at(2 * i), d.stream));
        launch((done + i) % sets);
        CK(cudaEventRecord(d.events.at(2 * i + 1), d.stream));
      }
      CK(cudaStreamSynchronize(d.stream));
      for (int i = 0; i < n; ++i) {
        const double us = 1000.0 * elapsed_ms(d.events.at(2 * i), d.events.at(2 * i + 1));
        ts.push_back(us);
        measured_s += us * 1e-6;
      }
      done += n;
    }
    check_device_errors(d.id);
    r.runs = done;
    r.median_us = bench::percentile(ts, 50);
    r.p10_us = bench::percentile(ts, 10);
    r.p90_us = bench::percentile(ts, 90);
    r.min_us = *std::min_element(ts.begin(), ts.end());
    double sum = 0;
    for (double v : ts) sum += v;
    r.mean_us = sum / double(ts.size());

    // Every output element written, and finite on random inputs: poison y, replay set 0, look.
    CK(cudaMemsetAsync(y.get(), 0xff, y.bytes(), d.stream));
    launch(0);
    std::vector<uint16_t> yh(static_cast<size_t>(T * s.H));
    CK(cudaMemcpyAsync(yh.data(), y.get(), y.bytes(), cudaMemcpyDeviceToHost, d.stream));
    CK(cudaStreamSynchronize(d.stream));
    int64_t bad = 0;
    for (uint16_t v : yh) bad += std::isfinite(bf16_bits_to_f32(v)) ? 0 : 1;
    r.output_check = bad == 0 ? "ok" : std::to_string(bad) + " non-finite outputs";
  } catch (const Error& e) {
    (void)cudaGetLastError();
    r.status = "error";
    r.message = std::string(to_string(e.code())) + ": " + e.what();
    return r;
  }

  // Counting: means over the input sets (the replays cycle through them evenly).
  const double per_expert = double(bench::expert_weight_bytes(o.format, s.H, s.I, c.gated));
  const double per_pair = double(bench::lora_pair_bytes(s.H, s.I, c.gated, kLoraRank));
  for (const auto& t : touches) {
    r.local_slots += double(t.local_slots) / sets;
    r.touched_experts += double(t.touched_experts) / sets;
    r.adapted_slots += double(lora ? t.adapted_slots : 0) / sets;
    r.touched_pairs += double(lora ? t.touched_pairs : 0) / sets;
  }
  r.weight_bytes = r.touched_experts * per_expert;
  r.lora_bytes = lora ? r.touched_pairs * per_pair : 0;
  r.io = bench::io_bytes(T, s.H, c.E_total, lora);
  double flops = 0;
  for (const auto& t : touches) {
    flops += bench::base_flops(t.local_slots, s.H, s.I, c.gated) / sets;
    if (lora) flops += bench::lora_flops(t.adapted_slots, s.H, s.I, c.gated, kLoraRank) / sets;
  }
  r.flops = flops;
  return r;
}

// Every token adapted: adapter t % 8.
std::vector<int32_t> adapter_ids_for(int64_t T) {
  std::vector<int32_t> v(static_cast<size_t>(T));
  for (int64_t t = 0; t < T; ++t) v[t] = static_cast<int32_t>(t % kLoraAdapters);
  return v;
}

// Whether the backend runs registry LoRA for this shape: one token through a one-expert copy of the layer.
std::string probe_lora(const ModelShape& s, WeightFormat format, int dev) {
  try {
    SyntheticLayer tiny = make_synthetic_layer(s, 1, 77, format);
    MoeWeights tw = prepare_weights(tiny.desc(), Backend::CUDA, dev);
    AdapterRegistry reg(tw, kLoraAdapters);
    SyntheticAdapter ad = make_synthetic_adapter(tiny, kLoraRank, 78);
    reg.load(0, ad.desc());
    const std::vector<uint16_t> x = random_bf16(s.H, 79);
    const std::vector<float> logits = random_f32(1, 80);
    const std::vector<int32_t> ids = {0};
    DevMem dx = DevMem::from(x), dl = DevMem::from(logits), di = DevMem::from(ids), dy(s.H * 2);
    MoeArgs a;
    a.x = make_view(dx.get(), DType::BF16, {1, s.H}, Backend::CUDA, dev);
    a.routing.method = RoutingMethod::Renormalize;
    a.routing.top_k = 1;
    a.routing.logits = make_view(dl.get(), DType::F32, {1, 1}, Backend::CUDA, dev);
    a.activation.type = s.activation;
    a.adapters = &reg;
    a.adapter_ids = make_view(di.get(), DType::I32, {1}, Backend::CUDA, dev);
    a.y = make_view(dy.get(), DType::BF16, {1, s.H}, Backend::CUDA, dev);
    moe_run(tw, a);
    CK(cudaDeviceSynchronize());
    check_device_errors(dev);
    return "";
  } catch (const Error& e) {
    (void)cudaGetLastError();
    return std::string(to_string(e.code())) + ": " + e.what();
  }
}

int run_bench_cuda(const Options& o) {
  const auto t_start = std::chrono::steady_clock::now();
  auto elapsed = [&] { return std::chrono::duration<double>(std::chrono::steady_clock::now() - t_start).count(); };
  int ndev = 0;
  if (cudaGetDeviceCount(&ndev) != cudaSuccess || ndev == 0) {
    (void)cudaGetLastError();
    std::fprintf(stderr, "fp4moe bench: no CUDA device\n");
    return 2;
  }
  if (o.device >= ndev) {
    std::fprintf(stderr, "fp4moe bench: --device %d: only %d CUDA device(s)\n", o.device, ndev);
    return 2;
  }
  Device d(o.device);
  cudaDeviceProp prop{};
  CK(cudaGetDeviceProperties(&prop, o.device));
  int sm_khz = 0, mem_khz = 0, bus = 0, drv = 0, rt = 0;
  (void)cudaDeviceGetAttribute(&sm_khz, cudaDevAttrClockRate, o.device);
  (void)cudaDeviceGetAttribute(&mem_khz, cudaDevAttrMemoryClockRate, o.device);
  (void)cudaDeviceGetAttribute(&bus, cudaDevAttrGlobalMemoryBusWidth, o.device);
  (void)cudaDriverGetVersion(&drv);
  (void)cudaRuntimeGetVersion(&rt);
  (void)cudaGetLastError();
  std::printf("fp4moe bench: %s, %d SMs, L2 %.0f MB, %.0f GB, SM clock %d MHz, memory clock %d MHz\n", prop.name,
              prop.multiProcessorCount, prop.l2CacheSize / 1e6, prop.totalGlobalMem / 1e9, sm_khz / 1000, mem_khz / 1000);
  std::fflush(stdout);

  // Synthetic layers: generated on host threads while the ceilings are measured.
  std::vector<std::future<SyntheticLayer>> layers;
  for (size_t i = 0; i < o.shapes.size(); ++i) {
    const ModelShape* s = o.shapes[i];
    layers.push_back(std::async(std::launch::async, [s, i, &o] {
      return make_synthetic_layer(*s, s->E_loc, 1000 + i, o.format);
    }));
  }

  // Random pools: x windows per case and set; the GEMM ceiling's operands.
  int64_t max_x = 0, max_logits = 0;
  for (const ModelShape* s : o.shapes)
    for (int64_t T : o.tokens) {
      max_x = std::max(max_x, T * s->H);
      max_logits = std::max(max_logits, T * s->E);
    }
  Pools pools;
  pools.set_shift_x = 8 * 1031;  // 16-byte aligned shifts: every set sees other values
  pools.set_shift_logits = 4 * 1031;
  pools.x_elems = std::max<int64_t>(max_x + o.sets * pools.set_shift_x, int64_t(2) * 8192 * 8192);
  pools.x = DevMem::from(parallel_random<uint16_t>(pools.x_elems, 11, [](int64_t n, uint64_t sd) { return random_bf16(n, sd); }));
  pools.logits_host = parallel_random<float>(max_logits + o.sets * pools.set_shift_logits, 12,
                                             [](int64_t n, uint64_t sd) { return random_f32(n, sd); });
  pools.logits = DevMem::from(pools.logits_host);

  Ceilings ceil;
  ceil.copy_gbps = measure_copy(d, ceil.copy_bytes);
  ceil.gemm_tflops = measure_gemm(d, pools.x, ceil.gemm_method);
  std::printf("ceilings: copy %.0f GB/s (read+write, %lld MB buffers), bf16 GEMM %.0f TFLOP/s; L2 flush: %s [%.1f s]\n",
              ceil.copy_gbps, (long long)(ceil.copy_bytes >> 20), ceil.gemm_tflops, d.flush_method.c_str(), elapsed());
  std::fflush(stdout);

  std::vector<CaseResult> results;
  // The JSON is rewritten after every shape ("complete": false until the end), so a run cut short keeps its cases.
  auto write_json = [&](bool complete) -> bool {
    if (o.json_path.empty()) return true;
    const BuildInfo bi = build_info();
    std::string archs;
    for (const auto& a : bi.cuda_archs) archs += (archs.empty() ? "" : ",") + a;
    JObj machine;
    machine.add("gpu", json::quote(prop.name)).add("sms", jint(prop.multiProcessorCount)).add("l2_bytes", jint(prop.l2CacheSize));
    machine.add("memory_bytes", jint(static_cast<int64_t>(prop.totalGlobalMem)));
    machine.add("compute_capability", json::quote(std::to_string(prop.major) + "." + std::to_string(prop.minor)));
    machine.add("sm_clock_mhz", jint(sm_khz / 1000)).add("memory_clock_mhz", jint(mem_khz / 1000)).add("memory_bus_bits", jint(bus));
    machine.add("driver", jint(drv)).add("runtime", jint(rt));
    JObj build;
    build.add("version", json::quote(bi.version)).add("source_hash", json::quote(bi.source_hash)).add("cxx", json::quote(bi.cxx_compiler));
    build.add("cuda", json::quote(bi.cuda_compiler)).add("archs", json::quote(archs));
    JObj method;
    method.add("timing", json::quote("CUDA events around one CUDA-graph replay of moe_run"));
    method.add("l2", json::quote(d.flush_method)).add("runs_min", jint(o.runs)).add("runs_max", jint(o.max_runs));
    method.add("min_time_s", jnum(o.min_time_s)).add("input_sets", jint(o.sets)).add("warmup", jint(2 * o.sets));
    method.add("format", json::quote(o.format == WeightFormat::NVFP4 ? "nvfp4" : "bf16")).add("mode", json::quote(o.mode == ActMode::A4 ? "A4" : "A16"));
    method.add("gemm_tile", json::quote(to_string(static_cast<GemmTile>(o.gemm_tile))));
    method.add("workspace_budget", jint(o.workspace_budget > 0 ? o.workspace_budget : kDefaultWorkspaceBudget));
    method.add("lora", json::quote("8 PEFT-fused adapters of rank 16, adapter_ids = t % 8"));
    method.add("weight_bytes", json::quote("per local expert routed to at least once: W1 + W2 (NVFP4: codes + e4m3 scales + fp32 "
                                    "global scales; bf16: 2 bytes an element); LoRA rows add the touched (adapter, expert) "
                                    "A and B matrices"));
    method.add("floor", json::quote("max((weight + io bytes) / copy ceiling, flops / gemm ceiling)"));
    JObj ceilings;
    ceilings.add("copy_gbps", jnum(ceil.copy_gbps)).add("copy_bytes", jint(ceil.copy_bytes));
    ceilings.add("copy", json::quote("cudaMemcpyAsync device to device, bytes read + written, median of 10"));
    ceilings.add("gemm_tflops", jnum(ceil.gemm_tflops)).add("gemm", json::quote(ceil.gemm_method));
    std::string cases = "[\n";
    for (size_t i = 0; i < results.size(); ++i) cases += "    " + case_json(results[i]) + (i + 1 < results.size() ? ",\n" : "\n");
    cases += "  ]";
    const std::string doc = "{\n  \"tool\": \"fp4moe bench\",\n  \"date\": " + json::quote(utc_now()) + ",\n  \"complete\": " + jbool(complete) +
                            ",\n  \"machine\": " +
                            machine.dump() + ",\n  \"build\": " + build.dump() + ",\n  \"method\": " + method.dump() +
                            ",\n  \"ceilings\": " + ceilings.dump() + ",\n  \"cases\": " + cases + "\n}\n";
    FILE* f = std::fopen(o.json_path.c_str(), "w");
    const bool ok = f && std::fwrite(doc.data(), 1, doc.size(), f) == doc.size();
    if (f && std::fclose(f) != 0) return false;
    return ok;
  };
  if (!write_json(false)) {
    std::fprintf(stderr, "fp4moe bench: cannot write %s\n", o.json_path.c_str());
    return 2;
  }
  DevMem ws;
  for (size_t si = 0; si < o.shapes.size(); ++si) {
    const ModelShape& s = *o.shapes[si];
    ShapeCtx c;
    c.shape = &s;
    c.E_loc = s.E_loc;
    c.E_total = s.E;
    c.gated = is_gated(s.activation);
    {
      SyntheticLayer L = layers[si].get();
      c.w = prepare_weights(L.desc(), Backend::CUDA, o.device);
      c.alpha = DevMem::from(L.alpha);
      c.beta = DevMem::from(L.beta);
      if (!L.clamp.empty()) c.clamp = DevMem::from(L.clamp);
      if (o.lora) {
        c.lora_status = probe_lora(s, o.format, o.device);
        if (c.lora_status.empty()) {
          // The adapters need only the layer's dimensions; generated on threads (the bulk of the setup).
          SyntheticLayer dims;
          dims.E = L.E; dims.H = L.H; dims.I = L.I; dims.gated = L.gated; dims.format = L.format; dims.order = L.order;
          std::vector<std::future<SyntheticAdapter>> fa;
          for (int a = 0; a < kLoraAdapters; ++a)
            fa.push_back(std::async(std::launch::async, [&dims, a, si] {
              return make_synthetic_adapter(dims, kLoraRank, 5000 + 100 * si + a);
            }));
          c.registry = std::make_unique<AdapterRegistry>(c.w, kLoraAdapters);
          for (int a = 0; a < kLoraAdapters; ++a) {
            SyntheticAdapter ad = fa[a].get();
            c.registry->load(a, ad.desc());
          }
        }
      } else {
        c.lora_status = "not run (--no-lora)";
      }
    }  // host copy of the synthetic layer freed here
    // A small routing bias (std 0.01): with N(0, 1) logits, sigmoid scores spread ~0.2, so the selection stays close
    // to uniform over experts, as the SPEC's floors assume (a 0.1 bias concentrated kimi_k3_tp8's T=1024 batch on
    // ~240 of 384 experts in the 2026-11-30 run).
    c.bias_host = random_f32(c.E_total, 2000 + si, 0.01f);
    c.bias = DevMem::from(c.bias_host);
    int64_t maxT = 0;
    for (int64_t T : o.tokens) maxT = std::max(maxT, T);
    c.adapter_ids = DevMem::from(adapter_ids_for(maxT));
    std::printf("== %s (H=%lld I=%lld E=%lld E_loc=%lld k=%lld %s %s)%s [%.1f s]\n", std::string(s.name).c_str(),
                (long long)s.H, (long long)s.I, (long long)s.E, (long long)s.E_loc, (long long)s.k, to_string(s.routing),
                to_string(s.activation), c.registry ? "" : (" LoRA: " + c.lora_status).c_str(), elapsed());
    std::fflush(stdout);

    for (int64_t T : o.tokens) {
      std::vector<bench::Touch> touches;
      const std::vector<int32_t> aids = adapter_ids_for(T);
      for (int k = 0; k < o.sets; ++k) {
        const std::vector<int32_t> ids = host_route(c, T, pools.logits_host.data() + k * pools.set_shift_logits);
        touches.push_back(bench::count_touch(ids, T, s.k, 0, c.E_loc, aids));
      }
      for (bool lora : {false, true}) {
        if (lora ? !o.lora : !o.base) continue;
        const double ref_mem = ceil.copy_gbps, ref_gemm = ceil.gemm_tflops;
        CaseResult r = run_case(d, c, pools, T, lora, o, ws, touches);
        if (r.status == "ok") r.m = bench::derive_metrics(r.median_us, r.weight_bytes + r.lora_bytes, r.io, r.flops, ref_mem, ref_gemm);
        if (r.status == "ok")
          std::printf("  T=%-6lld %-5s %10.1f us  p10 %9.1f  p90 %9.1f  %6.0f GB/s (%.2f of copy)  %6.1f TFLOP/s (%.2f of gemm)  "
                      "floor %8.1f us  x%.2f  %s%s\n",
                      (long long)T, lora ? "lora" : "base", r.median_us, r.p10_us, r.p90_us, r.m.gbps, r.m.ratio_copy, r.m.tflops,
                      r.m.ratio_gemm, r.m.floor_us, r.m.time_over_floor, r.output_check.c_str(), r.graph ? "" : " (no graph)");
        else
          std::printf("  T=%-6lld %-5s %s: %s\n", (long long)T, lora ? "lora" : "base", r.status.c_str(), r.message.c_str());
        std::fflush(stdout);
        results.push_back(std::move(r));
      }
    }
    if (!write_json(false)) std::fprintf(stderr, "fp4moe bench: cannot write %s\n", o.json_path.c_str());
  }

  std::printf("\n%s", markdown_table(results).c_str());
  std::printf("\n(time per moe_run: median of >= %d CUDA-graph replays, L2 flushed before each; weights MB: touched weight\n"
              "bytes incl. LoRA; /copy and /gemm: ratios to the ceilings measured above; floor: max(bytes / copy, FLOPs / gemm);\n"
              "LoRA / base: a LoRA row's median over the same shape and T without LoRA, in this run)\n",
              o.runs);
  std::printf("bench finished in %.1f s\n", elapsed());

  int failed = 0;
  for (const auto& r : results)
    if (r.status == "error" || (r.status == "ok" && r.output_check != "ok")) ++failed;
  if (!o.json_path.empty()) {
    if (!write_json(true)) {
      std::fprintf(stderr, "fp4moe bench: cannot write %s\n", o.json_path.c_str());
      return 1;
    }
    std::printf("wrote %s\n", o.json_path.c_str());
  }
  return failed ? 1 : 0;
}

#endif  // FP4MOE_WITH_CUDA

}  // namespace

int run_bench(int argc, char** argv) {
  for (int i = 0; i < argc; ++i)
    if (!std::strcmp(argv[i], "--help") || !std::strcmp(argv[i], "-h")) {
      usage();
      return 0;
    }
  Options o;
  try {
    o = parse_options(argc, argv);
  } catch (const std::invalid_argument& e) {
    std::fprintf(stderr, "fp4moe bench: %s\n", e.what());
    return usage();
  }
#ifdef FP4MOE_WITH_CUDA
  try {
    return run_bench_cuda(o);
  } catch (const Error& e) {
    std::fprintf(stderr, "fp4moe bench: error (%s): %s\n", to_string(e.code()), e.what());
    return 1;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "fp4moe bench: error: %s\n", e.what());
    return 1;
  }
#else
  (void)o;
  std::fprintf(stderr, "fp4moe bench: this build has no CUDA backend (configure with nvcc and FP4MOE_WITH_CUDA=ON)\n");
  return 2;
#endif
}

}  // namespace fp4moe
