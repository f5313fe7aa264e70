// Prints the README's status table of the backends from what each declares
// (engine_capabilities, through engine_factory::capabilities) and, for "verified on
// a GPU", from the GPU check's committed reports:
//
//   bazel run --config=cuda //tests/codebase:status_table -- [--reports tests/cuda/reports]
//
// tests/codebase/check_readme.py compares the README's table with this output, so
// the table cannot drift from the code. Built with --config=cuda so the GPU
// backends are registered and listed; a CPU build lists the CPU ones.
#include <dirent.h>

#include <fstream>
#include <iostream>
#include <iterator>
#include <set>
#include <sstream>
#include <string>

#include <refit/factory.h>
#include <refit/json.h>

namespace {

// Backends a committed GPU report (tests/cuda/reports/*.json, gpu_report.py's
// summary) shows passing on a GPU: those of its steps with status "passed".
std::set<std::string> gpu_verified(const std::string& dir) {
  std::set<std::string> out;
  DIR* d = opendir(dir.c_str());
  if (!d) return out;
  while (dirent* e = readdir(d)) {
    std::string name = e->d_name;
    if (name.size() < 5 || name.substr(name.size() - 5) != ".json") continue;
    std::ifstream in(dir + "/" + name);
    std::stringstream text;
    text << in.rdbuf();
    auto j = refit::json::parse(text.str(), nullptr, false);
    if (!j.is_object() || !j.contains("steps")) continue;
    for (const auto& step : j["steps"])
      if (step.value("status", "") == "passed" && step.contains("backend"))
        out.insert(step["backend"].get<std::string>());
  }
  closedir(d);
  return out;
}

const char* yes(bool b) { return b ? "yes" : "no"; }

}  // namespace

int main(int argc, char** argv) {
  std::string reports = "tests/cuda/reports";
  for (int i = 1; i + 1 < argc; i += 2)
    if (std::string(argv[i]) == "--reports") reports = argv[i + 1];
  if (const char* ws = std::getenv("BUILD_WORKSPACE_DIRECTORY"); ws && reports[0] != '/')
    reports = std::string(ws) + "/" + reports;
  const auto verified = gpu_verified(reports);
  auto& factory = refit::engine_factory::instance();
  std::cout << "| backend | direct receive | staged commit | checksums | relay | sharded | device memory | Python | "
               "verified on a GPU |\n";
  std::cout << "|---|---|---|---|---|---|---|---|---|\n";
  for (const auto& name : factory.available()) {
    const auto c = factory.capabilities(name);
    if (!c) continue;
    std::cout << "| `" << name << "` | " << yes(c->direct_receive) << " | " << yes(c->staged_commit) << " | "
              << yes(c->checksums) << " | " << yes(c->relay) << " | " << yes(c->sharded) << " | "
              << yes(c->device_memory) << " | "
              << (c->needs_gpu      ? "`--cuda` wheel"
                  : c->opt_in_build ? "CPU wheel"
                                    : "yes")
              << " | " << (verified.count(name) ? "yes" : "no") << " |\n";
  }
  return 0;
}
