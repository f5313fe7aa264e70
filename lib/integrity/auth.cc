#include <refit/integrity/auth.h>

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <system_error>

#include <openssl/crypto.h>

#include <refit/error.h>

namespace refit::auth {

std::string read_secret_file(const std::string& path) {
  const std::string where = "shared secret file '" + path + "'";
  // Takes errno before anything else can change it.
  auto fail = [&where](const char* doing) {
    std::string reason = std::error_code(errno, std::generic_category()).message();
    throw_error(errc::invalid_argument, where + ": " + doing + ": " + reason);
  };
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NOCTTY);
  if (fd < 0) fail("cannot open");
  struct closer {
    int fd;
    ~closer() { ::close(fd); }
  } close_on_exit{fd};

  // fstat on the open descriptor: the file checked is the file read.
  struct stat st {};
  if (::fstat(fd, &st) != 0) fail("cannot stat");
  if (!S_ISREG(st.st_mode)) throw_error(errc::invalid_argument, where + ": not a regular file");
  if (st.st_mode & 077) {
    char mode[8];
    std::snprintf(mode, sizeof mode, "%04o", static_cast<unsigned>(st.st_mode & 07777));
    throw_error(errc::invalid_argument, where + ": accessible by group or others (mode " + mode +
                                            "); a secret must be private to its owner: chmod 600 '" + path + "'");
  }
  if (static_cast<std::uint64_t>(st.st_size) > max_secret_bytes)
    throw_error(errc::invalid_argument, where + ": " + std::to_string(st.st_size) + " bytes, more than the " +
                                            std::to_string(max_secret_bytes) + " a secret may have");

  std::string secret;
  char buf[4096];
  for (;;) {
    ssize_t n = ::read(fd, buf, sizeof buf);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) fail("cannot read");
    if (n == 0) break;
    secret.append(buf, static_cast<std::size_t>(n));
    if (secret.size() > max_secret_bytes)
      throw_error(errc::invalid_argument, where + ": grew past " + std::to_string(max_secret_bytes) + " bytes");
  }
  OPENSSL_cleanse(buf, sizeof buf);
  if (!secret.empty() && secret.back() == '\n') secret.pop_back();
  if (secret.empty()) throw_error(errc::invalid_argument, where + ": empty (a shared secret needs at least one byte)");
  return secret;
}

}  // namespace refit::auth
