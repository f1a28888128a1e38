// `fp4moe check`: the validation harness (the original release's phases plus the SPEC §4/§5
// invariants), see docs/api.md "Validation harness".
#pragma once
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

namespace fp4moe {

// argv holds the arguments after the word "check" (main passes argc - 2, argv + 2). Prints one line
// per check and "N passed, M failed" as the last line; returns 0 when every check passed, 1 when one
// failed, 2 on a usage error.
int run_check(int argc, char** argv);

// Test hooks: not used by the CLI. on_backend_output sees every output of the backend under test
// (bf16 bits, [T, H]) before any comparison; `label` names the run ("base", "adapter3", "batch8",
// "requests12", ...). Tests plant a fault there to show that the harness catches it.
struct CheckHooks {
  std::function<void(const std::string& label, std::vector<uint16_t>& y_bits)> on_backend_output;
};
int run_check_with_hooks(int argc, char** argv, const CheckHooks& hooks);

}  // namespace fp4moe
