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
                    "expected at least " + std::to_string(bytes) + " bytes (workspace_size), got " +
                        std::to_string(have));
      if (!aligned(args.workspace.data, kWorkspaceAlign))
        throw Error(ErrorCode::InvalidArgument, "workspace",
                    "must be aligned to " + std::to_string(kWorkspaceAlign) + " bytes");
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


// The largest rank among the loaded adapters (sizes the LoRA workspace; at least 1). validate_moe_args checked every
// slot against this layer and the shared expert on the same snapshot; the registry checked the ranks at load.
int64_t max_rank_of(const MoeArgs& args, const AdapterSnapshot& adapters) {
  if (!aligned(args.adapter_ids.data, 4))
    throw Error(ErrorCode::InvalidArgument, "adapter_ids", "must be 4-byte aligned");
  int64_t max_rank = 1;
  for (const auto& a : *adapters)
    if (a) max_rank = std::max(max_rank, a->rank);
  return max_rank;
}

// lora_shrink1_kernel's grid: a token's items (shrink1_items, as the kernel counts them), the most over the loaded
// slots, at least one (block 0 publishes the token's slot).
int shrink1_max_items(const AdapterSnapshot& adapters, const DeviceWeights* sw, int64_t top_k, const MoePlan& plan) {
  int most = 1;
  for (const auto& a : *adapters) {
    if (!a) continue;
    const Shrink1Items n = shrink1_items(a->has_gate_up ? static_cast<int>(a->r1) : 0, a->a1_shared,
                                         sw && a->has_shared && a->s_has_gate_up ? static_cast<int>(a->s_r) : 0,
                                         static_cast<int>(top_k), plan.lora_shrink1_rows_per_item,
                                         plan.lora_shrink_tiled);
    most = std::max(most, n.routed + n.shared);
  }
  return most;
}

// The workspace regions of the plan, typed.
struct Buffers {
  int32_t *ids, *block_counts, *expert_offsets, *tile_info, *row_entry, *split_counters, *lora_slot;
  float *wts, *split_partials, *x_scale, *out, *shared_out, *lora_t1, *lora_t2, *lora_st1, *lora_st2;
  uint16_t *x_q, *act, *shared_act;
};
Buffers buffers_of(const MoePlan& p, const Workspace& ws) {
  Buffers b;
  b.ids = ws.at<int32_t>(p.topk_ids);
  b.wts = ws.at<float>(p.topk_weights);
  b.block_counts = ws.at<int32_t>(p.block_counts);
  b.expert_offsets = ws.at<int32_t>(p.expert_offsets);
  b.tile_info = ws.at<int32_t>(p.tile_info);
  b.row_entry = ws.at<int32_t>(p.row_entry);
  b.split_partials = ws.at<float>(p.split_partials);
  b.split_counters = ws.at<int32_t>(p.split_counters);
  b.x_q = ws.at<uint16_t>(p.x_q);
  b.x_scale = ws.at<float>(p.x_scale);
  b.act = ws.at<uint16_t>(p.act);
  b.out = ws.at<float>(p.out);
  b.shared_act = ws.at<uint16_t>(p.shared_act);
  b.shared_out = ws.at<float>(p.shared_out);
  b.lora_slot = ws.at<int32_t>(p.lora_slot);
  b.lora_t1 = ws.at<float>(p.lora_t1);
  b.lora_t2 = ws.at<float>(p.lora_t2);
  b.lora_st1 = ws.at<float>(p.lora_shared_t1);
  b.lora_st2 = ws.at<float>(p.lora_shared_t2);
  return b;
}

// What every stage of one call reads: the weights, the arguments, the plan, the device state and the buffers.
struct Call {
  const PreparedWeights& w;
  const MoeArgs& args;
  const AdapterSnapshot& adapters;
  const DeviceWeights* dw;
  const DeviceWeights* sw;  // the shared expert, or null
  const ProblemShape& s;
  const MoePlan& plan;
  bool lora, a4, a4_fused, y_f32;
  int* err;
  cudaStream_t stream;
  const LoraSlot* lora_table;
  int shrink1_items;
  act::Params defaults, shared_params;
  float fc2_scale;
  Buffers b;
  int k() const { return static_cast<int>(s.k); }
  int local_offset() const { return static_cast<int>(args.local_expert_offset); }
};

