// make_plan: tile configuration, launch grids and workspace layout of the CUDA backend, on the host.
// Every kernel bound (grid sizes, loop trip counts, buffer sizes) derives from the numbers chosen here;
// tests/cpp/test_plan.cpp sweeps shapes and checks the invariants the kernels rely on.
#include "runtime/plan.h"
#include "runtime/host_tensor.h"

#include <algorithm>
#include <cmath>
#include <string>

namespace fp4moe {
using detail::invalid;
namespace {

[[noreturn]] void unsupported(const char* arg, const std::string& what) { throw Error(ErrorCode::Unsupported, arg, what); }

int64_t round_up(int64_t a, int64_t b) { return ceil_div(a, b) * b; }

// The m tiles of bm rows that T tokens fill in expectation under uniform routing: a token's k experts are distinct,
// so each of the E_loc local experts gets c ~ Binomial(T, k / E_total) rows, and E_loc * E[ceil(c / bm)] tiles.
// Negative: the sum could not be formed (pmf(0) underflows), count the bound instead. The sum stops once past
// the mean the terms fall below 1e-13 of it (the tail is geometric there): make_plan runs on every call.
double expected_m_tiles(int64_t T, int64_t k, int64_t E_loc, int64_t E_total, int64_t bm) {
  const double p = std::min(1.0, static_cast<double>(k) / static_cast<double>(E_total));
  if (p >= 1.0) return static_cast<double>(E_loc * ceil_div(T, bm));
  const double odds = p / (1.0 - p), mean = static_cast<double>(T) * p;
  double pmf = std::pow(1.0 - p, static_cast<double>(T)), tiles = 0.0;  // pmf(c), from c = 0
  if (pmf <= 0.0) return -1.0;
  int64_t tiles_c = 0, left = 0;  // ceil(c / bm) for c = c + 1 below, and the rows its last tile still takes
  for (int64_t c = 0; c < T; ++c) {
    pmf *= static_cast<double>(T - c) / static_cast<double>(c + 1) * odds;  // pmf(c + 1)
    if (left == 0) { ++tiles_c; left = bm; }
    --left;
    tiles += pmf * static_cast<double>(tiles_c);
    if (static_cast<double>(c + 1) > mean && pmf * static_cast<double>(tiles_c) < 1e-13 * tiles) break;
  }
  return static_cast<double>(E_loc) * tiles;
}

// Lays out buffers one after the other, each aligned to kWorkspaceAlign; zero-size buffers get offset 0.
struct Layout {
  size_t end = 0;
  WorkspaceBuffer take(int64_t bytes) {
    WorkspaceBuffer b;
    if (bytes <= 0) return b;
    b.offset = end;
    b.bytes = static_cast<size_t>(bytes);
    end = static_cast<size_t>(round_up(static_cast<int64_t>(end) + bytes, kWorkspaceAlign));
    return b;
  }
};

void check_shape(const ProblemShape& s) {
  const auto in_range = [](int64_t v, int64_t lo, int64_t hi) { return v >= lo && v <= hi; };
  if (s.T < 0) invalid("T", "expected T >= 0, got " + std::to_string(s.T));
  if (s.T > kMaxTokens) unsupported("T", "at most " + std::to_string(kMaxTokens) + " tokens, got " + std::to_string(s.T));
  if (s.H < 16 || s.H % 16) invalid("H", "expected a positive multiple of 16, got " + std::to_string(s.H));
  if (s.I < 16 || s.I % 16) invalid("I", "expected a positive multiple of 16, got " + std::to_string(s.I));
  if (s.H > kMaxHidden) unsupported("H", "at most " + std::to_string(kMaxHidden) + ", got " + std::to_string(s.H));
  if (s.I > kMaxHidden) unsupported("I", "at most " + std::to_string(kMaxHidden) + ", got " + std::to_string(s.I));
  if (s.E_loc < 1) invalid("E_loc", "expected >= 1 local expert, got " + std::to_string(s.E_loc));
  if (s.E_loc > kMaxLocalExperts)
    unsupported("E_loc", "at most " + std::to_string(kMaxLocalExperts) + " local experts, got " + std::to_string(s.E_loc));
  const int64_t E_total = s.E_total == 0 ? s.E_loc : s.E_total;
  if (E_total < s.E_loc) invalid("num_experts_total", "expected >= E_loc, got " + std::to_string(E_total));
  if (E_total > (int64_t(1) << 30)) unsupported("num_experts_total", "too many experts: " + std::to_string(E_total));
  if (!in_range(s.k, 1, E_total)) invalid("routing.top_k", "expected 1 <= top_k <= " + std::to_string(E_total) + ", got " + std::to_string(s.k));
  if (s.k > kMaxTopK) unsupported("routing.top_k", "at most " + std::to_string(kMaxTopK) + ", got " + std::to_string(s.k));
  if (s.routing_from_logits && E_total > kMaxExpertsRouting)
    unsupported("routing.logits", "device routing keeps at most " + std::to_string(kMaxExpertsRouting) +
                                      " experts per token, got " + std::to_string(E_total));
  if (s.routing_from_logits && (s.n_group < 1 || s.n_group > kMaxGroups))
    unsupported("routing.n_group", "expected 1 <= n_group <= " + std::to_string(kMaxGroups) + ", got " + std::to_string(s.n_group));
  if (is_gated(s.activation) != s.gated)
    invalid("activation.type", std::string(to_string(s.activation)) + (s.gated ? " is not gated" : " is gated") +
                               " but the weights are " + (s.gated ? "gated" : "not gated"));
  if (s.mode != ActMode::A16 && s.mode != ActMode::A4) invalid("mode", "expected A16 or A4");
  if (s.format != WeightFormat::NVFP4 && s.format != WeightFormat::BF16 && s.format != WeightFormat::MXFP4)
    invalid("format", "expected NVFP4, BF16 or MXFP4");
  if (s.has_shared && (s.shared_I < 16 || s.shared_I % 16))
    invalid("shared_expert", "intermediate size must be a positive multiple of 16, got " + std::to_string(s.shared_I));
  if (s.has_shared && s.shared_I > kMaxHidden) unsupported("shared_expert", "intermediate size too large");
  if (s.max_lora_rank < 0 || s.max_lora_rank > kMaxLoraRank)
    invalid("max_lora_rank", "expected 0 (unknown) or 1.." + std::to_string(kMaxLoraRank) + ", got " +
                             std::to_string(s.max_lora_rank));
  if (s.workspace_budget < 0) invalid("workspace_budget", "expected >= 0");
  check_gemm_tile(s.gemm_config);
  if (s.gemm_config >= 0 && kGemmConfigs[s.gemm_config].wgmma && !s.device.wgmma)
    unsupported("gemm_tile", "tile " + std::to_string(s.gemm_config) + " needs wgmma (compute capability 9.0)");
}

}  // namespace

MoePlan make_plan(const ProblemShape& shape) {
  check_shape(shape);
  MoePlan p;
  p.shape = shape;
  ProblemShape& s = p.shape;
  if (s.E_total == 0) s.E_total = s.E_loc;
  if (s.workspace_budget == 0) s.workspace_budget = kDefaultWorkspaceBudget;
  const int64_t H = s.H, I = s.I, k = s.k;
  p.n1 = s.gated ? 2 * I : I;

  // Bytes per token of the token-proportional buffers (an upper estimate; the layout below is exact).
  int64_t per_token = k * (4 + 4 + 4) + k * I * 2 + k * H * 4 + k * 2 /* tiles, perm counters */;
  if (s.mode == ActMode::A4) per_token += H * 2 + 4;
  if (s.has_shared) per_token += s.shared_I * 2 + H * 4;
  // Rows (token, slot) of one chunk stay below 2^30 so every row index fits int32 with room to spare.
  const int64_t max_chunk_rows = int64_t(1) << 30;
  int64_t chunk = std::max<int64_t>(1, s.workspace_budget / per_token);
  chunk = std::min(chunk, max_chunk_rows / k);
  // The fewest chunks the budget allows, of equal size (the last one at most num_chunks - 1 tokens short): a small
  // last chunk would pay the whole pipeline's fixed costs for a few tokens, and its experts' tiles run nearly empty.
  p.num_chunks = s.T == 0 ? 0 : ceil_div(s.T, chunk);
  p.chunk_tokens = s.T == 0 ? 0 : ceil_div(s.T, p.num_chunks);
  p.rows = p.chunk_tokens * k;

  // Routing: one warp per token, each with its shared-memory scores, keys and group scores (the kernel runs only
  // from logits, where E_total <= kMaxExpertsRouting).
  const int64_t routing_floats = routing_floats_per_warp(static_cast<int>(std::min(s.E_total, kMaxExpertsRouting)));
  p.routing_warps_per_block = routing_floats * 4 * 4 <= 48 * 1024 ? 4 : (routing_floats * 4 * 2 <= 48 * 1024 ? 2 : 1);
  p.routing_smem = static_cast<size_t>(routing_floats * 4 * p.routing_warps_per_block);
  p.routing_blocks = ceil_div(p.chunk_tokens, p.routing_warps_per_block);
  // A few tokens: a block a token, an expert a thread, the top-k merged from each warp's best (routing.cu); the
  // same selection and weights as a warp a token, whose one warp walked the experts E / 32 times (and DeepSeekV3's
  // groups one after another). Measured 2026-12-04 against a warp a token: kimi_k3_tp8 (384 experts) T = 2..64
  // 0.96-0.99, LoRA T=1 0.97, base T=1 1.005; gpt_oss_120b (128) 1.00-1.04: so from more than 128 experts;
  // deepseek_v3_ep8 (8 groups, 2026-12-07) T = 1 / 8 / 64 0.94 / 0.98 / 0.99.
  if (s.routing_from_logits && p.chunk_tokens <= kRoutingBlockTokens && s.E_total > kRoutingBlockMinExperts &&
      s.E_total <= kRoutingBlockExperts && !s.routing_sums_experts) {
    p.routing_warps_per_token = static_cast<int>(ceil_div(s.E_total, 32));
    p.routing_blocks = p.chunk_tokens;
    p.routing_smem = static_cast<size_t>(routing_block_smem(s.E_total, k, p.routing_warps_per_token, s.n_group));
  }

  // Permutation: up to kOneBlockPermEntries entries in one kernel of one block; above, one warp per block of
  // entries, at most ~1024 blocks so the scan stays short.
  p.perm_entries = p.rows <= kOneBlockPermEntries
                       ? static_cast<int>(kOneBlockPermEntries)
                       : static_cast<int>(std::max<int64_t>(256, round_up(ceil_div(p.rows, 1024), 32)));
  p.perm_blocks = ceil_div(p.rows, p.perm_entries);
  p.perm_smem = static_cast<size_t>(s.E_loc * 4);
  p.perm_mid = p.rows > kMidPermAbove && p.rows <= kMidPermEntries && s.E_loc <= kMidPermExperts;

  // Entry tiles (MoePlan::entry_tiles) where the chunk's local entries exceed the distinct local experts they reach by
  // at most 10 % in expectation under uniform routing (E_loc (1 - (1 - k / E_total)^T) of them): an expert that two
  // entries share is read by both tiles. Measured 2026-12-03 against the permutation (bench/NOTES.md): T=1 0.89-0.96
  // on every SPEC shape; T=2..8 0.85-0.99 within the bound, above it qwen3_30b_a3b T=8 (24 %) 1.11, mixtral_8x7b T=4
  // (46 %) 1.35.
  const double local_entries = static_cast<double>(p.rows * s.E_loc) / static_cast<double>(s.E_total);
  const double local_experts = static_cast<double>(s.E_loc) *
      (1.0 - std::pow(1.0 - static_cast<double>(k) / static_cast<double>(s.E_total), static_cast<double>(p.chunk_tokens)));
  p.entry_tiles = s.routing_from_logits && s.mode == ActMode::A16 && p.rows > 0 &&
                  p.rows <= s.E_loc && local_entries <= 1.1 * local_experts;
  // GEMM tile: by the expected rows per expert, rows / E_total (under EP a local expert expects the share of any
  // other). Any choice gives the same bits (every tile follows the same K order), so it may depend on T without
  // breaking batch invariance. Measurements behind each threshold: bench/NOTES.md, "Plan choices".
  const int64_t avg_rows = ceil_div(p.rows, s.E_total);
  // sm_90a: the wgmma tile from 32 expected rows a local expert (rows / E_total under EP); with LoRA on the thinnest
  // experts (qwen3_30b_a3b_tp4, I = 192: 1.13-1.18x at 64 rows against the 32-row tile) from 80. kimi_k3_tp8 (I = 384)
  // and qwen3_30b_a3b (768) gain from 32 rows with LoRA too (2026-12-04: 0.87-0.98 at 32-64 rows).
  const bool lora_thin = s.has_lora && s.I <= kLoraThinI && p.rows < kLoraThinRows * s.E_total;
  // Layers of few experts (mixtral_8x7b: 8, I = 14336): the 32-row mma.sync tile ran slower than the 8-row tile
  // up to 8 rows an expert and than the wgmma tile above, so it is skipped there.
  // The 16-row tile from 5 to 12 expected rows (measured 2026-12-03 against the 32-row tile: gpt_oss_120b T=256
  // 0.88, kimi_k3_tp8 T=512 0.92, qwen3_30b_a3b T=128 0.91, deepseek_v3_ep8 T=256 0.95; mixtral_8x7b T=48 395
  // against 474 us on the wgmma tile; at 16 rows it lost to the 32-row tile by 3-10 % but on qwen3_30b_a3b_tp4;
  // against the 8-row tile: deepseek_v3_ep8 T=160 / 192 0.97 / 0.93, kimi_k3_tp8 T=256 0.97, at 4 rows 1.01).
  const bool few_experts = s.E_total <= kFewExperts;
  // The warp-specialised wgmma tile (128 tokens x 256 weight rows, one block an SM) from kWsRows expected rows an
  // expert on experts of I >= kWsMinI, NVFP4 weights without LoRA (the cases measured: bench/NOTES.md, "A warp-
  // specialised wgmma tile"; I = 192, qwen3_30b_a3b_tp4, since the token-major epilogue: T = 4096 / 16384 0.86 /
  // 0.82 of Wgmma64's time); from 64 since its wgmmas take a tile of up to 64 rows as 64 tokens (2026-12-07, at 64
  // expected rows against the plan's 64-token tiles: mixtral_8x7b T = 256 0.82, deepseek_v3_ep8 T = 2048 0.89,
  // gpt_oss_120b T = 2048 0.95, qwen3_30b_a3b T = 1024 0.97, qwen3_30b_a3b_tp4 T = 1024 0.98; at 32-43 rows
  // 1.13-1.17); below, its mostly empty 128-row tiles.
  // Where Wgmma64 would run, its 64-token form WgmmaWs64 on experts of I >= kWs64MinI (measured 2026-12-07, forced
  // tiles on the SPEC shapes at 32-64 rows an expert: 0.90-1.01 of Wgmma64's time, median 0.98; I = 192 1.02-1.08),
  // and its 32-token form WgmmaWs32 up to kWs32MaxRows where H and I are both at least kWs32MinK (mixtral_8x7b
  // T = 64, 16 rows: 0.83; on shorter K, or past 20 rows where an expert's rows often pass 32, 1.07-1.5).
  const bool fp4 = is_fp4(s.format);  // MXFP4 shares NVFP4's prepared layout and kernels
  const bool ws_ok = fp4 && !s.has_lora;
  const bool ws = ws_ok && avg_rows >= kWsRows && s.I >= kWsMinI;
  auto choose = [&](bool wgmma) {
    GemmTile t = GemmTile::TokensAsA64;
    if (wgmma && ws) t = GemmTile::WgmmaWs128;
    else if (wgmma && p.rows >= 32 * s.E_total && !lora_thin) t = GemmTile::Wgmma64;
    else if (avg_rows <= (few_experts ? 8 : 4)) t = GemmTile::SplitKDecode;
    else if (avg_rows <= 12) t = GemmTile::WeightsAsA16;
    else if (few_experts && wgmma) t = GemmTile::Wgmma64;
    else if (avg_rows <= 512) t = GemmTile::WeightsAsA32;
    if (t == GemmTile::Wgmma64 && ws_ok) {
      if (avg_rows <= kWs32MaxRows && H >= kWs32MinK && s.I >= kWs32MinK) t = GemmTile::WgmmaWs32;
      else if (s.I >= kWs64MinI) t = GemmTile::WgmmaWs64;
    }
    return static_cast<int>(t);
  };
  p.gemm_config = s.gemm_config >= 0 ? s.gemm_config : choose(s.device.wgmma);
  p.gemm = kGemmConfigs[p.gemm_config];
  const GemmConfig& g = p.gemm;
  p.k1_pad = round_up(H, g.bk);
  p.k2_pad = round_up(I, g.bk);
  p.n1_tiles = ceil_div(p.n1, gemm_bn(g, fp4));
  p.n2_tiles = ceil_div(H, gemm_bn(g, fp4));
  // sum_e ceil(c_e / bm) <= ceil(rows / bm) + (number of non-empty experts) <= ceil(rows/bm) + min(E_loc, rows).
  auto m_tiles_of = [&](const GemmConfig& c) {
    return p.rows == 0 ? 0 : ceil_div(p.rows, c.bm) + std::min<int64_t>(s.E_loc, p.rows);
  };
  p.max_m_tiles = m_tiles_of(g);
  // max_m_tiles bounds the tiles of any routing. Under expert parallelism and on layers of few experts the
  // split-K choice counts the tiles the chunk fills in expectation under uniform routing instead (their blocks do
  // the work; the others exit at once): deepseek_v3_ep8 (32 of 256 experts) at T=1 has room for nine m tiles and
  // fills one. On the other layers counting the expected tiles gained nothing and cost qwen3_30b_a3b_tp4 5 % at
  // T=64 (bench/NOTES.md). Only the one-block permutation's chunks split (at most kOneBlockPermEntries rows).
  // m_tiles: the bound, m_tiles_of(c), for a chunk of `tokens` tokens (p.chunk_tokens, or one: decode_chunk_kb).
  auto split_m_tiles_of = [&](int64_t bm, int64_t tokens, int64_t m_tiles) {
    const bool loose = s.E_loc < s.E_total || s.E_total <= kFewExperts;
    if (!loose || tokens == 0 || tokens * k > kOneBlockPermEntries) return m_tiles;
    const double e = expected_m_tiles(tokens, k, s.E_loc, s.E_total, bm);
    if (e < 0.0) return m_tiles;
    return std::clamp<int64_t>(static_cast<int64_t>(std::ceil(e - 1e-6)), 1, m_tiles);
  };
  // Bands of m tiles: without them a chunk whose token rows outgrow the L2 reads them from HBM again for every n
  // tile. Where the GEMM's token source (x for GEMM1, a for GEMM2) fits in L2 with room, one band.
  auto band_of = [&](int64_t source_rows, int64_t K, int64_t n_tiles) {
    if (p.max_m_tiles * n_tiles > 0x7fffffff || source_rows * K * 2 <= band_min_source_bytes(s.device)) return 0;
    const int64_t band = band_token_bytes(s.device) / (g.bm * K * 2);
    return static_cast<int>(std::clamp<int64_t>(band, 1, std::max<int64_t>(1, p.max_m_tiles)));
  };
  p.m_band1 = band_of(p.chunk_tokens, p.k1_pad, p.n1_tiles);
  p.m_band2 = band_of(p.rows, p.k2_pad, p.n2_tiles);
  if (s.has_shared) {
    p.shared_n1 = s.gated ? 2 * s.shared_I : s.shared_I;
    p.shared_n1_tiles = ceil_div(p.shared_n1, gemm_bn(g, fp4));
    p.shared_m_tiles = ceil_div(p.chunk_tokens, g.bm);
    p.shared_k2_pad = round_up(s.shared_I, g.bk);
  }
  // The canonical K order of each GEMM (decode_chunk_kb): from its grid on the decode tile at T = 1, m tiles as
  // split_m_tiles_of counts them there (one for the shared expert) times the decode tile's n tiles.
  const GemmConfig& dc = kGemmConfigs[static_cast<int>(GemmTile::SplitKDecode)];
  const int64_t t1_m = split_m_tiles_of(dc.bm, 1, ceil_div(k, dc.bm) + std::min<int64_t>(s.E_loc, k));
  const int64_t dbn = gemm_bn(dc, fp4);
  p.chunk1_kb = static_cast<int>(decode_chunk_kb(p.k1_pad, t1_m * ceil_div(p.n1, dbn)));
  p.chunk2_kb = static_cast<int>(decode_chunk_kb(p.k2_pad, t1_m * ceil_div(H, dbn)));
  if (s.has_shared) {
    p.shared_chunk1_kb = static_cast<int>(decode_chunk_kb(p.k1_pad, ceil_div(p.shared_n1, dbn)));
    p.shared_chunk2_kb = static_cast<int>(decode_chunk_kb(p.shared_k2_pad, ceil_div(H, dbn)));
  }
  // Split-K: mma.sync weights-as-A tiles on a grid below split_target_blocks, when the one-block permutation (which
  // zeroes the counters; under entry tiles the routing does) runs, split towards twice that many blocks; larger
  // grids stay whole (splitting them was slower). Whole chunks per block; no block without a chunk.
  int64_t partial_floats = 0, counters = 0;
  // The grid's blocks (partials, counters) are m_tiles x n_tiles; the choice counts work_m_tiles x n_tiles.
  auto split_of = [&](const GemmConfig& c, int64_t m_tiles, int64_t work_m_tiles, int64_t n_tiles, int64_t k_pad,
                      int chunk_kb) {
    const int64_t blocks = m_tiles * n_tiles, work = work_m_tiles * n_tiles, chunks = ceil_div(k_pad / 64, chunk_kb);
    const int64_t target = split_target_blocks(s.device);
    if (!c.weights_as_a || c.wgmma || p.perm_blocks != 1 || work == 0 || work >= target || chunks < 2) return 1;
    const int64_t want = std::min(chunks, ceil_div(2 * target, work));
    const int64_t split = whole_chunk_split(chunks, want);
    const int64_t rows_per_warp = c.bn / c.warps_n;  // accumulators: (bm / 8) token groups x (rows / 16) x 4
    partial_floats = std::max(partial_floats, blocks * chunks * c.threads() * (c.bm / 8) * (rows_per_warp / 16) * 4);
    counters = std::max(counters, blocks);
    return static_cast<int>(split);
  };
  auto splits = [&](const GemmConfig& c) {
    const int64_t m = m_tiles_of(c), n1t = ceil_div(p.n1, c.bn), n2t = ceil_div(H, c.bn);
    p.split_m_tiles = split_m_tiles_of(c.bm, p.chunk_tokens, m);
    p.split1 = split_of(c, m, p.split_m_tiles, n1t, p.k1_pad, p.chunk1_kb);
    p.split2 = split_of(c, m, p.split_m_tiles, n2t, p.k2_pad, p.chunk2_kb);
    if (s.has_shared) {
      const int64_t sm = ceil_div(p.chunk_tokens, c.bm), sn1t = ceil_div(p.shared_n1, c.bn);
      p.shared_split1 = split_of(c, sm, sm, sn1t, p.k1_pad, p.shared_chunk1_kb);
      p.shared_split2 = split_of(c, sm, sm, n2t, p.shared_k2_pad, p.shared_chunk2_kb);
    }
  };
  // The workspace is sized for the tile the device-independent choice takes too, so that workspace_size (which
  // the caller asks without a device) holds on every device; the splits are those of the tile that runs (last).
  const GemmConfig& g0 = kGemmConfigs[s.gemm_config >= 0 ? s.gemm_config : choose(false)];
  splits(g0);
  splits(g);
  // WS sub-tiles where K is short (the fill and the epilogue are much of a tile) and the grid is many waves: measured
  // 2026-12-06 (bench/NOTES.md) kimi_k3_tp8 T=4096 0.93 with four a block; with two on long K deepseek_v3_ep8
  // T=4096 (K = 2048, 7168) 1.08, mixtral_8x7b T=1024 1.13 (fewer, longer blocks).
  auto ws_sub = [&](int64_t k_pad, int64_t m_tiles, int64_t n_tiles) {
    const bool sub = g.ws && k_pad <= kWsSubMaxK && m_tiles * n_tiles >= kWsSubWaves * s.device.sm_count;
    return static_cast<int>(sub ? std::min(kWsMaxSub, n_tiles) : 1);
  };
  p.ws_sub1 = ws_sub(p.k1_pad, p.max_m_tiles, p.n1_tiles);
  p.ws_sub2 = ws_sub(p.k2_pad, p.max_m_tiles, p.n2_tiles);
  if (s.has_shared) {
    p.shared_ws_sub1 = ws_sub(p.k1_pad, p.shared_m_tiles, p.shared_n1_tiles);
    p.shared_ws_sub2 = ws_sub(p.shared_k2_pad, p.shared_m_tiles, p.n2_tiles);
  }
  // The tiles with rows first (GemmProblem::m_last), measured 2026-12-03 (bench/NOTES.md): deepseek_v3_ep8 T=1
  // 48.7 -> 45.9 us; on every grid it ranged 0.94-1.08 (kimi_k3_tp8 T=8 1.077), so it is kept to grids of mostly
  // empty tiles.
  p.gemm_m_last = p.max_m_tiles > 0 && 2 * p.split_m_tiles <= p.max_m_tiles;
  // With LoRA under entry tiles each GEMM follows a shrink but needs it only in its epilogue: on the decode tile
  // (whose LoRA lookup reads no t values) GEMM1's mainloop runs beside the x shrink, GEMM2's beside the a shrink.
  // Measured 2026-12-03 (bench/NOTES.md), 96 LoRA cases at T = 1..8 each: GEMM1's median 0.959 (T=1 0.91-0.94),
  // GEMM2's then 0.977 (T=1 0.93-0.97).
  p.gemms_beside_lora_shrinks =
      p.entry_tiles && s.has_lora && p.gemm_config == static_cast<int>(GemmTile::SplitKDecode);
  const int64_t tile_info_tiles = std::max(p.max_m_tiles, m_tiles_of(g0));
  p.gemm_smem = static_cast<size_t>(gemm_smem_bytes(g, fp4));
  if (p.max_m_tiles > 0x7fffffff || p.shared_m_tiles > 0x7fffffff)
    unsupported("T", "too many row tiles for one launch");
  if (p.n1_tiles > 65535 || p.n2_tiles > 65535 || p.shared_n1_tiles > 65535) unsupported("H", "too many column tiles");

  p.combine_threads = 128;
  p.combine_blocks_per_token = ceil_div(H / 4, p.combine_threads);
  p.quant_threads = 128;

  // Workspace.
  Layout L;
  const int64_t Tc = p.chunk_tokens, R = p.rows;
  if (s.routing_from_logits) {
    p.topk_ids = L.take(Tc * k * 4);
    p.topk_weights = L.take(Tc * k * 4);
  }
  p.block_counts = L.take(p.perm_blocks * s.E_loc * 4);
  p.expert_offsets = L.take(R == 0 ? 0 : (s.E_loc + 1) * 4);
  p.tile_info = L.take(R == 0 ? 0 : (tile_info_tiles * 2 + 1) * 4);
  p.row_entry = L.take(R * 4);
  if (s.mode == ActMode::A4) {
    p.x_q = L.take(Tc * H * 2);
    p.x_scale = L.take(Tc * 4);
  }
  p.act = L.take(R * I * 2);
  p.out = L.take(R * H * 4);
  p.split_partials = L.take(partial_floats * 4);
  p.split_counters = L.take(counters * 4);
  if (s.has_shared) {
    p.shared_act = L.take(Tc * s.shared_I * 2);
    p.shared_out = L.take(Tc * H * 4);
  }
  // LoRA buffers last, sized per chunk token: they are not part of per_token above, so the chunking (and
  // with it the GEMM tile choice) is the same with and without LoRA.
  if (s.has_lora) {
    p.lora_rank = s.max_lora_rank > 0 ? s.max_lora_rank : kMaxLoraRank;
    p.lora_r1_stride = 2 * p.lora_rank;
    p.lora_r2_stride = p.lora_rank;
    // The per-token / per-row shrinks (src/cuda/lora.cu): with few entries (decode) an item of 4 rank rows and a
    // warp a K chunk of H (4..16 warps), spreading a token's A rows over many SMs; with more, 16 rows an item (one
    // read of x serves 16 A rows, fewer blocks) and 4 warps a block.
    // A decode row's shrink2 (K = I) likewise: 4 rank rows an item while I has few chunks, else 16 (long K in small
    // items spreads too thin), and a warp a (chunk, item) unit, 4..16 warps.
    const bool few = p.rows <= 64;
    const int64_t chunks2 = ceil_div(s.I, kKChunk);
    p.lora_shrink1_rows_per_item = few ? 4 : 16;
    p.lora_shrink2_rows_per_item = few && chunks2 < 4 ? 4 : 16;
    p.lora_shrink1_threads = few ? static_cast<int>(32 * std::clamp<int64_t>(ceil_div(s.H, kKChunk), 4, 16)) : 128;
    p.lora_shrink2_threads =
        few ? static_cast<int>(32 * std::clamp<int64_t>(chunks2 * (16 / p.lora_shrink2_rows_per_item), 4, 16)) : 128;
    // The tiled routed shrinks where they measured faster: at least 20 rows an expert and 300 row tiles expected,
    // counting only this rank's share of the rows under EP (few tiles leave the tiled kernel too few warps).
    const int64_t local_rows = ceil_div(p.rows * s.E_loc, s.E_total);
    // Under entry tiles no permutation runs: the shrinks go by entry (the x shrink per token, the a shrink per entry).
    p.lora_shrink_tiled =
        !p.entry_tiles && ceil_div(local_rows, s.E_loc) >= 20 && ceil_div(local_rows, g.bm) + s.E_loc >= 300;
    p.lora_shrink1_permutes =
        !p.entry_tiles && p.perm_blocks == 1 && p.rows <= kShrinkPermuteRows && s.E_loc <= 1024;
    p.lora_slot = L.take(Tc * 4);
    p.lora_t1 = L.take(R * p.lora_r1_stride * 4);
    p.lora_t2 = L.take(R * p.lora_r2_stride * 4);
    if (s.has_shared) {
      p.lora_shared_t1 = L.take(Tc * p.lora_r2_stride * 4);
      p.lora_shared_t2 = L.take(Tc * p.lora_r2_stride * 4);
    }
  }
  p.workspace_bytes = L.end;
  return p;
}

size_t workspace_size(const ProblemShape& shape) { return make_plan(shape).workspace_bytes; }

void check_gemm_tile(int gemm_tile) {
  if (gemm_tile < -1 || gemm_tile >= kNumGemmConfigs)
    invalid("gemm_tile", "expected -1 (chosen) or 0.." + std::to_string(kNumGemmConfigs - 1) + ", got " +
                             std::to_string(gemm_tile));
}

}  // namespace fp4moe
