// Shared by the fuzz targets. Each target defines refit_fuzz_one(); a driver calls
// it: libFuzzer (libfuzzer_driver.cc, under --config=fuzz) or the corpus replayer
// (replay_main.cc, the default build, run by `bazel test`).
//
// The contract every target checks: a refit::error of the kinds the stage may
// throw is an expected outcome (the input was rejected); anything else escaping
// (nlohmann's exceptions, std::bad_alloc, std::length_error, a refit::error of an
// unexpected kind) is a bug and aborts, so libFuzzer records the input as a crash.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <initializer_list>
#include <typeinfo>

#include <refit/error.h>
#include <refit/json_reader.h>

/// Runs one input. Returns true when the input was accepted (every stage it went
/// through succeeded), false when it was rejected with an expected refit::error.
/// Aborts on anything else.
bool refit_fuzz_one(const std::uint8_t* data, std::size_t size);

namespace refit::fuzz {

[[noreturn]] inline void bug(const char* stage, const char* what) {
  std::fprintf(stderr, "refit fuzz: BUG in %s: %s\n", stage, what);
  std::abort();
}

/// Runs `f`; true when it returns, false when it throws a refit::error whose kind is
/// one of `allowed`. Aborts on any other exception or kind.
template <class F>
bool expect(const char* stage, std::initializer_list<errc> allowed, F&& f) {
  try {
    f();
    return true;
  } catch (const error& e) {
    // Messages travel in control answers (JSON): they must be valid UTF-8.
    try {
      (void)json(e.message()).dump();
    } catch (const std::exception& x) {
      std::fprintf(stderr, "refit fuzz: BUG in %s: message is not valid UTF-8 (%s): %s\n", stage, x.what(),
                   e.message().c_str());
      std::abort();
    }
    for (errc k : allowed)
      if (e.kind() == k) return false;
    std::fprintf(stderr, "refit fuzz: BUG in %s: refit::error of unexpected kind %d: %s\n", stage,
                 static_cast<int>(e.kind()), e.what());
    std::abort();
  } catch (const std::exception& e) {
    std::fprintf(stderr, "refit fuzz: BUG in %s: %s escaped: %s\n", stage, typeid(e).name(), e.what());
    std::abort();
  } catch (...) {
    bug(stage, "a non-std exception escaped");
  }
}

/// Aborts with `what` unless `condition` holds (a property the target checks).
inline void check(bool condition, const char* stage, const char* what) {
  if (!condition) bug(stage, what);
}

}  // namespace refit::fuzz