// One chunk of the call: its tokens [t0, t0 + tc), its (token, slot) rows, the routing and GEMM1 input it uses.
struct Chunk {
  int64_t t0 = 0;
  int tc = 0, rows = 0;
  const int32_t* ids = nullptr;
  const float* wts = nullptr;
  const uint16_t* a_in = nullptr;  // GEMM1's A: x, or its NVFP4 values (A4)
  bool launched = false;           // a kernel of this chunk is on the stream (the next one is not the chunk's first)
};

const uint16_t* x_of(const Call& c, const Chunk& ch) {
  return static_cast<const uint16_t*>(c.args.x.data) + ch.t0 * c.s.H;
}

GemmProblem with_split(const Call& c, GemmProblem g, int split) {
  g.split = split;
  g.partials = c.b.split_partials;
  g.counters = c.b.split_counters;
  return g;
}

// The expand parameters of one epilogue (table null without LoRA: every delta is +0).
LoraExpandParams expand(const Call& c, const float* t, int64_t stride, int which) {
  LoraExpandParams L;
  if (!c.lora) return L;
  L.table = c.lora_table;
  L.token_slot = c.b.lora_slot;
  L.t = t;
  L.t_stride = static_cast<int>(stride);
  L.which = which;
  return L;
}

// A GEMM that runs its mainloop beside a LoRA shrink (GemmProblem::wait_late) may start before the x shrink wrote
// token_slot: its epilogue checks the tokens' slots from the call's adapter ids, as the x shrink does.
void slots_from_adapter_ids(const Call& c, const Chunk& ch, LoraExpandParams& L) {
  L.token_slot = nullptr;
  L.adapter_ids = static_cast<const int32_t*>(c.args.adapter_ids.data) + ch.t0;
  L.num_slots = static_cast<int>(c.adapters->size());
}

// A4: GEMM1's bf16 output a [rows, width] -> NVFP4 values in place, with the FC2 input encode scale
// (row_count: the routed rows actually present, on the device; null: all rows).
void quantize_fc2_input(const Call& c, uint16_t* a, int64_t width, int rows, const int32_t* row_count) {
  QuantizeParams qp;
  qp.x = a;
  qp.ldx = width;
  qp.out = a;
  qp.rows = rows;
  qp.K = static_cast<int>(width);
  qp.row_count = row_count;
  qp.gs = 1.f / c.args.fc2_input_scale;
  launch_quantize(qp, c.stream);
}

// 1. Routing: top-k ids and weights of the chunk's tokens (from logits, or the caller's).
void route(const Call& c, Chunk& ch) {
  const RoutingArgs& ra = c.args.routing;
  if (!c.s.routing_from_logits) {
    ch.ids = static_cast<const int32_t*>(ra.topk_ids.data) + ch.t0 * c.s.k;
    ch.wts = static_cast<const float*>(ra.topk_weights.data) + ch.t0 * c.s.k;
    return;
  }
  RoutingParams rp;
  const size_t lsz = ra.logits.dtype == DType::BF16 ? 2 : 4;
  rp.logits = static_cast<const uint8_t*>(ra.logits.data) + ch.t0 * c.s.E_total * lsz;
  rp.logits_bf16 = ra.logits.dtype == DType::BF16;
  rp.bias = ra.bias.present() ? static_cast<const float*>(ra.bias.data) : nullptr;
  rp.method = static_cast<int>(ra.method);
  rp.T = ch.tc;
  rp.E = static_cast<int>(c.s.E_total);
  rp.k = c.k();
  rp.n_group = static_cast<int>(ra.method == RoutingMethod::DeepSeekV3 ? ra.n_group : 1);
  rp.topk_group = static_cast<int>(ra.topk_group);
  rp.routed_scaling_factor = ra.routed_scaling_factor;
  rp.ids = c.b.ids;
  rp.weights = c.b.wts;
  rp.error_flag = c.err;
  if (c.plan.entry_tiles) {
    rp.zero_counters = c.b.split_counters;
    rp.num_counters = static_cast<int>(c.plan.split_counters.bytes / 4);
  }
  launch_routing(rp, c.plan.routing_warps_per_block, c.plan.routing_warps_per_token, c.plan.routing_smem, c.stream);
  ch.launched = true;
  ch.ids = c.b.ids;
  ch.wts = c.b.wts;
}

