// The one host-side function that chooses the CUDA backend's tile configuration, launch grids and
// workspace layout (SPEC §6: "tile configuration and workspace size come from one host-side function,
// tested for every shape"). Pure host code: it runs (and is tested) without a GPU.
#pragma once
#include <algorithm>
#include <cstddef>
#include <cstdint>

#include "fp4moe/types.h"

namespace fp4moe {

// The device a plan is made for: the CUDA backend fills it from the device's attributes (cuda/backend.h
// device_desc), and so does workspace_size for weights on a CUDA device; the defaults are an H200's. Only speed
// depends on it (the tile, split-K and the tile bands never change a bit); the workspace only through split-K's
// partial sums, whose size follows the SM count (wgmma or not, it is sized for both tile choices).
struct DeviceDesc {
  int sm_count = 132;
  int64_t l2_bytes = int64_t(60) << 20;
  bool wgmma = false;  // runs the sm_90a wgmma tile (compute capability 9.0 with sm_90a code)
};

// Everything about a call that the kernels' configuration depends on.
struct ProblemShape {
  int64_t T = 0;        // tokens (0 is legal)
  int64_t H = 0;        // hidden size (multiple of 16)
  int64_t I = 0;        // intermediate size per expert (multiple of 16)
  int64_t E_loc = 0;    // experts on this rank
  int64_t E_total = 0;  // experts of the model (logits width); 0 = E_loc
  int64_t k = 0;        // experts per token
  bool gated = true;
  ActivationType activation = ActivationType::Swiglu;
  ActMode mode = ActMode::A16;
  WeightFormat format = WeightFormat::NVFP4;
  bool routing_from_logits = true;  // false: precomputed topk_ids/topk_weights
  int64_t n_group = 1;              // DeepSeekV3 groups (routing from logits)
  // The method's scores need a sum over all experts (Default, RenormalizeNaive: softmax before the top-k).
  bool routing_sums_experts = false;
  bool has_shared = false;          // shared expert present
  int64_t shared_I = 0;             // its intermediate size
  bool has_lora = false;            // registry LoRA in the call (an AdapterRegistry is given)
  // The largest adapter rank r (1..64) among the registry's adapters; 0 = unknown (sized for r = 64).
  // The LoRA buffers hold ranks up to 2r (PerExpert's canonical gate_up rank); they never change the
  // chunking or the GEMM tiles (a token's bits do not depend on LoRA being present).
  int64_t max_lora_rank = 0;
  // Upper bound (bytes) for the token-proportional workspace buffers; tokens beyond it are processed
  // in chunks of chunk_tokens. 0 = the default (kDefaultWorkspaceBudget).
  int64_t workspace_budget = 0;
  DeviceDesc device;
  // Forces the GEMM tile (index into kGemmConfigs: a GemmTile's value; MoeArgs::gemm_tile), -1 = chosen.
  int gemm_config = -1;
};

// One region of the workspace.
struct WorkspaceBuffer {
  size_t offset = 0;
  size_t bytes = 0;
};

// A grouped-GEMM tile configuration. The kernels are instantiated for exactly these (see
// kGemmConfigs); bm is chosen per call from the expected rows per expert.
struct GemmConfig {
  int bm = 0, bn = 0, bk = 0;       // block tile: rows (tokens), columns (weight rows), K step
  int warps_m = 0, warps_n = 0;     // warp grid
  int stages = 0;                   // shared-memory pipeline depth (src/cuda/gemm/pipeline.cuh StagePipe)
  bool weights_as_a = false;        // weights as the MMA A operand, bn / warps_n rows a warp
                                    // (src/cuda/gemm/kernel_weights_as_a.cuh)
  bool wgmma = false;               // the sm_90a warpgroup MMA (src/cuda/wgmma.cuh): ProblemShape::wgmma devices only;
                                    // its chunk sums live in shared memory (gemm/kernel_weights_as_a.cuh)
  bool ws = false;                  // warp-specialised: a producer warpgroup issues every copy, the warps_n math warps
                                    // only decode and multiply (src/cuda/gemm/kernel_ws_wgmma.cuh); bf16 weights take
                                    // half the weight rows (bn / 2) in the same shared memory
  constexpr int threads() const { return 32 * warps_m * warps_n; }  // the math threads
};

// The K chunk of the canonical K order's chunks (decode_chunk_kb: whole multiples of it).
constexpr int64_t kKChunk = 512;
constexpr int kKChunkKb = static_cast<int>(kKChunk / 64);  // its k-blocks of 64

struct MoePlan {
  ProblemShape shape;  // with defaults resolved (E_total, budget)

