// refit's error model: every failure is a refit::error (a std::system_error) whose
// code belongs to refit's category, so callers can branch on the kind of failure
// (timeout vs. peer lost vs. bad input) while the message says what was expected and
// what came.
#pragma once

#include <exception>
#include <string>
#include <string_view>
#include <system_error>

namespace refit {

/// Kinds of failure. Values are stable: they cross process and plugin boundaries.
enum class errc {
  timeout = 1,         ///< a wait on a peer passed its deadline
  peer_lost,           ///< the peer closed or reset the connection
  invalid_argument,    ///< bad input: JSON, names, dtypes, shapes, sizes
  protocol_error,      ///< the peer sent bytes that break the wire protocol
  not_registered,      ///< unknown backend name
  already_registered,  ///< a backend name registered twice
  invalid_state,       ///< an operation out of order (receive before init, ...)
  load_failed,         ///< a plugin library or its entry point could not be loaded
  processing_failed,   ///< post-processing (load_weights) threw
  integrity_error,     ///< a checksum or fingerprint mismatch
  io_error,            ///< an operating-system I/O failure
  cancelled,           ///< the operation was cancelled (shutdown)
  unsupported,         ///< not available in this build or on this machine
  auth_error,          ///< shared-secret authentication failed (either side's verdict)
  resource_exhausted,  ///< a limit was reached: connections, descriptors, requests in flight
};
/// The highest kind: codes above it from a peer or plugin are not refit kinds.
inline constexpr errc last_errc = errc::resource_exhausted;

/// The category of refit's error codes; name() is "refit".
const std::error_category& error_category() noexcept;

/// Lets std::error_code be built from refit::errc.
std::error_code make_error_code(errc e) noexcept;

/// The exception refit throws. what() is "<message>: <kind>" as std::system_error
/// builds it; message() returns the message alone.
class error : public std::system_error {
 public:
  error(errc code, const std::string& message);
  error(std::error_code code, const std::string& message);

  /// The refit kind, or errc{} for a code of another category (categories are
  /// matched by name, so errors from a plugin with its own copy of refit count).
  errc kind() const noexcept;
  /// The message without the kind suffix.
  const std::string& message() const noexcept { return message_; }

 private:
  std::string message_;
};

/// Stable identifier of a kind ("timeout", "peer_lost", ...), used on the wire.
std::string_view errc_name(errc code) noexcept;
/// Inverse of errc_name; errc{} for an unknown name.
errc parse_errc(std::string_view name) noexcept;

/// Throws refit::error(code, message). Out of line to keep call sites small.
[[noreturn]] void throw_error(errc code, const std::string& message);

/// What a caught exception holds, for reports and answers: its refit kind
/// (io_error for anything that is not a refit::error), its message (a
/// refit::error's message(), else what()), and "<kind name>: <message>" for a
/// refit::error (what() for anything else). A null pointer is "no error".
errc error_kind_of(std::exception_ptr e) noexcept;
std::string error_message_of(std::exception_ptr e);
std::string describe_error(std::exception_ptr e);

}  // namespace refit

template <>
struct std::is_error_code_enum<refit::errc> : std::true_type {};
