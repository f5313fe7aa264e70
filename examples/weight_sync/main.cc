// The main job: a trainer pushes several rounds of changed weights of a synthetic
// LLM to N worker processes on loopback, through the control plane and a refit
// backend, and verifies every tensor on every worker against its own checksums.
// Progress goes to stderr; the LAST line on stdout is one JSON object.
//
//   bazel run //examples/weight_sync -- --workers 2 --model-bytes 1G --updates 3
//
// This file only dispatches on --role; job.h says which file holds which role.
// Exit status: 0 verified, 1 failed (or not verified), 2 bad flags.
#include <cstdio>
#include <exception>
#include <iostream>
#include <string>

#include <refit/error.h>
#include "examples/weight_sync/flags.h"
#include "examples/weight_sync/job.h"

int main(int argc, char** argv) {
  using namespace refit::example::weight_sync;
  options o;
  try {
    o = parse_args(argc, argv);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "weight_sync: %s\n", e.what());
    return 2;
  }
  if (o.help) {
    std::cout << usage();
    return 0;
  }
  try {
    if (o.role == "worker") return run_worker(o);
    if (o.role == "trainer-rank") return run_trainer_rank(o);
    return o.sharded_job() ? run_sharded_trainer(o) : run_trainer(o);
  } catch (const refit::error& e) {
    // Startup failures (no descriptors for the event loop, an address that is not
    // one): one line and a non-zero status, not an abort.
    std::fprintf(stderr, "weight_sync %s: %s: %s\n", o.role.c_str(), std::string(refit::errc_name(e.kind())).c_str(),
                 e.message().c_str());
    return 1;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "weight_sync %s: %s\n", o.role.c_str(), e.what());
    return 1;
  }
}