// 2. A4: x -> NVFP4 values (e2m1 * e4m3) and the per-token FC1 input scale.
void quantize_x(const Call& c, Chunk& ch) {
  ch.a_in = x_of(c, ch);
  if (!c.a4) return;
  QuantizeParams qp;
  qp.x = x_of(c, ch);
  qp.ldx = c.s.H;
  qp.out = c.b.x_q;
  qp.out_scale = c.b.x_scale;
  qp.rows = ch.tc;
  qp.K = static_cast<int>(c.s.H);
  qp.per_row_scale = c.args.per_token_x_scale;
  qp.gs = c.args.per_token_x_scale ? 1.f : 1.f / c.args.fc1_input_scale;
  qp.scale2 = c.args.fc1_input_scale;
  launch_quantize(qp, c.stream);
  ch.launched = true;
  ch.a_in = c.b.x_q;
}

// The permutation's parameters: rows in (expert, token, slot) order, the tile list; with LoRA, rows ordered by
// adapter (permute).
PermuteParams permute_params(const Call& c, const Chunk& ch) {
  PermuteParams pp;
  pp.ids = ch.ids;
  pp.rows = ch.rows;
  pp.E_total = static_cast<int>(c.s.E_total);
  pp.E_loc = static_cast<int>(c.w.E);
  pp.local_offset = c.local_offset();
  pp.entries_per_block = c.plan.perm_entries;
  pp.num_blocks = static_cast<int>((ch.rows + c.plan.perm_entries - 1) / c.plan.perm_entries);
  pp.mid = c.plan.perm_mid;
  pp.bm = c.plan.gemm.bm;
  pp.max_tiles = static_cast<int>(c.plan.max_m_tiles);
  pp.block_counts = c.b.block_counts;
  pp.expert_offsets = c.b.expert_offsets;
  pp.tile_info = c.b.tile_info;
  pp.row_entry = c.b.row_entry;
  pp.error_flag = c.err;
  pp.zero_counters = c.b.split_counters;
  pp.num_counters = static_cast<int>(c.plan.split_counters.bytes / 4);
  return pp;
}

// 2b. LoRA: each token's slot (checked) and the shrink of the bf16 x (also in A4; with plan.lora_shrink_tiled the
// routed per-expert part runs after the permutation).
// pp: the chunk's permutation, launched here too where the plan says so (plan.lora_shrink1_permutes).
void lora_shrink_x(const Call& c, const Chunk& ch, const PermuteParams& pp) {
  LoraShrink1Params lp;
  lp.table = c.lora_table;
  lp.num_slots = static_cast<int>(c.adapters->size());
  lp.adapter_ids = static_cast<const int32_t*>(c.args.adapter_ids.data) + ch.t0;
  lp.ids = ch.ids;
  lp.x = x_of(c, ch);
  lp.T = ch.tc;
  lp.k = c.k();
  lp.H = static_cast<int>(c.s.H);
  lp.E_loc = static_cast<int>(c.w.E);
  lp.local_offset = c.local_offset();
  lp.shared_expert = c.sw != nullptr;
  lp.routed_in_tiles = c.plan.lora_shrink_tiled;
  lp.slots_before_wait = ch.launched;
  lp.rows_per_item = c.plan.lora_shrink1_rows_per_item;
  lp.max_items = c.shrink1_items;
  lp.token_slot = c.b.lora_slot;
  lp.t1 = c.b.lora_t1;
  lp.t1_stride = static_cast<int>(c.plan.lora_r1_stride);
  lp.st1 = c.b.lora_st1;
  lp.st_stride = static_cast<int>(c.plan.lora_r2_stride);
  lp.error_flag = c.err;
  launch_lora_shrink1(lp, c.plan.lora_shrink1_threads, c.plan.lora_shrink1_permutes ? &pp : nullptr, c.stream);
}

