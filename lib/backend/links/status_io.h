// Status messages in both directions of a group engine's side channel.
#pragma once

#include <chrono>
#include <string>

#include <asio/awaitable.hpp>
#include <asio/ip/tcp.hpp>

namespace refit::links {

struct status_message {
  std::uint32_t code = 0;  ///< 0 or a refit::errc
  std::uint64_t seq = 0;
  std::string message;
};

/// Strings by value: a coroutine started now may run after the caller's
/// temporaries are gone (all_of over several sends).
asio::awaitable<void> send_status(asio::ip::tcp::socket& socket, std::uint32_t code, std::uint64_t seq,
                                  std::string message, std::chrono::milliseconds deadline, std::string what);

/// Reads one status; a wrong magic or an over-long message is protocol_error.
asio::awaitable<status_message> read_status(asio::ip::tcp::socket& socket, std::chrono::milliseconds deadline,
                                            std::string what);

/// Throws the error a non-zero status carries, prefixed with `who`.
void throw_if_failed(const status_message& s, const std::string& who);

/// How long a side waits to read or write a failure's reason: a peer that is
/// there answers at once; one that is not must not hold up the error.
inline constexpr std::chrono::milliseconds reason_wait{500};

/// After `failure` on a connection whose peer may have said why before it went
/// away (a failing worker sends its error as a status, then closes): reads that
/// status (waiting at most reason_wait) and throws the peer's error (prefixed with
/// `who`) if it carries one; otherwise rethrows `failure`. Never returns.
asio::awaitable<void> rethrow_with_peer_reason(asio::ip::tcp::socket& socket, std::exception_ptr failure,
                                               std::string who);

/// Best effort: tells the peer why this side fails (`failure`'s kind and message,
/// as a status for update `seq`, waiting at most reason_wait); never throws.
asio::awaitable<void> tell_failure(asio::ip::tcp::socket& socket, std::exception_ptr failure, std::uint64_t seq);

}  // namespace refit::links
