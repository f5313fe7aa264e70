// The handshake of backend/handshake.h (the secret itself: integrity/auth.h).
#include <refit/backend/handshake.h>

#include <cstring>
#include <memory>
#include <vector>

#include <openssl/crypto.h>
#include <openssl/err.h>
#include <openssl/evp.h>
#include <openssl/hmac.h>
#include <openssl/rand.h>
#include <asio/buffer.hpp>

#include <refit/backend/net.h>
#include <refit/error.h>

namespace refit::auth {
namespace {

using tcp = asio::ip::tcp;
using nonce_t = std::array<std::uint8_t, nonce_bytes>;
using mac_t = std::array<std::uint8_t, mac_bytes>;

constexpr std::string_view client_label = "refit-auth-v1 client";
constexpr std::string_view server_label = "refit-auth-v1 server";

std::string openssl_error() {
  unsigned long e = ERR_get_error();
  if (e == 0) return "no OpenSSL error queued";
  char buf[256];
  ERR_error_string_n(e, buf, sizeof buf);
  ERR_clear_error();
  return buf;
}

// The secret, owned by the coroutine frame (the caller's string_view may dangle once
// the awaitable is spawned) and wiped when the frame goes. A unique_ptr, not a
// std::string, so a move never leaves a copy behind in a small-string buffer.
class key_material {
 public:
  explicit key_material(std::string_view s) : size_(s.size()), bytes_(s.empty() ? nullptr : new char[s.size()]) {
    if (!s.empty()) std::memcpy(bytes_.get(), s.data(), s.size());
  }
  key_material(key_material&&) noexcept = default;
  key_material& operator=(key_material&&) = delete;
  ~key_material() {
    if (bytes_) OPENSSL_cleanse(bytes_.get(), size_);
  }
  bool empty() const noexcept { return !bytes_; }
  std::string_view view() const noexcept { return bytes_ ? std::string_view(bytes_.get(), size_) : std::string_view(); }

