// The pipeline of one call on the CUDA backend (src/cuda/backend.h), chunk by chunk:
//   route (or precomputed ids) -> [A4: quantize x] -> permute -> GEMM1 (+epilogue) -> [A4: quantize a]
//   -> GEMM2 -> shared expert (dense GEMM1/GEMM2) -> combine into y.
// The other parts: device.cu (errors, device queries, the error flag), weights_upload.cu, lora_table.cu.
#include "cuda/backend.h"

#include <algorithm>
#include <string>

#include "common/activation.h"
#include "cuda/backend_parts.h"
#include "cuda/device_guard.h"
#include "cuda/kernels.h"
#include "runtime/plan.h"
#include "runtime/problem_shape.h"

namespace fp4moe::cuda_backend {
namespace {

bool aligned(const void* p, size_t a) { return reinterpret_cast<uintptr_t>(p) % a == 0; }

// Workspace: the caller's, or one allocated on the stream for this call (freed on the stream).
class Workspace {
 public:
  Workspace(const MoeArgs& args, size_t bytes, cudaStream_t stream) : stream_(stream) {
    if (bytes == 0) return;
    if (args.workspace.present()) {
      const size_t have = static_cast<size_t>(args.workspace.numel());
      if (have < bytes)
        throw Error(ErrorCode::InvalidArgument, "workspace",
                    "expected at least " + std::to_string(bytes) + " bytes (workspace_size), got " + std::to_string(have));
      if (!aligned(args.workspace.data, kWorkspaceAlign))
        throw Error(ErrorCode::InvalidArgument, "workspace", "must be aligned to " + std::to_string(kWorkspaceAlign) + " bytes");
      base_ = static_cast<uint8_t*>(args.workspace.data);
      return;
    }
    void* p = nullptr;
    const cudaError_t e = cudaMallocAsync(&p, bytes, stream);
    try {
      check_cuda(e, "cudaMallocAsync (workspace)");
    } catch (...) {  // a constructor that throws runs no destructor: free what was allocated here
      if (e == cudaSuccess) (void)cudaFreeAsync(p, stream);
      throw;
    }
    base_ = static_cast<uint8_t*>(p);
    owned_ = true;
  }
  ~Workspace() {
    if (owned_) (void)cudaFreeAsync(base_, stream_);
  }
  template <class T> T* at(const WorkspaceBuffer& b) const {
    return b.bytes ? reinterpret_cast<T*>(base_ + b.offset) : nullptr;
  }

