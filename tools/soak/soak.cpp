// fp4moe_soak: the operator under load (SPEC §4-§6). One layer and one AdapterRegistry of resident
// adapters of mixed ranks and layouts; a pool of batch specs (T mostly small, a tail up to 4096; base and
// adapter tokens mixed) whose outputs are computed once, at start, on a fresh registry holding the same
// adapters. Then N calls pick specs at random and compare each output bit for bit with its reference,
// while another thread loads and unloads adapters in slots the batches never name and re-loads the
// resident ones with identical content, and bad calls are interleaved (each must throw fp4moe::Error
// naming its argument, with y untouched; values only on the GPU must be reported by
// check_device_errors). Host RSS and device memory must stay flat after warm-up.
#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <memory>
#include <mutex>
#include <new>
#include <random>
#include <stdexcept>
#include <string>
#include <thread>
#include <type_traits>
#include <utility>
#include <vector>

#include <unistd.h>
#if defined(__GLIBC__)
#include <malloc.h>
#endif

#include "../common/device_buffer.h"
#include "../fp4moe/cli.h"
#include "fp4moe/build_info.h"
#include "fp4moe/model_shapes.h"
#include "fp4moe/moe.h"
#include "runtime/plan.h"
#include "runtime/problem_shape.h"
#include "fp4moe/synthetic.h"
#include "io/json_write.h"
#ifdef FP4MOE_WITH_CUDA
#include <cuda_runtime.h>
#endif

