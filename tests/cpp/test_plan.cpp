// make_plan / workspace_size (src/runtime/plan.h): a CPU sweep over thousands of shapes asserting
// every invariant the CUDA kernels rely on, and the refusals of shapes they cannot take. The decode rules,
// shape by shape: test_plan_decode.cpp.
#include <gtest/gtest.h>

#include <algorithm>
#include <random>
#include <tuple>
#include <vector>

#include "common/tile_order.h"
#include "plan_shapes.h"
#include "runtime/plan.h"

namespace fp4moe {
namespace {

using plantest::cdiv;
using plantest::random_shape;

// Checks every invariant of one plan; returns false (with gtest failures recorded) when one breaks.
void check_plan(const ProblemShape& s, std::mt19937_64& rng) {
  SCOPED_TRACE(::testing::Message() << "T=" << s.T << " H=" << s.H << " I=" << s.I << " E_loc=" << s.E_loc
                                    << " E_total=" << s.E_total << " k=" << s.k << " gated=" << s.gated
                                    << " A4=" << (s.mode == ActMode::A4) << " bf16=" << (s.format == WeightFormat::BF16)
                                    << " shared=" << s.has_shared << " budget=" << s.workspace_budget
                                    << " lora=" << s.has_lora << " r=" << s.max_lora_rank
                                    << " wgmma=" << s.device.wgmma << " tile=" << s.gemm_config);
  const MoePlan p = make_plan(s);
  ASSERT_EQ(workspace_size(s), p.workspace_bytes);
  if (!s.device.wgmma && s.gemm_config < 0) {
    // On a wgmma device: the 64-token wgmma tile from 32 expected rows a local expert on, the warp-specialised one
    // from kWsRows on experts of I >= kWsMinI (NVFP4, no LoRA), the same workspace (workspace_size is asked without
    // a device), and a plan that keeps every invariant below.
    ProblemShape w = s;
    w.device.wgmma = true;
    const MoePlan pw = make_plan(w);
    EXPECT_EQ(pw.workspace_bytes, p.workspace_bytes);
    const int64_t E_total = s.E_total == 0 ? s.E_loc : s.E_total;
    const bool lora_thin = s.has_lora && s.I <= kLoraThinI && p.rows < kLoraThinRows * E_total;
    // Layers of at most kFewExperts experts take it above 12 rows an expert too (the 16-row tile from 9 to 12).
    const bool few = E_total <= kFewExperts;
    const bool wgmma_tile = (p.rows >= 32 * E_total && !lora_thin) || (few && p.rows > 12 * E_total);
    // The warp-specialised tiles (4-bit weights, no LoRA): 128 tokens from kWsRows (I >= kWsMinI); where the 64-token
    // wgmma tile would run, 32 tokens up to kWs32MaxRows on long K (H, I >= kWs32MinK), else 64 on I >= kWs64MinI.
    const bool ws = s.format != WeightFormat::BF16 && !s.has_lora;
    const int64_t avg = (p.rows + E_total - 1) / E_total;
    int expect = wgmma_tile ? 3 : p.gemm_config;
    if (ws && avg >= kWsRows && s.I >= kWsMinI) expect = 5;
    else if (ws && expect == 3 && avg <= kWs32MaxRows && s.H >= kWs32MinK && s.I >= kWs32MinK) expect = 7;
    else if (ws && expect == 3 && s.I >= kWs64MinI) expect = 6;
    EXPECT_EQ(pw.gemm_config, expect);
    if (few && p.rows > 0 && p.rows <= 8 * E_total) EXPECT_EQ(p.gemm_config, 0);
    if (few && p.rows > 8 * E_total && p.rows <= 12 * E_total)
      EXPECT_EQ(p.gemm_config, static_cast<int>(GemmTile::WeightsAsA16));
    check_plan(w, rng);
    // Every tile forced (MoeArgs::gemm_tile) is a plan of its own that keeps them too.
    for (int t = 0; t < kNumGemmConfigs; ++t) {
      ProblemShape f = s;
      f.gemm_config = t;
      f.device.wgmma = kGemmConfigs[t].wgmma;
      EXPECT_EQ(make_plan(f).gemm_config, t);
      check_plan(f, rng);
    }
  }
  const int64_t T = s.T, k = s.k, H = s.H, I = s.I, E = s.E_loc;

  // Chunks cover all tokens, none is empty, and T = 0 launches nothing.
  if (T == 0) {
    EXPECT_EQ(p.num_chunks, 0);
    EXPECT_EQ(p.rows, 0);
    EXPECT_EQ(p.max_m_tiles, 0);
  } else {
    ASSERT_GE(p.chunk_tokens, 1);
    EXPECT_LE(p.chunk_tokens, T);
    EXPECT_GE(p.num_chunks * p.chunk_tokens, T);
    EXPECT_LT((p.num_chunks - 1) * p.chunk_tokens, T);
    // Chunks of equal size: the last at most num_chunks - 1 tokens short of the others.
    EXPECT_GE(T - (p.num_chunks - 1) * p.chunk_tokens, p.chunk_tokens - (p.num_chunks - 1));
    EXPECT_EQ(p.rows, p.chunk_tokens * k);
    EXPECT_LT(p.rows, int64_t(1) << 31);
  }

  // Routing grid covers the chunk's tokens; shared memory within the default 48 KiB.
  if (T > 0 && s.routing_from_logits) {
    if (p.routing_warps_per_token > 0) {  // a block a token: an expert a thread
      EXPECT_EQ(p.routing_blocks, p.chunk_tokens);
      EXPECT_GE(32 * p.routing_warps_per_token, p.shape.E_total);
      EXPECT_LE(32 * p.routing_warps_per_token, 1024);
      EXPECT_EQ(p.routing_smem, static_cast<size_t>(routing_block_smem(p.shape.E_total, s.k, p.routing_warps_per_token,
                                                                         s.n_group)));
    } else {
      EXPECT_GE(p.routing_blocks * p.routing_warps_per_block, p.chunk_tokens);
      EXPECT_GE(p.routing_smem, static_cast<size_t>(2 * p.shape.E_total * 4 * p.routing_warps_per_block));
    }
    EXPECT_LE(p.routing_smem, 48u * 1024u);
  }

  // Permutation blocks cover all entries with whole warps.
  if (T > 0) {
    EXPECT_EQ(p.perm_entries % 32, 0);
    EXPECT_GE(p.perm_blocks * p.perm_entries, p.rows);
    EXPECT_LT((p.perm_blocks - 1) * p.perm_entries, p.rows);
    EXPECT_LE(p.perm_blocks, 1025);
    // The one-block kernel (its shared cache of the entries' experts holds kOneBlockPermEntries) takes every
    // chunk up to that size, and only those.
    EXPECT_EQ(p.perm_blocks == 1, p.rows <= kOneBlockPermEntries) << p.rows;
    // One block of 32 warps from kMidPermAbove to kMidPermEntries on at most kMidPermExperts experts.
    EXPECT_EQ(p.perm_mid, p.rows > kMidPermAbove && p.rows <= kMidPermEntries && E <= kMidPermExperts)
        << p.rows << " rows, " << E << " experts";
    EXPECT_EQ(p.perm_smem, static_cast<size_t>(E * 4));
    EXPECT_LE(p.perm_smem, 48u * 1024u);
  }

  // GEMM tiles cover N and K; the tile fits the warp grid; shared memory within the sm_90 limit.
  const GemmConfig& g = p.gemm;
  // Tile bands (tile_of): a band's token rows within band_token_bytes (one m tile at least), set only where the grid's
  // places fit an int and the token source outgrows band_min_source_bytes.
  for (const auto& [band, src_rows, K, n_tiles] : {std::tuple{p.m_band1, p.chunk_tokens, p.k1_pad, p.n1_tiles},
                                                   std::tuple{p.m_band2, p.rows, p.k2_pad, p.n2_tiles}}) {
    EXPECT_GE(band, 0);
    EXPECT_LE(band, std::max<int64_t>(1, p.max_m_tiles));
    const bool want = p.max_m_tiles * n_tiles <= 0x7fffffff && src_rows * K * 2 > band_min_source_bytes(s.device);
    EXPECT_EQ(band > 0, want) << band;
    if (band > 0) EXPECT_TRUE(band == 1 || band * g.bm * K * 2 <= band_token_bytes(s.device)) << band;
  }
  EXPECT_EQ(g.bk, 64);  // the prepared weight layout is blocked by 64 along K
  if (g.weights_as_a) {  // 16 or 32 weight rows per warp, tokens in groups of 8
    EXPECT_EQ(g.warps_m, 1);
    EXPECT_TRUE(g.bn == 16 * g.warps_n || g.bn == 32 * g.warps_n) << g.bn;
    EXPECT_EQ(g.bm % 8, 0);
  } else {
    EXPECT_EQ(g.bm % (16 * g.warps_m), 0);
    EXPECT_EQ(g.bn % (32 * g.warps_n), 0);
  }
  // Split-K (weights-as-A tiles, one-block permutation only): whole K chunks, no empty split, partials and counters
  // sized for the grid (max_m_tiles), the choice made for split_m_tiles (the tiles expected under uniform routing):
  // no more than max_m_tiles, no fewer than the local rows' share needs when full.
  EXPECT_LE(p.split_m_tiles, p.max_m_tiles);
  if (T > 0) EXPECT_GE(p.split_m_tiles * g.bm, (p.rows * E / p.shape.E_total) - g.bm);
  if (E == p.shape.E_total && E > kFewExperts) EXPECT_EQ(p.split_m_tiles, p.max_m_tiles);
  EXPECT_EQ(p.gemm_m_last, p.max_m_tiles > 0 && 2 * p.split_m_tiles <= p.max_m_tiles);
  // The x shrink's launch permutes only a one-block chunk of few entries, in a block of its size (a warp or more).
  EXPECT_EQ(p.lora_shrink1_permutes, p.shape.has_lora && !p.entry_tiles && p.perm_blocks == 1 &&
                                         p.rows <= kShrinkPermuteRows && E <= 1024);
  if (p.entry_tiles) EXPECT_FALSE(p.lora_shrink_tiled);  // the tiled shrinks read the permutation's tiles
  // The GEMMs beside the LoRA shrinks: under entry tiles, on the decode tile only (its lookup reads no t values).
  EXPECT_EQ(p.gemms_beside_lora_shrinks, p.entry_tiles && p.shape.has_lora &&
                                         p.gemm_config == static_cast<int>(GemmTile::SplitKDecode));
  if (p.lora_shrink1_permutes) EXPECT_GE(p.lora_shrink1_threads, 32);
  struct SplitCase { int split; int64_t m_tiles, n_tiles, k_pad; int chunk_kb; };
  for (const SplitCase& c : {SplitCase{p.split1, p.split_m_tiles, p.n1_tiles, p.k1_pad, p.chunk1_kb},
                             SplitCase{p.split2, p.split_m_tiles, p.n2_tiles, p.k2_pad, p.chunk2_kb}}) {
    // A chunk is whole chunks of kKChunk or the whole K (decode_chunk_kb).
    EXPECT_TRUE(c.chunk_kb % (kKChunk / 64) == 0 || c.chunk_kb == c.k_pad / 64) << c.chunk_kb;
    EXPECT_GE(c.split, 1);
    if (c.split == 1) continue;
    EXPECT_TRUE(g.weights_as_a);
    EXPECT_FALSE(g.wgmma);
    EXPECT_EQ(p.perm_blocks, 1);
    const int64_t chunks = (c.k_pad / 64 + c.chunk_kb - 1) / c.chunk_kb, per = (chunks + c.split - 1) / c.split;
    EXPECT_LE(c.split, chunks);
    EXPECT_LT((c.split - 1) * per, chunks) << "an empty split";
    // Only grids below the target are split, and towards at most twice the target.
    EXPECT_LT(c.m_tiles * c.n_tiles, split_target_blocks(s.device));
    EXPECT_LE((c.split - 1) * c.m_tiles * c.n_tiles, 2 * split_target_blocks(s.device));
    const int64_t accs = (g.bm / 8) * (g.bn / g.warps_n / 16);
    EXPECT_GE(p.split_partials.bytes,
              static_cast<size_t>(p.max_m_tiles * c.n_tiles * chunks * g.threads() * accs * 16));
    EXPECT_GE(p.split_counters.bytes, static_cast<size_t>(p.max_m_tiles * c.n_tiles * 4));
  }
  // WS sub-tiles: only on the warp-specialised tile, short K and grids of many waves; never more n tiles than
  // the grid has.
  struct SubCase { int sub; int64_t k_pad, m_tiles, n_tiles; };
  for (const SubCase& c : {SubCase{p.ws_sub1, p.k1_pad, p.max_m_tiles, p.n1_tiles},
                           SubCase{p.ws_sub2, p.k2_pad, p.max_m_tiles, p.n2_tiles},
                           SubCase{p.shared_ws_sub1, p.k1_pad, p.shared_m_tiles, p.shared_n1_tiles},
                           SubCase{p.shared_ws_sub2, p.shared_k2_pad, p.shared_m_tiles, p.n2_tiles}}) {
    EXPECT_GE(c.sub, 1);
    if (c.sub == 1) continue;
    EXPECT_TRUE(g.ws);
    EXPECT_LE(c.sub, std::min(kWsMaxSub, c.n_tiles));
    EXPECT_LE(c.k_pad, kWsSubMaxK);
    EXPECT_GE(c.m_tiles * c.n_tiles, kWsSubWaves * s.device.sm_count);
  }
  EXPECT_LE(g.threads(), 1024);
  EXPECT_LE(p.gemm_smem, 227u * 1024u);
  EXPECT_EQ(static_cast<int64_t>(p.gemm_smem), gemm_smem_bytes(g, s.format == WeightFormat::NVFP4));
  const bool fp4 = s.format == WeightFormat::NVFP4;
  const int64_t bn = gemm_bn(g, fp4);  // the weight rows of a tile in this format
  EXPECT_TRUE(bn == g.bn || (g.ws && !fp4 && 2 * bn == g.bn));
  if (g.wgmma) {  // whole warpgroups of m64 tiles (16 weight rows a warp each); 1024-byte stages (the swizzle's atom)
    EXPECT_TRUE(s.device.wgmma);
    EXPECT_EQ(g.warps_n % 4, 0);
    EXPECT_EQ(bn % (16 * g.warps_n), 0);
    EXPECT_LE(bn / (16 * g.warps_n), 2);
    EXPECT_EQ(gemm_stage_bytes(g, s.format == WeightFormat::NVFP4) % 1024, 0);
    EXPECT_EQ(g.bm * g.bk * 2 % 1024, 0);
  }
  EXPECT_EQ(p.n1, s.gated ? 2 * I : I);
  EXPECT_GE(p.n1_tiles * bn, p.n1);
  EXPECT_LT((p.n1_tiles - 1) * bn, p.n1);
  EXPECT_GE(p.n2_tiles * bn, H);
  EXPECT_EQ(p.k1_pad % g.bk, 0);
  EXPECT_GE(p.k1_pad, H);
  EXPECT_LT(p.k1_pad, H + g.bk);
  EXPECT_EQ(p.k2_pad % g.bk, 0);
  EXPECT_GE(p.k2_pad, I);
  EXPECT_LE(p.n1_tiles, 65535);
  EXPECT_LE(p.n2_tiles, 65535);
  EXPECT_LE(p.max_m_tiles, 0x7fffffff);
  if (s.has_shared && T > 0) {
    EXPECT_GE(p.shared_m_tiles * g.bm, p.chunk_tokens);
    EXPECT_GE(p.shared_n1_tiles * bn, p.shared_n1);
    EXPECT_GE(p.shared_k2_pad, s.shared_I);
  }

  // max_m_tiles bounds sum_e ceil(c_e / bm) for any split of the chunk's entries over the experts:
  // adversarial splits (one entry in as many experts as possible, the rest in one) and random ones.
  if (T > 0) {
    const int64_t R = p.rows, bm = g.bm;
    const int64_t ones = std::min(E, R);
    const int64_t worst = (ones - 1) + cdiv(R - (ones - 1), bm);
    EXPECT_LE(worst, p.max_m_tiles);
    std::vector<int64_t> c(static_cast<size_t>(E), 0);
    std::uniform_int_distribution<int64_t> pick(0, E - 1);
    const int64_t local = std::uniform_int_distribution<int64_t>(0, R)(rng);  // some entries not local
    for (int64_t i = 0; i < std::min<int64_t>(local, 20000); ++i) c[pick(rng)]++;
    if (local > 20000) c[0] += local - 20000;
    int64_t tiles = 0;
    for (int64_t v : c) tiles += cdiv(v, bm);
    EXPECT_LE(tiles, p.max_m_tiles);
    // Every (bm-aligned) tile's rows lie within the row buffer.
    EXPECT_GE(static_cast<int64_t>(p.row_entry.bytes), R * 4);
  }

  // Combine covers H with 4 outputs per thread.
  EXPECT_EQ(H % 4, 0);
  EXPECT_GE(p.combine_blocks_per_token * p.combine_threads * 4, H);

  // LoRA: strides hold every canonical rank (2r for PerExpert's gate_up, r otherwise); the combine keeps
  // z in kMaxLoraRank floats of shared memory; warps whole.
  const int64_t lora_rank = s.has_lora ? (s.max_lora_rank > 0 ? s.max_lora_rank : kMaxLoraRank) : 0;
  EXPECT_EQ(p.lora_rank, lora_rank);
  EXPECT_EQ(p.lora_r1_stride, 2 * lora_rank);
  EXPECT_EQ(p.lora_r2_stride, lora_rank);
  EXPECT_LE(p.lora_r2_stride, kMaxLoraRank);
  if (s.has_lora) {
    EXPECT_EQ(p.lora_shrink1_threads % 32, 0);
    EXPECT_EQ(p.lora_shrink2_threads % 32, 0);
    EXPECT_GE(p.lora_shrink1_threads, 32);
    EXPECT_GE(p.lora_shrink2_threads, 32);
    EXPECT_LE(p.lora_shrink1_threads, 1024);
    EXPECT_LE(p.lora_shrink2_threads, 1024);
    // An item's rank rows fill one mma A operand's rows g (< 8) and g + 8 (src/cuda/lora.cu one_row_lane).
    for (int rpi : {p.lora_shrink1_rows_per_item, p.lora_shrink2_rows_per_item})
      EXPECT_TRUE(rpi == 4 || rpi == 8 || rpi == 16) << rpi;
    // The tiled routed shrinks (one A read per run of rows with one adapter): 20 local rows an expert, 300 tiles.
    const int64_t E_total = s.E_total == 0 ? s.E_loc : s.E_total, local = cdiv(p.rows * s.E_loc, E_total);
    EXPECT_EQ(p.lora_shrink_tiled, cdiv(local, s.E_loc) >= 20 && cdiv(local, p.gemm.bm) + s.E_loc >= 300);
  } else {
    EXPECT_FALSE(p.lora_shrink_tiled);
  }

  // Workspace: aligned, large enough, inside the total, pairwise disjoint.
  const int64_t Tc = p.chunk_tokens, R = p.rows;
  struct Need { const WorkspaceBuffer* b; int64_t bytes; const char* name; };
  std::vector<Need> needs = {
      {&p.topk_ids, s.routing_from_logits ? Tc * k * 4 : 0, "topk_ids"},
      {&p.topk_weights, s.routing_from_logits ? Tc * k * 4 : 0, "topk_weights"},
      {&p.block_counts, T > 0 ? p.perm_blocks * E * 4 : 0, "block_counts"},
      {&p.expert_offsets, T > 0 ? (E + 1) * 4 : 0, "expert_offsets"},
      {&p.tile_info, T > 0 ? (p.max_m_tiles * 2 + 1) * 4 : 0, "tile_info"},
      {&p.row_entry, R * 4, "row_entry"},
      {&p.x_q, s.mode == ActMode::A4 ? Tc * H * 2 : 0, "x_q"},
      {&p.x_scale, s.mode == ActMode::A4 ? Tc * 4 : 0, "x_scale"},
      {&p.act, R * I * 2, "act"},
      {&p.out, R * H * 4, "out"},
      {&p.shared_act, s.has_shared ? Tc * s.shared_I * 2 : 0, "shared_act"},
      {&p.shared_out, s.has_shared ? Tc * H * 4 : 0, "shared_out"},
      {&p.lora_slot, s.has_lora ? Tc * 4 : 0, "lora_slot"},
      {&p.lora_t1, s.has_lora ? R * 2 * lora_rank * 4 : 0, "lora_t1"},
      {&p.lora_t2, s.has_lora ? R * lora_rank * 4 : 0, "lora_t2"},
      {&p.lora_shared_t1, s.has_lora && s.has_shared ? Tc * lora_rank * 4 : 0, "lora_shared_t1"},
      {&p.lora_shared_t2, s.has_lora && s.has_shared ? Tc * lora_rank * 4 : 0, "lora_shared_t2"},
  };
  for (const Need& n : needs) {
    SCOPED_TRACE(n.name);
    EXPECT_GE(static_cast<int64_t>(n.b->bytes), n.bytes);
    EXPECT_EQ(n.b->offset % kWorkspaceAlign, 0u);
    EXPECT_LE(n.b->offset + n.b->bytes, p.workspace_bytes);
  }
  for (size_t a = 0; a < needs.size(); ++a)
    for (size_t b = a + 1; b < needs.size(); ++b) {
      const WorkspaceBuffer &x = *needs[a].b, &y = *needs[b].b;
      if (x.bytes == 0 || y.bytes == 0) continue;
      EXPECT_TRUE(x.offset + x.bytes <= y.offset || y.offset + y.bytes <= x.offset)
          << needs[a].name << " overlaps " << needs[b].name;
    }
  if (T == 0) { EXPECT_EQ(p.workspace_bytes, 0u); }
  // Token-proportional buffers respect the budget whenever more than one token per chunk was possible.
  if (p.chunk_tokens > 1) { EXPECT_LE(static_cast<int64_t>(p.out.bytes + p.act.bytes), p.shape.workspace_budget); }
}


TEST(Plan, SweepEveryHiddenSize) {
  std::mt19937_64 rng(1234);
  const int64_t Ts[] = {0, 1, 2, 3, 7, 8, 64, 257, 1024, 4096, 65536};
  for (int64_t H = 16; H <= 16384; H += 16) {
    const int64_t I = 16 * std::uniform_int_distribution<int64_t>(1, 1024)(rng);
    const int64_t T = rng() % 3 ? Ts[rng() % 11] : std::uniform_int_distribution<int64_t>(0, 65536)(rng);
    check_plan(random_shape(rng, H, I, T), rng);
    if (HasFatalFailure()) return;
  }
}

TEST(Plan, SweepEveryIntermediateSize) {
  std::mt19937_64 rng(99);
  for (int64_t I = 16; I <= 16384; I += 16) {
    const int64_t H = 16 * std::uniform_int_distribution<int64_t>(1, 1024)(rng);
    const int64_t T = std::uniform_int_distribution<int64_t>(0, 65536)(rng);
    check_plan(random_shape(rng, H, I, T), rng);
    if (HasFatalFailure()) return;
  }
}

TEST(Plan, ModelShapesAllTokenCounts) {
  std::mt19937_64 rng(7);
  struct M { int64_t H, I, E, k; bool gated; ActivationType a; };
  const M models[] = {{3584, 384, 384, 8, true, ActivationType::Situ},   {2048, 768, 128, 8, true, ActivationType::Swiglu},
                      {2048, 192, 128, 8, true, ActivationType::Swiglu}, {7168, 2048, 32, 8, true, ActivationType::Swiglu},
                      {4096, 14336, 8, 2, true, ActivationType::Swiglu}, {2880, 2880, 128, 4, true, ActivationType::SwigluBias},
                      {2048, 512, 512, 10, true, ActivationType::Swiglu}, {1040, 1040, 16, 4, false, ActivationType::Relu2}};
  for (const M& m : models)
    for (int64_t T = 0; T <= 65536; T = T < 16 ? T + 1 : T * 2 + (T % 3)) {
      for (int mode = 0; mode < 2; ++mode) {
        ProblemShape s;
        s.T = T; s.H = m.H; s.I = m.I; s.E_loc = m.E; s.E_total = m.E == 32 ? 256 : m.E; s.k = m.k;
        s.gated = m.gated; s.activation = m.a; s.mode = mode ? ActMode::A4 : ActMode::A16;
        s.has_shared = mode == 1; s.shared_I = m.I;
        check_plan(s, rng);
        if (HasFatalFailure()) return;
      }
    }
}

TEST(Plan, RandomShapes) {
  std::mt19937_64 rng(42);
  for (int i = 0; i < 3000; ++i) {
    const int64_t H = 16 * std::uniform_int_distribution<int64_t>(1, 1024)(rng);
    const int64_t I = 16 * std::uniform_int_distribution<int64_t>(1, 1024)(rng);
    const int64_t T = std::uniform_int_distribution<int64_t>(0, 65536)(rng);
    check_plan(random_shape(rng, H, I, T), rng);
    if (HasFatalFailure()) return;
  }
}

// The plan on other devices (a device description of fewer or more SMs and another L2): every invariant holds,
// the split target and the bands follow the device, and the H200's description is the default.
TEST(Plan, OtherDevicesKeepTheInvariants) {
  std::mt19937_64 rng(11);
  EXPECT_EQ(split_target_blocks(DeviceDesc{}), 528);
  const DeviceDesc devices[] = {{108, int64_t(40) << 20, false}, {148, int64_t(126) << 20, false},
                                {132, int64_t(50) << 20, true}, {16, int64_t(4) << 20, false}};
  for (const DeviceDesc& d : devices)
    for (int i = 0; i < 400; ++i) {
      const int64_t H = 16 * std::uniform_int_distribution<int64_t>(1, 512)(rng);
      const int64_t I = 16 * std::uniform_int_distribution<int64_t>(1, 512)(rng);
      const int64_t T = std::uniform_int_distribution<int64_t>(0, 20000)(rng);
      ProblemShape s = random_shape(rng, H, I, T);
      s.device = d;
      check_plan(s, rng);
      if (HasFatalFailure()) return;
    }
  // kimi_k3_tp8 at T=1: the split target is four blocks an SM.
  ProblemShape s;
  s.T = 1; s.H = 7168; s.I = 256; s.E_loc = s.E_total = 384; s.k = 8;
  s.device = DeviceDesc{16, int64_t(4) << 20, false};
  const MoePlan small = make_plan(s);
  s.device = DeviceDesc{};
  const MoePlan h200 = make_plan(s);
  EXPECT_LE(small.split1, h200.split1);
}

// The canonical K order of each GEMM (decode_chunk_kb): the K range a block of the T = 1 decode grid takes on the
// reference device, so decode there splits exactly into the chunks; the same at every T (batch invariance), on every
// device and tile. gpt_oss_120b's GEMMs (225 and 115 blocks at T = 1, split 3) and mixtral_8x7b's take longer chunks.
TEST(Plan, KChunksAreTheDecodeSplits) {
  struct M { int64_t H, I, E_loc, E_total, k; int c1, c2; };
  const M models[] = {{2880, 2880, 128, 128, 4, 16, 16},  // gpt_oss_120b: 45 k-blocks in 16, 16, 13
                      {2048, 768, 128, 128, 8, 8, 8},    // qwen3_30b_a3b
                      {2048, 192, 128, 128, 8, 8, 3},    // qwen3_30b_a3b_tp4 (K = 192: one chunk)
                      {7168, 2048, 32, 256, 8, 8, 8},    // deepseek_v3_ep8
                      {4096, 14336, 8, 8, 2, 32, 32},    // mixtral_8x7b: 2 and 7 chunks
                      {3584, 384, 384, 384, 8, 8, 6}};   // kimi_k3_tp8
  for (const M& m : models) {
    for (const bool wgmma : {false, true})
      for (const int64_t T : {int64_t(1), int64_t(2), int64_t(64), int64_t(1024), int64_t(16384)}) {
        ProblemShape s;
        s.T = T; s.H = m.H; s.I = m.I; s.E_loc = m.E_loc; s.E_total = m.E_total; s.k = m.k;
        s.device.wgmma = wgmma;
        s.device.sm_count = wgmma ? 132 : 78;
        const MoePlan p = make_plan(s);
        EXPECT_EQ(p.chunk1_kb, m.c1) << m.H << " " << m.I << " T=" << T;
        EXPECT_EQ(p.chunk2_kb, m.c2) << m.H << " " << m.I << " T=" << T;
      }
    ProblemShape s;
    s.T = 1; s.H = m.H; s.I = m.I; s.E_loc = m.E_loc; s.E_total = m.E_total; s.k = m.k;
    const MoePlan p = make_plan(s);
    EXPECT_EQ(p.split1, (p.k1_pad / 64 + p.chunk1_kb - 1) / p.chunk1_kb) << m.H << " " << m.I;
    EXPECT_EQ(p.split2, (p.k2_pad / 64 + p.chunk2_kb - 1) / p.chunk2_kb) << m.H << " " << m.I;
  }
  EXPECT_EQ(decode_chunk_kb(2880, 600), 45);  // a grid that fills the reference GPU unsplit: one chain
  EXPECT_EQ(decode_chunk_kb(2880, 1), 8);     // the fewest blocks: chunks of kKChunk
  EXPECT_EQ(decode_chunk_kb(2880, 176), 16);  // 176 blocks: three splits reach the 528 of the target
}

// The WS sub-tiles on the shapes measured (bench/NOTES.md): kimi_k3_tp8's GEMM2 (K = 384) at T = 4096 takes four n
// tiles a block, its GEMM1 (K = 3584) one; mixtral_8x7b (K = 4096, 14336) one on both; qwen3_30b_a3b_tp4 as kimi.
TEST(Plan, WsSubTilesOnShortK) {
  ProblemShape s;
  s.T = 4096; s.H = 3584; s.I = 384; s.E_loc = s.E_total = 384; s.k = 8;
  s.activation = ActivationType::Situ;
  s.device.wgmma = true;
  const MoePlan kimi = make_plan(s);
  ASSERT_EQ(kimi.gemm_config, static_cast<int>(GemmTile::WgmmaWs128));
  EXPECT_EQ(kimi.ws_sub1, 1);
  EXPECT_EQ(kimi.ws_sub2, 4);
  s.H = 4096; s.I = 14336; s.E_loc = s.E_total = 8; s.k = 2; s.activation = ActivationType::Swiglu;
  const MoePlan mixtral = make_plan(s);
  ASSERT_EQ(mixtral.gemm_config, static_cast<int>(GemmTile::WgmmaWs128));
  EXPECT_EQ(mixtral.ws_sub1, 1);
  EXPECT_EQ(mixtral.ws_sub2, 1);
  // qwen3_30b_a3b_tp4 (I = 192): the WS tile from 64 rows an expert (T = 4096: 256; T = 1024: 64); at T = 512 (32
  // rows) Wgmma64, its experts too thin for the 64-token WS form.
  s.T = 4096; s.H = 2048; s.I = 192; s.E_loc = s.E_total = 128; s.k = 8;
  const MoePlan tp4 = make_plan(s);
  EXPECT_EQ(tp4.gemm_config, static_cast<int>(GemmTile::WgmmaWs128));
  EXPECT_EQ(tp4.ws_sub1, 1);
  EXPECT_EQ(tp4.ws_sub2, 4);
  s.T = 1024;
  EXPECT_EQ(make_plan(s).gemm_config, static_cast<int>(GemmTile::WgmmaWs128));
  s.T = 512;
  EXPECT_EQ(make_plan(s).gemm_config, static_cast<int>(GemmTile::Wgmma64));
  s.I = 384;  // kimi_k3_tp8's experts: the 64-token WS form
  EXPECT_EQ(make_plan(s).gemm_config, static_cast<int>(GemmTile::WgmmaWs64));
  s.I = 192;
  s.device.wgmma = false;  // no WS tile, no sub-tiles
  const MoePlan old = make_plan(s);
  EXPECT_EQ(old.ws_sub1, 1);
  EXPECT_EQ(old.ws_sub2, 1);
}

TEST(Plan, TileOrderIsAPermutationInBands) {
  std::mt19937_64 rng(5);
  for (int it = 0; it < 400; ++it) {
    const int m_tiles = std::uniform_int_distribution<int>(1, 300)(rng), n_tiles = std::uniform_int_distribution<int>(1, 40)(rng);
    const int band = std::uniform_int_distribution<int>(0, m_tiles + 3)(rng);
    const int width = band == 0 || band > m_tiles ? m_tiles : band;
    SCOPED_TRACE(::testing::Message() << "m_tiles=" << m_tiles << " n_tiles=" << n_tiles << " band=" << band);
    std::vector<int> seen(static_cast<size_t>(m_tiles) * n_tiles, 0);
    int pm = -1, pn = -1;
    for (int L = 0; L < m_tiles * n_tiles; ++L) {
      int m = -1, n = -1;
      tile_of(L, m_tiles, n_tiles, band, m, n);
      ASSERT_TRUE(m >= 0 && m < m_tiles && n >= 0 && n < n_tiles) << "L=" << L << " -> (" << m << ", " << n << ")";
      ++seen[static_cast<size_t>(n) * m_tiles + m];
      if (L > 0) {
        if (m / width == pm / width) {  // same band: m fastest, then n
          EXPECT_TRUE((n == pn && m == pm + 1) || (n == pn + 1 && m == m / width * width)) << "L=" << L;
        } else {  // the next band starts at its first tile
          EXPECT_EQ(m / width, pm / width + 1);
          EXPECT_EQ(m % width, 0);
          EXPECT_EQ(n, 0);
        }
      }
      pm = m;
      pn = n;
    }
    EXPECT_TRUE(std::all_of(seen.begin(), seen.end(), [](int c) { return c == 1; }));
  }
}

TEST(Plan, SmallBudgetForcesChunks) {
  std::mt19937_64 rng(3);
  ProblemShape s;
  s.T = 4096; s.H = 3584; s.I = 384; s.E_loc = 384; s.k = 8; s.gated = true; s.activation = ActivationType::Situ;
  s.workspace_budget = 8 << 20;
  const MoePlan p = make_plan(s);
  EXPECT_GT(p.num_chunks, 1);
  check_plan(s, rng);
  s.workspace_budget = 1;  // less than one token: still one token per chunk
  const MoePlan q = make_plan(s);
  EXPECT_EQ(q.chunk_tokens, 1);
  EXPECT_EQ(q.num_chunks, 4096);
}

// LoRA adds its buffers after the others and never changes the chunking, the GEMM tiles or the offsets
// of the other buffers: a token's arithmetic is the same with and without LoRA (bit-identity invariants).
TEST(Plan, LoraNeverChangesChunkingOrTiles) {
  std::mt19937_64 rng(77);
  for (int i = 0; i < 2000; ++i) {
    const int64_t H = 16 * std::uniform_int_distribution<int64_t>(1, 512)(rng);
    const int64_t I = 16 * std::uniform_int_distribution<int64_t>(1, 512)(rng);
    const int64_t T = rng() % 2 ? std::uniform_int_distribution<int64_t>(0, 64)(rng)
                                : std::uniform_int_distribution<int64_t>(0, 65536)(rng);
    ProblemShape base = random_shape(rng, H, I, T);
    base.has_lora = false;
    base.max_lora_rank = 0;
    const MoePlan p0 = make_plan(base);
    for (int64_t r : {int64_t(0), int64_t(1), int64_t(16), kMaxLoraRank}) {
      ProblemShape s = base;
      s.has_lora = true;
      s.max_lora_rank = r;
      const MoePlan p = make_plan(s);
      SCOPED_TRACE(::testing::Message() << "T=" << T << " H=" << H << " I=" << I << " r=" << r);
      EXPECT_EQ(p.chunk_tokens, p0.chunk_tokens);
      EXPECT_EQ(p.num_chunks, p0.num_chunks);
      EXPECT_EQ(p.gemm_config, p0.gemm_config);
      EXPECT_EQ(p.max_m_tiles, p0.max_m_tiles);
      EXPECT_EQ(p.out.offset, p0.out.offset);
      EXPECT_EQ(p.act.offset, p0.act.offset);
      EXPECT_GE(p.workspace_bytes, p0.workspace_bytes);
      // On a wgmma device LoRA may keep the 32-row tile where the base takes the wgmma tile, or the 64-token wgmma
      // tile where the base takes a warp-specialised one (plan.cpp); the chunking and the base buffers' layout stay.
      ProblemShape bw = base, sw = s;
      bw.device.wgmma = sw.device.wgmma = true;
      const MoePlan pb = make_plan(bw), ps = make_plan(sw);
      EXPECT_EQ(ps.chunk_tokens, pb.chunk_tokens);
      EXPECT_TRUE(ps.gemm_config == pb.gemm_config || (pb.gemm_config == 3 && ps.gemm_config == p.gemm_config) ||
                  (kGemmConfigs[pb.gemm_config].ws && (ps.gemm_config == 3 || ps.gemm_config == p.gemm_config)));
      EXPECT_EQ(ps.out.offset, pb.out.offset);
      EXPECT_EQ(ps.act.offset, pb.act.offset);
      check_plan(s, rng);
      if (HasFatalFailure()) return;
    }
  }
}

TEST(Plan, RefusesLoraRanksOutOfRange) {
  ProblemShape s;
  s.T = 8; s.H = 2048; s.I = 768; s.E_loc = 16; s.k = 8; s.gated = true; s.activation = ActivationType::Swiglu;
  s.has_lora = true;
  for (int64_t r : {int64_t(-1), kMaxLoraRank + 1, int64_t(128)}) {
    s.max_lora_rank = r;
    try { (void)make_plan(s); ADD_FAILURE() << "max_lora_rank=" << r; } catch (const Error& e) {
      EXPECT_EQ(e.code(), ErrorCode::InvalidArgument);
      EXPECT_EQ(e.argument(), "max_lora_rank");
    }
  }
  s.max_lora_rank = kMaxLoraRank;
  EXPECT_NO_THROW(make_plan(s));
}

TEST(Plan, RefusesShapesTheKernelsCannotTake) {
  ProblemShape ok;
  ok.T = 8; ok.H = 2880; ok.I = 2880; ok.E_loc = 128; ok.k = 4; ok.gated = true; ok.activation = ActivationType::SwigluBias;
  EXPECT_NO_THROW(make_plan(ok));
  auto s = ok;
  for (int64_t h : {0, 8, 24 + 1, 2881, 1000}) {
    s = ok; s.H = h;
    if (h % 16 == 0 && h > 0) continue;
    try { (void)make_plan(s); ADD_FAILURE() << "H=" << h; } catch (const Error& e) {
      EXPECT_EQ(e.code(), ErrorCode::InvalidArgument); EXPECT_EQ(e.argument(), "H");
    }
  }
  for (int64_t i : {0, 8, 40, 2888 + 1}) {
    s = ok; s.I = i;
    if (i % 16 == 0 && i > 0) continue;
    try { (void)make_plan(s); ADD_FAILURE() << "I=" << i; } catch (const Error& e) {
      EXPECT_EQ(e.code(), ErrorCode::InvalidArgument); EXPECT_EQ(e.argument(), "I");
    }
  }
  s = ok; s.T = -1;
  try { (void)make_plan(s); ADD_FAILURE(); } catch (const Error& e) { EXPECT_EQ(e.argument(), "T"); }
  for (int t : {-2, kNumGemmConfigs}) {
    s = ok; s.gemm_config = t;
    try { (void)make_plan(s); ADD_FAILURE() << t; } catch (const Error& e) {
      EXPECT_EQ(e.code(), ErrorCode::InvalidArgument); EXPECT_EQ(e.argument(), "gemm_tile");
    }
  }
  s = ok; s.gemm_config = 3;  // the wgmma tile on a device without it
  try { (void)make_plan(s); ADD_FAILURE(); } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::Unsupported); EXPECT_EQ(e.argument(), "gemm_tile");
  }
  s.device.wgmma = true;
  EXPECT_NO_THROW(make_plan(s));
  s = ok; s.k = 0;
  try { (void)make_plan(s); ADD_FAILURE(); } catch (const Error& e) { EXPECT_EQ(e.argument(), "routing.top_k"); }
  s = ok; s.E_loc = 1024; s.E_total = 1024; s.k = 65;
  try { (void)make_plan(s); ADD_FAILURE(); } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::Unsupported); EXPECT_EQ(e.argument(), "routing.top_k");
  }
  s = ok; s.E_total = 64;
  try { (void)make_plan(s); ADD_FAILURE(); } catch (const Error& e) { EXPECT_EQ(e.argument(), "num_experts_total"); }
  s = ok; s.E_total = 8192; s.routing_from_logits = true;
  try { (void)make_plan(s); ADD_FAILURE(); } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::Unsupported); EXPECT_EQ(e.argument(), "routing.logits");
  }
  s.routing_from_logits = false;
  EXPECT_NO_THROW(make_plan(s));
  s = ok; s.activation = ActivationType::Relu;
  try { (void)make_plan(s); ADD_FAILURE(); } catch (const Error& e) { EXPECT_EQ(e.argument(), "activation.type"); }
  s = ok; s.has_shared = true; s.shared_I = 20;
  try { (void)make_plan(s); ADD_FAILURE(); } catch (const Error& e) { EXPECT_EQ(e.argument(), "shared_expert"); }
}

}  // namespace
}  // namespace fp4moe
