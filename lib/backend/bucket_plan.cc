#include <refit/backend/bucket_plan.h>

#include <string>

namespace refit {

void wire_params::validate() const {
  if (buffer_bytes < 4096 || buffer_bytes > (16ull << 30))
    throw_error(errc::invalid_argument,
                "wire params: buffer_bytes must be in [4096, 16 GiB], got " + std::to_string(buffer_bytes));
  if (num_buffers < 1 || num_buffers > 64)
    throw_error(errc::invalid_argument,
                "wire params: num_buffers must be in [1, 64], got " + std::to_string(num_buffers));
}

wire_params wire_params::read(json_reader& reader) {
  wire_params p;
  p.buffer_bytes = reader.optional<std::uint64_t>("buffer_bytes", p.buffer_bytes);
  p.num_buffers = reader.optional<std::uint32_t>("num_buffers", p.num_buffers);
  p.checksums = reader.optional<bool>("checksums", p.checksums);
  try {
    p.validate();
  } catch (const error& e) {
    reader.fail(e.message());
  }
  return p;
}

void wire_params::write(json& out) const {
  out["buffer_bytes"] = buffer_bytes;
  out["num_buffers"] = num_buffers;
  out["checksums"] = checksums;
}

namespace {
constexpr std::uint64_t align_up(std::uint64_t v, std::uint64_t a) { return (v + a - 1) / a * a; }
}  // namespace

bucket_plan plan_buckets(const update_metadata& meta, const wire_params& params) {
  params.validate();
  bucket_plan plan;
  const std::uint64_t cap = params.buffer_bytes;
  bucket open;  // the packed bucket being filled
  bool has_open = false;

  auto too_many = [&](std::uint64_t more, std::uint32_t tensor) {
    throw_error(errc::invalid_argument, "bucket plan: tensor #" + std::to_string(tensor) + " ('" +
                                            meta.tensors[tensor].name + "') brings the update to " +
                                            std::to_string(plan.buckets.size() + more) + " or more buckets of " +
                                            std::to_string(cap) + " bytes, more than the limit " +
                                            std::to_string(max_buckets) + " (use a larger buffer_bytes)");
  };
  auto close_open = [&] {
    if (!has_open) return;
    open.index = plan.buckets.size();
    plan.payload_bytes += open.payload_bytes;
    plan.buckets.push_back(open);
    has_open = false;
  };

  for (std::uint32_t i = 0; i < meta.tensors.size(); ++i) {
    const std::uint64_t n = meta.tensors[i].nbytes();
    plan.tensor_bytes += n;
    if (n > cap) {
      close_open();
      // Checked before any of the chunks is recorded: their count can be absurd.
      const std::uint64_t chunks = n / cap + (n % cap != 0);
      if (chunks > max_buckets - plan.buckets.size()) too_many(chunks, i);
      plan.largest_split_tensor = std::max(plan.largest_split_tensor, n);
      for (std::uint64_t off = 0; off < n; off += cap) {
        bucket b;
        b.index = plan.buckets.size();
        b.split = true;
        b.payload_bytes = std::min(cap, n - off);
        b.last_chunk = off + b.payload_bytes == n;
        b.first_piece = plan.pieces.size();
        b.piece_count = 1;
        plan.pieces.push_back({i, off, 0, b.payload_bytes});
        plan.payload_bytes += b.payload_bytes;
        plan.buckets.push_back(b);
      }
      continue;
    }
    std::uint64_t at = has_open ? align_up(open.payload_bytes, wire_params::alignment) : 0;
    if (has_open && at + n > cap) {
      close_open();
      at = 0;
    }
    if (!has_open) {
      if (plan.buckets.size() >= max_buckets) too_many(1, i);
      open = bucket{};
      open.first_piece = plan.pieces.size();
      has_open = true;
    }
    plan.pieces.push_back({i, 0, at, n});
    ++open.piece_count;
    open.payload_bytes = at + n;
  }
  close_open();
  return plan;
}

}  // namespace refit
