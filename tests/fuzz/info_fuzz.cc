// Info parsing: arbitrary bytes as JSON text, read as a TCP init_info, a metadata
// update_info, a torch_ipc update_info (PyTorch trainers' handles), wire params and
// a weight_transfer_config, the way engines and
// workers read what a user or a trainer sends. Accepted metadata must round-trip,
// and its bucket plan must hold the invariants both sides rely on.
#include <algorithm>
#include <string_view>
#include <vector>

#include <refit/backend/bucket_plan.h>
#include <refit/config.h>
#include <refit/engine.h>
#include <refit/engines/cuda_ipc/torch_ipc.h>
#include <refit/engines/tcp/tcp.h>
#include <refit/json_reader.h>
#include <refit/metadata.h>
#include "tests/fuzz/fuzz.h"

namespace refit::fuzz {
namespace {

constexpr std::initializer_list<errc> bad_input = {errc::invalid_argument};

// Plans of more buckets than this are not built (only slow, not wrong); beyond
// max_buckets plan_buckets must refuse without building.
constexpr std::uint64_t max_planned = 1u << 15;

// An upper bound on the buckets plan_buckets makes: every split chunk, and at most
// one packed bucket per tensor.
std::uint64_t bucket_bound(const update_metadata& meta, std::uint64_t cap) {
  std::uint64_t bound = 0;
  for (const auto& t : meta.tensors) {
    const std::uint64_t n = t.nbytes();
    bound += n > cap ? n / cap + (n % cap != 0) : 1;
  }
  return bound;
}

// The smallest number of buckets any plan needs (split chunks alone).
std::uint64_t bucket_floor(const update_metadata& meta, std::uint64_t cap) {
  std::uint64_t floor = 0;
  for (const auto& t : meta.tensors) {
    const std::uint64_t n = t.nbytes();
    if (n > cap) floor += n / cap + (n % cap != 0);
  }
  return floor;
}

void check_plan(const update_metadata& meta, const wire_params& params, const bucket_plan& plan) {
  const char* stage = "plan_buckets";
  const std::uint64_t cap = params.buffer_bytes;
  check(plan.tensor_bytes == meta.total_bytes(), stage, "tensor_bytes is not the metadata's total");
  std::vector<std::uint64_t> covered(meta.tensors.size(), 0);
  std::uint64_t payload = 0, largest_split = 0;
  std::uint32_t next_piece = 0;
  for (std::size_t k = 0; k < plan.buckets.size(); ++k) {
    const bucket& b = plan.buckets[k];
    check(b.index == k, stage, "bucket index is not its position");
    check(b.first_piece == next_piece && b.piece_count >= 1, stage, "pieces are not listed in bucket order");
    check(b.payload_bytes <= cap, stage, "bucket payload exceeds the buffer");
    next_piece += b.piece_count;
    payload += b.payload_bytes;
    std::uint64_t end = 0;
    for (const bucket_piece& p : plan.pieces_of(b)) {
      check(p.tensor < meta.tensors.size(), stage, "piece names a tensor that does not exist");
      const std::uint64_t n = meta.tensors[p.tensor].nbytes();
      check(p.tensor_offset == covered[p.tensor], stage, "pieces of a tensor are not consecutive");
      check(p.bucket_offset >= end, stage, "pieces overlap");
      check(p.bucket_offset % wire_params::alignment == 0, stage, "piece is not aligned");
      check(p.bytes <= n - p.tensor_offset, stage, "piece runs past its tensor");
      end = p.bucket_offset + p.bytes;
      covered[p.tensor] += p.bytes;
      if (b.split) {
        check(b.piece_count == 1 && n > cap, stage, "a split bucket is not one chunk of a large tensor");
        check(b.last_chunk == (covered[p.tensor] == n), stage, "last_chunk is wrong");
        largest_split = std::max(largest_split, n);
      }
    }
    check(end == b.payload_bytes, stage, "payload is not the end of the last piece");
  }
  check(next_piece == plan.pieces.size(), stage, "pieces not in any bucket");
  check(payload == plan.payload_bytes, stage, "payload_bytes is not the sum of the buckets");
  check(largest_split == plan.largest_split_tensor, stage, "largest_split_tensor is wrong");
  for (std::size_t i = 0; i < meta.tensors.size(); ++i)
    check(covered[i] == meta.tensors[i].nbytes(), stage, "a tensor is not covered exactly once");
}

void plan_with(const update_metadata& meta, const wire_params& params) {
  const std::uint64_t floor = bucket_floor(meta, params.buffer_bytes);
  const std::uint64_t bound = bucket_bound(meta, params.buffer_bytes);
  if (floor > max_buckets) {
    const bool built = expect("plan_buckets (over the limit)", bad_input, [&] { (void)plan_buckets(meta, params); });
    check(!built, "plan_buckets", "a plan of more than max_buckets buckets was built");
    return;
  }
  if (bound > max_planned) return;
  bucket_plan plan;
  const bool built = expect("plan_buckets", bad_input, [&] { plan = plan_buckets(meta, params); });
  check(built, "plan_buckets", "valid metadata and params were refused");
  check_plan(meta, params, plan);
}

bool run(std::string_view text) {
  json j;
  if (!expect("parse_json_text", bad_input, [&] { j = parse_json_text(text, "fuzz input"); })) return false;

  bool any = false;
  std::optional<wire_params> init_wire;
  any |= expect("tcp init_info", bad_input, [&] {
    json_reader r(j, "tcp init_info");
    auto info = tcp::init_info::read(r);
    r.finish();
    check(!info.master_address.empty() && info.master_port != 0, "tcp init_info", "accepted an empty address");
    check(info.rank_offset >= 1 && info.rank_offset < info.world_size, "tcp init_info", "accepted a bad rank");
    check(!info.timeout || info.timeout->count() > 0, "tcp init_info", "accepted a non-positive timeout");
    info.wire.validate();
    init_wire = info.wire;
  });
  any |= expect("wire_params", bad_input, [&] {
    json_reader r(j, "wire");
    auto p = wire_params::read(r);
    r.finish();
    json out;
    p.write(out);
    json_reader again(out, "wire again");
    check(wire_params::read(again) == p, "wire_params", "write/read does not round-trip");
  });
  any |= expect("weight_transfer_config", bad_input, [&] { (void)weight_transfer_config::from_json(j); });

  any |= expect("torch_ipc update_info", bad_input, [&] {
    json_reader r(j, "torch_ipc update_info");
    auto info = cuda_ipc::torch_update_info::read(r);
    r.finish();
    // What the worker will read: inside the storage, without overflow.
    check(info.handles.size() == info.metadata.tensors.size(), "torch_ipc update_info", "a tensor has no entry");
    for (std::size_t i = 0; i < info.handles.size(); ++i) {
      check(!info.handles[i].empty(), "torch_ipc update_info", "a tensor has no handle");
      for (const auto& h : info.handles[i]) {
        const std::uint64_t n = info.metadata.tensors[i].nbytes();
        check(h.offset_bytes <= h.storage_bytes && n <= h.storage_bytes - h.offset_bytes, "torch_ipc update_info",
              "accepted a tensor outside its storage");
        check(h.storage_offset_bytes <= ~std::uint64_t{0} - h.storage_bytes, "torch_ipc update_info",
              "accepted a storage past the end of the address space");
      }
    }
  });

  update_metadata meta;
  const bool have_meta = expect("update_info", bad_input, [&] {
    json_reader r(j, "tcp update_info");
    auto info = tcp::update_info::read(r);
    r.finish();
    meta = std::move(info.metadata);
  });
  any |= have_meta;
  if (have_meta) {
    // What one side accepts, written back, the other side reads as the same tensors.
    json out = json::object();
    write_update_metadata(meta, out);
    update_metadata again;
    const bool reread = expect("update_info round trip", bad_input, [&] {
      json_reader r(out, "round trip");
      again = read_update_metadata(r);
      r.finish();
    });
    check(reread && again.tensors == meta.tensors, "update_info", "write/read does not round-trip");
    check(metadata_digest(again) == metadata_digest(meta), "update_info", "digest differs after a round trip");

    wire_params small;
    small.buffer_bytes = 4096;
    plan_with(meta, small);
    if (init_wire) plan_with(meta, *init_wire);
  }
  return any;
}

}  // namespace
}  // namespace refit::fuzz

bool refit_fuzz_one(const std::uint8_t* data, std::size_t size) {
  return refit::fuzz::run(std::string_view(reinterpret_cast<const char*>(data), size));
}
