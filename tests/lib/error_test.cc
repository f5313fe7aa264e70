#include <refit/error.h>

#include <set>
#include <stdexcept>
#include <string>
#include <string_view>

#include <gtest/gtest.h>

namespace refit {
namespace {

constexpr errc all_kinds[] = {
    errc::timeout,           errc::peer_lost,          errc::invalid_argument,   errc::protocol_error,
    errc::not_registered,    errc::already_registered, errc::invalid_state,      errc::load_failed,
    errc::processing_failed, errc::integrity_error,    errc::io_error,           errc::cancelled,
    errc::unsupported,       errc::auth_error,         errc::resource_exhausted,
};

TEST(error_category, is_named_refit_and_describes_every_kind_distinctly) {
  EXPECT_STREQ(error_category().name(), "refit");
  std::set<std::string> messages;
  for (errc e : all_kinds) {
    std::string m = error_category().message(static_cast<int>(e));
    EXPECT_FALSE(m.empty()) << static_cast<int>(e);
    EXPECT_EQ(m.find("refit error"), std::string::npos) << "kind " << static_cast<int>(e) << " has no name";
    messages.insert(m);
  }
  EXPECT_EQ(messages.size(), std::size(all_kinds));
  EXPECT_EQ(error_category().message(static_cast<int>(errc::timeout)), "timeout");
  EXPECT_EQ(error_category().message(static_cast<int>(errc::not_registered)), "not registered");
  EXPECT_EQ(error_category().message(static_cast<int>(errc::auth_error)), "authentication error");
}

TEST(error_category, unknown_value_is_described_by_number) {
  EXPECT_EQ(error_category().message(99), "refit error 99");
}

TEST(error_category, kind_values_are_stable) {
  // They cross process and plugin boundaries (plugin creators return them as int).
  EXPECT_EQ(static_cast<int>(errc::timeout), 1);
  EXPECT_EQ(static_cast<int>(errc::load_failed), 8);
  EXPECT_EQ(static_cast<int>(errc::unsupported), 13);
  EXPECT_EQ(static_cast<int>(errc::auth_error), 14);
  EXPECT_EQ(static_cast<int>(errc::resource_exhausted), 15);
}

TEST(errc_name, is_a_stable_identifier_and_parse_errc_inverts_it) {
  EXPECT_EQ(errc_name(errc::timeout), "timeout");
  EXPECT_EQ(errc_name(errc::peer_lost), "peer_lost");
  EXPECT_EQ(errc_name(errc::unsupported), "unsupported");
  EXPECT_EQ(errc_name(errc::auth_error), "auth_error");
  EXPECT_EQ(errc_name(static_cast<errc>(99)), "unknown");
  std::set<std::string_view> names;
  for (errc e : all_kinds) {
    EXPECT_EQ(parse_errc(errc_name(e)), e) << errc_name(e);
    names.insert(errc_name(e));
  }
  EXPECT_EQ(names.size(), std::size(all_kinds));
  EXPECT_EQ(parse_errc("no_such_kind"), errc{});
  EXPECT_EQ(parse_errc(""), errc{});
  EXPECT_EQ(parse_errc("peer lost"), errc{}) << "the wire name, not the message";
}

TEST(error_code, converts_from_errc_and_compares) {
  std::error_code ec = errc::peer_lost;
  EXPECT_EQ(&ec.category(), &error_category());
  EXPECT_EQ(ec.value(), static_cast<int>(errc::peer_lost));
  EXPECT_EQ(ec, make_error_code(errc::peer_lost));
  EXPECT_TRUE(ec == errc::peer_lost);
  EXPECT_FALSE(ec == errc::timeout);
  EXPECT_EQ(ec.message(), "peer lost");
}

TEST(error, what_has_message_and_kind_message_has_message_only) {
  error e(errc::timeout, "tcp: bucket 3: no progress within 100 ms");
  EXPECT_EQ(e.kind(), errc::timeout);
  EXPECT_EQ(e.message(), "tcp: bucket 3: no progress within 100 ms");
  EXPECT_STREQ(e.what(), "tcp: bucket 3: no progress within 100 ms: timeout");
  EXPECT_EQ(e.code(), make_error_code(errc::timeout));
}

TEST(error, kind_of_a_foreign_category_is_empty) {
  error e(std::make_error_code(std::errc::connection_refused), "connect");
  EXPECT_EQ(e.kind(), errc{});
  EXPECT_EQ(e.message(), "connect");
  EXPECT_EQ(e.code(), std::errc::connection_refused);
}

TEST(error, throw_error_throws_a_system_error_with_the_kind) {
  try {
    throw_error(errc::invalid_state, "receive before init");
    FAIL() << "throw_error returned";
  } catch (const std::system_error& e) {
    EXPECT_EQ(e.code(), errc::invalid_state);
    auto* re = dynamic_cast<const error*>(&e);
    ASSERT_NE(re, nullptr);
    EXPECT_EQ(re->message(), "receive before init");
  }
}

TEST(error, a_caught_exception_reads_as_kind_message_and_description) {
  auto refit_error = std::make_exception_ptr(error(errc::peer_lost, "tcp: the trainer closed the connection"));
  EXPECT_EQ(error_kind_of(refit_error), errc::peer_lost);
  EXPECT_EQ(error_message_of(refit_error), "tcp: the trainer closed the connection");
  EXPECT_EQ(describe_error(refit_error), "peer_lost: tcp: the trainer closed the connection");
  auto other = std::make_exception_ptr(std::runtime_error("device full"));
  EXPECT_EQ(error_kind_of(other), errc::io_error);
  EXPECT_EQ(error_message_of(other), "device full");
  EXPECT_EQ(describe_error(other), "device full");
  EXPECT_EQ(describe_error(std::make_exception_ptr(42)), "a non-standard exception");
  EXPECT_EQ(error_kind_of(nullptr), errc{});
  EXPECT_EQ(describe_error(nullptr), "no error");
}

}  // namespace
}  // namespace refit
