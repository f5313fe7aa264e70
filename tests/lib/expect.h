// Assertions on refit errors for the unit tests: catch the refit::error a statement
// throws so a test can check its kind and the parts of its message.
#pragma once

#include <exception>
#include <string>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <refit/error.h>

namespace refit::testing {

/// Runs `f` and returns the refit::error it throws; records a test failure at
/// (file, line) when it throws nothing or something else.
template <class F>
refit::error thrown_by(F&& f, const char* file, int line) {
  try {
    f();
  } catch (const refit::error& e) {
    return e;
  } catch (const std::exception& e) {
    ADD_FAILURE_AT(file, line) << "threw a non-refit exception: " << e.what();
    return refit::error(std::error_code(), "<non-refit exception>");
  }
  ADD_FAILURE_AT(file, line) << "expected a refit::error, nothing was thrown";
  return refit::error(std::error_code(), "<nothing thrown>");
}

}  // namespace refit::testing

/// The refit::error that `stmt` throws (a failure is recorded if it throws none).
#define REFIT_THROWN(stmt) ::refit::testing::thrown_by([&] { stmt; }, __FILE__, __LINE__)