// 3. Permutation (launched by permute, or with the x shrink: plan.lora_shrink1_permutes).
void permute(const Call& c, const Chunk& ch, PermuteParams pp) {
  if (!c.plan.lora_shrink1_permutes) launch_permute(pp, c.stream);  // else in the x shrink's launch (LoRA only)
  if (c.lora && ch.rows > c.w.E) {  // more rows than experts: tiles with several tokens, worth grouping by adapter
    pp.token_slot = c.b.lora_slot;
    pp.k = c.k();
    launch_order_by_adapter(pp, c.stream);
  }
}

// A routed LoRA shrink over GEMM1's row tiles (plan.lora_shrink_tiled): in = x (gathered by token) or a.
void lora_shrink_tiled(const Call& c, const uint16_t* in, bool gather, int64_t K, int which, float* t,
                       int64_t t_stride) {
  LoraTiledShrinkParams tp;
  tp.table = c.lora_table;
  tp.token_slot = c.b.lora_slot;
  tp.which = which;
  tp.in = in;
  tp.gather = gather;
  tp.K = static_cast<int>(K);
  tp.k = c.k();
  tp.t = t;
  tp.t_stride = static_cast<int>(t_stride);
  tp.tile_info = c.b.tile_info;
  tp.expert_offsets = c.b.expert_offsets;
  tp.row_entry = c.b.row_entry;
  tp.max_tiles = static_cast<int>(c.plan.max_m_tiles);
  tp.bm = static_cast<int>(c.plan.gemm.bm);
  launch_lora_shrink_tiled(tp, c.stream);
}

// The LoRA shrink of a GEMM1 output a [rows, K] for projection `which` (routed: the permuted rows; else dense).
void lora_shrink_act(const Call& c, const Chunk& ch, const uint16_t* a, int64_t K, int n_rows, int which, float* t,
                     bool routed) {
  LoraShrink2Params lp;
  lp.table = c.lora_table;
  lp.token_slot = c.b.lora_slot;
  lp.a = a;
  lp.K = static_cast<int>(K);
  lp.rows = n_rows;
  if (routed) {  // GEMM1's rows: permuted, or the entries themselves under entry tiles
    lp.row_count = c.plan.entry_tiles ? nullptr : c.b.expert_offsets + c.w.E;
    lp.row_entry = c.plan.entry_tiles ? nullptr : c.b.row_entry;
    lp.ids = ch.ids;
    lp.k = c.k();
    lp.local_offset = c.local_offset();
    lp.E_loc = static_cast<int>(c.w.E);
  }
  lp.which = which;
  lp.t = t;
  lp.t_stride = static_cast<int>(c.plan.lora_r2_stride);
  lp.rows_per_item = c.plan.lora_shrink2_rows_per_item;
  launch_lora_shrink2(lp, c.plan.lora_shrink2_threads, c.stream);
}

