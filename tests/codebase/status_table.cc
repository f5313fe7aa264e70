// Prints the README's status table of the backends from what each declares
// (engine_capabilities, through engine_factory::capabilities) and, for "verified on
// a GPU", from the GPU check's committed reports:
//
//   bazel run --config=cuda //tests/codebase:status_table -- [--reports tests/cuda/reports]
//       [--schema tests/cuda/gpu_report_schema.json]
//
// tests/codebase/check_readme.py compares the README's table with this output, so
// the table cannot drift from the code. Built with --config=cuda so the GPU
// backends are registered and listed; a CPU build lists the CPU ones. The reports'
// statuses and fields are tests/cuda/gpu_report_schema.json's, which
// tests/cuda/gpu_report.py writes them by; //tests/codebase:status_table_test feeds a
// synthetic report through both.
#include <dirent.h>

#include <cstdlib>
#include <fstream>
#include <iostream>
#include <iterator>
#include <map>
#include <set>
#include <sstream>
#include <string>

#include <refit/factory.h>
#include <refit/json.h>

namespace {

refit::json read_json(const std::string& path) {
  std::ifstream in(path);
  std::stringstream text;
  text << in.rdbuf();
  return refit::json::parse(text.str(), nullptr, false);
}

// What gpu_report_schema.json says decides the column.
struct gpu_schema {
  std::string verified;  // the status of a step that proves its backends
  std::string gpu_mode;  // reports of other modes (dry runs) prove nothing
  std::set<std::string> failing, neutral;
};

gpu_schema read_schema(const std::string& path) {
  const auto j = read_json(path);
  if (!j.is_object() || !j.contains("verified_status")) {
    std::cerr << "status_table: " << path << " is not the GPU report schema (no verified_status)\n";
    std::exit(2);
  }
  gpu_schema s;
  s.verified = j["verified_status"].get<std::string>();
  s.gpu_mode = j["gpu_mode"].get<std::string>();
  for (const auto& f : j["failing_statuses"]) s.failing.insert(f.get<std::string>());
  for (const auto& n : j["neutral_statuses"]) s.neutral.insert(n.get<std::string>());
  return s;
}

// The last column for each backend a GPU-mode report in `dir` names: "yes" when a
// step naming it passed and none naming it failed, "yes (1 GPU)" when some of its
// steps needed two GPUs and the machine had one; "no" otherwise.
std::map<std::string, std::string> gpu_verified(const std::string& dir, const gpu_schema& schema) {
  std::set<std::string> good, bad, partial;
  DIR* d = opendir(dir.c_str());
  if (!d) return {};
  while (dirent* e = readdir(d)) {
    std::string name = e->d_name;
    if (name.size() < 5 || name.substr(name.size() - 5) != ".json") continue;
    const auto j = read_json(dir + "/" + name);
    if (!j.is_object() || j.value("mode", "") != schema.gpu_mode || !j.contains("steps")) continue;
    for (const auto& step : j["steps"]) {
      const std::string status = step.value("status", "");
      for (const auto& b : step.value("backends", refit::json::array())) {
        const std::string backend = b.get<std::string>();
        if (status == schema.verified)
          good.insert(backend);
        else if (schema.failing.count(status))
          bad.insert(backend);
        else if (schema.neutral.count(status))
          partial.insert(backend);
      }
    }
  }
  closedir(d);
  std::map<std::string, std::string> out;
  for (const auto& b : good)
    if (!bad.count(b)) out[b] = partial.count(b) ? "yes (1 GPU)" : "yes";
  return out;
}

const char* yes(bool b) { return b ? "yes" : "no"; }

}  // namespace

int main(int argc, char** argv) {
  std::string reports = "tests/cuda/reports", schema_path = "tests/cuda/gpu_report_schema.json";
  for (int i = 1; i + 1 < argc; i += 2) {
    if (std::string(argv[i]) == "--reports") reports = argv[i + 1];
    if (std::string(argv[i]) == "--schema") schema_path = argv[i + 1];
  }
  if (const char* ws = std::getenv("BUILD_WORKSPACE_DIRECTORY")) {
    if (reports[0] != '/') reports = std::string(ws) + "/" + reports;
    if (schema_path[0] != '/') schema_path = std::string(ws) + "/" + schema_path;
  }
  const auto verified = gpu_verified(reports, read_schema(schema_path));
  auto& factory = refit::engine_factory::instance();
  std::cout << "| backend | direct receive | staged commit | checksums | relay | sharded | device memory | Python | "
               "verified on a GPU |\n";
  std::cout << "|---|---|---|---|---|---|---|---|---|\n";
  for (const auto& name : factory.available()) {
    const auto c = factory.capabilities(name);
    if (!c) continue;
    const auto v = verified.find(name);
    std::cout << "| `" << name << "` | " << yes(c->direct_receive) << " | " << yes(c->staged_commit) << " | "
              << yes(c->checksums) << " | " << yes(c->relay) << " | " << yes(c->sharded) << " | "
              << yes(c->device_memory) << " | "
              << (c->needs_gpu      ? "`--cuda` wheel"
                  : c->opt_in_build ? "CPU wheel"
                                    : "yes")
              << " | " << (v != verified.end() ? v->second : "no") << " |\n";
  }
  return 0;
}
