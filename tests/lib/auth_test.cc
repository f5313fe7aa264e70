// Shared-secret authentication: both real sides over loopback sockets, hand-written
// peers that speak (or break) the wire protocol, HMAC known answers and the secret
// file checks. Everything runs on an io_context with a watchdog; nothing sleeps.
#include <refit/backend/handshake.h>

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <asio/buffer.hpp>
#include <asio/io_context.hpp>
#include <asio/ip/tcp.hpp>

#include <refit/backend/net.h>
#include <refit/error.h>
#include <refit/internal/hex.h>
#include "tests/lib/expect.h"
#include "tests/support/run.h"

namespace refit {
namespace {

using ::testing::HasSubstr;
using ::testing::Not;
using testing::spawn;
using tcp = asio::ip::tcp;
using namespace std::chrono_literals;

using bytes = std::vector<std::uint8_t>;
using outcome_ptr = std::shared_ptr<testing::outcome>;

constexpr auto generous = 5s;
constexpr char server_what[] = "test server: connection from a worker";
constexpr char client_what[] = "test client: connection to the trainer";

int kind(errc e) { return static_cast<int>(e); }

// A connected loopback pair on `io`.
struct connection {
  tcp::socket server;
  tcp::socket client;
};

connection connect_pair(asio::io_context& io) {
  tcp::acceptor acceptor = net::listen(io.get_executor(), "127.0.0.1", 0);
  tcp::socket client(io);
  client.connect(acceptor.local_endpoint());
  tcp::socket server(io);
  acceptor.accept(server);
  return {std::move(server), std::move(client)};
}

bool run_until_done(asio::io_context& io, const std::vector<outcome_ptr>& all) {
  return testing::run_until(
      io,
      [&] {
        for (const auto& o : all)
          if (!o->done) return false;
        return true;
      },
      30s);
}

// ---- little-endian wire helpers for the hand-written peers ----

void put_u32(bytes& b, std::size_t at, std::uint32_t v) {
  for (int i = 0; i < 4; ++i) b[at + i] = static_cast<std::uint8_t>(v >> (8 * i));
}
std::uint32_t get_u32(const bytes& b, std::size_t at) {
  std::uint32_t v = 0;
  for (int i = 0; i < 4; ++i) v |= static_cast<std::uint32_t>(b[at + i]) << (8 * i);
  return v;
}
bytes message(std::size_t size, std::uint32_t word, std::uint32_t version = auth::version) {
  bytes b(size, 0);
  put_u32(b, 0, auth::magic);
  put_u32(b, 4, version);
  put_u32(b, 8, word);
  return b;
}
// label || a || b, the input of both proofs.
bytes proof_input(std::string_view label, const std::uint8_t* a, const std::uint8_t* b) {
  bytes d(label.begin(), label.end());
  d.insert(d.end(), a, a + auth::nonce_bytes);
  d.insert(d.end(), b, b + auth::nonce_bytes);
  return d;
}

asio::awaitable<void> send(tcp::socket& s, bytes b) {
  co_await net::write_all(s, asio::buffer(b), generous, "fake peer: send");
}
asio::awaitable<void> receive(tcp::socket& s, std::shared_ptr<bytes> into) {
  co_await net::read_exact(s, asio::buffer(*into), generous, "fake peer: receive");
}

// ---- both real sides ----

struct results {
  outcome_ptr server, client;
};

results handshake(std::string server_secret, std::string client_secret, std::chrono::milliseconds deadline = generous) {
  asio::io_context io;
  auto c = connect_pair(io);
  results r;
  r.server = spawn(io, auth::as_server(c.server, server_secret, deadline, server_what));
  r.client = spawn(io, auth::as_client(c.client, client_secret, deadline, client_what));
  EXPECT_TRUE(run_until_done(io, {r.server, r.client})) << "the handshake hung";
  return r;
}

TEST(auth_handshake, same_secret_succeeds_and_leaves_the_stream_in_step) {
  asio::io_context io;
  auto c = connect_pair(io);
  auto server = spawn(io, auth::as_server(c.server, "correct horse", generous, server_what));
  auto client = spawn(io, auth::as_client(c.client, "correct horse", generous, client_what));
  ASSERT_TRUE(run_until_done(io, {server, client}));
  ASSERT_FALSE(server->error) << server->message();
  ASSERT_FALSE(client->error) << client->message();

  // The next byte on either side is the application's, not a leftover of the handshake.
  auto got = std::make_shared<bytes>(4);
  auto write = spawn(io, send(c.client, bytes{'p', 'i', 'n', 'g'}));
  auto read = spawn(io, receive(c.server, got));
  ASSERT_TRUE(run_until_done(io, {write, read}));
  ASSERT_FALSE(read->error) << read->message();
  EXPECT_EQ(*got, (bytes{'p', 'i', 'n', 'g'}));
}

TEST(auth_handshake, secret_does_not_need_to_outlive_the_call) {
  asio::io_context io;
  auto c = connect_pair(io);
  outcome_ptr server, client;
  {
    std::string s1 = std::string(40, 'k') + "server copy";  // heap-allocated, freed below
    std::string s2 = std::string(40, 'k') + "server copy";
    server = spawn(io, auth::as_server(c.server, s1, generous, server_what));
    client = spawn(io, auth::as_client(c.client, s2, generous, client_what));
    s1.assign(s1.size(), 'x');
    s2.assign(s2.size(), 'y');
  }
  ASSERT_TRUE(run_until_done(io, {server, client}));
  EXPECT_FALSE(server->error) << server->message();
  EXPECT_FALSE(client->error) << client->message();
}

TEST(auth_handshake, no_secret_on_either_side_succeeds_unauthenticated) {
  auto r = handshake("", "");
  EXPECT_FALSE(r.server->error) << r.server->message();
  EXPECT_FALSE(r.client->error) << r.client->message();
}

TEST(auth_handshake, wrong_secret_fails_on_both_sides_without_revealing_either) {
  auto r = handshake("server-secret-1", "client-secret-2");
  EXPECT_EQ(r.server->kind(), kind(errc::auth_error)) << r.server->message();
  EXPECT_EQ(r.client->kind(), kind(errc::auth_error)) << r.client->message();
  EXPECT_THAT(r.server->message(), HasSubstr("peer failed authentication (wrong shared secret)"));
  EXPECT_THAT(r.server->message(), HasSubstr(server_what));
  EXPECT_THAT(r.client->message(), HasSubstr("server refused the shared secret"));
  EXPECT_THAT(r.client->message(), HasSubstr(client_what));
  for (const auto& m : {r.server->message(), r.client->message()}) {
    EXPECT_THAT(m, Not(HasSubstr("secret-1")));
    EXPECT_THAT(m, Not(HasSubstr("secret-2")));
  }
}

TEST(auth_handshake, server_requiring_a_secret_refuses_a_client_without_one) {
  auto r = handshake("s3cret", "");
  EXPECT_EQ(r.server->kind(), kind(errc::auth_error)) << r.server->message();
  EXPECT_EQ(r.client->kind(), kind(errc::auth_error)) << r.client->message();
  EXPECT_THAT(r.server->message(), HasSubstr("peer has no shared secret but this side requires one"));
  EXPECT_THAT(r.client->message(), HasSubstr("server requires a shared secret but none is configured"));
}

TEST(auth_handshake, client_with_a_secret_refuses_a_server_without_one_and_the_server_fails_too) {
  auto r = handshake("", "s3cret");
  EXPECT_EQ(r.client->kind(), kind(errc::auth_error)) << r.client->message();
  EXPECT_THAT(r.client->message(), HasSubstr("server has no shared secret"));
  EXPECT_EQ(r.server->kind(), kind(errc::auth_error)) << r.server->message();
  EXPECT_THAT(r.server->message(), HasSubstr("peer has a shared secret but this side has none"));
}

TEST(auth_handshake, secrets_differing_only_in_length_or_last_byte_fail) {
  const std::vector<std::pair<std::string, std::string>> pairs = {{"abc", "abcd"}, {"abcd", "abce"}};
  for (const auto& [a, b] : pairs) {
    auto r = handshake(a, b);
    EXPECT_EQ(r.server->kind(), kind(errc::auth_error)) << a << " vs " << b;
    EXPECT_EQ(r.client->kind(), kind(errc::auth_error)) << a << " vs " << b;
  }
}

// ---- the wire format, checked by peers written from the protocol description ----

// A client that speaks the protocol from its description alone.
asio::awaitable<void> spec_client(tcp::socket& s, std::string secret, std::shared_ptr<bytes> challenge,
                                  std::shared_ptr<bytes> verdict) {
  co_await net::read_exact(s, asio::buffer(*challenge), generous, "spec client: challenge");
  bytes response = message(auth::response_bytes, auth::flag_has_secret);
  for (std::size_t i = 0; i < auth::nonce_bytes; ++i) response[16 + i] = static_cast<std::uint8_t>(0xa0 + i);
  auto mac =
      auth::hmac_sha256(secret, proof_input("refit-auth-v1 client", challenge->data() + 16, response.data() + 16));
  std::memcpy(response.data() + 48, mac.data(), mac.size());
  co_await net::write_all(s, asio::buffer(response), generous, "spec client: response");
  co_await net::read_exact(s, asio::buffer(*verdict), generous, "spec client: verdict");
  auto expected =
      auth::hmac_sha256(secret, proof_input("refit-auth-v1 server", response.data() + 16, challenge->data() + 16));
  if (std::memcmp(expected.data(), verdict->data() + 16, expected.size()) != 0)
    throw_error(errc::auth_error, "spec client: the server's proof is not the documented one");
}

TEST(auth_wire, a_client_written_from_the_protocol_description_is_accepted) {
  asio::io_context io;
  auto c = connect_pair(io);
  auto challenge = std::make_shared<bytes>(auth::challenge_bytes);
  auto verdict = std::make_shared<bytes>(auth::verdict_bytes);
  auto server = spawn(io, auth::as_server(c.server, "s3cret", generous, server_what));
  auto client = spawn(io, spec_client(c.client, "s3cret", challenge, verdict));
  ASSERT_TRUE(run_until_done(io, {server, client}));
  EXPECT_FALSE(server->error) << server->message();
  EXPECT_FALSE(client->error) << client->message();
  EXPECT_EQ(std::string(challenge->begin(), challenge->begin() + 4), "RFTA");
  EXPECT_EQ(get_u32(*challenge, 4), 1u);
  EXPECT_EQ(get_u32(*challenge, 8), auth::flag_has_secret);
  EXPECT_EQ(get_u32(*challenge, 12), 0u);
  EXPECT_EQ(std::string(verdict->begin(), verdict->begin() + 4), "RFTA");
  EXPECT_EQ(get_u32(*verdict, 8), 0u) << "verdict ok";
}

TEST(auth_wire, server_without_a_secret_says_so_and_nonces_are_fresh) {
  asio::io_context io;
  auto c1 = connect_pair(io);
  auto c2 = connect_pair(io);
  auto ch1 = std::make_shared<bytes>(auth::challenge_bytes);
  auto ch2 = std::make_shared<bytes>(auth::challenge_bytes);
  auto s1 = spawn(io, auth::as_server(c1.server, "", 300ms, server_what));
  auto s2 = spawn(io, auth::as_server(c2.server, "", 300ms, server_what));
  auto r1 = spawn(io, receive(c1.client, ch1));
  auto r2 = spawn(io, receive(c2.client, ch2));
  ASSERT_TRUE(run_until_done(io, {s1, s2, r1, r2}));
  EXPECT_EQ(get_u32(*ch1, 8), 0u) << "no secret flag";
  EXPECT_NE(bytes(ch1->begin() + 16, ch1->end()), bytes(ch2->begin() + 16, ch2->end()));
  EXPECT_EQ(s1->kind(), kind(errc::timeout)) << "nobody answered: " << s1->message();
}

// A server that does not know the secret but claims success: the client must notice.
asio::awaitable<void> impostor_server(tcp::socket& s) {
  bytes challenge = message(auth::challenge_bytes, auth::flag_has_secret);
  co_await net::write_all(s, asio::buffer(challenge), generous, "impostor: challenge");
  bytes response(auth::response_bytes);
  co_await net::read_exact(s, asio::buffer(response), generous, "impostor: response");
  bytes verdict = message(auth::verdict_bytes, 0);  // ok, with an all-zero proof
  co_await net::write_all(s, asio::buffer(verdict), generous, "impostor: verdict");
}

TEST(auth_wire, client_rejects_a_server_that_cannot_prove_the_secret) {
  asio::io_context io;
  auto c = connect_pair(io);
  auto server = spawn(io, impostor_server(c.server));
  auto client = spawn(io, auth::as_client(c.client, "s3cret", generous, client_what));
  ASSERT_TRUE(run_until_done(io, {server, client}));
  EXPECT_EQ(client->kind(), kind(errc::auth_error)) << client->message();
  EXPECT_THAT(client->message(), HasSubstr("server failed authentication"));
}

// Records a real client's response to a fixed challenge, then closes.
asio::awaitable<void> recording_server(tcp::socket& s, std::shared_ptr<bytes> response) {
  bytes challenge = message(auth::challenge_bytes, auth::flag_has_secret);
  co_await net::write_all(s, asio::buffer(challenge), generous, "recorder: challenge");
  co_await net::read_exact(s, asio::buffer(*response), generous, "recorder: response");
  s.close();
}
// Replays a recorded response to whatever challenge comes, and reads the verdict.
asio::awaitable<void> replaying_client(tcp::socket& s, std::shared_ptr<bytes> response,
                                       std::shared_ptr<bytes> verdict) {
  bytes challenge(auth::challenge_bytes);
  co_await net::read_exact(s, asio::buffer(challenge), generous, "replayer: challenge");
  co_await net::write_all(s, asio::buffer(*response), generous, "replayer: response");
  co_await net::read_exact(s, asio::buffer(*verdict), generous, "replayer: verdict");
}

TEST(auth_wire, a_recorded_response_cannot_be_replayed) {
  asio::io_context io;
  auto recorded = std::make_shared<bytes>(auth::response_bytes);
  {
    auto c = connect_pair(io);
    auto recorder = spawn(io, recording_server(c.server, recorded));
    auto victim = spawn(io, auth::as_client(c.client, "s3cret", generous, client_what));
    ASSERT_TRUE(run_until_done(io, {recorder, victim}));
    ASSERT_FALSE(recorder->error) << recorder->message();
    EXPECT_EQ(victim->kind(), kind(errc::peer_lost)) << victim->message();
  }
  auto c = connect_pair(io);
  auto verdict = std::make_shared<bytes>(auth::verdict_bytes);
  auto server = spawn(io, auth::as_server(c.server, "s3cret", generous, server_what));
  auto replayer = spawn(io, replaying_client(c.client, recorded, verdict));
  ASSERT_TRUE(run_until_done(io, {server, replayer}));
  EXPECT_EQ(server->kind(), kind(errc::auth_error)) << server->message();
  EXPECT_THAT(server->message(), HasSubstr("wrong shared secret"));
  ASSERT_FALSE(replayer->error) << "the server answers before failing: " << replayer->message();
  EXPECT_EQ(get_u32(*verdict, 8), static_cast<std::uint32_t>(auth::verdict::bad_mac));
}

// ---- broken peers: typed errors, never a hang ----

TEST(auth_broken_peer, garbage_from_a_client_is_a_protocol_error_naming_what_came) {
  asio::io_context io;
  auto c = connect_pair(io);
  std::string http = "GET / HTTP/1.1\r\nHost: trainer\r\n\r\n";
  bytes garbage(http.begin(), http.end());
  garbage.resize(auth::response_bytes, 'x');
  auto server = spawn(io, auth::as_server(c.server, "s3cret", generous, server_what));
  auto client = spawn(io, send(c.client, garbage));
  ASSERT_TRUE(run_until_done(io, {server, client}));
  EXPECT_EQ(server->kind(), kind(errc::protocol_error)) << server->message();
  EXPECT_THAT(server->message(), HasSubstr(server_what));
  EXPECT_THAT(server->message(), HasSubstr("magic 'RFTA'"));
  EXPECT_THAT(server->message(), HasSubstr("'GET '"));
}

TEST(auth_broken_peer, another_protocol_version_is_a_protocol_error) {
  asio::io_context io;
  auto c = connect_pair(io);
  auto server = spawn(io, auth::as_server(c.server, "s3cret", generous, server_what));
  auto client = spawn(io, send(c.client, message(auth::response_bytes, auth::flag_has_secret, 2)));
  ASSERT_TRUE(run_until_done(io, {server, client}));
  EXPECT_EQ(server->kind(), kind(errc::protocol_error)) << server->message();
  EXPECT_THAT(server->message(), HasSubstr("expected authentication protocol version 1"));
  EXPECT_THAT(server->message(), HasSubstr("got version 2"));
}

TEST(auth_broken_peer, garbage_from_a_server_is_a_protocol_error_on_the_client) {
  asio::io_context io;
  auto c = connect_pair(io);
  auto server = spawn(io, send(c.server, bytes(auth::challenge_bytes, 0xff)));
  auto client = spawn(io, auth::as_client(c.client, "s3cret", generous, client_what));
  ASSERT_TRUE(run_until_done(io, {server, client}));
  EXPECT_EQ(client->kind(), kind(errc::protocol_error)) << client->message();
  EXPECT_THAT(client->message(), HasSubstr(client_what));
  EXPECT_THAT(client->message(), HasSubstr("0xffffffff"));
}

TEST(auth_broken_peer, unknown_verdict_code_is_a_protocol_error) {
  asio::io_context io;
  auto c = connect_pair(io);
  auto answer = [](tcp::socket& s) -> asio::awaitable<void> {
    co_await send(s, message(auth::challenge_bytes, 0));
    bytes response(auth::response_bytes);
    co_await net::read_exact(s, asio::buffer(response), generous, "fake server: response");
    co_await send(s, message(auth::verdict_bytes, 7));
  };
  auto server = spawn(io, answer(c.server));
  auto client = spawn(io, auth::as_client(c.client, "", generous, client_what));
  ASSERT_TRUE(run_until_done(io, {server, client}));
  EXPECT_EQ(client->kind(), kind(errc::protocol_error)) << client->message();
  EXPECT_THAT(client->message(), HasSubstr("got 7"));
}

TEST(auth_broken_peer, a_silent_client_times_out_at_the_deadline) {
  asio::io_context io;
  auto c = connect_pair(io);
  auto started = std::chrono::steady_clock::now();
  auto server = spawn(io, auth::as_server(c.server, "s3cret", 200ms, server_what));
  ASSERT_TRUE(run_until_done(io, {server}));
  EXPECT_GE(std::chrono::steady_clock::now() - started, 200ms);
  EXPECT_EQ(server->kind(), kind(errc::timeout)) << server->message();
  EXPECT_THAT(server->message(), HasSubstr(server_what));
  EXPECT_THAT(server->message(), HasSubstr("authentication response"));
}

TEST(auth_broken_peer, a_silent_server_times_out_at_the_deadline) {
  asio::io_context io;
  auto c = connect_pair(io);
  auto client = spawn(io, auth::as_client(c.client, "s3cret", 200ms, client_what));
  ASSERT_TRUE(run_until_done(io, {client}));
  EXPECT_EQ(client->kind(), kind(errc::timeout)) << client->message();
  EXPECT_THAT(client->message(), HasSubstr("authentication challenge"));
}

TEST(auth_broken_peer, client_closing_mid_handshake_is_peer_lost) {
  asio::io_context io;
  auto c = connect_pair(io);
  auto hang_up = [](tcp::socket& s) -> asio::awaitable<void> {
    co_await receive(s, std::make_shared<bytes>(auth::challenge_bytes));
    co_await send(s, bytes(10, 0));  // part of a response
    s.close();
  };
  auto server = spawn(io, auth::as_server(c.server, "s3cret", generous, server_what));
  auto client = spawn(io, hang_up(c.client));
  ASSERT_TRUE(run_until_done(io, {server, client}));
  EXPECT_EQ(server->kind(), kind(errc::peer_lost)) << server->message();
  EXPECT_THAT(server->message(), HasSubstr(server_what));
}

TEST(auth_broken_peer, server_closing_mid_handshake_is_peer_lost) {
  asio::io_context io;
  auto c = connect_pair(io);
  auto hang_up = [](tcp::socket& s) -> asio::awaitable<void> {
    co_await send(s, message(auth::challenge_bytes, auth::flag_has_secret));
    co_await receive(s, std::make_shared<bytes>(auth::response_bytes));
    s.close();
  };
  auto server = spawn(io, hang_up(c.server));
  auto client = spawn(io, auth::as_client(c.client, "s3cret", generous, client_what));
  ASSERT_TRUE(run_until_done(io, {server, client}));
  EXPECT_EQ(client->kind(), kind(errc::peer_lost)) << client->message();
  EXPECT_THAT(client->message(), HasSubstr("authentication verdict"));
}

// ---- HMAC known answers (RFC 4231) ----

std::string hex(const std::array<std::uint8_t, 32>& mac) { return to_hex(std::as_bytes(std::span(mac))); }

bytes of(std::string_view s) { return bytes(s.begin(), s.end()); }

TEST(hmac_sha256, rfc4231_test_case_2) {
  EXPECT_EQ(hex(auth::hmac_sha256("Jefe", of("what do ya want for nothing?"))),
            "5bdcc146bf60754e6a042426089575c75a003f089d2739839dec58b964ec3843");
}

TEST(hmac_sha256, rfc4231_test_case_1) {
  EXPECT_EQ(hex(auth::hmac_sha256(std::string(20, '\x0b'), of("Hi There"))),
            "b0344c61d8db38535ca8afceaf0bf12b881dc200c9833da726e9376c2e32cff7");
}

TEST(hmac_sha256, empty_key_and_data_are_accepted) {
  // HMAC-SHA256("", "") from Python's hmac module.
  EXPECT_EQ(hex(auth::hmac_sha256("", {})), "b613679a0814d9ec772f95d778c35fc5ff1697c493715653c6c712144292c5ad");
}

// ---- read_secret_file ----

// A file in the test temp dir, removed at the end of the test.
class temp_file {
 public:
  explicit temp_file(const std::string& name) {
    static std::atomic<int> counter{0};
    const char* dir = std::getenv("REFIT_TEST_TMPDIR");
    path_ = std::string(dir && *dir ? dir : "/tmp") + "/refit_auth_test_" + std::to_string(::getpid()) + "_" +
            std::to_string(counter++) + "_" + name;
    ::unlink(path_.c_str());
  }
  ~temp_file() {
    ::rmdir(path_.c_str());
    ::unlink(path_.c_str());
  }
  const std::string& path() const { return path_; }
  void write(const std::string& content, mode_t mode) {
    int fd = ::open(path_.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
    ASSERT_GE(fd, 0) << path_ << ": " << std::strerror(errno);
    ASSERT_EQ(::write(fd, content.data(), content.size()), static_cast<ssize_t>(content.size()));
    ASSERT_EQ(::fchmod(fd, mode), 0);  // explicitly, whatever the umask
    ::close(fd);
  }

 private:
  std::string path_;
};

TEST(read_secret_file, strips_exactly_one_trailing_newline) {
  temp_file f("newline");
  f.write("s3cret\n", 0600);
  EXPECT_EQ(auth::read_secret_file(f.path()), "s3cret");
  f.write("s3cret\n\n", 0600);
  EXPECT_EQ(auth::read_secret_file(f.path()), "s3cret\n");
  f.write("s3cret", 0400);
  EXPECT_EQ(auth::read_secret_file(f.path()), "s3cret");
  f.write(std::string("bin\0ary \r", 9), 0600);
  EXPECT_EQ(auth::read_secret_file(f.path()), std::string("bin\0ary \r", 9));
}

TEST(read_secret_file, missing_file_is_invalid_argument_naming_the_path) {
  temp_file f("missing");
  auto e = REFIT_THROWN(auth::read_secret_file(f.path()));
  EXPECT_EQ(e.kind(), errc::invalid_argument);
  EXPECT_THAT(e.message(), HasSubstr(f.path()));
  EXPECT_THAT(e.message(), HasSubstr("cannot open"));
  EXPECT_THAT(e.message(), HasSubstr("No such file"));
}

TEST(read_secret_file, empty_file_or_a_lone_newline_is_refused) {
  temp_file f("empty");
  for (std::string content : {"", "\n"}) {
    f.write(content, 0600);
    auto e = REFIT_THROWN(auth::read_secret_file(f.path()));
    EXPECT_EQ(e.kind(), errc::invalid_argument);
    EXPECT_THAT(e.message(), HasSubstr("empty"));
  }
}

TEST(read_secret_file, group_or_world_access_is_refused_without_showing_the_secret) {
  temp_file f("shared");
  for (mode_t mode : {0640, 0604, 0620, 0601, 0644}) {
    f.write("do-not-print-me\n", mode);
    auto e = REFIT_THROWN(auth::read_secret_file(f.path()));
    EXPECT_EQ(e.kind(), errc::invalid_argument) << std::oct << mode;
    EXPECT_THAT(e.message(), HasSubstr("accessible by group or others"));
    EXPECT_THAT(e.message(), HasSubstr("chmod 600"));
    EXPECT_THAT(e.message(), Not(HasSubstr("do-not-print-me")));
  }
}

TEST(read_secret_file, a_directory_is_refused) {
  temp_file f("dir");
  ASSERT_EQ(::mkdir(f.path().c_str(), 0700), 0);
  auto e = REFIT_THROWN(auth::read_secret_file(f.path()));
  EXPECT_EQ(e.kind(), errc::invalid_argument);
  EXPECT_THAT(e.message(), HasSubstr("not a regular file"));
}

TEST(read_secret_file, an_oversized_file_is_refused) {
  temp_file f("big");
  f.write(std::string(auth::max_secret_bytes + 1, 'k'), 0600);
  auto e = REFIT_THROWN(auth::read_secret_file(f.path()));
  EXPECT_EQ(e.kind(), errc::invalid_argument);
  EXPECT_THAT(e.message(), HasSubstr("more than"));
}

}  // namespace
}  // namespace refit
