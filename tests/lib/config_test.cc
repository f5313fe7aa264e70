#include <refit/config.h>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "tests/lib/expect.h"

namespace refit {
namespace {

using ::testing::HasSubstr;

TEST(weight_transfer_config, empty_object_gives_defaults) {
  auto c = weight_transfer_config::from_json(json::object());
  EXPECT_EQ(c.backend, "tcp");
  EXPECT_EQ(c.timeout, std::chrono::milliseconds(60'000));
  EXPECT_EQ(c.processing_threads, 1u);
  // null is "not given".
  c = weight_transfer_config::from_json(json::parse(R"({"backend": null, "timeout_ms": null})"));
  EXPECT_EQ(c.backend, "tcp");
  EXPECT_EQ(c.timeout, std::chrono::milliseconds(60'000));
}

TEST(weight_transfer_config, reads_every_member_and_round_trips) {
  auto c = weight_transfer_config::from_json(
      json::parse(R"({"backend": "nccl", "timeout_ms": 250, "processing_threads": 256, "commit": "staged",
                      "socket_buffer_bytes": 8388608, "max_stage_bytes": 1073741824})"));
  EXPECT_EQ(c.backend, "nccl");
  EXPECT_EQ(c.max_stage_bytes, 1u << 30);
  EXPECT_EQ(c.socket_buffer_bytes, 8u << 20);
  EXPECT_EQ(c.commit, commit_mode::staged);
  EXPECT_EQ(c.timeout, std::chrono::milliseconds(250));
  EXPECT_EQ(c.processing_threads, 256u);
  json j = c.to_json();
  EXPECT_EQ(j, json::parse(R"({"backend": "nccl", "timeout_ms": 250, "processing_threads": 256, "commit": "staged",
                                "socket_buffer_bytes": 8388608, "max_stage_bytes": 1073741824})"));
  auto again = weight_transfer_config::from_json(j);
  EXPECT_EQ(again.backend, c.backend);
  EXPECT_EQ(again.timeout, c.timeout);
  EXPECT_EQ(again.processing_threads, c.processing_threads);
  EXPECT_EQ(again.commit, commit_mode::staged);
  EXPECT_EQ(weight_transfer_config{}.commit, commit_mode::in_place) << "the default";
}

TEST(weight_transfer_config, rejects_bad_values_naming_member_and_value) {
  struct bad {
    const char* text;
    const char* says;
  };
  for (const bad& b : {
           bad{R"({"backend": ""})", "member 'backend' must not be empty"},
           bad{R"({"backend": 3})", "member 'backend' expected a string, got number 3"},
           bad{R"({"timeout_ms": 0})", "member 'timeout_ms' must be positive, got 0"},
           bad{R"({"timeout_ms": -5})", "member 'timeout_ms' must be positive, got -5"},
           bad{R"({"timeout_ms": "1000"})", "member 'timeout_ms' expected an integer, got string \"1000\""},
           bad{R"({"timeout_ms": 1.5})", "member 'timeout_ms' expected an integer"},
           bad{R"({"processing_threads": 0})", "member 'processing_threads' must be in [1, 256], got 0"},
           bad{R"({"processing_threads": 257})", "member 'processing_threads' must be in [1, 256], got 257"},
           bad{R"({"processing_threads": -1})", "member 'processing_threads' must not be negative, got -1"},
           bad{R"({"commit": "atomic"})", "member 'commit' must be \"in_place\" or \"staged\", got \"atomic\""},
           bad{R"({"commit": 1})", "member 'commit' expected a string"},
           bad{R"({"socket_buffer_bytes": 2147483648})", "member 'socket_buffer_bytes' must be at most 1 GiB"},
       }) {
    json j = json::parse(b.text);
    auto e = REFIT_THROWN(weight_transfer_config::from_json(j));
    EXPECT_EQ(e.kind(), errc::invalid_argument) << b.text;
    EXPECT_THAT(e.message(), HasSubstr(std::string("weight_transfer_config: ") + b.says)) << b.text;
  }
}

TEST(weight_transfer_config, unknown_member_lists_accepted_members) {
  auto e = REFIT_THROWN(weight_transfer_config::from_json(json::parse(R"({"timeout": 5})")));
  EXPECT_EQ(e.kind(), errc::invalid_argument);
  EXPECT_EQ(e.message(),
            "weight_transfer_config: unknown member 'timeout' (accepted: backend, timeout_ms, "
            "processing_threads, commit, socket_buffer_bytes, max_stage_bytes)");
}

TEST(weight_transfer_config, non_object_is_rejected) {
  auto e = REFIT_THROWN(weight_transfer_config::from_json(json("tcp")));
  EXPECT_EQ(e.message(), "weight_transfer_config: expected a JSON object, got string \"tcp\"");
}

}  // namespace
}  // namespace refit
