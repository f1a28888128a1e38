// Command-line helpers shared by fp4moe check and fp4moe_soak.
#pragma once
#include <string>
#include <vector>

namespace fp4moe::cli {

// "a,b,,c" -> {"a", "b", "c"}: comma-separated items, empty ones skipped.
inline std::vector<std::string> split_list(const std::string& s) {
  std::vector<std::string> out;
  std::string cur;
  for (char c : s) {
    if (c == ',') {
      if (!cur.empty()) out.push_back(cur);
      cur.clear();
    } else {
      cur += c;
    }
  }
  if (!cur.empty()) out.push_back(cur);
  return out;
}

}  // namespace fp4moe::cli
