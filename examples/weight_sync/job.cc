#include "examples/weight_sync/job.h"

#include <cstring>

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

trainer_model::trainer_model(model_layout l) : layout(std::move(l)) {
  arena.resize(layout.meta.total_bytes());
  std::uint64_t at = 0;
  for (const auto& t : layout.meta.tensors) {
    views.emplace_back(t, arena.data() + at);
    at += t.nbytes();
  }
}

void trainer_model::step(int r) {
  for (std::size_t i = 0; i < views.size(); ++i) fill_pattern(views[i].bytes(), i, r, 0);
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
