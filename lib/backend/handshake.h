// The handshake behind refit's shared secrets (integrity/auth.h): mutual
// challenge-response authentication with a shared secret (HMAC-SHA256), run on
// a freshly connected TCP socket before any other byte. Each side proves it knows the
// secret without sending it, over fresh random nonces from both sides, so a recorded
// exchange cannot be replayed. It authenticates the peer only: the bytes that follow
// are neither encrypted nor integrity-protected (a man in the middle that relays
// everything stays possible), so use it on trusted networks, or under TLS/WireGuard
// where that matters.
//
// Wire protocol, version 1 (all integers u32 little-endian, fixed-size messages):
//   1. server -> client  challenge: magic "RFTA", version, flags, reserved, nonce_s[32]
//                        flags bit 0: the server has a secret (requires one)
//                        flags bit 1: the server is busy (at its connection limit)
//                        and closes the connection: the client fails at once
//   2. client -> server  response:  magic, version, flags, reserved, nonce_c[32], mac_c[32]
//                        flags bit 0: the client has a secret
//                        mac_c = HMAC(secret, "refit-auth-v1 client" || nonce_s || nonce_c)
//   3. server -> client  verdict:   magic, version, code, reserved, mac_s[32]
//                        code: 0 ok, 1 bad mac, 2 secret required, 3 server has none
//                        mac_s = HMAC(secret, "refit-auth-v1 server" || nonce_c || nonce_s)
//   4. the client checks the verdict and mac_s.
// Both sides without a secret: the handshake succeeds, unauthenticated. A secret on
// one side only fails on both sides (a client with a secret refuses a server that
// cannot prove it knows it).
#pragma once

#include <array>
#include <chrono>
#include <cstdint>
#include <span>
#include <string>
#include <string_view>

#include <asio/awaitable.hpp>
#include <asio/ip/tcp.hpp>

#include <refit/integrity/auth.h>

namespace refit::auth {

/// Wire constants of protocol version 1.
inline constexpr std::uint32_t magic = 0x41544652;  // "RFTA" as little-endian bytes
inline constexpr std::uint32_t version = 1;
inline constexpr std::uint32_t flag_has_secret = 1;
/// In a challenge: the server is at its connection limit; it refuses this
/// connection and closes it (no response is read).
inline constexpr std::uint32_t flag_busy = 2;
inline constexpr std::size_t nonce_bytes = 32;
inline constexpr std::size_t mac_bytes = 32;
inline constexpr std::size_t challenge_bytes = 16 + nonce_bytes;
inline constexpr std::size_t response_bytes = 16 + nonce_bytes + mac_bytes;
inline constexpr std::size_t verdict_bytes = 16 + mac_bytes;

/// Verdict codes (step 3).
enum class verdict : std::uint32_t {
  ok = 0,
  bad_mac = 1,           ///< the client's proof does not match the server's secret
  secret_required = 2,   ///< the server has a secret, the client none
  no_server_secret = 3,  ///< the client has a secret, the server none
};

/// HMAC-SHA256 of `data` under `key` (OpenSSL). Throws refit::error(unsupported) if
/// OpenSSL refuses (e.g. a FIPS provider rejecting a short key).
std::array<std::uint8_t, 32> hmac_sha256(std::string_view key, std::span<const std::uint8_t> data);

/// Runs the server side of the handshake on `socket` (accepted, nothing read or
/// written yet). `secret` empty means this side has none. Each read and write has
/// `deadline`; `what` names the connection in every message ("tcp trainer: worker
/// connection from 127.0.0.1:5555"). The secret is copied before the coroutine
/// starts (and wiped when it ends), so it need not outlive the call; `socket` must
/// outlive the awaitable, so co_await it directly.
/// Throws auth_error (the peer's proof is wrong, or only one side has a secret; the
/// peer is told why first), protocol_error (not a refit auth peer or another
/// version), timeout, peer_lost, io_error. Messages never contain secret bytes.
asio::awaitable<void> as_server(asio::ip::tcp::socket& socket, std::string_view secret,
                                std::chrono::milliseconds deadline, std::string what);

/// Server side of a refusal: tells the peer, in place of the challenge, that the
/// server is at its connection limit (flag_busy; `what` says why in the server's
/// logs only). The caller closes the socket. Best effort within `deadline`.
asio::awaitable<void> refuse_busy(asio::ip::tcp::socket& socket, std::chrono::milliseconds deadline, std::string what);

/// Runs the client side on a freshly connected `socket`; same contract as as_server.
/// With a secret, succeeds only if the server proved it knows the same secret. A
/// busy server (flag_busy) is resource_exhausted.
asio::awaitable<void> as_client(asio::ip::tcp::socket& socket, std::string_view secret,
                                std::chrono::milliseconds deadline, std::string what);

}  // namespace refit::auth
