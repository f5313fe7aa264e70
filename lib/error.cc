#include <refit/error.h>

#include <string_view>

namespace refit {
namespace {

class category final : public std::error_category {
 public:
  const char* name() const noexcept override { return "refit"; }
  std::string message(int value) const override {
    switch (static_cast<errc>(value)) {
      case errc::timeout:
        return "timeout";
      case errc::peer_lost:
        return "peer lost";
      case errc::invalid_argument:
        return "invalid argument";
      case errc::protocol_error:
        return "protocol error";
      case errc::not_registered:
        return "not registered";
      case errc::already_registered:
        return "already registered";
      case errc::invalid_state:
        return "invalid state";
      case errc::load_failed:
        return "load failed";
      case errc::processing_failed:
        return "processing failed";
      case errc::integrity_error:
        return "integrity error";
      case errc::io_error:
        return "I/O error";
      case errc::cancelled:
        return "cancelled";
      case errc::unsupported:
        return "unsupported";
      case errc::auth_error:
        return "authentication error";
      case errc::resource_exhausted:
        return "resource exhausted";
    }
    return "refit error " + std::to_string(value);
  }
};

}  // namespace

const std::error_category& error_category() noexcept {
  static const category instance;
  return instance;
}

std::error_code make_error_code(errc e) noexcept { return {static_cast<int>(e), error_category()}; }

error::error(errc code, const std::string& message)
    : std::system_error(make_error_code(code), message), message_(message) {}

error::error(std::error_code code, const std::string& message) : std::system_error(code, message), message_(message) {}

errc error::kind() const noexcept {
  // By name, not address: a plugin linked with its own copy of refit has its own
  // category object, and its errors must still be recognised.
  return std::string_view(code().category().name()) == error_category().name() ? static_cast<errc>(code().value())
                                                                               : errc{};
}

namespace {
constexpr std::string_view names[] = {"",
                                      "timeout",
                                      "peer_lost",
                                      "invalid_argument",
                                      "protocol_error",
                                      "not_registered",
                                      "already_registered",
                                      "invalid_state",
                                      "load_failed",
                                      "processing_failed",
                                      "integrity_error",
                                      "io_error",
                                      "cancelled",
                                      "unsupported",
                                      "auth_error",
                                      "resource_exhausted"};
}  // namespace

std::string_view errc_name(errc code) noexcept {
  auto i = static_cast<std::size_t>(code);
  return i < std::size(names) ? names[i] : std::string_view("unknown");
}

errc parse_errc(std::string_view name) noexcept {
  for (std::size_t i = 1; i < std::size(names); ++i)
    if (names[i] == name) return static_cast<errc>(i);
  return errc{};
}

void throw_error(errc code, const std::string& message) { throw error(code, message); }

errc error_kind_of(std::exception_ptr e) noexcept {
  if (!e) return errc{};
  try {
    std::rethrow_exception(e);
  } catch (const error& x) {
    return x.kind();
  } catch (...) {
  }
  return errc::io_error;
}

std::string error_message_of(std::exception_ptr e) {
  if (!e) return "no error";
  try {
    std::rethrow_exception(e);
  } catch (const error& x) {
    return x.message();
  } catch (const std::exception& x) {
    return x.what();
  } catch (...) {
  }
  return "a non-standard exception";
}

std::string describe_error(std::exception_ptr e) {
  if (!e) return "no error";
  try {
    std::rethrow_exception(e);
  } catch (const error& x) {
    return std::string(errc_name(x.kind())) + ": " + x.message();
  } catch (...) {
  }
  return error_message_of(e);
}

}  // namespace refit