  // Token chunking: each chunk of up to chunk_tokens tokens runs the whole pipeline.
  int64_t chunk_tokens = 0;
  int64_t num_chunks = 0;
  int64_t rows = 0;  // chunk_tokens * k: (token, slot) entries per chunk

  // Routing kernel (from logits): one warp per token.
  int routing_warps_per_block = 0;
  // At small T: one block of this many warps a token (an expert a thread; 0: a warp a token).
  int routing_warps_per_token = 0;
  int64_t routing_blocks = 0;   // for a full chunk
  size_t routing_smem = 0;      // dynamic shared memory per block

  // Deterministic histogram / permutation: one block for all when rows <= kOneBlockPermEntries, else one warp
  // per block of perm_entries entries.
  int perm_entries = 0;
  int64_t perm_blocks = 0;      // for a full chunk
  size_t perm_smem = 0;         // E_loc ints per block
  bool perm_mid = false;        // one block of 32 warps (kMidPermAbove < rows <= kMidPermEntries)

  // Entry tiles: every (token, slot) entry of the chunk is an m tile of its own in the routed GEMMs (its expert read
  // from the routing's ids, its row the entry), so no permutation runs; the routing kernel zeroes the split-K
  // counters, and the LoRA shrinks go by entry. Decode from logits in A16, at most E_loc entries (plan.cpp): the
  // routed grids then have the chunk's entries as m tiles, at most max_m_tiles, which still sizes the workspace and
  // the split choice.
  bool entry_tiles = false;
  // With LoRA under entry tiles, on the decode tile: GEMM1's PDL wait (for the x shrink) and GEMM2's (for the a shrink)
  // move from before their mainloops to before their epilogues, the only part that reads the shrink's t rows (the
  // slots come from adapter_ids); each GEMM's mainloop runs beside the shrink before it.
  bool gemms_beside_lora_shrinks = false;

  // Grouped GEMMs.
  int gemm_config = 0;          // index into kGemmConfigs
  GemmConfig gemm;              // = kGemmConfigs[gemm_config]
  int64_t k1_pad = 0, k2_pad = 0;   // K of GEMM1 (H) and GEMM2 (I) padded to gemm.bk
  int64_t n1 = 0;               // GEMM1 output columns (2I gated, I otherwise)
  int64_t n1_tiles = 0, n2_tiles = 0;
  int64_t max_m_tiles = 0;      // upper bound of sum_e ceil(rows_e / bm) over any routing
  // Tile order of the routed GEMMs (src/common/tile_order.h tile_of): bands of m_band1 / m_band2 m tiles, each
  // band's tiles n by n with m fastest, so that the band's token rows (about band_token_bytes) stay in L2 while its
  // weight tiles go by. 0: one band (the grid's m tiles, n tile by n tile; where m_tiles * n_tiles overflows an int).
  int m_band1 = 0, m_band2 = 0;
  int64_t shared_n1 = 0, shared_n1_tiles = 0, shared_m_tiles = 0, shared_k2_pad = 0;
  size_t gemm_smem = 0;         // dynamic shared memory per GEMM block
  // Split-K of the weights-as-A tiles when their grid is small (decode): blocks per tile along K, in whole
  // kKChunk chunks (1 = no split). The bits do not depend on it (every tile sums the same chunk sums in order).
  int split1 = 1, split2 = 1, shared_split1 = 1, shared_split2 = 1;
  // k-blocks a K chunk of each GEMM (decode_chunk_kb: the canonical K order; GemmProblem::chunk_kb).
  int chunk1_kb = kKChunkKb, chunk2_kb = kKChunkKb, shared_chunk1_kb = kKChunkKb, shared_chunk2_kb = kKChunkKb;
  // The routed m tiles split1 / split2 are chosen for: max_m_tiles, or under expert parallelism and on layers of
  // few experts those the chunk's rows fill in expectation under uniform routing (the grid stays max_m_tiles; the
  // blocks of empty tiles exit at once).
  int64_t split_m_tiles = 0;
  // The warp-specialised tile: n tiles a block runs one after the other (the producer loads the next one's first
  // stages during the epilogue of the one before; 1 on every other tile). The bits do not depend on it.
  int ws_sub1 = 1, ws_sub2 = 1, shared_ws_sub1 = 1, shared_ws_sub2 = 1;
  // The routed weights-as-A grids in (n tile, split, m tile) order, so that the blocks of the tiles with rows go
  // first: where the expected tiles are at most half of max_m_tiles (expert parallelism at decode).
  bool gemm_m_last = false;

