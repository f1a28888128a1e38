// fp4moe_soak's calls: a good call (bit for bit against its reference) and each kind of bad call (refused naming
// its argument with y untouched, or, for a value only on the GPU, reported by check_device_errors).
#include <algorithm>
#include <cstring>
#include <exception>
#include <string>
#include <vector>

#include "soak.h"

namespace fp4moe::soak {

void Soak::note(const std::string& msg) {
  if (++notes_ <= 20) std::fprintf(stderr, "soak: %s\n", msg.c_str());
  else if (notes_ == 21) std::fprintf(stderr, "soak: (further problems counted, not printed)\n");
}

bool Soak::bad_enabled(Bad kind) const {
  const std::string name = kBadNames[static_cast<int>(kind)];
  return std::find(o_.skip_bad.begin(), o_.skip_bad.end(), name) == o_.skip_bad.end();
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

}  // namespace fp4moe::soak
