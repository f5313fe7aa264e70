#include <refit/backend/send_cursor.h>

#include <cstring>

#include <string>

namespace refit {
namespace {
// Alignment padding between packed tensors is never longer than this.
alignas(64) constexpr std::byte zeros[wire_params::alignment] = {};
}  // namespace

send_cursor::send_cursor(const update_metadata& declared, const bucket_plan& plan, tensor_source& source,
                         bool allow_device)
    : declared_(declared), plan_(plan), source_(source), allow_device_(allow_device) {
  views_.reserve(declared.tensors.size());
}

const tensor_view& send_cursor::pull(std::size_t index) {
  while (views_.size() <= index) {
    const std::size_t i = views_.size();
    auto next = source_.next();
    if (!next)
      throw_error(errc::invalid_argument, "trainer sent " + std::to_string(i) + " tensor(s) but declared " +
                                              std::to_string(declared_.tensors.size()) + "; first missing: '" +
                                              declared_.tensors[i].name + "'");
    check_matches_declared(declared_.tensors[i], *next, i);
    if (!allow_device_ && !next->device.is_cpu())
      throw_error(errc::invalid_argument, "parameter #" + std::to_string(i) + " ('" + declared_.tensors[i].name +
                                              "') is on " + to_string(next->device) +
                                              "; this backend sends host memory only");
    views_.push_back(*next);
  }
  return views_[index];
}

void send_cursor::append(const void* data, std::size_t bytes) {
  if (bytes == 0) return;
  // Adjacent ranges (tensors laid out back to back) become one buffer: fewer iovecs.
  if (!buffers_.empty()) {
    auto& last = buffers_.back();
    if (static_cast<const std::byte*>(last.data()) + last.size() == data) {
      last = asio::const_buffer(last.data(), last.size() + bytes);
      return;
    }
  }
  buffers_.emplace_back(data, bytes);
}

const std::vector<asio::const_buffer>& send_cursor::gather(const bucket& b) {
  buffers_.clear();
  std::uint64_t at = 0;
  for (const auto& p : plan_.pieces_of(b)) {
    const tensor_view& v = pull(p.tensor);
    if (p.bucket_offset > at) append(zeros, static_cast<std::size_t>(p.bucket_offset - at));
    append(v.data + p.tensor_offset, static_cast<std::size_t>(p.bytes));
    at = p.bucket_offset + p.bytes;
  }
  return buffers_;
}

void send_cursor::finish() {
  if (!declared_.tensors.empty()) pull(declared_.tensors.size() - 1);
  if (auto extra = source_.next())
    throw_error(errc::invalid_argument, "trainer sent more tensors than the " +
                                            std::to_string(declared_.tensors.size()) + " declared; first extra: '" +
                                            std::string(extra->name) + "'");
}

std::size_t pack_pieces(std::span<const asio::const_buffer> pieces, std::byte* dst) {
  std::size_t at = 0;
  for (const auto& p : pieces) {
    if (p.size()) std::memcpy(dst + at, p.data(), p.size());
    at += p.size();
  }
  return at;
}

}  // namespace refit
