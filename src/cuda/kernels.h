// Internal interface of the CUDA backend: the prepared device weights and the parameter blocks and
// host launchers of each kernel. Layering (CUTLASS-like; docs/architecture.md draws it):
//   nvfp4_device.cuh, mma.cuh, wgmma*.cuh   tile math: decode, quantize, tensor-core fragments
//   gemm/                       the grouped GEMM: tile table, pipeline, mainloops, epilogues, scheduler, kernels
//   *.cu                        host launchers (this header), backend.cu orchestrates a call.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>
#include <vector>

#include "common/activation.h"
#include "runtime/plan.h"
#include "fp4moe/types.h"

namespace fp4moe::cuda_backend {

// ---- prepared weights on the device ------------------------------------------------------------
// Kernel layout of one [N, K] weight matrix per expert, K padded to Kp = roundup(K, 64) with zeros and
// stored k-block-major, so that one block tile (bn rows x 64 K) is a contiguous run of bytes:
//   NVFP4 data  [E][Kp/64][N][32 bytes]   within a row's 32 bytes, lane t of a quad finds the values of its mma
//                                          fragments for the 4 k16 steps at bytes t*8 .. t*8+7 (elements
//                                          16s + 2t + 8h, +1), bit-placed as format/nvfp4_prepared.h says
//   NVFP4 scale [E][Kp/64][N][4]          the 4 block scales of the row's 64 K, as nvfp4_prepared.h codes
//   BF16 data   [E][Kp/64][N][64 elems]   new[t*16 + s*4 + q] = old[s*16 + 2t + {0,1,8,9}[q]]
// Gated W1 rows are interleaved: prepared row 2j = gate row j, 2j+1 = up row j (whatever the weights'
// half order), so one thread's accumulator pair (c0, c1) holds the gate and up of the same j.
struct DeviceMatrix {
  const uint8_t* data = nullptr;
  const uint8_t* sf = nullptr;  // NVFP4 only
  int64_t N = 0, K = 0, Kp = 0;
  int64_t expert_data_bytes = 0, expert_sf_bytes = 0;
};

struct DeviceWeights {
  int device_id = 0;
  WeightFormat format = WeightFormat::NVFP4;
  GateUpOrder order = GateUpOrder::GateFirst;
  bool gated = true;
  int64_t E = 0, H = 0, I = 0, N1 = 0;
  DeviceMatrix w1, w2;
  const float* s1_even = nullptr;  // [E] scale of prepared W1 rows 2j (gate; the only half when not gated)
  const float* s1_odd = nullptr;   // [E] scale of prepared W1 rows 2j+1 (up)
  const float* s2 = nullptr;       // [E]
  const float* bias1 = nullptr;    // [E][N1] in prepared row order, or null
  const float* bias2 = nullptr;    // [E][H], or null
  std::vector<void*> allocations;
  ~DeviceWeights();
};

// ---- multi-LoRA on the device (SPEC §5) --------------------------------------------------------------
// One projection of one adapter slot, the canonical matrices of runtime/prepared.h uploaded at load:
//   A [a_shared ? 1 : E][r][K] (K = H for gate_up, I for down), B [b_shared ? 1 : E][N][r] (N = N1 or H).
// r == 0: the slot has no such projection (its delta is +0).
struct LoraProj {
  const uint16_t* A = nullptr;
  const uint16_t* B = nullptr;
  int32_t r = 0;
  int32_t a_shared = 0;  // SharedOuter gate_up: one A for every expert
  int32_t b_shared = 0;  // SharedOuter down: one B, expanded once per token in the combine
  int32_t pad = 0;
};
enum LoraWhich : int { kLoraGateUp = 0, kLoraDown = 1, kLoraSharedGateUp = 2, kLoraSharedDown = 3 };
// lora_shrink1_kernel's blocks (grid y) of one token: its routed entries' gate_up A in rpi-row items (k entries, or
// one for an A shared by the experts; none when the tiled shrink takes the routed rows), then the shared expert's.
// gu_r, sg_r: the slot's ranks (0 without that projection). The kernel and its launch (backend.cu: grid y = the most
// over the loaded slots) both count them here.
struct Shrink1Items {
  int per_entry, routed, shared;
};
FP4MOE_HD Shrink1Items shrink1_items(int gu_r, bool gu_a_shared, int sg_r, int k, int rpi, bool routed_in_tiles) {
  const int per_entry = (gu_r + rpi - 1) / rpi;
  return {per_entry, gu_r > 0 && (gu_a_shared || !routed_in_tiles) ? (gu_a_shared ? 1 : k) * per_entry : 0,
          sg_r > 0 ? (sg_r + rpi - 1) / rpi : 0};
}
// One registry slot as the kernels see it (a device array [num_slots], one per adapter snapshot).
struct LoraSlot {
  LoraProj proj[4];      // by LoraWhich
  int32_t loaded = 0;    // 0: empty slot (a token naming it is dropped to base and flagged)
  int32_t pad[7] = {};
};
static_assert(sizeof(LoraProj) == 32 && sizeof(LoraSlot) == 160, "LoraSlot layout");
// A token's adapter id as a slot: -1 unless it names a loaded slot (the x shrink and GEMM1 beside it check alike).
FP4MOE_HD int checked_slot(const LoraSlot* table, int num_slots, int id) {
  return id >= 0 && id < num_slots && table[id].loaded ? id : -1;
}

// The expand of one GEMM epilogue: delta[n] = bf16(sum_i t[row][i] * B_e[n][i]), fp32 sums of k16 mma steps
// (lora_expand.cuh), added to every output (+0 without LoRA).
struct LoraExpandParams {
  const LoraSlot* table = nullptr;      // null: no LoRA in this call
  const int32_t* token_slot = nullptr;  // [chunk tokens] checked slot, -1 = base
  // Or, where a GEMM runs beside a LoRA shrink, before the x shrink wrote token_slot (GemmProblem::wait_late), the call's adapter ids
  // checked as the x shrink checks them (its flag is the x shrink's to raise).
  const int32_t* adapter_ids = nullptr;
  int num_slots = 0;
  const float* t = nullptr;             // shrink rows (kernels.h LoraShrink*), stride t_stride
  int t_stride = 0;
  int which = kLoraGateUp;              // a_shared A: the t row is the token's first entry, token * token_div
};

// Shrink of x (before GEMM1), blocks (token, item) of the chunk, an item rows_per_item rank rows of one A (lora.cu).
// Resolves adapter_ids[t] into token_slot[t] (out-of-range or empty: -1 and error flag 3), then
//   t1[t*k + j][i] = bf16(x_t . A1_e[i])  for each local slot j (a_shared: once, in row t*k),
//   st1[t][i]      = bf16(x_t . sA1[i])   when the call has a shared expert.
struct LoraShrink1Params {
  const LoraSlot* table = nullptr;
  int num_slots = 0;
  const int32_t* adapter_ids = nullptr;  // chunk-offset [T]
  const int32_t* ids = nullptr;          // [T, k] global expert ids (chunk-offset)
  const uint16_t* x = nullptr;           // bf16 [T, H] (chunk-offset), the un-quantized x in A4 too
  int T = 0, k = 0, H = 0, E_loc = 0, local_offset = 0;
  bool shared_expert = false;
  int rows_per_item = 16;                // rank rows of one A an item: 4, 8 or 16 (plan.lora_shrink1_rows_per_item)
  int max_items = 1;                     // the most items a token has over the loaded slots (grid size, >= 1: block 0
                                         // of every token publishes its slot)
  int32_t* token_slot = nullptr;
  float* t1 = nullptr;
  int t1_stride = 0;
  float* st1 = nullptr;
  int st_stride = 0;
  int* error_flag = nullptr;
  // plan.lora_shrink_tiled: the routed outputs of per-expert A1s are left to launch_lora_shrink_tiled, after the
  // permutation (this kernel still checks the slots and does shared A1s and the shared expert).
  bool routed_in_tiles = false;
  // A kernel of this call runs before this one (the routing or the x quantizer), so the caller's adapter_ids may be
  // read before pdl_wait(); false when this is the call's first kernel (its predecessor may be the caller's).
  bool slots_before_wait = false;
};

// A routed shrink over GEMM1's row tiles (plan.lora_shrink_tiled): t[entry][i] = bf16(in_row . A_{slot,e}[i]) for
// every permuted row whose token has an adapter with this projection; in_row = in[entry / k] (gather: x) or
// in[row] (the permuted activations a). Same bits as the per-token / per-row kernels.
struct LoraTiledShrinkParams {
  const LoraSlot* table = nullptr;
  const int32_t* token_slot = nullptr;
  int which = kLoraGateUp;
  const uint16_t* in = nullptr;
  bool gather = false;
  int K = 0, k = 1;
  float* t = nullptr;
  int t_stride = 0;
  const int32_t* tile_info = nullptr;
  const int32_t* expert_offsets = nullptr;
  const int32_t* row_entry = nullptr;
  int max_tiles = 0, bm = 0;
};

// Shrink of the activations a (bf16, before A4 rounding), one block per GEMM1 output row:
//   routed (row_entry given): t[entry][i] = bf16(a_row . A2_e[i]), rows beyond *row_count skipped;
//   dense (shared expert):    t[row][i]   = bf16(a_row . sA2[i]).
struct LoraShrink2Params {
  const LoraSlot* table = nullptr;
  const int32_t* token_slot = nullptr;
  const uint16_t* a = nullptr;           // bf16 [rows, K]
  int K = 0;
  int rows = 0;
  const int32_t* row_count = nullptr;    // routed after the permutation: expert_offsets + E_loc
  const int32_t* row_entry = nullptr;    // routed after the permutation: permuted row -> entry (null: row = entry)
  const int32_t* ids = nullptr;          // routed: [T, k] global expert ids (null: dense rows)
  int k = 1, local_offset = 0, E_loc = 0;
  int which = kLoraDown;
  float* t = nullptr;
  int t_stride = 0;
  int rows_per_item = 16;                // rank rows of one A an item: 4, 8 or 16 (plan.lora_shrink2_rows_per_item)
};

// ---- kernel parameter blocks --------------------------------------------------------------------
struct RoutingParams {
  const void* logits = nullptr;  // [T, E_total] f32 or bf16 (chunk-offset)
  bool logits_bf16 = false;
  const float* bias = nullptr;   // [E_total] or null
  int method = 0;
  int T = 0, E = 0, k = 0;
  int n_group = 1, topk_group = 1;
  float routed_scaling_factor = 1.f;
  int32_t* ids = nullptr;        // [T, k] out
  float* weights = nullptr;      // [T, k] out
  int* error_flag = nullptr;     // set (kErrRoutingBias) when the bias holds a value that is not finite
  // Entry tiles (plan.h MoePlan::entry_tiles): no permutation runs, so block 0 zeroes the split-K counters.
  int32_t* zero_counters = nullptr;
  int num_counters = 0;
};

struct PermuteParams {
  const int32_t* ids = nullptr;  // [rows] (token, slot) entries, global expert ids
  int rows = 0;                  // entries in this chunk
  int E_total = 0, E_loc = 0, local_offset = 0;
  int entries_per_block = 0, num_blocks = 0;
  bool mid = false;                   // one block of 32 warps whatever num_blocks (MoePlan::perm_mid)
  int bm = 0, max_tiles = 0;
  int32_t* block_counts = nullptr;    // [num_blocks, E_loc]
  int32_t* expert_offsets = nullptr;  // [E_loc + 1]
  int32_t* tile_info = nullptr;       // [max_tiles, 2] + count
  int32_t* row_entry = nullptr;       // [rows]
  int* error_flag = nullptr;
  int32_t* zero_counters = nullptr;   // [num_counters] split-K counters, zeroed by the one-block kernel
  int num_counters = 0;
  const int32_t* token_slot = nullptr;  // LoRA: each token's slot (order_by_adapter), k entries a token
  int k = 1;
};

// A grouped GEMM: C[r, :] = A[row(r), :] . B_e^T for the rows r of each tile; see gemm/kernel_*.cuh.
struct GemmProblem {
  const uint16_t* A = nullptr;     // bf16 rows
  int64_t lda = 0;                 // elements
  int K = 0;                       // valid K (multiple of 16); A columns beyond it read as 0
  const int32_t* row_entry = nullptr;  // permuted row -> entry (null: dense, entry = row)
  int gather_k = 0;                // A row = entry / gather_k (0: A row = permuted row)
  const int32_t* tile_info = nullptr;  // routed tiles (null: dense tiles over dense_rows)
  const int32_t* expert_offsets = nullptr;
  int max_tiles = 0;
  int dense_rows = 0;
  int m_band = 0;                  // tile order: bands of m_band m tiles (plan.h MoePlan::m_band1; 0: one band), tile_of
  DeviceMatrix B;
  // Split-K (weights-as-A tiles only, plan.h split1/split2): `split` blocks share a tile's K chunks; each writes its
  // chunk sums to partials and the last to arrive adds them in chunk order (counters: one per tile, zero
  // between calls — the one-block permutation zeroes them, or the routing under entry tiles; the last block of a tile
  // resets its own).
  int split = 1;
  // k-blocks (of 64) a K chunk: the canonical K order of this GEMM (plan.h decode_chunk_kb, MoePlan::chunk1_kb).
  int chunk_kb = kKChunkKb;
  float* partials = nullptr;
  int32_t* counters = nullptr;
  // Weights-as-A grids of one band (plan.h MoePlan::gemm_m_last; the launch keeps it to grids it fits): blocks
  // (n tile, split, m tile), so the first m tiles, the ones with rows, go first (0: (m tile, n tile, split)).
  int m_last = 0;
  // Entry tiles (plan.h MoePlan::entry_tiles; tile_info null): m tile m is (token, slot) entry m alone, its expert
  // entry_ids[m] - local_offset (the tile is empty when that is not in [0, E_loc)), its row the entry.
  const int32_t* entry_ids = nullptr;
  int local_offset = 0, E_loc = 0;
  // The weights-as-A kernel's PDL wait before its epilogue instead of before its mainloop (MoePlan::
  // gemms_beside_lora_shrinks): the mainloop reads only what kernels before the predecessor wrote.
  int wait_late = 0;
  // The warp-specialised tile: n tiles a block runs one after the other (kernel_ws_wgmma.cuh; plan.h MoePlan::ws_sub1).
  int ws_sub = 1;
};

// GEMM1 epilogue: h = acc * s_half[e] * row_scale[token] (+bias) (+delta); a = act(g, u); bf16.
struct Epilogue1Params {
  const float* s_even = nullptr;
  const float* s_odd = nullptr;
  const float* row_scale = nullptr;  // per token (A4 x dequant scale) or null (1)
  int token_div = 1;                 // token = entry / token_div
  const float* bias = nullptr;       // [E][N1] prepared order
  const uint16_t* delta = nullptr;   // bf16 [entries][N1] in the weights' half order, or null
  bool gate_first = true;
  const float* alpha = nullptr;      // per expert activation parameters or null (defaults)
  const float* beta = nullptr;
  const float* limit = nullptr;
  act::Params defaults;
  uint16_t* out = nullptr;           // bf16 [rows][I] by permuted row
  uint16_t* act_out = nullptr;       // bf16 [entries][I] bridge or null
  int I = 0, N1 = 0;
  // > 0 (A4, fused): out gets a's NVFP4 values with this encode scale (1 / fc2_input_scale) instead of a; only the
  // weights-as-A tiles with two row groups a warp (configs 0, 1) and gated activations do it (gemm_a4_fusable).
  float a_quant_gs = 0.f;
  LoraExpandParams lora;             // + bf16(t . B1_e^T) before the activation
};

// GEMM2 epilogue: o = acc * (s2[e] * in_scale) (+bias) + down LoRA delta (+0 without), f32 [entries][H].
struct Epilogue2Params {
  const float* s2 = nullptr;
  float in_scale = 1.f;
  const float* bias = nullptr;  // [E][H]
  float* out = nullptr;
  int H = 0;
  int token_div = 1;            // token = entry / token_div (k routed, 1 dense)
  LoraExpandParams lora;        // + bf16(t2 . B2_e^T); SharedOuter's shared B2 is left to the combine
};

// Whether GEMM1 on tile `config` quantizes a itself in A4 (Epilogue1Params::a_quant_gs, gemm/epilogue_a4.cuh):
// the weights-as-A tiles with two row groups of 16 a warp (mma.sync, and the warp-specialised wgmma tile), gated
// activations. (The kernel's own
// condition is checked against this one at compile time: gemm/dispatch.cuh.)
constexpr bool gemm_a4_fusable(int config, ActivationType a, bool fp4 = true) {
  const GemmConfig& c = kGemmConfigs[config];
  return c.weights_as_a && (!c.wgmma || c.ws) && gemm_bn(c, fp4) == 32 * c.warps_n && is_gated(a);
}

struct QuantizeParams {
  const uint16_t* x = nullptr;   // bf16 [rows, K] input (may equal out)
  int64_t ldx = 0;
  uint16_t* out = nullptr;       // bf16 [rows, K]: e2m1 * e4m3 values
  float* out_scale = nullptr;    // [rows] dequant scale per row (x quantization) or null
  int rows = 0, K = 0;
  const int32_t* row_count = nullptr;  // rows at or beyond *row_count are skipped (null: all rows)
  bool per_row_scale = false;    // gs from each row's amax, else gs
  float gs = 1.f, scale2 = 1.f;
};

struct CombineParams {
  const int32_t* ids = nullptr;  // [T, k]
  const float* weights = nullptr;
  const float* out = nullptr;    // [T*k, H]
  const float* shared_out = nullptr;  // [T, H] or null
  // The shared expert's sigmoid gate: g bf16 [H] (null: weight 1) and the chunk's x rows [T, H] it reads.
  const uint16_t* shared_gate = nullptr;
  const uint16_t* x = nullptr;
  uint16_t* y = nullptr;         // bf16 [T, H] (one rounding), or null when y_f32 is given
  float* y_f32 = nullptr;        // f32 [T, H]: the same sum, not rounded (args.y float32; parallel partials)
  int T = 0, k = 0, H = 0, E_loc = 0, local_offset = 0;
  int blocks_per_token = 0, threads = 0;
  // SharedOuter down LoRA: z = sum_j w_j t2[t*k + j] (local slots, slot order), dy = bf16(bf16(z) . B2^T),
  // added after the shared expert (+0 for every other token).
  const LoraSlot* lora_table = nullptr;
  const int32_t* token_slot = nullptr;
  const float* lora_t2 = nullptr;
  int lora_t2_stride = 0;
  // Per-expert activation parameters given on the device (null: absent or on the host, checked there): an entry
  // whose expert holds a bad value contributes nothing, and block 0 raises the flag (kErrActAlpha, ...).
  const float* act_alpha = nullptr;
  const float* act_beta = nullptr;
  const float* act_clamp_limit = nullptr;
  bool act_positive = false;     // Situ: alpha and beta must be > 0
  int* error_flag = nullptr;
};

// ---- launchers (all on `stream`, each checked) ---------------------------------------------------
// warps_per_token > 0: a block a token (MoePlan::routing_warps_per_token), else warps_per_block tokens a block.
void launch_routing(const RoutingParams& p, int warps_per_block, int warps_per_token, size_t smem,
                    cudaStream_t stream);
void launch_permute(const PermuteParams& p, cudaStream_t stream);
// After launch_permute, with LoRA: each expert's rows sorted by (adapter slot, entry) (permute.cu).
void launch_order_by_adapter(const PermuteParams& p, cudaStream_t stream);
// Device dev's compute capability, major * 10 + minor (cached per device; backend.cu).
int compute_capability(int dev);
// Device dev's SM count (cached per device; backend.cu).
int sm_count(int dev);
// Whether device dev runs the sm_90a wgmma tiles (plan.h kGemmConfigs[3], [4]; ProblemShape::wgmma): compute capability
// 9.0 and a build with sm_90a code.
bool wgmma_supported_on(int dev);
void launch_gemm1(int config, WeightFormat fmt, ActivationType act, const GemmProblem& g, const Epilogue1Params& e,
                  int n_tiles, int m_tiles, cudaStream_t stream);
void launch_gemm2(int config, WeightFormat fmt, const GemmProblem& g, const Epilogue2Params& e, int n_tiles,
                  int m_tiles, cudaStream_t stream);
void launch_quantize(const QuantizeParams& p, cudaStream_t stream);
void launch_combine(const CombineParams& p, cudaStream_t stream);
// permute: the chunk's one-block permutation to run in the same launch (plan.lora_shrink1_permutes), or null.
void launch_lora_shrink1(const LoraShrink1Params& p, int threads, const PermuteParams* permute, cudaStream_t stream);
void launch_lora_shrink_tiled(const LoraTiledShrinkParams& p, cudaStream_t stream);
void launch_lora_shrink2(const LoraShrink2Params& p, int threads, cudaStream_t stream);

// Throws Error(CudaError naming `what`; OutOfMemory for allocation failures) when e != cudaSuccess.
void check_cuda(cudaError_t e, const char* what);
// The last launch's error (cudaGetLastError), checked.
void check_launch(const char* kernel);
// The per-device error flag buffer (allocated on first use). Codes: 1 routing.topk_ids out of range,
// 2 internal (more tiles than planned), 3 adapter_ids out of range or naming an empty slot, 4 another rank of a
// parallel call (moe_run_tp / moe_run_ep) failed: this rank's y was left untouched, 5 routing.bias not finite,
// 6 / 7 / 8 activation.alpha / beta / clamp_limit out of range (as the host check of validate.cpp).
int* device_error_flag(int device_id);
constexpr int kErrTopkIds = 1, kErrTiles = 2, kErrAdapterIds = 3, kErrParallelPeer = 4, kErrRoutingBias = 5,
              kErrActAlpha = 6, kErrActBeta = 7, kErrActClampLimit = 8, kErrSharedGate = 9;

}  // namespace fp4moe::cuda_backend
