// The soak driver's parts (tools/soak): options (soak_options.cpp), host and device memory and the adapter churn
// thread (soak_host.cpp), the good and bad calls (soak_calls.cpp), and the soak itself (soak.cpp).
#pragma once
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstdio>
#include <memory>
#include <mutex>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "../common/device_buffer.h"
#include "fp4moe/model_shapes.h"
#include "fp4moe/moe.h"
#include "fp4moe/synthetic.h"

namespace fp4moe::soak {

using Clock = std::chrono::steady_clock;
inline double seconds_since(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }

// Every byte of y before a call: a bad call must leave all of them so; a good call must overwrite them all.
inline constexpr int kSentinel = 0xA5;
inline constexpr double kMiB = 1024.0 * 1024.0;

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

void usage(FILE* f);
// "" on success, "help", or the problem.
std::string parse_options(int argc, char** argv, Options& o);

// ---- memory (soak_host.cpp) --------------------------------------------------------------------------
// Host RSS after returning freed heap pages; -1 when it cannot be read.
int64_t host_rss_bytes();
// Device memory in use (total - free), after the device is idle; 0 on the CPU backend.
int64_t device_used_bytes(Backend b);
// The first n bytes of b as the host sees them once the stream's work is done: b itself on the host, else a copy
// into `staging`.
const uint8_t* read_back(const DeviceBuffer& b, size_t n, void* stream, void* staging);
#ifdef FP4MOE_WITH_CUDA
// Throws std::runtime_error naming `what` when a CUDA call of the harness failed (e: a cudaError_t).
void cuda_ok(int e, const char* what);
#endif

// Page-locked host memory for the copy-back of y on the CUDA backend (plain memory otherwise).
class Staging {
 public:
  Staging(Backend b, size_t bytes);
  ~Staging();
  Staging(const Staging&) = delete;
  Staging& operator=(const Staging&) = delete;
  void* get() const { return p_; }

 private:
  bool cuda_ = false;
  void* p_ = nullptr;
};

// ---- the adapters of the registry (the churn thread: soak_host.cpp) ---------------------------------
inline constexpr int64_t kRanks[] = {4, 8, 16, 32, 64};
inline constexpr LoraLayout kLayouts[] = {LoraLayout::PeftFused, LoraLayout::PerExpert, LoraLayout::SharedOuter};

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
  void pause();
  void resume();
  void stop();
  std::string first_error();

  std::atomic<int64_t> loads{0}, unloads{0}, stable_reloads{0}, empty_unloads_refused{0}, errors{0};

 private:
  void note(const std::string& e);
  void clear(std::vector<char>& loaded);
  void loop();

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

// ---- bad calls (soak_calls.cpp) -----------------------------------------------------------------------
enum class Bad : int {
  XShape, XDtype, XStrides, XDevice, YShape, YDtype, LogitsShape, TopKAboveE, TopKZero, IdsDtype, IdsShape,
  IdsWithoutRegistry, AdapterIdRange, AdapterIdNegative, AdapterSlotEmpty, TopkIdRange, LogitsAndTopk, A4Scale,
  GemmTile, NumThreads, Workspace, ExpertWindow, ActivationType, AlphaShape, ForeignRegistry, Count
};
inline constexpr int kNumBad = static_cast<int>(Bad::Count);
inline constexpr const char* kBadNames[kNumBad] = {
    "x_shape", "x_dtype", "x_strides", "x_device", "y_shape", "y_dtype", "logits_shape", "top_k_above_E",
    "top_k_zero", "adapter_ids_dtype", "adapter_ids_shape", "adapter_ids_without_registry", "adapter_id_range",
    "adapter_id_negative", "adapter_slot_empty", "topk_id_range", "logits_and_topk", "a4_scale", "gemm_tile",
    "num_threads", "workspace", "expert_window", "activation_type", "alpha_shape", "foreign_registry"};

struct BadTally {
  int64_t tried = 0, ok = 0, on_device = 0;
};

// ---- the soak (soak.cpp; its calls: soak_calls.cpp) ----------------------------------------------------
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

}  // namespace fp4moe::soak
