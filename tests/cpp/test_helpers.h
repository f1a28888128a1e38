// GoogleTest helpers shared by the C++ test files: a temporary directory per test, "this call throws fp4moe::Error
// naming this argument" and "run one function per rank on its own thread".
#pragma once
#include <gtest/gtest.h>
#include <unistd.h>

#include <exception>
#include <filesystem>
#include <functional>
#include <string>
#include <thread>
#include <vector>

#include "fp4moe/types.h"

namespace fp4moe::testutil {

// A fresh temporary directory per test, removed afterwards.
struct TempDir {
  std::filesystem::path path;
  TempDir() {
    const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
    path = std::filesystem::temp_directory_path() /
           ("fp4moe_" + std::string(info->test_suite_name()) + "_" + info->name() + "_" + std::to_string(::getpid()));
    std::filesystem::remove_all(path);
    std::filesystem::create_directories(path);
  }
  ~TempDir() {
    std::error_code ec;
    std::filesystem::remove_all(path, ec);
  }
  std::string file(const std::string& name) const { return (path / name).string(); }
};

// f() must throw Error with argument() == arg and code() == code.
inline void expect_error(const std::function<void()>& f, const std::string& arg,
                         ErrorCode code = ErrorCode::InvalidArgument) {
  try {
    f();
    ADD_FAILURE() << "expected an error naming '" << arg << "'";
  } catch (const Error& e) {
    EXPECT_EQ(e.argument(), arg) << e.what();
    EXPECT_EQ(e.code(), code) << e.what();
  }
}

// Runs fn(rank) on one thread per rank; rethrows the first failure after joining all.
inline void run_ranks(int world, const std::function<void(int)>& fn) {
  std::vector<std::thread> th;
  std::vector<std::exception_ptr> errs(static_cast<size_t>(world));
  for (int r = 0; r < world; ++r)
    th.emplace_back([&, r] {
      try {
        fn(r);
      } catch (...) {
        errs[static_cast<size_t>(r)] = std::current_exception();
      }
    });
  for (auto& t : th) t.join();
  for (auto& e : errs)
    if (e) std::rethrow_exception(e);
}

}  // namespace fp4moe::testutil
