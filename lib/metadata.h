// Per-update tensor metadata, the part of every update info that is the same for
// all engines: names, dtypes and shapes, in the order the trainer sends them.
#pragma once

#include <cstdint>
#include <vector>

#include <refit/json.h>
#include <refit/json_reader.h>
#include <refit/tensor.h>

namespace refit {

/// The tensors of one update, in send order. Validated: names unique and non-empty,
/// dtypes known, shapes non-negative with byte sizes that fit in int64.
struct update_metadata {
  std::vector<tensor_spec> tensors;

  /// Sum of byte sizes.
  std::uint64_t total_bytes() const;
  /// Throws invalid_argument on an empty or duplicate name or a bad shape.
  void validate() const;
};

/// A 64-bit digest of names, dtypes and shapes in order: both sides of a transfer
/// compare it before any weight byte moves, so differing metadata is an error, not
/// a hang or garbage.
std::uint64_t metadata_digest(const update_metadata& meta);

/// Writes vLLM's metadata members `names`, `dtype_names` and `shapes` (parallel
/// arrays) into `out` (read_update_metadata reads them).
void write_update_metadata(const update_metadata& meta, json& out);

/// Reads vLLM's metadata members `names`, `dtype_names` and `shapes` (parallel
/// arrays), validating lengths, dtypes, shapes and duplicates; throws
/// invalid_argument naming the member path (json_reader's context).
update_metadata read_update_metadata(json_reader& reader);

}  // namespace refit