// 4. GEMM1 over the routed rows (its problem is GEMM2's too, but for A, K and B).
GemmProblem gemm1(const Call& c, const Chunk& ch) {
  const MoeArgs& a = c.args;
  const int64_t k = c.s.k, I = c.s.I;
  uint16_t* act_out = nullptr;
  if (a.activation_out.present()) {
    act_out = static_cast<uint16_t*>(a.activation_out.data) + ch.t0 * k * I;
    // Slots whose expert is another rank's stay 0; GEMM1 overwrites the local ones.
    check_cuda(cudaMemsetAsync(act_out, 0, static_cast<size_t>(ch.tc) * k * I * 2, c.stream),
               "cudaMemsetAsync (activation_out)");
  }
  GemmProblem g1;
  g1.A = ch.a_in;
  g1.lda = c.s.H;
  g1.K = static_cast<int>(c.s.H);
  g1.row_entry = c.b.row_entry;
  g1.gather_k = static_cast<int>(k);
  g1.tile_info = c.b.tile_info;
  g1.expert_offsets = c.b.expert_offsets;
  g1.max_tiles = static_cast<int>(c.plan.max_m_tiles);
  g1.m_band = c.plan.m_band1;
  g1.m_last = c.plan.gemm_m_last ? 1 : 0;
  if (c.plan.entry_tiles) {  // one entry a tile, no permutation (plan.h MoePlan::entry_tiles)
    g1.row_entry = nullptr;
    g1.tile_info = nullptr;
    g1.expert_offsets = nullptr;
    g1.entry_ids = ch.ids;
    g1.max_tiles = ch.rows;
    g1.local_offset = c.local_offset();
    g1.E_loc = static_cast<int>(c.w.E);
  }
  g1.wait_late = c.plan.gemms_beside_lora_shrinks ? 1 : 0;
  g1.B = c.dw->w1;
  Epilogue1Params e1 = epilogue1_for(*c.dw, c.b.act, static_cast<int>(k), c.a4 ? c.b.x_scale : nullptr);
  e1.delta = a.gate_up_lora_delta.present()
                 ? static_cast<const uint16_t*>(a.gate_up_lora_delta.data) + ch.t0 * k * c.plan.n1
                 : nullptr;
  e1.alpha = a.activation.alpha.present() ? static_cast<const float*>(a.activation.alpha.data) : nullptr;
  e1.beta = a.activation.beta.present() ? static_cast<const float*>(a.activation.beta.data) : nullptr;
  e1.limit = a.activation.clamp_limit.present() ? static_cast<const float*>(a.activation.clamp_limit.data) : nullptr;
  e1.defaults = c.defaults;
  e1.act_out = act_out;
  e1.lora = expand(c, c.b.lora_t1, c.plan.lora_r1_stride, kLoraGateUp);
  if (g1.wait_late) slots_from_adapter_ids(c, ch, e1.lora);
  e1.a_quant_gs = c.a4_fused ? 1.f / a.fc2_input_scale : 0.f;
  g1 = with_split(c, g1, c.plan.split1);
  g1.ws_sub = c.plan.ws_sub1;
  g1.chunk_kb = c.plan.chunk1_kb;
  launch_gemm1(c.plan.gemm_config, c.w.format, c.s.activation, g1, e1, static_cast<int>(c.plan.n1_tiles),
               g1.max_tiles, c.stream);
  return g1;
}

// 6. GEMM2: o per (token, slot) entry.
void gemm2(const Call& c, const Chunk& ch, const GemmProblem& g1) {
  GemmProblem g2 = with_split(c, g1, c.plan.split2);
  g2.ws_sub = c.plan.ws_sub2;
  g2.chunk_kb = c.plan.chunk2_kb;
  g2.wait_late = c.plan.gemms_beside_lora_shrinks ? 1 : 0;  // the a shrink lets it in after GEMM1 finished
  g2.A = c.b.act;
  g2.lda = c.s.I;
  g2.K = static_cast<int>(c.s.I);
  g2.gather_k = 0;
  g2.m_band = c.plan.m_band2;
  g2.B = c.dw->w2;
  Epilogue2Params e2 = epilogue2_for(*c.dw, c.b.out, c.k(), c.fc2_scale);
  e2.lora = expand(c, c.b.lora_t2, c.plan.lora_r2_stride, kLoraDown);
  if (g2.wait_late) slots_from_adapter_ids(c, ch, e2.lora);
  launch_gemm2(c.plan.gemm_config, c.w.format, g2, e2, static_cast<int>(c.plan.n2_tiles),
               g2.max_tiles, c.stream);
}

