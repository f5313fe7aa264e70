// Layout parsing and planning: arbitrary bytes as JSON text, read the way a
// tcp_sharded worker reads its update_info ({"names", "dtype_names", "shapes",
// "layout": {"source", "destination"}}) and planned. A plan that is built must
// hold what both sides rely on: every item inside its rank's shard and its
// destination tensor, each worker's ingress the bytes its pieces cover (each byte
// once), the pairs' bytes summing to the egress and ingress totals.
#include <string_view>
#include <vector>

#include <refit/json_reader.h>
#include <refit/layout/layout.h>
#include <refit/layout/transfer_plan.h>
#include <refit/metadata.h>
#include "tests/fuzz/fuzz.h"

namespace refit::fuzz {
namespace {

constexpr std::initializer_list<errc> bad_input = {errc::invalid_argument};

bool inside(const box& b, std::span<const std::int64_t> shape) {
  if (b.offset.size() != shape.size() || b.extent.size() != shape.size()) return false;
  for (std::size_t d = 0; d < shape.size(); ++d)
    if (b.offset[d] < 0 || b.extent[d] < 0 || b.offset[d] + b.extent[d] > shape[d]) return false;
  return true;
}

bool run(std::string_view text) {
  json j;
  if (!expect("parse", bad_input, [&] { j = parse_json_text(text, "layout_fuzz"); })) return false;
  if (!j.is_object()) return false;
  update_metadata meta;
  source_layout source;
  std::vector<dest_layout> workers;
  const bool read = expect("layouts", bad_input, [&] {
    json_reader r(j, "layout_fuzz");
    meta = read_update_metadata(r);
    auto layout = r.object("layout");
    auto s = layout.object("source");
    source = read_source_layout(s, meta);
    s.finish();
    auto d = layout.object("destination");
    workers = read_dest_layouts(d, meta);
    d.finish();
    layout.finish();
    r.finish();
  });
  if (!read) return false;
  transfer_plan plan;
  if (!expect("plan_transfer", bad_input, [&] { plan = plan_transfer(source, workers); })) return false;
  const char* stage = "plan_transfer";
  check(plan.ranks == source.ranks() && plan.workers == static_cast<int>(workers.size()), stage, "plan dimensions");
  check(plan.digest == layout_digest(source, workers), stage, "digest is not the layouts'");
  std::vector<std::uint64_t> egress(plan.ranks, 0), ingress(plan.workers, 0);
  for (int r = 0; r < plan.ranks; ++r) {
    const auto local = source.local_metadata(r);
    for (int w = 0; w < plan.workers; ++w) {
      const auto& pair = plan.pair(r, w);
      std::uint64_t bytes = 0;
      for (const auto& it : pair.items) {
        check(it.source < local.tensors.size() && it.dest < workers[w].tensors.size(), stage, "item out of range");
        check(inside(it.src, local.tensors[it.source].shape), stage, "item outside its rank's shard");
        const box at{it.dst_at, it.src.extent};
        check(inside(at, workers[w].tensors[it.dest].spec.shape), stage, "item outside its destination");
        check(it.bytes == static_cast<std::uint64_t>(it.src.numel()) * element_size(local.tensors[it.source].dtype),
              stage, "item bytes");
        bytes += it.bytes;
      }
      check(bytes == pair.bytes, stage, "pair bytes are not its items'");
      egress[r] += bytes;
      ingress[w] += bytes;
    }
  }
  check(egress == plan.egress && ingress == plan.ingress, stage, "egress or ingress totals");
  for (int w = 0; w < plan.workers; ++w) {
    std::uint64_t covered = 0;
    for (const auto& t : workers[w].tensors)
      for (const auto& p : t.pieces) covered += static_cast<std::uint64_t>(p.from.numel()) * element_size(t.spec.dtype);
    check(covered == plan.ingress[w], stage, "a worker's ingress is not what its pieces cover");
  }
  return true;
}

}  // namespace
}  // namespace refit::fuzz

bool refit_fuzz_one(const std::uint8_t* data, std::size_t size) {
  return refit::fuzz::run(std::string_view(reinterpret_cast<const char*>(data), size));
}
