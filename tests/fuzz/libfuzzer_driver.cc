// libFuzzer's entry point (linked with -fsanitize=fuzzer under --config=fuzz).
#include "tests/fuzz/fuzz.h"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  (void)refit_fuzz_one(data, size);
  return 0;
}
