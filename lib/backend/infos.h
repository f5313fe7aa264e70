// Readers of the members refit's init and update infos share, for engines' typed
// infos (`static X read(json_reader&)`, see backend/engine.h): the commit mode,
// vLLM's tensor metadata and sharded layouts. Each validates what it reads and
// throws invalid_argument naming the member path (json_reader's context).
#pragma once

#include <optional>
#include <string>
#include <vector>

#include <refit/backend/json_reader.h>
#include <refit/config.h>
#include <refit/layout/layout.h>
#include <refit/metadata.h>

namespace refit {

/// Reads the optional member `name` ("in_place" or "staged").
std::optional<commit_mode> read_commit_mode(json_reader& r, const std::string& name = "commit");

/// Reads vLLM's metadata members `names`, `dtype_names` and `shapes` (parallel
/// arrays), validating lengths, dtypes, shapes and duplicates
/// (write_update_metadata writes them).
update_metadata read_update_metadata(json_reader& reader);

/// {"mesh": [2], "ranks": [...] (optional), "placements": ["shard(0)"] (every
/// tensor), "tensors": {"name": ["replicate"], ...} (optional overrides)} over the
/// global `meta` (write_source_layout writes it).
source_layout read_source_layout(json_reader& r, const update_metadata& meta);

/// {"preset": "vllm_llama", "tp_size": N (, "vocab_padding": 64)} or {"workers":
/// [[{"name", "dtype", "shape", "pieces": [{"source", "offset", "extent", "at"}]}]]}:
/// every worker's layout.
std::vector<dest_layout> read_dest_layouts(json_reader& r, const update_metadata& global);

}  // namespace refit
