// The UCX transport family a ucx test binary runs over: REFIT_TEST_UCX_TLS, which its
// test target sets (tests/engines/ucx/BUILD: one binary per family, compiled once).
#pragma once

#include <cstdio>
#include <cstdlib>
#include <string>

namespace refit::testing {

// Sets UCX_TLS to the family and UCX_NET_DEVICES to lo (else UCX's tcp uses every
// interface); returns the family. UCX reads both when its first context is made, so
// call it from a static initializer, before any test. Exits 2, saying why, when the
// variable is unset.
inline std::string use_ucx_test_transports() {
  const char* tls = std::getenv("REFIT_TEST_UCX_TLS");
  if (!tls || !*tls) {
    std::fprintf(stderr, "REFIT_TEST_UCX_TLS is not set (the test target sets it: sm,self or tcp,self)\n");
    std::exit(2);
  }
  setenv("UCX_TLS", tls, 1);
  setenv("UCX_NET_DEVICES", "lo", 1);
  return tls;
}

}  // namespace refit::testing