namespace fp4moe::soak {
namespace {

using Clock = std::chrono::steady_clock;
double seconds_since(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }

// Every byte of y before a call: a bad call must leave all of them so; a good call must overwrite them all.
constexpr int kSentinel = 0xA5;
constexpr double kMiB = 1024.0 * 1024.0;

// ---- options --------------------------------------------------------------------------------------
struct Options {
  std::string backend = "cpu";
  std::string shape;  // a SPEC shape (model_shapes.h); empty: the small custom shape below
  int64_t hidden = 0, inter = 0, experts = 0, topk = 0;  // 0: the backend's default
  int64_t max_tokens = 0, small_tokens = 0;               // 0: the backend's default
  double small_fraction = 0.7;
  int64_t calls = 100000;
  double seconds = 300;
  int specs = 0;  // 0: the backend's default
  int slots = 72, stable = 64;
  int bad_every = 20;
  int threads = 0;  // CPU: MoeArgs::num_threads (0: 1 on the CPU backend, whose reference is the slow part)
  uint64_t seed = 1;
  int64_t warmup = -1;  // -1: max(200, 5 % of --calls)
  double rss_bound_mib = 64, dev_bound_mib = 16;
  double churn_sleep_ms = -1;  // -1: the backend's default
  double no_ws_fraction = 0.15, chunked_fraction = 0.10;
  bool a4 = false, up_first = false;
  std::vector<std::string> skip_bad;
  double progress_s = 30;
  std::string json;
};

void usage(FILE* f) {
  std::fputs(
      "usage: fp4moe_soak [--backend cpu|cuda] [--shape NAME] [--hidden H] [--inter I] [--experts E] [--topk K]\n"
      "                   [--calls N] [--seconds S] [--max-tokens T] [--small-tokens T] [--small-fraction F]\n"
      "                   [--specs N] [--slots N] [--stable N] [--bad-every N] [--threads N] [--seed N]\n"
      "                   [--warmup N] [--rss-bound-mib M] [--dev-bound-mib M] [--churn-sleep-ms MS]\n"
      "                   [--no-workspace-fraction F] [--chunked-fraction F] [--a4] [--up-first]\n"
      "                   [--skip-bad KIND,...] [--progress S] [--json FILE]\n"
      "  Soaks moe_run: N calls (or S seconds, whichever ends first) over a pool of batch specs, every good\n"
      "  output compared bit for bit with the spec's reference (computed once on a fresh registry), adapters\n"
      "  loaded and unloaded meanwhile from another thread, one bad call in --bad-every. Exits 0 only when\n"
      "  every good call matched, every bad call erred as expected with y untouched, and host RSS and device\n"
      "  memory grew by at most their bounds after warm-up.\n"
      "  Defaults: cpu H=256 I=128 E=16 k=4, T <= 96 (70 % in 1..16), 24 specs; cuda H=1024 I=256 E=64 k=6,\n"
      "  T <= 4096 (70 % in 1..64), 64 specs. Slots: --stable resident adapters in 0..stable-1, churn slots\n"
      "  after them, the last slot always empty. --shape takes a SPEC shape (--experts may reduce it). Warm-up:\n"
      "  every spec once (per workspace variant on CUDA), then up to max(200, 5 % of --calls) calls or 5 % of\n"
      "  --seconds. Bad-call kinds (--skip-bad): x_shape x_dtype x_strides x_device y_shape y_dtype logits_shape\n"
      "  top_k_above_E top_k_zero adapter_ids_dtype adapter_ids_shape adapter_ids_without_registry adapter_id_range\n"
      "  adapter_id_negative adapter_slot_empty topk_id_range logits_and_topk a4_scale gemm_tile num_threads\n"
      "  workspace expert_window activation_type alpha_shape foreign_registry.\n",
      f);
}

using cli::split_list;

bool parse_i64(const std::string& s, int64_t& out) {
  char* end = nullptr;
  errno = 0;
  const long long v = std::strtoll(s.c_str(), &end, 10);
  if (errno != 0 || end == s.c_str() || *end != '\0') return false;
  out = v;
  return true;
}
bool parse_f64(const std::string& s, double& out) {
  char* end = nullptr;
  errno = 0;
  const double v = std::strtod(s.c_str(), &end);
  if (errno != 0 || end == s.c_str() || *end != '\0' || !std::isfinite(v)) return false;
  out = v;
  return true;
}

// "" on success, "help", or the problem.
std::string parse_options(int argc, char** argv, Options& o) {
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    std::string v;
    auto value = [&]() -> bool {
      if (i + 1 >= argc) return false;
      v = argv[++i];
      return true;
    };
    auto int_opt = [&](int64_t lo, int64_t hi, auto& dst) -> std::string {
      int64_t n = 0;
      if (!value() || !parse_i64(v, n) || n < lo || n > hi)
        return a + " expects an integer in [" + std::to_string(lo) + ", " + std::to_string(hi) + "], got '" + v + "'";
      dst = static_cast<std::remove_reference_t<decltype(dst)>>(n);
      return "";
    };
    auto f64_opt = [&](double lo, double hi, double& dst) -> std::string {
      double d = 0;
      if (!value() || !parse_f64(v, d) || d < lo || d > hi)
        return a + " expects a number in [" + std::to_string(lo) + ", " + std::to_string(hi) + "], got '" + v + "'";
      dst = d;
      return "";
    };
    std::string err;
    if (a == "--help" || a == "-h") return "help";
    if (a == "--backend") {
      if (!value() || (v != "cpu" && v != "cuda")) return "--backend expects cpu or cuda";
      o.backend = v;
    } else if (a == "--shape") {
      if (!value() || !find_model_shape(v)) {
        std::string known;
        for (const auto& m : kModelShapes) known += std::string(known.empty() ? "" : ", ") + std::string(m.name);
        return "unknown shape '" + v + "' (known: " + known + ")";
      }
      o.shape = v;
    } else if (a == "--hidden") err = int_opt(16, 1 << 16, o.hidden);
    else if (a == "--inter") err = int_opt(16, 1 << 16, o.inter);
    else if (a == "--experts") err = int_opt(1, 4096, o.experts);
    else if (a == "--topk") err = int_opt(1, 64, o.topk);
    else if (a == "--calls") err = int_opt(1, int64_t(1) << 40, o.calls);
    else if (a == "--seconds") err = f64_opt(0.001, 1e7, o.seconds);
    else if (a == "--max-tokens") err = int_opt(2, 1 << 20, o.max_tokens);
    else if (a == "--small-tokens") err = int_opt(1, 1 << 20, o.small_tokens);
    else if (a == "--small-fraction") err = f64_opt(0, 1, o.small_fraction);
    else if (a == "--specs") err = int_opt(2, 100000, o.specs);
    else if (a == "--slots") err = int_opt(3, 1 << 16, o.slots);
    else if (a == "--stable") err = int_opt(1, 1 << 16, o.stable);
    else if (a == "--bad-every") err = int_opt(0, 1 << 30, o.bad_every);
    else if (a == "--threads") err = int_opt(0, 1024, o.threads);
    else if (a == "--seed") err = int_opt(0, int64_t(1) << 62, o.seed);
    else if (a == "--warmup") err = int_opt(0, int64_t(1) << 40, o.warmup);
    else if (a == "--rss-bound-mib") err = f64_opt(0, 1e9, o.rss_bound_mib);
    else if (a == "--dev-bound-mib") err = f64_opt(0, 1e9, o.dev_bound_mib);
    else if (a == "--churn-sleep-ms") err = f64_opt(0, 1e6, o.churn_sleep_ms);
    else if (a == "--no-workspace-fraction") err = f64_opt(0, 1, o.no_ws_fraction);
    else if (a == "--chunked-fraction") err = f64_opt(0, 1, o.chunked_fraction);
    else if (a == "--progress") err = f64_opt(0, 1e7, o.progress_s);
    else if (a == "--a4") o.a4 = true;
    else if (a == "--up-first") o.up_first = true;
    else if (a == "--skip-bad") {
      if (!value()) return "--skip-bad needs a list of kinds";
      for (auto& s : split_list(v)) o.skip_bad.push_back(s);
    } else if (a == "--json") {
      if (!value() || v.empty()) return "--json needs a file name";
      o.json = v;
    } else {
      return "unknown option '" + a + "'";
    }
    if (!err.empty()) return err;
  }
  if (o.stable + 2 > o.slots) return "--slots must leave room for at least one churn slot and the empty slot after --stable";
  if (o.no_ws_fraction + o.chunked_fraction > 1) return "--no-workspace-fraction plus --chunked-fraction exceeds 1";
  return "";
}

// ---- memory -----------------------------------------------------------------------------------------
#ifdef FP4MOE_WITH_CUDA
void cuda_ok(cudaError_t e, const char* what) {
  if (e != cudaSuccess) throw std::runtime_error(std::string(what) + " failed: " + cudaGetErrorString(e));
}
#endif

int64_t host_rss_bytes() {
#if defined(__GLIBC__)
  malloc_trim(0);  // freed heap pages go back first: what stays resident is what is live or fragmented
#endif
  FILE* f = std::fopen("/proc/self/statm", "r");
  if (!f) return -1;
  long long size = 0, resident = 0;
  const int n = std::fscanf(f, "%lld %lld", &size, &resident);
  std::fclose(f);
  return n == 2 ? resident * static_cast<int64_t>(sysconf(_SC_PAGESIZE)) : -1;
}

// Device memory in use (total - free), after the device is idle; 0 on the CPU backend.
int64_t device_used_bytes(Backend b) {
  if (b != Backend::CUDA) return 0;
#ifdef FP4MOE_WITH_CUDA
  cuda_ok(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
  size_t free_b = 0, total_b = 0;
  cuda_ok(cudaMemGetInfo(&free_b, &total_b), "cudaMemGetInfo");
  return static_cast<int64_t>(total_b - free_b);
#else
  return 0;
#endif
}

// The first n bytes of b as the host sees them once the stream's work is done: b itself on the host, else a copy
// into `staging`.
const uint8_t* read_back(const DeviceBuffer& b, size_t n, void* stream, void* staging) {
  if (b.where() == Backend::CPU) return b.as<const uint8_t>();
  b.download_to(staging, n, stream);
  return static_cast<const uint8_t*>(staging);
}

// Page-locked host memory for the copy-back of y on the CUDA backend (plain memory otherwise).
class Staging {
 public:
  Staging(Backend b, size_t bytes) : cuda_(b == Backend::CUDA) {
#ifdef FP4MOE_WITH_CUDA
    if (cuda_) {
      cuda_ok(cudaMallocHost(&p_, std::max<size_t>(bytes, 256)), "cudaMallocHost");
      return;
    }
#endif
    cuda_ = false;
    p_ = ::operator new(std::max<size_t>(bytes, 256));
  }
  ~Staging() {
#ifdef FP4MOE_WITH_CUDA
    if (cuda_) {
      (void)cudaFreeHost(p_);
      return;
    }
#endif
    ::operator delete(p_);
  }
  Staging(const Staging&) = delete;
  Staging& operator=(const Staging&) = delete;
  void* get() const { return p_; }

 private:
  bool cuda_ = false;
  void* p_ = nullptr;
};

// ---- the adapters of the registry --------------------------------------------------------------
constexpr int64_t kRanks[] = {4, 8, 16, 32, 64};
constexpr LoraLayout kLayouts[] = {LoraLayout::PeftFused, LoraLayout::PerExpert, LoraLayout::SharedOuter};

// Loads and unloads adapters in the churn slots, and re-loads stable slots with their own content, until
// stopped. pause() brings the churn slots to one state (all empty) so that memory readings compare alike.
class Churn {
 public:
  Churn(AdapterRegistry& reg, std::vector<SyntheticAdapter>& stable, std::vector<SyntheticAdapter>& pool,
        int first_slot, int num_slots, uint64_t seed, double sleep_ms)
      : reg_(reg), stable_(stable), pool_(pool), first_(first_slot), n_(num_slots), seed_(seed),
        sleep_(std::chrono::microseconds(static_cast<int64_t>(sleep_ms * 1000))) {}
  ~Churn() { stop(); }
  void start() { th_ = std::thread([this] { loop(); }); }
  void pause() {
    std::unique_lock<std::mutex> lk(mu_);
    want_pause_ = true;
    cv_.notify_all();
    cv_.wait(lk, [&] { return paused_ || done_; });
  }
  void resume() {
    std::lock_guard<std::mutex> lk(mu_);
    want_pause_ = false;
    cv_.notify_all();
  }
  void stop() {
    {
      std::lock_guard<std::mutex> lk(mu_);
      stop_ = true;
      cv_.notify_all();
    }
    if (th_.joinable()) th_.join();
  }
  std::string first_error() {
    std::lock_guard<std::mutex> lk(mu_);
    return first_error_;
  }

  std::atomic<int64_t> loads{0}, unloads{0}, stable_reloads{0}, empty_unloads_refused{0}, errors{0};

 private:
  void note(const std::string& e) {
    ++errors;
    std::lock_guard<std::mutex> lk(mu_);
    if (first_error_.empty()) first_error_ = e;
  }
  void clear(std::vector<char>& loaded) {
    for (int s = 0; s < n_; ++s) {
      if (!loaded[s]) continue;
      try {
        reg_.unload(first_ + s);
        ++unloads;
      } catch (const std::exception& e) {
        note(std::string("unload: ") + e.what());
      }
      loaded[s] = 0;
    }
  }
  void loop() {
    std::mt19937_64 rng(seed_);
    std::vector<char> loaded(n_, 0);
    for (;;) {
      {
        std::unique_lock<std::mutex> lk(mu_);
        if (stop_ || want_pause_) {
          lk.unlock();
          clear(loaded);
          lk.lock();
          if (stop_) {
            done_ = true;
            cv_.notify_all();
            return;
          }
          paused_ = true;
          cv_.notify_all();
          cv_.wait(lk, [&] { return !want_pause_ || stop_; });
          paused_ = false;
          continue;
        }
      }
      const int op = static_cast<int>(rng() % 16);
      const int s = static_cast<int>(rng() % n_);
      try {
        if (op < 6 || (op < 12 && !loaded[s])) {
          if (op >= 6 && rng() % 4 == 0) {
            // An empty slot: unload must refuse it (NotFound) and change nothing.
            try {
              reg_.unload(first_ + s);
              note("unload of empty slot " + std::to_string(first_ + s) + " did not throw");
            } catch (const Error& e) {
              if (e.code() != ErrorCode::NotFound) note(std::string("unload of an empty slot: ") + e.what());
              else ++empty_unloads_refused;
            }
          }
          reg_.load(first_ + s, pool_[rng() % pool_.size()].desc());  // new, or replaces what the slot held
          loaded[s] = 1;
          ++loads;
        } else if (op < 12) {
          reg_.unload(first_ + s);
          loaded[s] = 0;
          ++unloads;
        } else {
          const size_t i = rng() % stable_.size();
          reg_.load(static_cast<int>(i), stable_[i].desc());  // the same content: must be invisible
          ++loads;
          ++stable_reloads;
        }
      } catch (const std::exception& e) {
        note(e.what());
      }
      std::unique_lock<std::mutex> lk(mu_);
      cv_.wait_for(lk, sleep_, [&] { return stop_ || want_pause_; });
    }
  }

  AdapterRegistry& reg_;
  std::vector<SyntheticAdapter>& stable_;
  std::vector<SyntheticAdapter>& pool_;
  const int first_, n_;
  const uint64_t seed_;
  const std::chrono::microseconds sleep_;
  std::thread th_;
  std::mutex mu_;
  std::condition_variable cv_;
  bool want_pause_ = false, paused_ = false, stop_ = false, done_ = false;
  std::string first_error_;
};

// ---- bad calls ------------------------------------------------------------------------------------
enum class Bad : int {
  XShape, XDtype, XStrides, XDevice, YShape, YDtype, LogitsShape, TopKAboveE, TopKZero, IdsDtype, IdsShape,
  IdsWithoutRegistry, AdapterIdRange, AdapterIdNegative, AdapterSlotEmpty, TopkIdRange, LogitsAndTopk, A4Scale,
  GemmTile, NumThreads, Workspace, ExpertWindow, ActivationType, AlphaShape, ForeignRegistry, Count
};
constexpr int kNumBad = static_cast<int>(Bad::Count);
const char* const kBadNames[kNumBad] = {
    "x_shape", "x_dtype", "x_strides", "x_device", "y_shape", "y_dtype", "logits_shape", "top_k_above_E",
    "top_k_zero", "adapter_ids_dtype", "adapter_ids_shape", "adapter_ids_without_registry", "adapter_id_range",
    "adapter_id_negative", "adapter_slot_empty", "topk_id_range", "logits_and_topk", "a4_scale", "gemm_tile",
    "num_threads", "workspace", "expert_window", "activation_type", "alpha_shape", "foreign_registry"};

struct BadTally {
  int64_t tried = 0, ok = 0, on_device = 0;
};

// ---- the soak ---------------------------------------------------------------------------------
struct Spec {
  int64_t T = 0;
  std::vector<uint16_t> x;
  std::vector<float> logits;
  std::vector<int32_t> aids;
  std::vector<int32_t> topk_ids;  // the host routing of the logits, for the precomputed-routing bad calls
  std::vector<float> topk_w;
  std::vector<uint8_t> ref;       // y's bits on the fresh registry
  float fc1 = 0.f;
  size_t ws = 0, ws_chunked = 0;  // workspace_size without and with the chunking budget
  DeviceBuffer dx, dlogits, daids;  // where the calls read them (the backend's memory)
};

struct MemReading {
  int64_t rss = -1, dev = 0;
};

class Soak {
 public:
  explicit Soak(const Options& o) : o_(o), backend_(o.backend == "cuda" ? Backend::CUDA : Backend::CPU) {}
  int run();

 private:
  void setup_problem();
  void setup_layer();
  void setup_specs();
  MoeArgs args_for(Spec& s, const AdapterRegistry* reg) const;
  size_t ws_for(int64_t T, int64_t budget) const;
  void note(const std::string& msg);
  void good_call(Spec& s, int variant);
  void bad_call(Bad kind, Spec& s);
  bool bad_enabled(Bad kind) const;
  MemReading read_memory() const;
  bool write_json(double secs, double setup_secs, bool pass) const;

  const Options o_;
  const Backend backend_;
  bool cuda() const { return backend_ == Backend::CUDA; }

  // Problem.
  ModelShape shape_{};
  std::string shape_name_;
  int64_t H_ = 0, I_ = 0, E_loc_ = 0, E_total_ = 0, offset_ = 0, k_ = 0, max_T_ = 0, small_T_ = 0;
  GateUpOrder order_ = GateUpOrder::GateFirst;
  int threads_ = 0, num_specs_ = 0, churn_first_ = 0, churn_n_ = 0, empty_slot_ = 0;
  double churn_sleep_ms_ = 0;
  int64_t chunk_budget_ = 0;
  bool uses_bias_ = false;

  // Layer, adapters, inputs.
  SyntheticLayer layer_;
  MoeWeights w_, foreign_w_;
  std::unique_ptr<AdapterRegistry> reg_, foreign_reg_;
  std::vector<SyntheticAdapter> stable_, pool_;
  std::vector<float> router_bias_;
  DeviceBuffer bias_, alpha_, beta_, clamp_, y_, ws_, bad_aids_, bad_ids_, bad_w_, base_aids_, host_ws_;
  std::unique_ptr<Staging> staging_;
  std::vector<Spec> specs_;
  void* stream_ = nullptr;

  // Counts.
  int64_t calls_ = 0, good_ = 0, bad_ = 0, mismatches_ = 0, good_errors_ = 0, spurious_faults_ = 0;
  int64_t bad_wrong_ = 0, bad_touched_ = 0, bad_ok_ = 0, device_faults_ = 0, post_fault_exact_ = 0;
  int64_t bytes_compared_ = 0, ws_given_ = 0, ws_none_ = 0, ws_chunked_ = 0;
  BadTally tally_[kNumBad];
  bool force_good_ = false, after_fault_ = false, fatal_ = false;
  int notes_ = 0;
  std::mt19937_64 rng_;
  MemReading before_, after_;
  bool measured_ = false;
  int64_t warmup_calls_ = 0, loads_ = 0, unloads_ = 0, reloads_ = 0, empty_unloads_ = 0, churn_errors_ = 0;
  std::string churn_error_;
};

void Soak::note(const std::string& msg) {
  if (++notes_ <= 20) std::fprintf(stderr, "soak: %s\n", msg.c_str());
  else if (notes_ == 21) std::fprintf(stderr, "soak: (further problems counted, not printed)\n");
}

bool Soak::bad_enabled(Bad kind) const {
  const std::string name = kBadNames[static_cast<int>(kind)];
  return std::find(o_.skip_bad.begin(), o_.skip_bad.end(), name) == o_.skip_bad.end();
}

void Soak::setup_problem() {
  if (!o_.shape.empty()) {
    const ModelShape& m = *find_model_shape(o_.shape);
    shape_ = m;
    shape_name_ = std::string(m.name);
    // A reduced SPEC shape keeps its ratio of all experts to local ones (expert parallelism) and puts this
    // rank's window away from 0, as `fp4moe check` does.
    E_loc_ = o_.experts > 0 ? std::min<int64_t>(o_.experts, m.E_loc) : m.E_loc;
    E_total_ = E_loc_ * (m.E / m.E_loc);
    offset_ = m.E > m.E_loc ? E_loc_ : 0;
    H_ = m.H;
    I_ = m.I;
    k_ = m.k;
    // kimi_k3_tp8's weights are up rows first (FlashInfer trtllm order), as in `fp4moe check`.
    order_ = m.routing == RoutingMethod::DeepSeekV3 && m.n_group == 1 ? GateUpOrder::UpFirst : GateUpOrder::GateFirst;
  } else {
    H_ = o_.hidden > 0 ? o_.hidden : (cuda() ? 1024 : 256);
    I_ = o_.inter > 0 ? o_.inter : (cuda() ? 256 : 128);
    E_loc_ = E_total_ = o_.experts > 0 ? o_.experts : (cuda() ? 64 : 16);
    k_ = o_.topk > 0 ? o_.topk : (cuda() ? 6 : 4);
    shape_ = ModelShape{"custom", H_, I_, E_total_, k_, RoutingMethod::Renormalize, 1, 1, 1.f,
                        ActivationType::Swiglu, 1.f, 0.f, 0.f, E_loc_};
    shape_name_ = "custom";
  }
  if (o_.up_first) order_ = GateUpOrder::UpFirst;
  shape_.E = E_total_;
  shape_.E_loc = E_loc_;
  shape_.k = k_;
  if (H_ % 16 || I_ % 16) throw std::runtime_error("H and I must be multiples of 16");
  if (k_ > E_total_) throw std::runtime_error("top-k " + std::to_string(k_) + " exceeds the " + std::to_string(E_total_) + " experts");
  if (E_loc_ < 2) throw std::runtime_error("the soak needs at least 2 local experts");
  if (shape_.n_group > 1 && (E_total_ % shape_.n_group != 0 || E_total_ / shape_.n_group < 2 ||
                             k_ > shape_.topk_group * (E_total_ / shape_.n_group)))
    throw std::runtime_error("too few experts for the shape's groups");
  uses_bias_ = shape_.routing == RoutingMethod::DeepSeekV3 || shape_.routing == RoutingMethod::MiniMax2;
  max_T_ = o_.max_tokens > 0 ? o_.max_tokens : (cuda() ? 4096 : 96);
  small_T_ = std::min(max_T_, o_.small_tokens > 0 ? o_.small_tokens : (cuda() ? 64 : 16));
  num_specs_ = o_.specs > 0 ? o_.specs : (cuda() ? 64 : 24);
  threads_ = o_.threads > 0 ? o_.threads : (cuda() ? 0 : 1);
  churn_sleep_ms_ = o_.churn_sleep_ms >= 0 ? o_.churn_sleep_ms : (cuda() ? 1.0 : 2.0);
  churn_first_ = o_.stable;
  empty_slot_ = o_.slots - 1;
  churn_n_ = empty_slot_ - churn_first_;
}

size_t Soak::ws_for(int64_t T, int64_t budget) const {
  MoeArgs a;  // a call of shapes only
  a.x = make_view(nullptr, DType::BF16, {T, H_});
  a.routing.method = shape_.routing;
  a.routing.top_k = k_;
  a.routing.n_group = shape_.n_group;
  a.routing.logits = make_view(nullptr, DType::F32, {T, E_total_});
  a.num_experts_total = E_total_;
  a.activation.type = shape_.activation;
  a.mode = o_.a4 ? ActMode::A4 : ActMode::A16;
  a.workspace_budget = budget;
  // LoRA sized for any rank: the registry's largest changes under churn.
  return call_workspace_size(w_.impl(), a, true, 0);
}

void Soak::setup_layer() {
  const bool with_bias = shape_.activation == ActivationType::SwigluBias;
  layer_ = make_synthetic_layer(shape_, E_loc_, o_.seed * 7 + 1, WeightFormat::NVFP4, with_bias, order_);
  w_ = prepare_weights(layer_.desc(), backend_, 0);
  if (!layer_.alpha.empty()) alpha_ = DeviceBuffer::from(layer_.alpha, backend_);
  if (!layer_.beta.empty()) beta_ = DeviceBuffer::from(layer_.beta, backend_);
  if (!layer_.clamp.empty()) clamp_ = DeviceBuffer::from(layer_.clamp, backend_);
  if (uses_bias_) {
    router_bias_ = random_f32(E_total_, o_.seed * 7 + 2, 0.1f);
    bias_ = DeviceBuffer::from(router_bias_, backend_);
  }
  // Stable adapters: every rank with every layout (5 x 3 combinations cycle through the slots).
  for (int i = 0; i < o_.stable; ++i)
    stable_.push_back(make_synthetic_adapter(layer_, kRanks[i % 5], o_.seed * 1000 + 100 + i, kLayouts[i % 3]));
  // The churn pool: its own content, every rank and layout, one zero-B adapter.
  for (int i = 0; i < 8; ++i)
    pool_.push_back(make_synthetic_adapter(layer_, kRanks[(i + 2) % 5], o_.seed * 1000 + 900000 + i, kLayouts[(i + 1) % 3],
                                           /*zero_b=*/i == 7));
  if (bad_enabled(Bad::ForeignRegistry)) {
    // Another layer of the same shape and the other half order (the case of the registry-ownership defect).
    SyntheticLayer other = make_synthetic_layer(shape_, E_loc_, o_.seed * 7 + 3, WeightFormat::NVFP4, with_bias,
                                                order_ == GateUpOrder::GateFirst ? GateUpOrder::UpFirst : GateUpOrder::GateFirst);
    foreign_w_ = prepare_weights(other.desc(), backend_, 0);
    foreign_reg_ = std::make_unique<AdapterRegistry>(foreign_w_, o_.slots);
  }
}

MoeArgs Soak::args_for(Spec& s, const AdapterRegistry* reg) const {
  MoeArgs a;
  const int64_t T = s.T;
  a.x = s.dx.view(DType::BF16, {T, H_});
  a.routing.method = shape_.routing;
  a.routing.top_k = k_;
  a.routing.n_group = shape_.n_group;
  a.routing.topk_group = shape_.topk_group;
  a.routing.routed_scaling_factor = shape_.routed_scaling_factor;
  a.routing.logits = s.dlogits.view(DType::F32, {T, E_total_});
  if (uses_bias_) a.routing.bias = bias_.view(DType::F32, {E_total_});
  a.num_experts_total = E_total_;
  a.local_expert_offset = offset_;
  a.activation.type = shape_.activation;
  if (alpha_.get()) a.activation.alpha = alpha_.view(DType::F32, {E_loc_});
  if (beta_.get()) a.activation.beta = beta_.view(DType::F32, {E_loc_});
  if (clamp_.get()) a.activation.clamp_limit = clamp_.view(DType::F32, {E_loc_});
  a.mode = o_.a4 ? ActMode::A4 : ActMode::A16;
  a.fc1_input_scale = s.fc1;
  a.fc2_input_scale = 6.f / 2688.f;
  a.adapters = reg;
  a.adapter_ids = s.daids.view(DType::I32, {T});
  a.y = y_.view(DType::BF16, {T, H_});
  a.stream = stream_;
  a.num_threads = threads_;
  if (cuda()) a.workspace = ws_.view(DType::U8, {static_cast<int64_t>(s.ws)});
  return a;
}

void Soak::setup_specs() {
  std::mt19937_64 rng(o_.seed * 31 + 5);
  std::uniform_real_distribution<double> u01(0.0, 1.0);
  size_t ws_max = 0;
  for (int i = 0; i < num_specs_; ++i) {
    Spec s;
    // The extremes are always in the pool: the largest batch (it sizes every buffer) and a single token.
    if (i == 0) s.T = max_T_;
    else if (i == 1) s.T = 1;
    else if (u01(rng) < o_.small_fraction || max_T_ <= small_T_) s.T = 1 + static_cast<int64_t>(rng() % small_T_);
    else s.T = std::clamp<int64_t>(static_cast<int64_t>(std::exp(std::log(double(small_T_ + 1)) +
                                                                 u01(rng) * std::log(double(max_T_) / (small_T_ + 1)))),
                                   small_T_ + 1, max_T_);  // log-uniform tail
    const int64_t T = s.T;
    s.x = random_bf16(T * H_, rng());
    s.logits = random_f32(T * E_total_, rng());
    // Adapter ids: all base, all one adapter, or (most specs) a mix of base and any stable adapter.
    s.aids.resize(T);
    const int pattern = i % 5;
    const int32_t one = static_cast<int32_t>(rng() % o_.stable);
    for (int64_t t = 0; t < T; ++t) {
      if (pattern == 0) s.aids[t] = -1;
      else if (pattern == 1) s.aids[t] = one;
      else s.aids[t] = u01(rng) < 0.3 ? -1 : static_cast<int32_t>(rng() % o_.stable);
    }
    float amax = 0.f;
    for (uint16_t b : s.x) amax = std::max(amax, std::fabs(bf16_bits_to_f32(b)));
    s.fc1 = amax / 2688.f;
    // Precomputed routing: the same experts and weights, from the host router.
    s.topk_ids.resize(T * k_);
    s.topk_w.resize(T * k_);
    RoutingArgs r;
    r.method = shape_.routing;
    r.top_k = k_;
    r.logits = make_view(s.logits.data(), DType::F32, {T, E_total_});
    if (uses_bias_) r.bias = make_view(router_bias_.data(), DType::F32, {E_total_});
    r.n_group = shape_.n_group;
    r.topk_group = shape_.topk_group;
    r.routed_scaling_factor = shape_.routed_scaling_factor;
    route(r, E_total_, make_view(s.topk_ids.data(), DType::I32, {T, k_}), make_view(s.topk_w.data(), DType::F32, {T, k_}));
    s.dx = DeviceBuffer::from(s.x, backend_);
    s.dlogits = DeviceBuffer::from(s.logits, backend_);
    s.daids = DeviceBuffer::from(s.aids, backend_);
    if (cuda()) {
      s.ws = ws_for(T, 0);
      s.ws_chunked = ws_for(T, chunk_budget_);
      ws_max = std::max({ws_max, s.ws, s.ws_chunked});
    }
    specs_.push_back(std::move(s));
  }
  y_ = DeviceBuffer(static_cast<size_t>(max_T_ * H_ * 2), backend_);
  staging_ = std::make_unique<Staging>(backend_, static_cast<size_t>(max_T_ * H_ * 2));
  if (cuda()) ws_ = DeviceBuffer(ws_max, backend_);
  bad_aids_ = DeviceBuffer(static_cast<size_t>(max_T_ * 4), backend_);
  bad_ids_ = DeviceBuffer(static_cast<size_t>(max_T_ * k_ * 4), backend_);
  bad_w_ = DeviceBuffer(static_cast<size_t>(max_T_ * k_ * 4), backend_);
  base_aids_ = DeviceBuffer::from(std::vector<int32_t>(max_T_, -1), backend_);
  host_ws_ = DeviceBuffer(256, Backend::CPU);
}

MemReading Soak::read_memory() const {
  MemReading m;
  m.dev = device_used_bytes(backend_);
  m.rss = host_rss_bytes();
  return m;
}

void Soak::good_call(Spec& s, int variant) {
  MoeArgs a = args_for(s, reg_.get());
  if (cuda()) {
    if (variant == 1) {
      a.workspace = TensorView{};
      ++ws_none_;
    } else if (variant == 2) {
      a.workspace_budget = chunk_budget_;
      a.workspace = ws_.view(DType::U8, {static_cast<int64_t>(s.ws_chunked)});
      ++ws_chunked_;
    } else {
      ++ws_given_;
    }
  }
  const size_t bytes = static_cast<size_t>(s.T * H_ * 2);
  ++good_;
  const bool check_after_fault = after_fault_;
  after_fault_ = false;
  try {
    y_.fill(kSentinel, bytes, stream_);
    try {
      moe_run(w_, a);
    } catch (const Error& e) {
      ++good_errors_;
      note("good call (T=" + std::to_string(s.T) + ") threw " + to_string(e.code()) + ": " + e.what());
      return;
    }
    const uint8_t* got = read_back(y_, bytes, stream_, staging_->get());
    bytes_compared_ += static_cast<int64_t>(bytes);
    if (std::memcmp(got, s.ref.data(), bytes) != 0) {
      ++mismatches_;
      size_t i = 0;
      while (got[i] == s.ref[i]) ++i;
      note("good call (T=" + std::to_string(s.T) + ", variant " + std::to_string(variant) +
           ") differs from its reference first at token " + std::to_string(i / 2 / H_) + ", element " +
           std::to_string(i / 2 % H_));
    } else if (check_after_fault) {
      ++post_fault_exact_;
    }
    if (cuda()) {
      try {
        check_device_errors(0);
      } catch (const Error& e) {
        ++spurious_faults_;
        note(std::string("check_device_errors after a good call: ") + e.what());
      }
    }
  } catch (const std::exception& e) {
    // A failing CUDA call of the harness itself: the context may be lost, stop here.
    ++good_errors_;
    fatal_ = true;
    note(std::string("harness failure in a good call: ") + e.what());
  }
}

void Soak::bad_call(Bad kind, Spec& s0) {
  // Kinds that need two tokens take the largest spec when the drawn one has one.
  Spec& s = s0.T >= 2 ? s0 : specs_[0];
  const int64_t T = s.T;
  MoeArgs a = args_for(s, reg_.get());
  ErrorCode code = ErrorCode::InvalidArgument;
  std::string arg;
  bool on_device = false;  // CUDA: a value only on the GPU, reported by check_device_errors
  int64_t bad_token = -1;
  auto set_bad_adapter_id = [&](int32_t id) {
    std::vector<int32_t> ids = s.aids;
    bad_token = static_cast<int64_t>(rng_() % T);
    ids[bad_token] = id;
    bad_aids_.upload(ids.data(), ids.size() * 4, stream_);
    a.adapter_ids = bad_aids_.view(DType::I32, {T});
    arg = "adapter_ids";
    if (cuda()) {
      on_device = true;
      code = ErrorCode::DeviceFault;
    }
  };
  auto set_topk = [&](bool corrupt) {
    std::vector<int32_t> ids = s.topk_ids;
    if (corrupt) ids[rng_() % ids.size()] = static_cast<int32_t>(E_total_);
    bad_ids_.upload(ids.data(), ids.size() * 4, stream_);
    bad_w_.upload(s.topk_w.data(), s.topk_w.size() * 4, stream_);
    a.routing.topk_ids = bad_ids_.view(DType::I32, {T, k_});
    a.routing.topk_weights = bad_w_.view(DType::F32, {T, k_});
    a.workspace = TensorView{};  // precomputed routing has its own workspace layout
  };
  switch (kind) {
    case Bad::XShape: a.x = s.dx.view(DType::BF16, {T, H_ - 16}); arg = "x"; break;
    case Bad::XDtype: a.x.dtype = DType::F16; arg = "x"; break;
    case Bad::XStrides:  // the transposed strides of the same memory
      a.x.stride[0] = 1;
      a.x.stride[1] = T;
      arg = "x";
      break;
    case Bad::XDevice:
      if (cuda()) a.x = make_view(s.x.data(), DType::BF16, {T, H_});  // host memory given to a GPU call
      else a.x.device = Backend::CUDA;                                // never dereferenced: refused first
      arg = "x";
      break;
    case Bad::YShape: a.y = y_.view(DType::BF16, {T, H_ - 16}); arg = "y"; break;
    case Bad::YDtype: a.y.dtype = DType::F16; arg = "y"; break;
    case Bad::LogitsShape: a.routing.logits = s.dlogits.view(DType::F32, {T, E_total_ - 1}); arg = "routing.logits"; break;
    case Bad::TopKAboveE: a.routing.top_k = E_total_ + 1; arg = "routing.top_k"; break;
    case Bad::TopKZero: a.routing.top_k = 0; arg = "routing.top_k"; break;
    case Bad::IdsDtype: a.adapter_ids.dtype = DType::F32; arg = "adapter_ids"; break;
    case Bad::IdsShape: a.adapter_ids = s.daids.view(DType::I32, {T, 1}); arg = "adapter_ids"; break;
    case Bad::IdsWithoutRegistry: a.adapters = nullptr; arg = "adapter_ids"; break;
    case Bad::AdapterIdRange: set_bad_adapter_id(static_cast<int32_t>(o_.slots)); break;
    case Bad::AdapterIdNegative: set_bad_adapter_id(-2); break;
    case Bad::AdapterSlotEmpty:
      set_bad_adapter_id(static_cast<int32_t>(empty_slot_));
      if (!cuda()) code = ErrorCode::NotFound;
      break;
    case Bad::TopkIdRange:
      a.routing.logits = TensorView{};
      a.routing.bias = TensorView{};
      set_topk(true);
      arg = "routing.topk_ids";
      if (cuda()) {
        on_device = true;
        code = ErrorCode::DeviceFault;
      }
      break;
    case Bad::LogitsAndTopk: set_topk(false); arg = "routing.logits"; break;
    case Bad::A4Scale:
      a.mode = ActMode::A4;
      a.fc1_input_scale = 0.f;
      a.per_token_x_scale = false;
      arg = "fc1_input_scale";
      break;
    case Bad::GemmTile: a.gemm_tile = static_cast<GemmTile>(1 << 20); arg = "gemm_tile"; break;
    case Bad::NumThreads: a.num_threads = -1; arg = "num_threads"; break;
    case Bad::Workspace:
      // CPU: no backend but CUDA takes one; CUDA: far smaller than workspace_size.
      a.workspace = cuda() ? ws_.view(DType::U8, {16}) : host_ws_.view(DType::U8, {256});
      arg = "workspace";
      break;
    case Bad::ExpertWindow: a.local_expert_offset = E_total_ - E_loc_ + 1; arg = "local_expert_offset"; break;
    case Bad::ActivationType: a.activation.type = ActivationType::Relu; arg = "activation.type"; break;
    case Bad::AlphaShape:
      a.activation.alpha = (alpha_.get() ? alpha_ : y_).view(DType::F32, {E_loc_ - 1});
      arg = "activation.alpha";
      break;
    case Bad::ForeignRegistry:
      a.adapters = foreign_reg_.get();
      a.adapter_ids = base_aids_.view(DType::I32, {T});
      arg = "adapters";
      break;
    case Bad::Count: break;
  }

  BadTally& tally = tally_[static_cast<int>(kind)];
  ++tally.tried;
  ++bad_;
  const size_t bytes = static_cast<size_t>(T * H_ * 2);
  const std::string what = std::string("bad call ") + kBadNames[static_cast<int>(kind)] + " (T=" + std::to_string(T) + ")";
  std::string problem;
  auto add = [&](const std::string& p) {
    if (!p.empty()) problem += (problem.empty() ? "" : "; ") + p;
  };
  // "" when fn throws fp4moe::Error with the expected code and argument, else what happened.
  auto expect_error = [&](const char* who, auto&& fn) -> std::string {
    try {
      fn();
      return std::string(who) + " did not throw";
    } catch (const Error& e) {
      if (e.code() != code || e.argument() != arg)
        return std::string(who) + " threw " + to_string(e.code()) + " naming '" + e.argument() + "' (expected " +
               to_string(code) + " naming '" + arg + "'): " + e.what();
    } catch (const std::exception& e) {
      return std::string(who) + " threw an exception that is not an fp4moe::Error: " + e.what();
    }
    return "";
  };
  try {
    y_.fill(kSentinel, bytes, stream_);
    if (!on_device) {
      add(expect_error("moe_run", [&] { moe_run(w_, a); }));
      const uint8_t* y = read_back(y_, bytes, stream_, staging_->get());
      bool untouched = true;
      for (size_t i = 0; i < bytes && untouched; ++i) untouched = y[i] == kSentinel;
      if (!untouched) {
        ++bad_touched_;
        add("y was written");
      }
      if (cuda()) {
        try {
          check_device_errors(0);  // a call refused on the host sets no device flag
        } catch (const Error& e) {
          add(std::string("check_device_errors reported: ") + e.what());
        }
      }
    } else {
      // The host cannot see the value: the call runs, drops what the bad value names, and flags the device.
      bool ran = true;
      try {
        moe_run(w_, a);
      } catch (const std::exception& e) {
        ran = false;
        add(std::string("moe_run threw (the value lives on the GPU): ") + e.what());
      }
      if (ran && bad_token >= 0) {
        // Every other token's output is defined and, by batch invariance, its reference's.
        const uint8_t* y = read_back(y_, bytes, stream_, staging_->get());
        const size_t row = static_cast<size_t>(H_ * 2);
        int64_t rows_off = 0;
        for (int64_t t = 0; t < T; ++t)
          if (t != bad_token) {
            rows_off += std::memcmp(y + t * row, s.ref.data() + t * row, row) != 0;
            bytes_compared_ += static_cast<int64_t>(row);
          }
        if (rows_off) {
          ++mismatches_;
          add(std::to_string(rows_off) + " other tokens differ from their reference");
        }
      }
      const std::string reported = expect_error("check_device_errors", [&] { check_device_errors(0); });
      if (reported.empty()) ++device_faults_;
      add(reported);
      ++tally.on_device;
      force_good_ = after_fault_ = true;  // the next call is good and must still be bit-exact
    }
  } catch (const std::exception& e) {
    fatal_ = true;  // a failing CUDA call of the harness itself: the context may be lost
    add(std::string("harness failure: ") + e.what());
  }
  if (problem.empty()) {
    ++bad_ok_;
    ++tally.ok;
  } else {
    ++bad_wrong_;
    note(what + ": " + problem);
  }
}

bool Soak::write_json(double secs, double setup_secs, bool pass) const {
  FILE* f = std::fopen(o_.json.c_str(), "w");
  if (!f) return false;
  const BuildInfo bi = build_info();
  auto q = [](const std::string& s) { return json::quote(s); };
  std::fprintf(f, "{\n  \"tool\": \"fp4moe_soak\",\n  \"version\": %s,\n  \"source_hash\": %s,\n", q(bi.version).c_str(),
               q(bi.source_hash).c_str());
  std::fprintf(f, "  \"backend\": %s,\n  \"shape\": {\"name\": %s, \"H\": %lld, \"I\": %lld, \"E_loc\": %lld, \"E_total\": %lld, "
               "\"k\": %lld, \"mode\": %s},\n",
               q(o_.backend).c_str(), q(shape_name_).c_str(), (long long)H_, (long long)I_, (long long)E_loc_,
               (long long)E_total_, (long long)k_, q(o_.a4 ? "a4" : "a16").c_str());
  std::fprintf(f, "  \"slots\": %d, \"stable_adapters\": %d, \"churn_slots\": %d, \"specs\": %d, \"max_tokens\": %lld,\n",
               o_.slots, o_.stable, churn_n_, num_specs_, (long long)max_T_);
  std::fprintf(f, "  \"calls\": %lld,\n  \"good\": %lld,\n  \"bad\": %lld,\n  \"mismatches\": %lld,\n  \"errors\": %lld,\n",
               (long long)calls_, (long long)good_, (long long)bad_, (long long)mismatches_, (long long)good_errors_);
  std::fprintf(f, "  \"spurious_device_errors\": %lld,\n  \"bad_erred_as_expected\": %lld,\n  \"bad_wrong\": %lld,\n"
               "  \"bad_y_touched\": %lld,\n  \"device_faults_reported\": %lld,\n  \"exact_after_device_fault\": %lld,\n",
               (long long)spurious_faults_, (long long)bad_ok_, (long long)bad_wrong_, (long long)bad_touched_,
               (long long)device_faults_, (long long)post_fault_exact_);
  std::fprintf(f, "  \"workspace\": {\"given\": %lld, \"none\": %lld, \"chunked\": %lld, \"chunk_budget\": %lld},\n",
               (long long)ws_given_, (long long)ws_none_, (long long)ws_chunked_, (long long)chunk_budget_);
  std::fprintf(f, "  \"loads\": %lld,\n  \"unloads\": %lld,\n  \"stable_reloads\": %lld,\n  \"empty_unloads_refused\": %lld,\n"
               "  \"churn_errors\": %lld,\n",
               (long long)loads_, (long long)unloads_, (long long)reloads_, (long long)empty_unloads_, (long long)churn_errors_);
  std::fprintf(f, "  \"bytes_compared\": %lld,\n  \"seconds\": %.3f,\n  \"setup_seconds\": %.3f,\n  \"calls_per_second\": %.1f,\n",
               (long long)bytes_compared_, secs, setup_secs, secs > 0 ? calls_ / secs : 0.0);
  std::fprintf(f, "  \"warmup_calls\": %lld,\n  \"memory_measured\": %s,\n", (long long)warmup_calls_, measured_ ? "true" : "false");
  std::fprintf(f, "  \"rss_before\": %lld,\n  \"rss_after\": %lld,\n  \"rss_bound\": %lld,\n", (long long)before_.rss,
               (long long)after_.rss, (long long)(o_.rss_bound_mib * kMiB));
  std::fprintf(f, "  \"device_used_before\": %lld,\n  \"device_used_after\": %lld,\n  \"device_bound\": %lld,\n",
               (long long)before_.dev, (long long)after_.dev, (long long)(o_.dev_bound_mib * kMiB));
  std::fprintf(f, "  \"bad_kinds\": {");
  bool first = true;
  for (int i = 0; i < kNumBad; ++i) {
    if (!bad_enabled(static_cast<Bad>(i))) continue;
    std::fprintf(f, "%s\n    %s: {\"tried\": %lld, \"ok\": %lld, \"on_device\": %lld}", first ? "" : ",", q(kBadNames[i]).c_str(),
                 (long long)tally_[i].tried, (long long)tally_[i].ok, (long long)tally_[i].on_device);
    first = false;
  }
  std::fprintf(f, "\n  },\n  \"pass\": %s\n}\n", pass ? "true" : "false");
  return std::fclose(f) == 0;
}

int Soak::run() {
  const auto t_setup = Clock::now();
  for (const std::string& k : o_.skip_bad)
    if (std::find(std::begin(kBadNames), std::end(kBadNames), k) == std::end(kBadNames))
      throw std::runtime_error("--skip-bad: unknown kind '" + k + "' (see --help)");
  setup_problem();
#ifdef FP4MOE_WITH_CUDA
  struct StreamHolder {
    cudaStream_t s = nullptr;
    ~StreamHolder() {
      if (s) (void)cudaStreamDestroy(s);
    }
  } stream_holder;
  if (cuda()) {
    cuda_ok(cudaSetDevice(0), "cudaSetDevice");
    cuda_ok(cudaStreamCreateWithFlags(&stream_holder.s, cudaStreamNonBlocking), "cudaStreamCreateWithFlags");
    stream_ = stream_holder.s;
  }
#endif
  rng_.seed(o_.seed * 131 + 7);
  std::printf("fp4moe_soak: backend %s, shape %s: H=%lld I=%lld, %lld local experts of %lld (window at %lld), k=%lld, %s "
              "routing, %s, %s, NVFP4 %s\n",
              o_.backend.c_str(), shape_name_.c_str(), (long long)H_, (long long)I_, (long long)E_loc_, (long long)E_total_,
              (long long)offset_, (long long)k_, to_string(shape_.routing), to_string(shape_.activation),
              o_.a4 ? "A4" : "A16", order_ == GateUpOrder::UpFirst ? "up-first" : "gate-first");
  std::fflush(stdout);
  setup_layer();
  if (cuda()) chunk_budget_ = std::max<int64_t>(1, static_cast<int64_t>(ws_for(max_T_, 0) / 8));  // ~8 chunks at max T
  setup_specs();

  // References: a fresh registry holding only the stable adapters, in the same slots, with the same content.
  {
    const auto t0 = Clock::now();
    AdapterRegistry fresh(w_, o_.slots);
    for (int i = 0; i < o_.stable; ++i) fresh.load(i, stable_[i].desc());
    for (Spec& s : specs_) {
      MoeArgs a = args_for(s, &fresh);
      const size_t bytes = static_cast<size_t>(s.T * H_ * 2);
      y_.fill(kSentinel, bytes, stream_);
      moe_run(w_, a);
      const uint8_t* y = read_back(y_, bytes, stream_, staging_->get());
      s.ref.assign(y, y + bytes);
    }
    if (cuda()) check_device_errors(0);
    std::printf("references: %d batch specs (T 1..%lld, %.0f %% drawn in 1..%lld) on a fresh registry in %.1f s\n",
                num_specs_, (long long)max_T_, o_.small_fraction * 100, (long long)small_T_, seconds_since(t0));
  }
  // The soak registry: the same stable adapters, then a few churn slots filled before the churn starts.
  reg_ = std::make_unique<AdapterRegistry>(w_, o_.slots);
  for (int i = 0; i < o_.stable; ++i) reg_->load(i, stable_[i].desc());
  std::printf("registry: %d slots: %d stable adapters in 0..%d (ranks 4..64; %s, %s, %s), %d churn slots %d..%d, slot %d "
              "always empty\n",
              o_.slots, o_.stable, o_.stable - 1, to_string(kLayouts[0]), to_string(kLayouts[1]), to_string(kLayouts[2]),
              churn_n_, churn_first_, empty_slot_ - 1, empty_slot_);
  int enabled = 0;
  for (int i = 0; i < kNumBad; ++i) enabled += bad_enabled(static_cast<Bad>(i));
  std::printf("soak: up to %lld calls or %.0f s; one bad call in %d (%d kinds); %s\n", (long long)o_.calls, o_.seconds,
              o_.bad_every, enabled,
              cuda() ? "CUDA stream, workspace given / none / chunked" : "CPU reference threads");
  std::fflush(stdout);
  const double setup_secs = seconds_since(t_setup);

  Churn churn(*reg_, stable_, pool_, churn_first_, churn_n_, o_.seed * 17 + 3, churn_sleep_ms_);
  churn.start();

  // Warm-up: every spec once in every workspace variant, then random calls up to the warm-up count.
  std::vector<std::pair<int, int>> first_pass;
  for (int v = 0; v < (cuda() ? 3 : 1); ++v)
    for (int i = 0; i < num_specs_; ++i) first_pass.push_back({i, v});
  // Warm-up ends after the first pass and --warmup calls; by default after max(200, 5 % of --calls) calls (at most
  // half of them) or 5 % of --seconds, whichever comes first, so that a run bounded by time is measured too.
  const int64_t first_pass_calls = static_cast<int64_t>(first_pass.size());
  const int64_t warmup_target = std::max<int64_t>(
      first_pass_calls, o_.warmup >= 0 ? o_.warmup : std::min<int64_t>(std::max<int64_t>(200, o_.calls / 20), o_.calls / 2));
  const double warmup_seconds = o_.warmup >= 0 ? 1e300 : o_.seconds / 20;
  std::vector<Bad> kinds;
  for (int i = 0; i < kNumBad; ++i)
    if (bad_enabled(static_cast<Bad>(i))) kinds.push_back(static_cast<Bad>(i));
  size_t next_kind = 0;
  std::uniform_real_distribution<double> u01(0.0, 1.0);
  const auto t0 = Clock::now();
  auto last_progress = t0;
  for (; calls_ < o_.calls && !fatal_; ++calls_) {
    if (seconds_since(t0) >= o_.seconds) break;
    if (!measured_ && calls_ >= first_pass_calls && (calls_ >= warmup_target || seconds_since(t0) >= warmup_seconds)) {
      warmup_calls_ = calls_;
      churn.pause();
      before_ = read_memory();
      measured_ = true;
      churn.resume();
    }
    if (o_.progress_s > 0 && std::chrono::duration<double>(Clock::now() - last_progress).count() >= o_.progress_s) {
      last_progress = Clock::now();
      const MemReading m = read_memory();  // with the churn running: a trend, not the verdict
      std::printf("  %.0f s: %lld calls, %lld mismatches, %lld errors, %lld bad calls wrong, loads %lld, unloads %lld, "
                  "RSS %.0f MiB%s\n",
                  seconds_since(t0), (long long)calls_, (long long)mismatches_, (long long)good_errors_, (long long)bad_wrong_,
                  (long long)churn.loads.load(), (long long)churn.unloads.load(), m.rss / kMiB,
                  cuda() ? (", device " + std::to_string(static_cast<long long>(m.dev / kMiB)) + " MiB").c_str() : "");
      std::fflush(stdout);
    }
    if (static_cast<size_t>(calls_) < first_pass.size()) {
      good_call(specs_[first_pass[calls_].first], first_pass[calls_].second);
      continue;
    }
    Spec& s = specs_[rng_() % specs_.size()];
    if (!force_good_ && o_.bad_every > 0 && !kinds.empty() && rng_() % o_.bad_every == 0) {
      bad_call(kinds[next_kind++ % kinds.size()], s);
      continue;
    }
    force_good_ = false;
    int variant = 0;
    if (cuda()) {
      const double r = u01(rng_);
      variant = r < o_.no_ws_fraction ? 1 : (r < o_.no_ws_fraction + o_.chunked_fraction ? 2 : 0);
    }
    good_call(s, variant);
  }
  const double secs = seconds_since(t0);
  churn.stop();
  loads_ = churn.loads;
  unloads_ = churn.unloads;
  reloads_ = churn.stable_reloads;
  empty_unloads_ = churn.empty_unloads_refused;
  churn_errors_ = churn.errors;
  if (churn_errors_) note("churn thread: " + std::to_string(churn_errors_) + " errors, first: " + churn.first_error());
  after_ = read_memory();

  const double rss_growth = measured_ ? (after_.rss - before_.rss) / kMiB : 0;
  const double dev_growth = measured_ ? (after_.dev - before_.dev) / kMiB : 0;
  const bool mem_ok = measured_ && before_.rss >= 0 && after_.rss >= 0 && rss_growth <= o_.rss_bound_mib &&
                      dev_growth <= o_.dev_bound_mib;
  const bool pass = !fatal_ && good_ > 0 && mismatches_ == 0 && good_errors_ == 0 && spurious_faults_ == 0 &&
                    bad_wrong_ == 0 && bad_touched_ == 0 && churn_errors_ == 0 && mem_ok;

  std::printf("== soak %s\n", pass ? "PASS" : "FAIL");
  std::printf("calls        %lld in %.1f s (%.1f calls/s; setup %.1f s): %lld good, %lld bad\n", (long long)calls_, secs,
              secs > 0 ? calls_ / secs : 0.0, setup_secs, (long long)good_, (long long)bad_);
  std::printf("good calls   %lld mismatches, %lld errors, %lld spurious device errors; %.3e bytes compared bit for bit\n",
              (long long)mismatches_, (long long)good_errors_, (long long)spurious_faults_, double(bytes_compared_));
  if (cuda())
    std::printf("workspace    given %lld, none %lld, chunked %lld (budget %lld bytes)\n", (long long)ws_given_,
                (long long)ws_none_, (long long)ws_chunked_, (long long)chunk_budget_);
  std::printf("bad calls    %lld erred as expected, %lld wrong, %lld left y written; %lld device faults reported, "
              "%lld next good calls exact\n",
              (long long)bad_ok_, (long long)bad_wrong_, (long long)bad_touched_, (long long)device_faults_,
              (long long)post_fault_exact_);
  std::string line;
  int on_line = 0;
  for (Bad k : kinds) {
    const BadTally& t = tally_[static_cast<int>(k)];
    char buf[96];
    std::snprintf(buf, sizeof buf, "%s %lld/%lld%s", kBadNames[static_cast<int>(k)], (long long)t.ok, (long long)t.tried,
                  t.on_device ? " (gpu)" : "");
    line += std::string(on_line ? ", " : "") + buf;
    if (++on_line == 4) {
      std::printf("  %s\n", line.c_str());
      line.clear();
      on_line = 0;
    }
  }
  if (!line.empty()) std::printf("  %s\n", line.c_str());
  std::printf("churn        %lld loads (%lld stable re-loads), %lld unloads, %lld unloads of empty slots refused, %lld errors\n",
              (long long)loads_, (long long)reloads_, (long long)unloads_, (long long)empty_unloads_, (long long)churn_errors_);
  if (measured_) {
    std::printf("host RSS     %.1f MiB after %lld warm-up calls, %.1f MiB at the end: %+.2f MiB (bound %.0f MiB)\n",
                before_.rss / kMiB, (long long)warmup_calls_, after_.rss / kMiB, rss_growth, o_.rss_bound_mib);
    if (cuda())
      std::printf("device used  %.1f MiB after warm-up, %.1f MiB at the end: %+.2f MiB (bound %.0f MiB)\n", before_.dev / kMiB,
                  after_.dev / kMiB, dev_growth, o_.dev_bound_mib);
  } else {
    std::printf("memory       not measured: the run ended within the warm-up (%lld calls)\n", (long long)calls_);
  }
  std::fflush(stdout);
  if (!o_.json.empty() && !write_json(secs, setup_secs, pass)) {
    std::fprintf(stderr, "fp4moe_soak: cannot write %s\n", o_.json.c_str());
    return 1;
  }
  return pass ? 0 : 1;
}

}  // namespace
}  // namespace fp4moe::soak

int main(int argc, char** argv) {
  using namespace fp4moe;
  soak::Options opt;
  const std::string err = soak::parse_options(argc, argv, opt);
  if (err == "help") {
    soak::usage(stdout);
    return 0;
  }
  if (!err.empty()) {
    std::fprintf(stderr, "fp4moe_soak: %s\n", err.c_str());
    soak::usage(stderr);
    return 2;
  }
  if (opt.backend == "cuda" && cuda_device_count() == 0) {
    std::fprintf(stderr, "fp4moe_soak: --backend cuda, but %s\n",
                 build_info().with_cuda ? "no CUDA device is usable" : "this build has no CUDA backend");
    return 2;
  }
  try {
    soak::Soak s(opt);
    return s.run();
  } catch (const std::exception& e) {
    std::fprintf(stderr, "fp4moe_soak: %s\n", e.what());
    return 1;
  }
}
