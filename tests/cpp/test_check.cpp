// `fp4moe check` (tools/fp4moe/check*.cpp) run in-process on the CPU backend at a tiny size: it must pass,
// and a planted fault (through CheckHooks, a test-only entry point) must make it fail the right checks.
//
// The harness lives in the CLI's sources; the test binary compiles them too (CMakeLists.txt).
#include "../../tools/fp4moe/check.h"

#include <gtest/gtest.h>

#include "fp4moe/types.h"
#include "io/json.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

namespace {

// The harness re-launches /proc/self/exe as `check --child ...` for its two-launch invariant. Inside this
// test binary that is fp4moe_tests, so such a launch is answered here, before GoogleTest's main runs.
struct ChildLaunchInterceptor {
  ChildLaunchInterceptor() {
    std::ifstream f("/proc/self/cmdline", std::ios::binary);
    std::vector<std::string> args;
    for (std::string a; std::getline(f, a, '\0');) args.push_back(a);
    if (args.size() >= 3 && args[1] == "check" && args[2] == "--child") {
      std::vector<char*> av;
      for (size_t i = 2; i < args.size(); ++i) av.push_back(args[i].data());
      std::exit(fp4moe::run_check(static_cast<int>(av.size()), av.data()));
    }
  }
} g_child_launch_interceptor;

struct Outcome {
  int rc = -1;
  std::string out;
  std::vector<std::string> labels;  // backend runs seen by the hook
};

// The tiny problem: qwen3_30b_a3b_tp4 (H 2048, I 192) with 8 experts and 12 tokens (or another shape and count).
Outcome run(std::vector<std::string> extra, const fp4moe::CheckHooks& hooks = {},
            const std::string& shape = "qwen3_30b_a3b_tp4", const std::string& experts = "8") {
  std::vector<std::string> args{"--backend", "cpu", "--shape", shape, "--experts", experts, "--tokens", "12"};
  args.insert(args.end(), extra.begin(), extra.end());
  std::vector<char*> av;
  for (auto& a : args) av.push_back(a.data());
  Outcome o;
  fp4moe::CheckHooks h = hooks;
  auto user = hooks.on_backend_output;
  h.on_backend_output = [&o, user](const std::string& label, std::vector<uint16_t>& y) {
    o.labels.push_back(label);
    if (user) user(label, y);
  };
  testing::internal::CaptureStdout();
  o.rc = fp4moe::run_check_with_hooks(static_cast<int>(av.size()), av.data(), h);
  o.out = testing::internal::GetCapturedStdout();
  return o;
}

std::string last_line(const std::string& s) {
  std::string t = s;
  while (!t.empty() && t.back() == '\n') t.pop_back();
  const size_t nl = t.rfind('\n');
  return nl == std::string::npos ? t : t.substr(nl + 1);
}

int count(const std::string& s, const std::string& what) {
  int n = 0;
  for (size_t p = s.find(what); p != std::string::npos; p = s.find(what, p + 1)) ++n;
  return n;
}

bool has_line(const std::string& out, const std::string& prefix, const std::string& contains) {
  size_t p = 0;
  while (p < out.size()) {
    size_t e = out.find('\n', p);
    if (e == std::string::npos) e = out.size();
    const std::string line = out.substr(p, e - p);
    if (line.rfind(prefix, 0) == 0 && line.find(contains) != std::string::npos) return true;
    p = e + 1;
  }
  return false;
}

TEST(Check, PassesOnTheCpuBackendAtATinySize) {
  const Outcome o = run({});
  // 2 activations x 2 modes x (1 base + 8 + 8 + 12 + 5 invariants).
  EXPECT_EQ(o.rc, 0) << o.out;
  EXPECT_EQ(last_line(o.out), "136 passed, 0 failed");
  EXPECT_EQ(count(o.out, "\nPASS  "), 136);
  EXPECT_EQ(count(o.out, "\nFAIL  "), 0);
  for (const char* scope : {"swiglu A16", "swiglu A4", "situ A16", "situ A4"})
    EXPECT_TRUE(has_line(o.out, "-- qwen3_30b_a3b_tp4 " + std::string(scope),
                         "individual adapters 8/8, eight adapters in one batch 8/8, mixed adapter and base requests 12/12, invariants 5/5"))
        << scope;
  // The sizes used are stated.
  EXPECT_NE(o.out.find("8 local experts (reduced from 128)"), std::string::npos);
  EXPECT_NE(o.out.find("T=12 tokens"), std::string::npos);
  // Every run kind went through the backend.
  for (const char* l : {"base", "adapter7", "batch8", "requests12", "zero_b", "bridge_fused", "bridge_delta",
                        "base_empty_registry", "base_after_unload"})
    EXPECT_NE(std::find(o.labels.begin(), o.labels.end(), l), o.labels.end()) << l;
}

TEST(Check, CoversTheGatedSharedExpertOfQwen3Next) {
  // 16 of its 512 experts (top-10), its shared expert (I 512) and sigmoid gate in every run.
  const Outcome o = run({"--activations", "swiglu", "--modes", "a16"}, {}, "qwen3_next_80b_a3b", "16");
  EXPECT_EQ(o.rc, 0) << o.out;
  EXPECT_EQ(last_line(o.out), "35 passed, 0 failed");
  EXPECT_NE(o.out.find("shared expert I=512 sigmoid-gated"), std::string::npos) << o.out;
  EXPECT_TRUE(has_line(o.out, "PASS  qwen3_next_80b_a3b swiglu A16 | invariants | shared expert weighted by sigmoid(x . g)",
                       "gate's effect"))
      << o.out;
  EXPECT_TRUE(has_line(o.out, "-- qwen3_next_80b_a3b swiglu A16", "invariants 6/6")) << o.out;
}

TEST(Check, CatchesAWrongValueInTheMixedBatch) {
  fp4moe::CheckHooks h;
  // Token 1 of the round-robin batch belongs to adapter 1: make one of its values 5% of its row's norm off.
  h.on_backend_output = [](const std::string& label, std::vector<uint16_t>& y) {
    if (label != "batch8") return;
    const int64_t H = 2048;
    double n2 = 0;
    for (int64_t h2 = 0; h2 < H; ++h2) n2 += std::pow(fp4moe::bf16_bits_to_f32(y[H + h2]), 2);
    y[H + 17] = fp4moe::f32_to_bf16_bits(fp4moe::bf16_bits_to_f32(y[H + 17]) + 0.05f * static_cast<float>(std::sqrt(n2)));
  };
  const Outcome o = run({"--activations", "swiglu", "--modes", "a16"}, h);
  EXPECT_EQ(o.rc, 1) << o.out;
  EXPECT_EQ(last_line(o.out), "33 passed, 1 failed");
  EXPECT_TRUE(has_line(o.out, "FAIL  qwen3_30b_a3b_tp4 swiglu A16 | eight adapters in one batch | adapter 1 tokens", "rel_l2"))
      << o.out;
}

TEST(Check, CatchesOneUlpInTheBaseOutput) {
  fp4moe::CheckHooks h;
  // One bf16 ulp on one value of the base run: within every tolerance, but not bit-identical.
  h.on_backend_output = [](const std::string& label, std::vector<uint16_t>& y) {
    if (label == "base") y[5] ^= 1;
  };
  const Outcome o = run({"--activations", "situ", "--modes", "a4"}, h);
  EXPECT_EQ(o.rc, 1) << o.out;
  const std::string scope = "FAIL  qwen3_30b_a3b_tp4 situ A4 | invariants | ";
  EXPECT_TRUE(has_line(o.out, scope + "zero-B adapters equal base", "1 differing")) << o.out;
  EXPECT_TRUE(has_line(o.out, scope + "base tokens in a mixed batch equal base alone", "1 differing")) << o.out;
  EXPECT_TRUE(has_line(o.out, scope + "base unchanged by load/unload", "1 differing")) << o.out;
  // The re-launched child is not perturbed, so its hash differs.
  EXPECT_TRUE(has_line(o.out, scope + "identical output across two process launches", "re-launched process")) << o.out;
  EXPECT_TRUE(has_line(o.out, "PASS  qwen3_30b_a3b_tp4 situ A4 | without LoRA | base vs reference", "rel_l2")) << o.out;
  EXPECT_EQ(last_line(o.out), "30 passed, 4 failed");
}

TEST(Check, CatchesABridgeThatDiffersFromTheFusedLora) {
  fp4moe::CheckHooks h;
  h.on_backend_output = [](const std::string& label, std::vector<uint16_t>& y) {
    if (label == "bridge_delta") y[y.size() - 1] ^= 1;
  };
  const Outcome o = run({"--activations", "swiglu", "--modes", "a16"}, h);
  EXPECT_EQ(o.rc, 1);
  EXPECT_TRUE(has_line(o.out, "FAIL  qwen3_30b_a3b_tp4 swiglu A16 | invariants | bridge equals fused LoRA", "1 differing")) << o.out;
  EXPECT_EQ(last_line(o.out), "33 passed, 1 failed");
}

TEST(Check, CatchesAnAdapterWithoutEffect) {
  fp4moe::CheckHooks h;
  std::vector<uint16_t> base;
  // The backend "forgets" adapter 4: its output is the base output.
  h.on_backend_output = [&base](const std::string& label, std::vector<uint16_t>& y) {
    if (label == "base") base = y;
    if (label == "adapter4") y = base;
  };
  const Outcome o = run({"--activations", "swiglu", "--modes", "a16"}, h);
  EXPECT_EQ(o.rc, 1);
  EXPECT_TRUE(has_line(o.out, "FAIL  qwen3_30b_a3b_tp4 swiglu A16 | individual adapters | adapter 4 (peft_fused)", "effect vs base 0.000e+00"))
      << o.out;
}

TEST(Check, WritesJson) {
  const std::string path = testing::TempDir() + "fp4moe_check_test.json";
  const Outcome o = run({"--activations", "swiglu", "--modes", "a16", "--json", path});
  EXPECT_EQ(o.rc, 0) << o.out;
  std::ifstream f(path);
  const std::string text((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
  EXPECT_NE(text.find("\"passed\": 34"), std::string::npos) << text;
  EXPECT_NE(text.find("\"failed\": 0"), std::string::npos);
  EXPECT_EQ(count(text, "\"pass\": true"), 34);
  // It parses as JSON (fp4moe's own strict parser).
  EXPECT_NO_THROW(fp4moe::json::parse(text, "check json"));
  std::remove(path.c_str());
}

TEST(Check, RefusesBadUsage) {
  auto rc = [](std::vector<std::string> args) {
    std::vector<char*> av;
    for (auto& a : args) av.push_back(a.data());
    testing::internal::CaptureStderr();
    const int r = fp4moe::run_check(static_cast<int>(av.size()), av.data());
    const std::string err = testing::internal::GetCapturedStderr();
    EXPECT_FALSE(err.empty());
    return r;
  };
  EXPECT_EQ(rc({"--shape", "no_such_model"}), 2);
  EXPECT_EQ(rc({"--backend", "tpu"}), 2);
  EXPECT_EQ(rc({"--tokens", "5"}), 2);   // fewer than the 12 requests of phase 3
  EXPECT_EQ(rc({"--tokens", "-3"}), 2);
  EXPECT_EQ(rc({"--tokens", "12x"}), 2);
  EXPECT_EQ(rc({"--experts", "4"}), 2);  // fewer than top-8
  EXPECT_EQ(rc({"--modes", "a8"}), 2);
  EXPECT_EQ(rc({"--frobnicate"}), 2);
  EXPECT_EQ(rc({"--json"}), 2);
}

}  // namespace