// 7. Shared expert: the same pipeline over all tokens of the chunk, dense rows.
void shared_expert(const Call& c, const Chunk& ch) {
  const DeviceWeights& sw = *c.sw;
  const int64_t H = c.s.H, Is = sw.I;
  GemmProblem gs1 = with_split(c, dense_problem(ch.a_in, H, static_cast<int>(H), ch.tc, sw.w1), c.plan.shared_split1);
  gs1.ws_sub = c.plan.shared_ws_sub1;
  gs1.chunk_kb = c.plan.shared_chunk1_kb;
  Epilogue1Params es1 = epilogue1_for(sw, c.b.shared_act, 1, c.a4 ? c.b.x_scale : nullptr);
  es1.defaults = c.shared_params;
  es1.lora = expand(c, c.b.lora_st1, c.plan.lora_r2_stride, kLoraSharedGateUp);
  es1.a_quant_gs = c.a4_fused ? 1.f / c.args.fc2_input_scale : 0.f;
  launch_gemm1(c.plan.gemm_config, sw.format, c.s.activation, gs1, es1, static_cast<int>(c.plan.shared_n1_tiles),
               static_cast<int>(c.plan.shared_m_tiles), c.stream);
  if (c.lora) lora_shrink_act(c, ch, c.b.shared_act, Is, ch.tc, kLoraSharedDown, c.b.lora_st2, false);
  if (c.a4 && !c.a4_fused) quantize_fc2_input(c, c.b.shared_act, Is, ch.tc, nullptr);
  GemmProblem gs2 =
      with_split(c, dense_problem(c.b.shared_act, Is, static_cast<int>(Is), ch.tc, sw.w2), c.plan.shared_split2);
  gs2.ws_sub = c.plan.shared_ws_sub2;
  gs2.chunk_kb = c.plan.shared_chunk2_kb;
  Epilogue2Params es2 = epilogue2_for(sw, c.b.shared_out, 1, c.fc2_scale);
  es2.lora = expand(c, c.b.lora_st2, c.plan.lora_r2_stride, kLoraSharedDown);
  launch_gemm2(c.plan.gemm_config, sw.format, gs2, es2, static_cast<int>(c.plan.n2_tiles),
               static_cast<int>(c.plan.shared_m_tiles), c.stream);
}

// 8. Combine in slot order, + shared, one bf16 rounding (none for an f32 y).
void combine(const Call& c, const Chunk& ch) {
  const int64_t H = c.s.H;
  CombineParams cp;
  cp.ids = ch.ids;
  cp.weights = ch.wts;
  cp.out = c.b.out;
  cp.shared_out = c.sw ? c.b.shared_out : nullptr;
  // The gate reads the bf16 x (also in A4: the gate is not the shared expert's GEMM) of the chunk's tokens.
  if (c.sw && c.args.shared_expert_gate.present()) {
    cp.shared_gate = static_cast<const uint16_t*>(c.args.shared_expert_gate.data);
    cp.x = static_cast<const uint16_t*>(c.args.x.data) + ch.t0 * H;
  }
  cp.y = c.y_f32 ? nullptr : static_cast<uint16_t*>(c.args.y.data) + ch.t0 * H;
  cp.y_f32 = c.y_f32 ? static_cast<float*>(c.args.y.data) + ch.t0 * H : nullptr;
  cp.T = ch.tc;
  cp.k = c.k();
  cp.H = static_cast<int>(H);
  cp.E_loc = static_cast<int>(c.w.E);
  cp.local_offset = c.local_offset();
  cp.blocks_per_token = static_cast<int>(c.plan.combine_blocks_per_token);
  cp.threads = c.plan.combine_threads;
  auto on_device = [](const TensorView& v) {
    return v.present() && v.device == Backend::CUDA ? static_cast<const float*>(v.data) : nullptr;
  };
  cp.act_alpha = on_device(c.args.activation.alpha);
  cp.act_beta = on_device(c.args.activation.beta);
  cp.act_clamp_limit = on_device(c.args.activation.clamp_limit);
  cp.act_positive = c.s.activation == ActivationType::Situ;
  cp.error_flag = c.err;
  if (c.lora) {
    cp.lora_table = c.lora_table;
    cp.token_slot = c.b.lora_slot;
    cp.lora_t2 = c.b.lora_t2;
    cp.lora_t2_stride = static_cast<int>(c.plan.lora_r2_stride);
  }
  launch_combine(cp, c.stream);
}