 private:
  uint8_t* base_ = nullptr;
  bool owned_ = false;
  cudaStream_t stream_;
};

// What the GEMM epilogues take from the weights (routed experts or the shared expert); the caller adds the
// per-call parts (outputs, row scales, LoRA, activation parameters).
Epilogue1Params epilogue1_for(const DeviceWeights& d, uint16_t* out, int token_div, const float* row_scale) {
  Epilogue1Params e;
  e.s_even = d.s1_even;
  e.s_odd = d.s1_odd;
  e.bias = d.bias1;
  e.gate_first = d.order == GateUpOrder::GateFirst;
  e.I = static_cast<int>(d.I);
  e.N1 = static_cast<int>(d.N1);
  e.out = out;
  e.token_div = token_div;
  e.row_scale = row_scale;
  return e;
}
Epilogue2Params epilogue2_for(const DeviceWeights& d, float* out, int token_div, float in_scale) {
  Epilogue2Params e;
  e.s2 = d.s2;
  e.in_scale = in_scale;
  e.bias = d.bias2;
  e.out = out;
  e.H = static_cast<int>(d.H);
  e.token_div = token_div;
  return e;
}

GemmProblem dense_problem(const uint16_t* A, int64_t lda, int K, int rows, const DeviceMatrix& B) {
  GemmProblem g;
  g.A = A;
  g.lda = lda;
  g.K = K;
  g.dense_rows = rows;
  g.B = B;
  return g;
}

}  // namespace

void run(const PreparedWeights& w, const MoeArgs& args, const AdapterSnapshot& adapters) {
  const auto* dw = static_cast<const DeviceWeights*>(w.device.get());
  if (!dw) throw Error(ErrorCode::InvalidArgument, "weights", "not prepared for the CUDA backend");
  const DeviceWeights* sw = nullptr;
  if (args.shared_expert) {
    sw = static_cast<const DeviceWeights*>(args.shared_expert->impl().device.get());
    if (!sw) throw Error(ErrorCode::InvalidArgument, "shared_expert", "not prepared for the CUDA backend");
  }
  // Registry LoRA: every loaded adapter must fit this layer (and the call's shared expert); the largest
  // rank sizes the LoRA workspace. An empty registry still runs the LoRA path (ids other than -1 flagged).
  const bool lora = adapters != nullptr;
  int64_t max_rank = 1;
  if (lora) {
    if (!args.adapter_ids.present()) throw Error(ErrorCode::InvalidArgument, "adapter_ids", "required with adapters");
    if (!aligned(args.adapter_ids.data, 4)) throw Error(ErrorCode::InvalidArgument, "adapter_ids", "must be 4-byte aligned");
    for (size_t i = 0; i < adapters->size(); ++i) {
      const PreparedAdapter* a = (*adapters)[i].get();
      if (!a) continue;
      const std::string slot = "slot " + std::to_string(i);
      if (a->E != w.E || a->H != w.H || a->I != w.I || a->N1 != w.n1())
        throw Error(ErrorCode::InvalidArgument, "adapters", slot + " was prepared for another layer shape");
      if (a->rank < 1 || a->rank > kMaxLoraRank || a->r1 > 2 * a->rank || a->r2 > a->rank ||
          (a->has_shared && a->s_r > a->rank))
        throw Error(ErrorCode::InvalidArgument, "adapters", slot + ": rank out of range");
      if (sw && a->has_shared && (a->s_I != sw->I || a->s_N1 != sw->N1))
        throw Error(ErrorCode::InvalidArgument, "adapters", slot + ": its shared-expert LoRA does not match the shared expert");
      max_rank = std::max(max_rank, a->rank);
    }
  }

  const RoutingArgs& ra = args.routing;
  const ProblemShape s = problem_shape(w, args, lora, lora ? max_rank : 0, wgmma_supported_on(w.device_id));
  const MoePlan plan = make_plan(s);
  if (plan.num_chunks == 0) return;
  // lora_shrink1_kernel's grid: a token's items (shrink1_items, as the kernel counts them), the most over the loaded
  // slots, at least one (block 0 publishes the token's slot). Once a call, not once a chunk.
  int shrink1_max_items = 1;
  if (lora) {
    for (const auto& a : *adapters) {
      if (!a) continue;
      const Shrink1Items n = shrink1_items(a->has_gate_up ? static_cast<int>(a->r1) : 0, a->a1_shared,
                                           sw && a->has_shared && a->s_has_gate_up ? static_cast<int>(a->s_r) : 0,
                                           static_cast<int>(args.routing.top_k), plan.lora_shrink1_rows_per_item,
                                           plan.lora_shrink_tiled);
      shrink1_max_items = std::max(shrink1_max_items, n.routed + n.shared);
    }
  }

  if (!aligned(args.x.data, 16))
    throw Error(ErrorCode::Unsupported, "x", "the CUDA backend needs x aligned to 16 bytes");
  const int dev = w.device_id;
  DeviceGuard guard(dev);
  int* err = device_error_flag(dev);
  auto stream = static_cast<cudaStream_t>(args.stream);
  const LoraSlot* lora_table = nullptr;
  if (lora) lora_table = lora_table_for(adapters, dev, stream);
  Workspace ws(args, plan.workspace_bytes, stream);

  const int64_t T = s.T, H = s.H, I = s.I, k = s.k, N1 = plan.n1, E_total = s.E_total;
  const bool a4 = s.mode == ActMode::A4;
  const auto* x = static_cast<const uint16_t*>(args.x.data);
  // y: bf16 (one rounding in the combine) or f32 (the unrounded sum; moe_run_tp / moe_run_ep partials).
  const bool y_f32 = args.y.dtype == DType::F32;
  auto* y = y_f32 ? nullptr : static_cast<uint16_t*>(args.y.data);
  auto* yf = y_f32 ? static_cast<float*>(args.y.data) : nullptr;
  const act::Params defaults = act::resolve_params(s.activation, false, 0.f, false, 0.f, false, 0.f);
  const act::Params shared_params =
      args.shared_params_given
          ? act::resolve_params(s.activation, true, args.shared_alpha, true, args.shared_beta, args.shared_clamp_limit > 0.f,
                                args.shared_clamp_limit)
          : defaults;
  const float fc2_scale = a4 ? args.fc2_input_scale : 1.f;

  int32_t* ws_ids = ws.at<int32_t>(plan.topk_ids);
  float* ws_w = ws.at<float>(plan.topk_weights);
  int32_t* block_counts = ws.at<int32_t>(plan.block_counts);
  int32_t* expert_offsets = ws.at<int32_t>(plan.expert_offsets);
  int32_t* tile_info = ws.at<int32_t>(plan.tile_info);
  int32_t* row_entry = ws.at<int32_t>(plan.row_entry);
  float* split_partials = ws.at<float>(plan.split_partials);
  int32_t* split_counters = ws.at<int32_t>(plan.split_counters);
  auto with_split = [&](GemmProblem g, int split) {
    g.split = split;
    g.partials = split_partials;
    g.counters = split_counters;
    return g;
  };
  uint16_t* x_q = ws.at<uint16_t>(plan.x_q);
  float* x_scale = ws.at<float>(plan.x_scale);
  uint16_t* act_buf = ws.at<uint16_t>(plan.act);
  float* out_buf = ws.at<float>(plan.out);
  uint16_t* shared_act = ws.at<uint16_t>(plan.shared_act);
  float* shared_out = ws.at<float>(plan.shared_out);
  int32_t* lora_slot = ws.at<int32_t>(plan.lora_slot);
  float* lora_t1 = ws.at<float>(plan.lora_t1);
  float* lora_t2 = ws.at<float>(plan.lora_t2);
  float* lora_st1 = ws.at<float>(plan.lora_shared_t1);
  float* lora_st2 = ws.at<float>(plan.lora_shared_t2);
  // The expand parameters of one epilogue (table null without LoRA: every delta is +0).
  auto expand = [&](const float* t, int64_t stride, int which) {
    LoraExpandParams L;
    if (!lora) return L;
    L.table = lora_table;
    L.token_slot = lora_slot;
    L.t = t;
    L.t_stride = static_cast<int>(stride);
    L.which = which;
    return L;
  };

  // A4 without LoRA (whose shrink reads a before the rounding) on a tile that can: GEMM1 writes a's NVFP4 values
  // itself (one launch less; the same bits, gemm/epilogue_a4.cuh).
  const bool a4_fused = a4 && !lora && gemm_a4_fusable(plan.gemm_config, s.activation);
  // A4: GEMM1's bf16 output a [rows, width] -> NVFP4 values in place, with the FC2 input encode scale
  // (row_count: the routed rows actually present, on the device; null: all rows).
  auto quantize_fc2_input = [&](uint16_t* a, int64_t width, int rows, const int32_t* row_count) {
    QuantizeParams qp;
    qp.x = a;
    qp.ldx = width;
    qp.out = a;
    qp.rows = rows;
    qp.K = static_cast<int>(width);
    qp.row_count = row_count;
    qp.gs = 1.f / args.fc2_input_scale;
    launch_quantize(qp, stream);
  };

  for (int64_t c = 0; c < plan.num_chunks; ++c) {
    const int64_t t0 = c * plan.chunk_tokens;
    const int tc = static_cast<int>(std::min<int64_t>(plan.chunk_tokens, T - t0));
    const int rows = static_cast<int>(tc * k);

    // 1. Routing.
    const int32_t* ids;
    const float* wts;
    if (s.routing_from_logits) {
      RoutingParams rp;
      const size_t lsz = ra.logits.dtype == DType::BF16 ? 2 : 4;
      rp.logits = static_cast<const uint8_t*>(ra.logits.data) + t0 * E_total * lsz;
      rp.logits_bf16 = ra.logits.dtype == DType::BF16;
      rp.bias = ra.bias.present() ? static_cast<const float*>(ra.bias.data) : nullptr;
      rp.method = static_cast<int>(ra.method);
      rp.T = tc;
      rp.E = static_cast<int>(E_total);
      rp.k = static_cast<int>(k);
      rp.n_group = static_cast<int>(ra.method == RoutingMethod::DeepSeekV3 ? ra.n_group : 1);
      rp.topk_group = static_cast<int>(ra.topk_group);
      rp.routed_scaling_factor = ra.routed_scaling_factor;
      rp.ids = ws_ids;
      rp.weights = ws_w;
      rp.error_flag = err;
      launch_routing(rp, plan.routing_warps_per_block, plan.routing_smem, stream);
      ids = ws_ids;
      wts = ws_w;
    } else {
      ids = static_cast<const int32_t*>(ra.topk_ids.data) + t0 * k;
      wts = static_cast<const float*>(ra.topk_weights.data) + t0 * k;
    }

    // 2. A4: x -> NVFP4 values (e2m1 * e4m3) and the per-token FC1 input scale.
    const uint16_t* a_in = x + t0 * H;
    if (a4) {
      QuantizeParams qp;
      qp.x = x + t0 * H;
      qp.ldx = H;
      qp.out = x_q;
      qp.out_scale = x_scale;
      qp.rows = tc;
      qp.K = static_cast<int>(H);
      qp.per_row_scale = args.per_token_x_scale;
      qp.gs = args.per_token_x_scale ? 1.f : 1.f / args.fc1_input_scale;
      qp.scale2 = args.fc1_input_scale;
      launch_quantize(qp, stream);
      a_in = x_q;
    }

    // 2b. LoRA: each token's slot (checked) and the shrink of the bf16 x (also in A4; with plan.lora_shrink_tiled
    // the routed per-expert part runs after the permutation).
    if (lora) {
      LoraShrink1Params lp;
      lp.table = lora_table;
      lp.num_slots = static_cast<int>(adapters->size());
      lp.adapter_ids = static_cast<const int32_t*>(args.adapter_ids.data) + t0;
      lp.ids = ids;
      lp.x = x + t0 * H;
      lp.T = tc;
      lp.k = static_cast<int>(k);
      lp.H = static_cast<int>(H);
      lp.E_loc = static_cast<int>(w.E);
      lp.local_offset = static_cast<int>(args.local_expert_offset);
      lp.shared_expert = sw != nullptr;
      lp.routed_in_tiles = plan.lora_shrink_tiled;
      lp.rows_per_item = plan.lora_shrink1_rows_per_item;
      lp.max_items = shrink1_max_items;
      lp.token_slot = lora_slot;
      lp.t1 = lora_t1;
      lp.t1_stride = static_cast<int>(plan.lora_r1_stride);
      lp.st1 = lora_st1;
      lp.st_stride = static_cast<int>(plan.lora_r2_stride);
      lp.error_flag = err;
      launch_lora_shrink1(lp, plan.lora_shrink1_threads, stream);
    }

    // 3. Permutation.
    PermuteParams pp;
    pp.ids = ids;
    pp.rows = rows;
    pp.E_total = static_cast<int>(E_total);
    pp.E_loc = static_cast<int>(w.E);
    pp.local_offset = static_cast<int>(args.local_expert_offset);
    pp.entries_per_block = plan.perm_entries;
    pp.num_blocks = static_cast<int>((rows + plan.perm_entries - 1) / plan.perm_entries);
    pp.bm = plan.gemm.bm;
    pp.max_tiles = static_cast<int>(plan.max_m_tiles);
    pp.block_counts = block_counts;
    pp.expert_offsets = expert_offsets;
    pp.tile_info = tile_info;
    pp.row_entry = row_entry;
    pp.error_flag = err;
    pp.zero_counters = split_counters;
    pp.num_counters = static_cast<int>(plan.split_counters.bytes / 4);
    launch_permute(pp, stream);
    if (lora && rows > w.E) {  // more rows than experts: tiles with several tokens, worth grouping by adapter
      pp.token_slot = lora_slot;
      pp.k = static_cast<int>(k);
      launch_order_by_adapter(pp, stream);
    }
    // A routed LoRA shrink over GEMM1's row tiles (plan.lora_shrink_tiled): in = x (gathered by token) or a.
    auto shrink_tiled = [&](const uint16_t* in, bool gather, int64_t K, int which, float* t, int64_t t_stride) {
      LoraTiledShrinkParams tp;
      tp.table = lora_table;
      tp.token_slot = lora_slot;
      tp.which = which;
      tp.in = in;
      tp.gather = gather;
      tp.K = static_cast<int>(K);
      tp.k = static_cast<int>(k);
      tp.t = t;
      tp.t_stride = static_cast<int>(t_stride);
      tp.tile_info = tile_info;
      tp.expert_offsets = expert_offsets;
      tp.row_entry = row_entry;
      tp.max_tiles = static_cast<int>(plan.max_m_tiles);
      tp.bm = static_cast<int>(plan.gemm.bm);
      launch_lora_shrink_tiled(tp, stream);
    };
    if (lora && plan.lora_shrink_tiled) shrink_tiled(x + t0 * H, true, H, kLoraGateUp, lora_t1, plan.lora_r1_stride);

    // 4. GEMM1 over the routed rows.
    uint16_t* act_out = nullptr;
    if (args.activation_out.present()) {
      act_out = static_cast<uint16_t*>(args.activation_out.data) + t0 * k * I;
      // Slots whose expert is another rank's stay 0; GEMM1 overwrites the local ones.
      check_cuda(cudaMemsetAsync(act_out, 0, static_cast<size_t>(tc) * k * I * 2, stream), "cudaMemsetAsync (activation_out)");
    }
    GemmProblem g1;
    g1.A = a_in;
    g1.lda = H;
    g1.K = static_cast<int>(H);
    g1.row_entry = row_entry;
    g1.gather_k = static_cast<int>(k);
    g1.tile_info = tile_info;
    g1.expert_offsets = expert_offsets;
    g1.max_tiles = static_cast<int>(plan.max_m_tiles);
    g1.m_band = plan.m_band1;
    g1.B = dw->w1;
    Epilogue1Params e1 = epilogue1_for(*dw, act_buf, static_cast<int>(k), a4 ? x_scale : nullptr);
    e1.delta = args.gate_up_lora_delta.present() ? static_cast<const uint16_t*>(args.gate_up_lora_delta.data) + t0 * k * N1
                                                 : nullptr;
    e1.alpha = args.activation.alpha.present() ? static_cast<const float*>(args.activation.alpha.data) : nullptr;
    e1.beta = args.activation.beta.present() ? static_cast<const float*>(args.activation.beta.data) : nullptr;
    e1.limit = args.activation.clamp_limit.present() ? static_cast<const float*>(args.activation.clamp_limit.data) : nullptr;
    e1.defaults = defaults;
    e1.act_out = act_out;
    e1.lora = expand(lora_t1, plan.lora_r1_stride, kLoraGateUp);
    e1.a_quant_gs = a4_fused ? 1.f / args.fc2_input_scale : 0.f;
    g1 = with_split(g1, plan.split1);
    launch_gemm1(plan.gemm_config, w.format, s.activation, g1, e1, static_cast<int>(plan.n1_tiles),
                 static_cast<int>(plan.max_m_tiles), stream);

    // 4b. LoRA: shrink of the bf16 a (before the A4 rounding below), per routed row.
    // The LoRA shrink of a GEMM1 output a [rows, K] for projection `which` (routed: the permuted rows; else dense).
    auto shrink_act = [&](const uint16_t* a, int64_t K, int n_rows, int which, float* t, bool routed) {
      LoraShrink2Params lp;
      lp.table = lora_table;
      lp.token_slot = lora_slot;
      lp.a = a;
      lp.K = static_cast<int>(K);
      lp.rows = n_rows;
      if (routed) {
        lp.row_count = expert_offsets + w.E;
        lp.row_entry = row_entry;
        lp.ids = ids;
        lp.k = static_cast<int>(k);
        lp.local_offset = static_cast<int>(args.local_expert_offset);
      }
      lp.which = which;
      lp.t = t;
      lp.t_stride = static_cast<int>(plan.lora_r2_stride);
      lp.rows_per_item = plan.lora_shrink2_rows_per_item;
      launch_lora_shrink2(lp, plan.lora_shrink2_threads, stream);
    };
    if (lora && plan.lora_shrink_tiled) shrink_tiled(act_buf, false, I, kLoraDown, lora_t2, plan.lora_r2_stride);
    else if (lora) shrink_act(act_buf, I, rows, kLoraDown, lora_t2, true);

    // 5. A4: a -> NVFP4 values with the FC2 input encode scale.
    if (a4 && !a4_fused) quantize_fc2_input(act_buf, I, rows, expert_offsets + w.E);

    // 6. GEMM2: o per (token, slot) entry.
    GemmProblem g2 = with_split(g1, plan.split2);
    g2.A = act_buf;
    g2.lda = I;
    g2.K = static_cast<int>(I);
    g2.gather_k = 0;
    g2.m_band = plan.m_band2;
    g2.B = dw->w2;
    Epilogue2Params e2 = epilogue2_for(*dw, out_buf, static_cast<int>(k), fc2_scale);
    e2.lora = expand(lora_t2, plan.lora_r2_stride, kLoraDown);
    launch_gemm2(plan.gemm_config, w.format, g2, e2, static_cast<int>(plan.n2_tiles), static_cast<int>(plan.max_m_tiles),
                 stream);

    // 7. Shared expert: the same pipeline over all tokens of the chunk, dense rows.
    if (sw) {
      const int64_t Is = sw->I;
      const GemmProblem gs1 = with_split(dense_problem(a_in, H, static_cast<int>(H), tc, sw->w1), plan.shared_split1);
      Epilogue1Params es1 = epilogue1_for(*sw, shared_act, 1, a4 ? x_scale : nullptr);
      es1.defaults = shared_params;
      es1.lora = expand(lora_st1, plan.lora_r2_stride, kLoraSharedGateUp);
      es1.a_quant_gs = e1.a_quant_gs;
      launch_gemm1(plan.gemm_config, sw->format, s.activation, gs1, es1, static_cast<int>(plan.shared_n1_tiles),
                   static_cast<int>(plan.shared_m_tiles), stream);
      if (lora) shrink_act(shared_act, Is, tc, kLoraSharedDown, lora_st2, false);
      if (a4 && !a4_fused) quantize_fc2_input(shared_act, Is, tc, nullptr);
      const GemmProblem gs2 = with_split(dense_problem(shared_act, Is, static_cast<int>(Is), tc, sw->w2), plan.shared_split2);
      Epilogue2Params es2 = epilogue2_for(*sw, shared_out, 1, fc2_scale);
      es2.lora = expand(lora_st2, plan.lora_r2_stride, kLoraSharedDown);
      launch_gemm2(plan.gemm_config, sw->format, gs2, es2, static_cast<int>(plan.n2_tiles),
                   static_cast<int>(plan.shared_m_tiles), stream);
    }

    // 8. Combine in slot order, + shared, one bf16 rounding (none for an f32 y).
    CombineParams cp;
    cp.ids = ids;
    cp.weights = wts;
    cp.out = out_buf;
    cp.shared_out = sw ? shared_out : nullptr;
    cp.y = y_f32 ? nullptr : y + t0 * H;
    cp.y_f32 = y_f32 ? yf + t0 * H : nullptr;
    cp.T = tc;
    cp.k = static_cast<int>(k);
    cp.H = static_cast<int>(H);
    cp.E_loc = static_cast<int>(w.E);
    cp.local_offset = static_cast<int>(args.local_expert_offset);
    cp.blocks_per_token = static_cast<int>(plan.combine_blocks_per_token);
    cp.threads = plan.combine_threads;
    auto on_device = [](const TensorView& v) {
      return v.present() && v.device == Backend::CUDA ? static_cast<const float*>(v.data) : nullptr;
    };
    cp.act_alpha = on_device(args.activation.alpha);
    cp.act_beta = on_device(args.activation.beta);
    cp.act_clamp_limit = on_device(args.activation.clamp_limit);
    cp.act_positive = s.activation == ActivationType::Situ;
    cp.error_flag = err;
    if (lora) {
      cp.lora_table = lora_table;
      cp.token_slot = lora_slot;
      cp.lora_t2 = lora_t2;
      cp.lora_t2_stride = static_cast<int>(plan.lora_r2_stride);
    }
    launch_combine(cp, stream);
  }
}

}  // namespace fp4moe::cuda_backend