 private:
  std::size_t size_;
  std::unique_ptr<char[]> bytes_;
};

nonce_t random_nonce() {
  nonce_t n;
  if (RAND_bytes(n.data(), static_cast<int>(n.size())) != 1)
    throw_error(errc::io_error, "authentication: no random bytes for a nonce (" + openssl_error() + ")");
  return n;
}

mac_t proof(std::string_view key, std::string_view label, const nonce_t& first, const nonce_t& second) {
  std::vector<std::uint8_t> data(label.begin(), label.end());
  data.insert(data.end(), first.begin(), first.end());
  data.insert(data.end(), second.begin(), second.end());
  return hmac_sha256(key, data);
}

bool same_mac(const mac_t& a, const std::uint8_t* b) { return CRYPTO_memcmp(a.data(), b, a.size()) == 0; }

void put_u32(std::uint8_t* p, std::uint32_t v) {
  for (int i = 0; i < 4; ++i) p[i] = static_cast<std::uint8_t>(v >> (8 * i));
}
std::uint32_t get_u32(const std::uint8_t* p) {
  std::uint32_t v = 0;
  for (int i = 0; i < 4; ++i) v |= static_cast<std::uint32_t>(p[i]) << (8 * i);
  return v;
}

void put_header(std::uint8_t* p, std::uint32_t word) {
  put_u32(p, magic);
  put_u32(p + 4, version);
  put_u32(p + 8, word);
  put_u32(p + 12, 0);
}

std::string hex32(std::uint32_t v) {
  char b[16];
  std::snprintf(b, sizeof b, "0x%08x", v);
  return b;
}

// Checks magic and version of a received message; returns its flags/code word.
std::uint32_t check_header(const std::uint8_t* p, const std::string& what, const char* message) {
  std::uint32_t m = get_u32(p);
  if (m != magic) {
    std::string shown;
    for (int i = 0; i < 4; ++i) shown += p[i] >= 0x20 && p[i] < 0x7f ? static_cast<char>(p[i]) : '.';
    throw_error(errc::protocol_error, what + ": expected the authentication " + message + " (magic 'RFTA', " +
                                          hex32(magic) + "), got " + hex32(m) + " ('" + shown +
                                          "'); is the peer a refit process of this version, using authentication?");
  }
  std::uint32_t v = get_u32(p + 4);
  if (v != version)
    throw_error(errc::protocol_error, what + ": expected authentication protocol version " + std::to_string(version) +
                                          " in the " + message + ", got version " + std::to_string(v));
  return get_u32(p + 8);
}

std::string server_failure(verdict code) {
  switch (code) {
    case verdict::bad_mac:
      return "peer failed authentication (wrong shared secret)";
    case verdict::secret_required:
      return "peer has no shared secret but this side requires one (configure the same secret on both sides)";
    case verdict::no_server_secret:
      return "peer has a shared secret but this side has none (configure the same secret on both sides, "
             "or none on either)";
    case verdict::ok:
      break;
  }
  return "authentication failed";
}

asio::awaitable<void> server_handshake(tcp::socket& socket, key_material key, std::chrono::milliseconds deadline,
                                       std::string what) {
  const nonce_t nonce_s = random_nonce();
  std::array<std::uint8_t, challenge_bytes> challenge{};
  put_header(challenge.data(), key.empty() ? 0 : flag_has_secret);
  std::memcpy(challenge.data() + 16, nonce_s.data(), nonce_bytes);
  co_await net::write_all(socket, asio::buffer(challenge), deadline, what + ": sending the authentication challenge");

  std::array<std::uint8_t, response_bytes> response{};
  co_await net::read_exact(socket, asio::buffer(response), deadline, what + ": reading the authentication response");
  const bool peer_has_secret = check_header(response.data(), what, "response") & flag_has_secret;
  nonce_t nonce_c;
  std::memcpy(nonce_c.data(), response.data() + 16, nonce_bytes);
  const std::uint8_t* mac_c = response.data() + 16 + nonce_bytes;

  verdict code = verdict::ok;
  if (!key.empty() && !peer_has_secret)
    code = verdict::secret_required;
  else if (key.empty() && peer_has_secret)
    code = verdict::no_server_secret;
  else if (!key.empty() && !same_mac(proof(key.view(), client_label, nonce_s, nonce_c), mac_c))
    code = verdict::bad_mac;

  std::array<std::uint8_t, verdict_bytes> answer{};
  put_header(answer.data(), static_cast<std::uint32_t>(code));
  if (code == verdict::ok) {
    if (!key.empty()) {
      mac_t mac_s = proof(key.view(), server_label, nonce_c, nonce_s);
      std::memcpy(answer.data() + 16, mac_s.data(), mac_bytes);
    }
    co_await net::write_all(socket, asio::buffer(answer), deadline, what + ": sending the authentication verdict");
    co_return;
  }
  // Tell the peer why before failing here; if that write fails too, the
  // authentication failure is still the news.
  try {
    co_await net::write_all(socket, asio::buffer(answer), deadline, what + ": sending the authentication verdict");
  } catch (const error&) {
  }
  throw_error(errc::auth_error, what + ": " + server_failure(code));
}

asio::awaitable<void> client_handshake(tcp::socket& socket, key_material key, std::chrono::milliseconds deadline,
                                       std::string what) {
  std::array<std::uint8_t, challenge_bytes> challenge{};
  co_await net::read_exact(socket, asio::buffer(challenge), deadline, what + ": reading the authentication challenge");
  const std::uint32_t flags = check_header(challenge.data(), what, "challenge");
  if (flags & flag_busy)
    throw_error(errc::resource_exhausted, what +
                                              ": the server refused the connection: it is at its connection "
                                              "limit (too many connections)");
  const bool server_has_secret = flags & flag_has_secret;
  nonce_t nonce_s;
  std::memcpy(nonce_s.data(), challenge.data() + 16, nonce_bytes);

  const nonce_t nonce_c = random_nonce();
  std::array<std::uint8_t, response_bytes> response{};
  put_header(response.data(), key.empty() ? 0 : flag_has_secret);
  std::memcpy(response.data() + 16, nonce_c.data(), nonce_bytes);
  if (!key.empty()) {
    mac_t mac_c = proof(key.view(), client_label, nonce_s, nonce_c);
    std::memcpy(response.data() + 16 + nonce_bytes, mac_c.data(), mac_bytes);
  }
  co_await net::write_all(socket, asio::buffer(response), deadline, what + ": sending the authentication response");

  std::array<std::uint8_t, verdict_bytes> answer{};
  const std::string reading = what + ": reading the authentication verdict";
  if (server_has_secret != !key.empty()) {
    // The challenge already decided: fail. The response went out anyway so the server
    // learns why; wait for its verdict (best effort) so it has read it before we close.
    try {
      co_await net::read_exact(socket, asio::buffer(answer), deadline, reading);
    } catch (const error&) {
    }
    if (server_has_secret)
      throw_error(errc::auth_error, what + ": server requires a shared secret but none is configured on this side");
    throw_error(errc::auth_error, what +
                                      ": server has no shared secret, so it cannot prove it knows this "
                                      "side's; refusing an unauthenticated connection");
  }

  co_await net::read_exact(socket, asio::buffer(answer), deadline, reading);
  const std::uint32_t code = check_header(answer.data(), what, "verdict");
  switch (static_cast<verdict>(code)) {
    case verdict::ok:
      if (!key.empty() && !same_mac(proof(key.view(), server_label, nonce_c, nonce_s), answer.data() + 16))
        throw_error(errc::auth_error,
                    what + ": server failed authentication (its proof of the shared secret is wrong)");
      co_return;
    case verdict::bad_mac:
      throw_error(errc::auth_error, what + ": server refused the shared secret (the two sides have different secrets)");
    case verdict::secret_required:
      throw_error(errc::auth_error, what + ": server requires a shared secret and refused this side's");
    case verdict::no_server_secret:
      throw_error(errc::auth_error, what + ": server has no shared secret and refused this side's");
  }
  throw_error(errc::protocol_error,
              what + ": expected an authentication verdict code 0 to 3, got " + std::to_string(code));
}

}  // namespace

asio::awaitable<void> refuse_busy(tcp::socket& socket, std::chrono::milliseconds deadline, std::string what) {
  std::array<std::uint8_t, challenge_bytes> challenge{};
  put_header(challenge.data(), flag_busy);
  try {
    co_await net::write_all(socket, asio::buffer(challenge), deadline, what + ": refusing (busy)");
  } catch (const error&) {
  }
}

std::array<std::uint8_t, 32> hmac_sha256(std::string_view key, std::span<const std::uint8_t> data) {
  static const unsigned char nothing = 0;  // OpenSSL wants non-null pointers even for empty input
  std::array<std::uint8_t, 32> out{};
  unsigned int length = 0;
  const void* key_bytes = key.empty() ? static_cast<const void*>(&nothing) : key.data();
  const unsigned char* data_bytes = data.empty() ? &nothing : data.data();
  if (!HMAC(EVP_sha256(), key_bytes, static_cast<int>(key.size()), data_bytes, data.size(), out.data(), &length) ||
      length != out.size())
    throw_error(errc::unsupported, "authentication: OpenSSL refused HMAC-SHA256 (" + openssl_error() + ")");
  return out;
}

asio::awaitable<void> as_server(tcp::socket& socket, std::string_view secret, std::chrono::milliseconds deadline,
                                std::string what) {
  return server_handshake(socket, key_material(secret), deadline, std::move(what));
}

asio::awaitable<void> as_client(tcp::socket& socket, std::string_view secret, std::chrono::milliseconds deadline,
                                std::string what) {
  return client_handshake(socket, key_material(secret), deadline, std::move(what));
}

}  // namespace refit::auth
