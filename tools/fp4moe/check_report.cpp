// `fp4moe check` comparisons and report (check_report.h).
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC optimize("fp-contract=off")  // no fused multiply-adds: the statistics are the same on every host
#endif

#include "check_report.h"

#include <cmath>

#include "fp4moe/build_info.h"
#include "fp4moe/types.h"
#include "io/json_write.h"

#if defined(__clang__)
#pragma clang fp contract(off)
#endif

namespace fp4moe::check {

std::string fmt(const char* f, double v) {
  char buf[64];
  std::snprintf(buf, sizeof buf, f, v);
  return buf;
}

Stats compare_rows(const std::vector<double>& got, const std::vector<double>& ref, int64_t H,
                   const std::vector<int64_t>& rows) {
  double num = 0, den = 0, dot = 0, ng = 0, mx = 0;
  auto row = [&](int64_t t) {
    for (int64_t h = 0; h < H; ++h) {
      const double g = got[t * H + h], r = ref[t * H + h];
      num += (g - r) * (g - r);
      den += r * r;
      dot += g * r;
      ng += g * g;
      mx = std::max(mx, std::fabs(g - r));
      if (std::isnan(g) || std::isnan(r)) mx = NAN;
    }
  };
  if (rows.empty()) {
    for (int64_t t = 0; t < static_cast<int64_t>(got.size()) / H; ++t) row(t);
  } else {
    for (int64_t t : rows) row(t);
  }
  Stats s;
  s.max_abs = mx;
  if (den == 0 && num == 0) return s;  // both zero (e.g. tokens whose experts all live on other ranks)
  s.rel_l2 = std::sqrt(num / std::max(den, 1e-300));
  s.cosine = (ng == 0 || den == 0) ? 0.0 : dot / std::sqrt(ng * den);
  if (std::isnan(num) || std::isnan(dot)) s.rel_l2 = s.cosine = NAN;
  return s;
}
bool within(const Stats& s, const Tolerance& tol) { return s.rel_l2 <= tol.rel_l2 && s.cosine >= tol.cosine && !std::isnan(s.max_abs); }
std::string describe(const Stats& s, const Tolerance& tol) {
  return "rel_l2 " + fmt("%.3e", s.rel_l2) + " (<= " + fmt("%.0e", tol.rel_l2) + "), cos " + fmt("%.7f", s.cosine) +
         " (>= " + fmt("%g", tol.cosine) + "), max|d| " + fmt("%.3e", s.max_abs);
}

int64_t differing_elements(const std::vector<uint16_t>& a, const std::vector<uint16_t>& b, int64_t H,
                           const std::vector<int64_t>& rows) {
  if (a.size() != b.size()) return -1;
  int64_t n = 0;
  auto row = [&](int64_t t) {
    for (int64_t h = 0; h < H; ++h) n += a[t * H + h] != b[t * H + h];
  };
  if (rows.empty()) {
    for (int64_t t = 0; t < static_cast<int64_t>(a.size()) / H; ++t) row(t);
  } else {
    for (int64_t t : rows) row(t);
  }
  return n;
}

std::vector<double> to_double(const std::vector<uint16_t>& bits) {
  std::vector<double> v(bits.size());
  for (size_t i = 0; i < bits.size(); ++i) v[i] = bf16_bits_to_f32(bits[i]);
  return v;
}

bool write_json(const std::string& path, const Reporter& rep, const std::string& backend, int64_t experts, int64_t tokens) {
  FILE* f = std::fopen(path.c_str(), "w");
  if (!f) return false;
  const BuildInfo bi = build_info();
  std::fprintf(f, "{\n  \"tool\": \"fp4moe check\",\n  \"version\": %s,\n  \"source_hash\": %s,\n",
               json::quote(bi.version).c_str(), json::quote(bi.source_hash).c_str());
  std::fprintf(f, "  \"backend\": %s,\n  \"experts\": %lld,\n  \"tokens\": %lld,\n", json::quote(backend).c_str(), (long long)experts,
               (long long)tokens);
  std::fprintf(f, "  \"passed\": %d,\n  \"failed\": %d,\n  \"checks\": [\n", rep.passed(), rep.failed());
  const auto& r = rep.records();
  for (size_t i = 0; i < r.size(); ++i)
    std::fprintf(f, "    {\"scope\": %s, \"phase\": %s, \"name\": %s, \"pass\": %s, \"detail\": %s}%s\n",
                 json::quote(r[i].scope).c_str(), json::quote(r[i].phase).c_str(), json::quote(r[i].name).c_str(),
                 r[i].pass ? "true" : "false", json::quote(r[i].detail).c_str(), i + 1 < r.size() ? "," : "");
  std::fprintf(f, "  ]\n}\n");
  return std::fclose(f) == 0;
}

}  // namespace fp4moe::check