  // Combine: one thread per 4 outputs of a token.
  int combine_threads = 0;
  int64_t combine_blocks_per_token = 0;

  // A4 quantization kernels: one thread per 16-element block.
  int quant_threads = 0;

  // Workspace regions (offsets from the workspace base, each aligned to kWorkspaceAlign).
  WorkspaceBuffer topk_ids;       // i32 [chunk, k] (routing from logits)
  WorkspaceBuffer topk_weights;   // f32 [chunk, k]
  WorkspaceBuffer block_counts;   // i32 [perm_blocks, E_loc]: per-block expert counts, then bases
  WorkspaceBuffer expert_offsets; // i32 [E_loc + 1]
  WorkspaceBuffer tile_info;      // i32 [max_m_tiles, 2] (expert, first row) + i32 tile count at the end
  WorkspaceBuffer row_entry;      // i32 [rows]: permuted row -> entry t*k + j (chunk-local)
  WorkspaceBuffer x_q;            // A4: bf16 [chunk, H] NVFP4 values of x (e2m1*e4m3)
  WorkspaceBuffer x_scale;        // A4: f32 [chunk] FC1 input dequant scale per token
  WorkspaceBuffer act;            // bf16 [rows, I]: GEMM2 input in permuted row order
  WorkspaceBuffer out;            // f32 [rows, H]: o per entry t*k + j
  WorkspaceBuffer split_partials; // f32: per split tile, per K chunk, the chunk sums of every thread
  WorkspaceBuffer split_counters; // i32 [tiles]: blocks of a split tile done (zero between calls)
  WorkspaceBuffer shared_act;     // bf16 [chunk, shared_I]
  WorkspaceBuffer shared_out;     // f32 [chunk, H]
  // Multi-LoRA (has_lora): the shrink products t = bf16(in . A^T) kept as f32, expanded in the GEMM
  // epilogues (and, for SharedOuter's down projection, in the combine).
  int64_t lora_rank = 0;          // R: max_lora_rank resolved (0 without LoRA)
  int64_t lora_r1_stride = 0;     // 2R: row stride (elements) of lora_t1
  int64_t lora_r2_stride = 0;     // R: row stride of lora_t2, lora_shared_t1, lora_shared_t2
  int lora_shrink1_threads = 0;   // shrink of x: blocks (token, item), warps over the item's K chunks
  int lora_shrink1_rows_per_item = 16;  // rank rows of one A an item (4, 8 or 16), and of a row's shrink2 item:
  int lora_shrink2_rows_per_item = 16;  // fewer spread a few tokens' A rows over more SMs (src/cuda/lora.cu)
  bool lora_shrink_tiled = false;  // the routed shrinks (of x and of a) per GEMM1 row tile, with many rows an expert
                                   // and many tiles (plan.cpp): one read of an adapter's A rows serves the tile's run
                                   // of rows with that adapter
  int lora_shrink2_threads = 0;   // shrink of a: one block per GEMM1 output row, warps over its (chunk, item) units
  // The x shrink's launch runs the chunk's permutation in a block of its own (both wait only for the routing): at
  // decode, where the permutation is one block of a few hundred entries (perm_blocks == 1, rows <= 256).
  bool lora_shrink1_permutes = false;
  WorkspaceBuffer lora_slot;      // i32 [chunk]: each token's checked adapter slot (-1 = base or dropped)
  WorkspaceBuffer lora_t1;        // f32 [rows, 2R] by entry t*k + j (SharedOuter: row t*k for the token)
  WorkspaceBuffer lora_t2;        // f32 [rows, R] by entry
  WorkspaceBuffer lora_shared_t1; // f32 [chunk, R] the shared expert's own LoRA
  WorkspaceBuffer lora_shared_t2; // f32 [chunk, R]
  size_t workspace_bytes = 0;
};

constexpr size_t kWorkspaceAlign = 256;
// The token rows a band of m tiles reads (MoePlan::m_band1/2): 2/15 of the L2 (8 MiB of an H200's 60), the rest
// for the weight tiles in flight and the outputs going by (measured: bench/NOTES.md, "Plan choices"). Bands only
// where the GEMM's token source (x for GEMM1, a for GEMM2) is above band_min_source_bytes (8/15 of the L2); below
// it fits in L2 with room.
constexpr int64_t band_token_bytes(const DeviceDesc& d) { return d.l2_bytes / 15 * 2; }
constexpr int64_t band_min_source_bytes(const DeviceDesc& d) { return d.l2_bytes / 15 * 8; }
static_assert(band_token_bytes(DeviceDesc{}) == int64_t(8) << 20 && band_min_source_bytes(DeviceDesc{}) == int64_t(32) << 20,
              "the H200's bands");
// 4 GiB: a 16384-token batch of kimi_k3_tp8 (1.98 GB), qwen3_30b_a3b or mixtral_8x7b in one chunk, deepseek_v3_ep8
// in two. Larger chunks fill the GEMM tiles with more rows per expert.
constexpr int64_t kDefaultWorkspaceBudget = int64_t(4) << 30;
// Limits of this backend (beyond them: Error Unsupported naming the argument).
constexpr int64_t kMaxTopK = 64;
constexpr int64_t kMaxExpertsRouting = 4096;  // logits width the routing kernel keeps in shared memory
// Routing a token on a block (MoePlan::routing_warps_per_token): up to this many tokens a chunk, more than
// kRoutingBlockMinExperts and up to kRoutingBlockExperts experts (one a thread); methods without a sum over the
// experts.
constexpr int64_t kRoutingBlockTokens = 64, kRoutingBlockMinExperts = 128, kRoutingBlockExperts = 512;
constexpr int64_t kMaxLocalExperts = 4096;    // per-block expert counters and the scan in shared memory
constexpr int64_t kMaxGroups = 64;            // group scores: two registers a routing lane
// Shared-memory floats of one routing warp (src/cuda/routing.cu): scores [E], top-k keys [E].
constexpr int64_t routing_floats_per_warp(int E) { return 2 * E; }
// The block-a-token routing's shared memory: the scores, each warp's best (a 64-bit key each), the chosen ids, the
// group keys (DeepSeekV3 with n_group > 1).
constexpr int64_t routing_block_smem(int64_t E, int64_t k, int64_t warps, int64_t n_group) {
  return ((E * 4 + 7) / 8) * 8 + warps * (k < 32 ? k : 32) * 8 + k * 4 + (n_group > 1 ? n_group * 4 : 0);
}
constexpr int64_t kMaxTokens = int64_t(1) << 30;
constexpr int64_t kMaxHidden = int64_t(1) << 20;  // H, I: keeps every per-row index inside int32
constexpr int64_t kMaxLoraRank = 64;              // an adapter's r (SPEC §5)

// The canonical K order of the GEMMs (docs/numerics.md): chains over K chunks, chunk sums added in order. A GEMM's
// chunks are as few as its one-token decode grid needs along K to reach split_target_blocks on the reference device
// (DeviceDesc{}), in whole chunks of kKChunk, and the whole K where that grid reaches it unsplit (decode_chunk_kb): a
// function of the layer's shape alone (never of T, the device, the tile or LoRA: batch invariance). The LoRA shrinks
// keep chunks of kKChunk. Split-K splits a grid smaller than split_target_blocks (four per SM) towards twice that
// many (plan.cpp), in whole chunks.
constexpr int64_t split_target_blocks(const DeviceDesc& d) { return int64_t(4) * d.sm_count; }
constexpr int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }
// Splits of `chunks` chunks towards `want`, each split whole chunks and none empty.
constexpr int64_t whole_chunk_split(int64_t chunks, int64_t want) { return ceil_div(chunks, ceil_div(chunks, want)); }
// The k-blocks (of 64) of one K chunk of a GEMM of k_pad (K padded to 64) whose decode grid at T = 1 has t1_blocks
// blocks (the last chunk may be short). Measured 2026-12-07 (bench/NOTES.md): towards the target rather than twice
// it, gpt_oss_120b T = 4096 0.93 of chunks of 512 against 0.96, mixtral_8x7b 0.88-0.96; T = 1 1.04 against 0.98.
constexpr int64_t decode_chunk_kb(int64_t k_pad, int64_t t1_blocks) {
  const int64_t kb = k_pad / 64 > 0 ? k_pad / 64 : 1, chunks = ceil_div(k_pad, kKChunk);
  const int64_t target = split_target_blocks(DeviceDesc{});
  if (t1_blocks >= target || chunks < 2) return kb;  // one chain: the unsplit grid fills the GPU
  const int64_t want = std::min(chunks, ceil_div(target, std::max<int64_t>(t1_blocks, 1)));
  return std::min(kb, ceil_div(chunks, whole_chunk_split(chunks, want)) * kKChunkKb);
}
// A chunk of at most this many (token, slot) entries is permuted by one kernel of one block (count, scan and
// in-order placement; src/cuda/permute.cu), larger ones by three kernels over many blocks. (Its placement is one
// warp's serial walk, 32 steps at 1024 entries: from kMidPermAbove entries 32 warps place instead, perm_mid.)
constexpr int64_t kOneBlockPermEntries = 1024;
// From more than kMidPermAbove up to kMidPermEntries entries on at most kMidPermExperts local experts, one block of
// 32 warps runs the three steps instead (MoePlan::perm_mid): each warp counts its own run of entries, then places
// them by the ranks kept. Measured (bench/NOTES.md): 0.90-0.99 of the layer at 512-1024 entries,
// 0.95-0.99 at 2048; beyond, 1.02-1.06 (the three kernels spread over the SMs).
constexpr int64_t kMidPermAbove = 256, kMidPermEntries = 2048, kMidPermExperts = 512;
// LoRA at decode: the x shrink's launch also permutes a chunk of up to this many entries (MoePlan::lora_shrink1_permutes).
constexpr int64_t kShrinkPermuteRows = 256;
// A layer of at most this many experts (E_total) skips the 32-row mma.sync tile (make_plan's tile choice).
constexpr int64_t kFewExperts = 16;
// With LoRA on experts this thin (I <= kLoraThinI) the wgmma tile waits for kLoraThinRows expected rows an expert, not
// 32 (make_plan's tile choice; measured on qwen3_30b_a3b_tp4, I = 192: bench/NOTES.md).
constexpr int64_t kLoraThinI = 256, kLoraThinRows = 80;
// The warp-specialised wgmma tile from this many expected rows an expert, on experts of I >= kWsMinI (make_plan).
constexpr int64_t kWsRows = 64, kWsMinI = 192;
// Its 64-token form where the plan would take Wgmma64, on experts of I >= kWs64MinI; its 32-token form up to
// kWs32MaxRows expected rows an expert where both GEMMs' K (H and I) are at least kWs32MinK (make_plan).
constexpr int64_t kWs64MinI = 384, kWs32MaxRows = 20, kWs32MinK = 4096;
// Its blocks run up to kWsMaxSub n tiles of their m tile in turn where K is at most kWsSubMaxK and the grid is at
// least kWsSubWaves blocks an SM (MoePlan::ws_sub1).
constexpr int64_t kWsMaxSub = 4, kWsSubMaxK = 1024, kWsSubWaves = 16;

