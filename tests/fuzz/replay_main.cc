// Replays a fuzz target's corpus without libFuzzer (the default, GCC build), so
// `bazel test //...` runs every seed and every checked-in reproducer. Arguments are
// files or directories (flags starting with '-' are libFuzzer's and ignored).
// A file named ok-* must be accepted and one named bad-* rejected; any other name
// (a libFuzzer-found input) only must not crash.
#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

#include "tests/fuzz/fuzz.h"

namespace fs = std::filesystem;

int main(int argc, char** argv) {
  std::vector<fs::path> inputs;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    if (arg.starts_with("-")) continue;
    if (fs::is_directory(arg)) {
      for (const auto& entry : fs::recursive_directory_iterator(arg))
        if (!fs::is_directory(entry.path())) inputs.push_back(entry.path());
    } else {
      inputs.emplace_back(arg);
    }
  }
  std::sort(inputs.begin(), inputs.end());
  if (inputs.empty()) {
    std::fprintf(stderr, "replay: no inputs (pass corpus files or directories)\n");
    return 2;
  }
  int failures = 0, accepted = 0;
  for (const auto& path : inputs) {
    std::ifstream in(path, std::ios::binary);
    if (!in) {
      std::fprintf(stderr, "replay: cannot read %s\n", path.c_str());
      return 2;
    }
    const std::vector<char> bytes{std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
    const bool ok = refit_fuzz_one(reinterpret_cast<const std::uint8_t*>(bytes.data()), bytes.size());
    accepted += ok;
    const std::string name = path.filename().string();
    const bool want_ok = name.starts_with("ok-"), want_bad = name.starts_with("bad-");
    if ((want_ok && !ok) || (want_bad && ok)) {
      std::fprintf(stderr, "replay: %s was %s, expected %s\n", path.c_str(), ok ? "accepted" : "rejected",
                   ok ? "rejected" : "accepted");
      ++failures;
    }
  }
  std::printf("replay: %zu inputs, %d accepted, %d rejected, %d unexpected\n", inputs.size(), accepted,
              static_cast<int>(inputs.size()) - accepted, failures);
  return failures ? 1 : 0;
}
