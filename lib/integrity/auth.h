// Shared secrets for refit's connections: every control and data connection starts
// with a mutual challenge-response handshake (HMAC-SHA256, backend/handshake.h has
// the protocol) proving both sides hold the same secret, without sending it. Give
// the same secret to every trainer and worker (weight_transfer_config::auth_secret,
// control::client, control::worker_group), read from a file only its owner can read:
//
//   config.auth_secret = refit::auth::read_secret_file("/etc/refit/secret");
//
// It authenticates peers only: the bytes that follow are neither encrypted nor
// integrity-protected (per-bucket checksums are), so use it on trusted networks, or
// under TLS/WireGuard where that matters.
#pragma once

#include <cstddef>
#include <string>

namespace refit::auth {

/// The largest secret read_secret_file accepts.
inline constexpr std::size_t max_secret_bytes = 64 * 1024;

/// Reads a shared secret from a file, stripping one trailing newline. Throws
/// refit::error(invalid_argument) naming the path if the file is missing or
/// unreadable, not a regular file, accessible to group or others (mode & 077, so a
/// secret is never left world-readable by mistake), empty, or over max_secret_bytes.
std::string read_secret_file(const std::string& path);

}  // namespace refit::auth