constexpr int kNumGemmConfigs = 8;
inline constexpr GemmConfig kGemmConfigs[kNumGemmConfigs] = {
    {8, 128, 64, 1, 4, 8, true},   // decode: <= 8 rows per expert tile, 32 weight rows a warp, many bytes in flight
    {32, 128, 64, 1, 4, 6, true},  // up to 512 rows an expert (plan.cpp), in tiles of <= 32 rows
    {64, 128, 64, 2, 4, 3},        // more rows an expert (a 128-row tile ran 1 block an SM at 244 registers: slower)
    // sm_90a: two warpgroups, each 64 weight rows (register A) x the 64 tokens (shared B) with wgmma; two blocks an SM.
    {64, 128, 64, 1, 8, 4, true, true},
    // 5-12 rows an expert (plan.cpp): the 8-row tile reads an expert's weights twice, the 32-row one is capped at
    // 128 registers (four blocks an SM).
    {16, 128, 64, 1, 4, 6, true},
    // sm_90a, many rows an expert: 128 tokens x 256 weight rows, two math warpgroups of 128 weight rows (32 a warp),
    // a producer warpgroup; one block an SM (the chunk sums take 128 KB).
    {128, 256, 64, 1, 8, 3, true, true, true},
    // The same with 64 and 32 tokens: half and a quarter of the chunk sums (64 and 32 KB), so eight and ten stages.
    {64, 256, 64, 1, 8, 8, true, true, true},
    {32, 256, 64, 1, 8, 10, true, true, true},
    // (A 128-token wgmma tile with producer warps and one persistent block an SM was retired: with the tile bands
    // it was never faster than the one above; it is in git history up to revision 1ee7f89.)
};
// The stage bytes of a tile (tokens, weights, their scales) and its dynamic shared memory: a wgmma tile's stages
// start 1024-byte aligned (the 128-byte swizzle's atom), with 1 KB to align the base (src/cuda/gemm/tile_config.cuh).
// The weight rows of a tile for a weight format: a warp-specialised tile's bf16 weights take half of them.
constexpr int gemm_bn(const GemmConfig& g, bool fp4) { return g.ws && !fp4 ? g.bn / 2 : g.bn; }
constexpr int64_t gemm_stage_bytes(const GemmConfig& g, bool fp4) {
  const int64_t bn = gemm_bn(g, fp4);
  const int64_t b = fp4 ? bn * (g.bk / 2 + g.bk / 16) : bn * g.bk * 2, raw = g.bm * g.bk * 2 + b;
  return g.wgmma ? (raw + 1023) / 1024 * 1024 : raw;
}
// wgmma: a float4 a thread per 8 tokens and 16 weight rows of its warp.
constexpr int64_t gemm_chunk_sum_bytes(const GemmConfig& g, bool fp4) {
  return g.wgmma ? int64_t(g.threads()) * (g.bm / 8) * (gemm_bn(g, fp4) / g.warps_n / 16) * 16 : 0;
}
// A tile's dynamic shared memory with `stages` stages.
constexpr int64_t gemm_smem_bytes_at(const GemmConfig& g, bool fp4, int stages) {
  return stages * gemm_stage_bytes(g, fp4) + (g.wgmma ? 1024 : 0) + gemm_chunk_sum_bytes(g, fp4);
}
// A warp-specialised tile keeps its dynamic shared memory within kWsSmemCap (sm_90's 227 KB a block less the WS
// kernel's static shared memory, up to about 8 KB): its bf16 form, twice the weight bytes a stage, runs fewer stages.
constexpr int64_t kWsSmemCap = 212 * 1024;
constexpr int gemm_stages(const GemmConfig& g, bool fp4) {
  int s = g.stages;
  while (g.ws && s > 2 && gemm_smem_bytes_at(g, fp4, s) > kWsSmemCap) --s;
  return s;
}
constexpr int64_t gemm_smem_bytes(const GemmConfig& g, bool fp4) {
  return gemm_smem_bytes_at(g, fp4, gemm_stages(g, fp4));
}

// Throws Error(InvalidArgument/Unsupported) naming the argument for shapes the kernels cannot take.
MoePlan make_plan(const ProblemShape& shape);
size_t workspace_size(const ProblemShape& shape);
// Throws Error(InvalidArgument, "gemm_tile") unless -1 <= gemm_tile < kNumGemmConfigs (MoeArgs::gemm_tile, on
// every backend; make_plan checks ProblemShape::gemm_config with it).
void check_gemm_tile(int gemm_tile);

}  // namespace fp4moe
