#include <refit/stats.h>

#include <gtest/gtest.h>

namespace refit {
namespace {

update_stats make(double receive, double process, double wall, std::uint64_t bytes = 0) {
  update_stats s;
  s.receive_s = receive;
  s.process_s = process;
  s.wall_s = wall;
  s.bytes = bytes;
  s.finalize();
  return s;
}

TEST(update_stats, overlap_is_the_hidden_fraction_of_the_shorter_phase) {
  EXPECT_DOUBLE_EQ(make(1.0, 1.0, 1.5).overlap, 0.5);
  EXPECT_DOUBLE_EQ(make(1.0, 1.0, 1.0).overlap, 1.0);  // fully hidden
  EXPECT_DOUBLE_EQ(make(1.0, 1.0, 2.0).overlap, 0.0);  // strictly sequential
  EXPECT_DOUBLE_EQ(make(4.0, 1.0, 4.25).overlap, 0.75);
}

TEST(update_stats, overlap_is_clamped_and_zero_without_both_phases) {
  EXPECT_DOUBLE_EQ(make(1.0, 1.0, 3.0).overlap, 0.0);  // idle time: would be negative
  EXPECT_DOUBLE_EQ(make(1.0, 1.0, 0.5).overlap, 1.0);  // clock skew: would exceed 1
  EXPECT_DOUBLE_EQ(make(0.0, 1.0, 1.0).overlap, 0.0);
  EXPECT_DOUBLE_EQ(make(1.0, 0.0, 1.0).overlap, 0.0);
}

TEST(update_stats, gbps_is_bytes_per_wall_second) {
  EXPECT_DOUBLE_EQ(make(1, 1, 2.0, 4'000'000'000ull).gbps, 2.0);
  EXPECT_DOUBLE_EQ(make(0, 0, 0.0, 1000).gbps, 0.0);  // no division by zero
}

TEST(update_stats, to_json_has_every_member) {
  update_stats s = make(1.0, 2.0, 2.5, 5'000'000'000ull);
  s.tensors = 7;
  s.buckets = 3;
  s.wire_bytes = 4'000'000'000ull;
  json j = s.to_json();
  EXPECT_EQ(j["bytes"], 5'000'000'000ull);
  EXPECT_EQ(j["tensors"], 7);
  EXPECT_EQ(j["buckets"], 3);
  EXPECT_EQ(j["wire_bytes"], 4'000'000'000ull);
  EXPECT_DOUBLE_EQ(j["wall_s"].get<double>(), 2.5);
  EXPECT_DOUBLE_EQ(j["receive_s"].get<double>(), 1.0);
  EXPECT_DOUBLE_EQ(j["process_s"].get<double>(), 2.0);
  EXPECT_DOUBLE_EQ(j["overlap"].get<double>(), 0.5);
  EXPECT_DOUBLE_EQ(j["gbps"].get<double>(), 2.0);
  EXPECT_EQ(j.size(), 9u);
}

}  // namespace
}  // namespace refit
