// fp4moe_soak: the operator under load (SPEC §4-§6). One layer and one AdapterRegistry of resident
// adapters of mixed ranks and layouts; a pool of batch specs (T mostly small, a tail up to 4096; base and
// adapter tokens mixed) whose outputs are computed once, at start, on a fresh registry holding the same
// adapters. Then N calls pick specs at random and compare each output bit for bit with its reference,
// while another thread loads and unloads adapters in slots the batches never name and re-loads the
// resident ones with identical content, and bad calls are interleaved (each must throw fp4moe::Error
// naming its argument, with y untouched; values only on the GPU must be reported by
// check_device_errors). Host RSS and device memory must stay flat after warm-up.
// The parts: soak.h.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <exception>
#include <iterator>
#include <memory>
#include <random>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "fp4moe/build_info.h"
#include "io/json_write.h"
#include "runtime/plan.h"
#include "runtime/problem_shape.h"
#include "soak.h"
#ifdef FP4MOE_WITH_CUDA
#include <cuda_runtime.h>
#endif

namespace fp4moe::soak {

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
