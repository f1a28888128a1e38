// `fp4moe check` comparisons and report: the tolerances, the statistics of an output against its reference,
// the PASS/FAIL lines with their tallies, and the JSON of --json.
#pragma once
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <string>
#include <vector>

namespace fp4moe::check {

// ---- tolerances (docs/numerics.md, "Validation harness") ---------------------------------------
struct Tolerance {
  double rel_l2, cosine;
};
// A16: the SPEC's bf16 roundings vs an unrounded run cost ~2.5e-3 relative L2; the bound leaves 4x.
inline constexpr Tolerance kTolA16{1e-2, 0.9999};
// A4 vs the fp64 A4 reference: fp64 quantizes the unrounded activation to NVFP4 where fp32 first rounds
// it to bf16, so ~1% of FC2 inputs land on a neighbouring E2M1 code: 2-3.6e-2 measured on 2-3 tokens.
inline constexpr Tolerance kTolA4VsFp64{6e-2, 0.998};
// A4 vs the fp32 A4 reference (CUDA): same roundings, so only summation order differs.
inline constexpr Tolerance kTolA4VsFp32{2e-2, 0.9998};
// An adapter "has an effect" when the output moves from base by at least this relative L2.
inline constexpr double kMinEffect = 1e-2;
// The oracle's shared-expert part against its weight sigmoid(x . g) computed on the host in double: only the
// oracle's own roundings of the combine and of x . g differ (fp32 oracle: ~1e-7 of the part).
inline constexpr double kTolSharedWeight = 1e-5;

struct CheckRecord {
  std::string scope;  // "shape activation mode"
  std::string phase;
  std::string name;
  bool pass = false;
  std::string detail;
};

class Reporter {
 public:
  explicit Reporter(bool quiet) : quiet_(quiet) {}
  void add(const std::string& scope, const std::string& phase, const std::string& name, bool pass,
           const std::string& detail) {
    records_.push_back({scope, phase, name, pass, detail});
    if (!quiet_) {
      std::printf("%s  %s | %s | %s: %s\n", pass ? "PASS" : "FAIL", scope.c_str(), phase.c_str(), name.c_str(),
                  detail.c_str());
      std::fflush(stdout);
    }
  }
  const std::vector<CheckRecord>& records() const { return records_; }
  int passed() const {
    return static_cast<int>(std::count_if(records_.begin(), records_.end(), [](auto& r) { return r.pass; }));
  }
  int failed() const { return static_cast<int>(records_.size()) - passed(); }
  // "8/8"-style tally of one scope's phase.
  std::string tally(const std::string& scope, const std::string& phase) const {
    int n = 0, p = 0;
    for (auto& r : records_)
      if (r.scope == scope && r.phase == phase) {
        ++n;
        p += r.pass;
      }
    return std::to_string(p) + "/" + std::to_string(n);
  }

 private:
  bool quiet_;
  std::vector<CheckRecord> records_;
};

std::string fmt(const char* f, double v);

// Relative L2, cosine and max |difference| of `got` vs `ref` over rows (all rows when `rows` is empty).
struct Stats {
  double rel_l2 = 0, cosine = 1, max_abs = 0;
};
Stats compare_rows(const std::vector<double>& got, const std::vector<double>& ref, int64_t H,
                   const std::vector<int64_t>& rows);
bool within(const Stats& s, const Tolerance& tol);
std::string describe(const Stats& s, const Tolerance& tol);

// Rows (tokens) where the two bf16 outputs differ in any bit; `rows` empty = all.
int64_t differing_elements(const std::vector<uint16_t>& a, const std::vector<uint16_t>& b, int64_t H,
                           const std::vector<int64_t>& rows);

// bf16 bits as doubles.
std::vector<double> to_double(const std::vector<uint16_t>& bits);

// Writes every check of rep to path; false when the file cannot be written.
bool write_json(const std::string& path, const Reporter& rep, const std::string& backend, int64_t experts, int64_t tokens);

}  // namespace fp4moe::check
