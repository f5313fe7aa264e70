#include "examples/weight_sync/job.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <fstream>

#include <refit/error.h>

namespace refit::example::weight_sync {

void fill_pattern(std::span<std::byte> out, std::size_t index, int round, std::uint64_t offset) {
  const std::uint64_t x = 0x9E3779B97F4A7C15ull * (index + 1) ^ (static_cast<std::uint64_t>(round) << 40);
  auto word = [x](std::uint64_t k) { return x + k * 0xBF58476D1CE4E5B9ull; };
  std::size_t i = 0;
  const std::size_t n = out.size();
  for (; i < n && (offset + i) % 8 != 0; ++i)
    out[i] = static_cast<std::byte>(word((offset + i) / 8) >> (8 * ((offset + i) % 8)));
  for (; i + 8 <= n; i += 8) {
    const std::uint64_t w = word((offset + i) / 8);
    std::memcpy(out.data() + i, &w, 8);
  }
  for (; i < n; ++i) out[i] = static_cast<std::byte>(word((offset + i) / 8) >> (8 * ((offset + i) % 8)));
}

trainer_model::trainer_model(model_layout l, double fraction) : layout(std::move(l)), change_fraction(fraction) {
  arena.resize(layout.meta.total_bytes());
  std::uint64_t at = 0;
  for (const auto& t : layout.meta.tensors) {
    views.emplace_back(t, arena.data() + at);
    at += t.nbytes();
  }
}

namespace {

std::uint64_t splitmix64(std::uint64_t& s) {
  std::uint64_t z = (s += 0x9E3779B97F4A7C15ull);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

// Adds +-1 or +-2 to about `fraction` of the elements [0, total) (2-byte: the raw
// 16-bit value, i.e. units in the last place of a bf16; otherwise each byte), of
// which `bytes` holds [first, first + bytes.size() / elem). The gaps between
// changed elements are geometric: one PRNG draw and one log per change, from the
// tensor's first element whatever part is held.
void perturb(std::span<std::byte> bytes, std::size_t elem, double fraction, std::uint64_t seed, std::uint64_t first,
             std::uint64_t total) {
  const std::uint64_t end = std::min(total, first + bytes.size() / elem);
  const double log_keep = fraction < 1 ? std::log1p(-fraction) : 0;  // 0: every element
  std::uint64_t s = seed;
  for (std::uint64_t at = 0;;) {
    const std::uint64_t r = splitmix64(s);
    if (log_keep < 0) {
      // u in (0, 1] from the top 53 bits; gap = floor(log(u) / log(1 - F)).
      const double u = (static_cast<double>(r >> 11) + 1) * 0x1.0p-53;
      const double gap = std::floor(std::log(u) / log_keep);
      if (gap >= static_cast<double>(end - std::min(at, end))) return;
      at += static_cast<std::uint64_t>(gap);
    }
    if (at >= end) return;
    if (at >= first) {
      const int moves[] = {1, 2, -1, -2};
      const int d = moves[r & 3];
      const std::uint64_t k = at - first;
      if (elem == 2) {
        std::uint16_t v;
        std::memcpy(&v, bytes.data() + k * 2, 2);
        v = static_cast<std::uint16_t>(v + d);
        std::memcpy(bytes.data() + k * 2, &v, 2);
      } else {
        bytes[k] = static_cast<std::byte>(static_cast<unsigned char>(bytes[k]) + d);
      }
    }
    ++at;
  }
}

}  // namespace

void change_elements(std::span<std::byte> out, dtype type, double fraction, std::size_t index, int round,
                     std::uint64_t offset, std::uint64_t total) {
  const std::size_t elem = element_size(type) == 2 ? 2 : 1;  // bf16/fp16 by ulps, else bytes
  perturb(out, elem, fraction, (static_cast<std::uint64_t>(round) << 32) ^ (0xD1B54A32D192ED03ull * (index + 1)),
          offset / elem, total / elem);
}

void trainer_model::step(int r) {
  if (change_fraction > 0 && filled_) {
    for (std::size_t i = 0; i < views.size(); ++i)
      change_elements(views[i].bytes(), views[i].dtype, change_fraction, i, r, 0, views[i].bytes().size());
    return;
  }
  for (std::size_t i = 0; i < views.size(); ++i) fill_pattern(views[i].bytes(), i, r, 0);
  filled_ = true;
}

void trainer_model::load(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw_error(errc::invalid_argument, "--replay: cannot open '" + path + "'");
  in.read(reinterpret_cast<char*>(arena.data()), static_cast<std::streamsize>(arena.size()));
  const auto got = static_cast<std::uint64_t>(in.gcount());
  char extra;
  if (got != arena.size() || in.read(&extra, 1))
    throw_error(errc::invalid_argument, "--replay: '" + path + "' does not hold exactly the layout's " +
                                            std::to_string(arena.size()) + " bytes");
  filled_ = true;
}

std::string describe(std::exception_ptr e) {
  try {
    std::rethrow_exception(e);
  } catch (const error& x) {
    return std::string(errc_name(x.kind())) + ": " + x.message();
  } catch (const std::exception& x) {
    return x.what();
  } catch (...) {
    return "unknown exception";
  }
}

}  // namespace refit::example::weight_sync