// One chunk through the pipeline, stage by stage.
void run_chunk(const Call& c, int64_t chunk) {
  Chunk ch;
  ch.t0 = chunk * c.plan.chunk_tokens;
  ch.tc = static_cast<int>(std::min<int64_t>(c.plan.chunk_tokens, c.s.T - ch.t0));
  ch.rows = static_cast<int>(ch.tc * c.s.k);
  route(c, ch);
  quantize_x(c, ch);
  const PermuteParams pp = permute_params(c, ch);
  if (c.lora) lora_shrink_x(c, ch, pp);
  if (!c.plan.entry_tiles) permute(c, ch, pp);
  if (c.lora && c.plan.lora_shrink_tiled)
    lora_shrink_tiled(c, x_of(c, ch), true, c.s.H, kLoraGateUp, c.b.lora_t1, c.plan.lora_r1_stride);
  const GemmProblem g1 = gemm1(c, ch);
  // 4b. LoRA: shrink of the bf16 a (before the A4 rounding below), per routed row.
  if (c.lora && c.plan.lora_shrink_tiled)
    lora_shrink_tiled(c, c.b.act, false, c.s.I, kLoraDown, c.b.lora_t2, c.plan.lora_r2_stride);
  else if (c.lora)
    lora_shrink_act(c, ch, c.b.act, c.s.I, ch.rows, kLoraDown, c.b.lora_t2, true);
  // 5. A4: a -> NVFP4 values with the FC2 input encode scale (fused in GEMM1's epilogue where the tile can).
  if (c.a4 && !c.a4_fused) quantize_fc2_input(c, c.b.act, c.s.I, ch.rows, c.b.expert_offsets + c.w.E);
  gemm2(c, ch, g1);
  if (c.sw) shared_expert(c, ch);
  combine(c, ch);
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
  const bool lora = adapters != nullptr;
  const int64_t max_rank = lora ? max_rank_of(args, adapters) : 0;
  const ProblemShape s = problem_shape(w, args, lora, max_rank, device_desc(w.device_id));
  const MoePlan plan = make_plan(s);
  if (plan.num_chunks == 0) return;
  if (!aligned(args.x.data, 16))
    throw Error(ErrorCode::Unsupported, "x", "the CUDA backend needs x aligned to 16 bytes");

  DeviceGuard guard(w.device_id);
  auto stream = static_cast<cudaStream_t>(args.stream);
  int* err = device_error_flag(w.device_id);
  const LoraSlot* lora_table = lora ? lora_table_for(adapters, w.device_id, stream) : nullptr;
  Workspace ws(args, plan.workspace_bytes, stream);
  const bool a4 = s.mode == ActMode::A4;
  const act::Params defaults = act::resolve_params(s.activation, false, 0.f, false, 0.f, false, 0.f);
  const Call c{
      w, args, adapters, dw, sw, s, plan, lora, a4,
      // A4 without LoRA (whose shrink reads a before the rounding) on a tile that can: GEMM1 writes a's NVFP4
      // values itself (one launch less; the same bits, gemm/epilogue_a4.cuh).
      a4 && !lora && gemm_a4_fusable(plan.gemm_config, s.activation, is_fp4(w.format)),
      // y: bf16 (one rounding in the combine) or f32 (the unrounded sum; moe_run_tp / moe_run_ep partials).
      args.y.dtype == DType::F32, err, stream, lora_table,
      lora ? shrink1_max_items(adapters, sw, s.k, plan) : 1, defaults,
      args.shared_params_given
          ? act::resolve_params(s.activation, true, args.shared_alpha, true, args.shared_beta,
                                args.shared_clamp_limit > 0.f, args.shared_clamp_limit)
          : defaults,
      a4 ? args.fc2_input_scale : 1.f, buffers_of(plan, ws)};
  for (int64_t chunk = 0; chunk < plan.num_chunks; ++chunk) run_chunk(c, chunk);
}

}  // namespace fp4moe::cuda_backend
