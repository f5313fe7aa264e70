// How a model's tensors are laid out on both sides of a sharded transfer.
//
// Source side (the trainer): every global tensor is placed on a device mesh in torch
// DTensor's vocabulary (vLLM's ParamMeta uses the same): per mesh dimension
// Replicate or Shard(dim), with torch.chunk's uneven split (chunk size
// ceil(n / k), the last chunks smaller or empty). Rank r holds one box of each
// tensor (possibly empty), and replicated boxes are held by several ranks.
//
// Destination side (one worker): a list of local tensors, each made of pieces, each
// piece a box of a source (global) tensor placed at an offset of the local tensor.
// That says renames, fusing (qkv_proj from q/k/v_proj rows), column- and
// row-parallel shards, vocab-parallel embeddings with padding (bytes no piece
// covers are left alone), replicated norms and expert-parallel weights alike.
//
// lib/layout/transfer_plan.h turns both into who sends which bytes to whom.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include <refit/json.h>
#include <refit/json_reader.h>
#include <refit/metadata.h>
#include <refit/tensor.h>

namespace refit {

/// Replicate or Shard(dim) on one mesh dimension.
struct placement {
  enum class kind : std::uint8_t { replicate, shard };
  kind type = kind::replicate;
  int dim = 0;  ///< the tensor dimension split (shard only)

  static placement replicate() noexcept { return {}; }
  static placement shard(int dim) noexcept { return {kind::shard, dim}; }
  bool is_shard() const noexcept { return type == kind::shard; }
  /// "replicate" or "shard(0)" (what parse_placement reads; also "R", "S(0)").
  std::string to_string() const;
  friend bool operator==(const placement&, const placement&) = default;
};
placement parse_placement(std::string_view text);

/// A box of a tensor: per dimension an offset and an extent (row-major tensors).
struct box {
  std::vector<std::int64_t> offset, extent;

  std::int64_t numel() const;
  bool empty() const { return numel() == 0; }
  /// "[0:4, 8:16]".
  std::string to_string() const;
  friend bool operator==(const box&, const box&) = default;
};
/// The whole of a tensor of `shape`.
box whole(std::span<const std::int64_t> shape);
/// The intersection of two boxes of the same rank (empty extents when disjoint).
box intersect(const box& a, const box& b);

/// [start, start + length) of chunk `index` of `n` elements cut into `parts` the way
/// torch.chunk (and DTensor's Shard) cuts them: ceil(n / parts) each, the last
/// chunks smaller or empty.
struct chunk_range {
  std::int64_t start = 0, length = 0;
};
chunk_range torch_chunk(std::int64_t n, std::int64_t parts, std::int64_t index);

/// The trainer's device mesh: its shape and which trainer rank sits at each
/// coordinate (row-major); ranks empty means 0, 1, 2, ... in order.
struct device_mesh {
  std::vector<std::int64_t> shape{1};
  std::vector<int> ranks;

  std::int64_t size() const;
  /// The rank at linear coordinate `index`.
  int rank_at(std::int64_t index) const { return ranks.empty() ? static_cast<int>(index) : ranks[index]; }
  /// Throws invalid_argument for an empty or non-positive shape, or ranks that are
  /// not a permutation of 0 .. size-1.
  void validate() const;
  friend bool operator==(const device_mesh&, const device_mesh&) = default;
};

/// A global tensor and its placement on the mesh (one placement per mesh dim).
struct placed_tensor {
  tensor_spec spec;
  std::vector<placement> placements;
  friend bool operator==(const placed_tensor&, const placed_tensor&) = default;
};

/// The trainer side of a sharded transfer.
struct source_layout {
  device_mesh mesh;
  std::vector<placed_tensor> tensors;

  /// Trainer ranks (the mesh's size).
  int ranks() const { return static_cast<int>(mesh.size()); }
  /// The box of tensor `t` (global coordinates) that `rank` holds; empty extents
  /// when it holds none of it.
  box local_box(std::size_t t, int rank) const;
  /// What `rank` holds, in tensor order: the local shards' specs (global names,
  /// local shapes), what its sender is given.
  update_metadata local_metadata(int rank) const;
  /// The global tensors' metadata.
  update_metadata global_metadata() const;
  /// Throws invalid_argument naming the tensor: placements not one per mesh dim,
  /// a shard dim out of range, names not unique, a bad mesh.
  void validate() const;

  /// Every tensor of `meta` placed with `placements` (e.g. {shard(0)} over a mesh of
  /// `ranks`: FSDP's layout); scalars are replicated. invalid_argument for a tensor
  /// without the dim a placement shards.
  static source_layout uniform(const update_metadata& meta, device_mesh mesh, std::vector<placement> placements);
  /// One rank holding everything: the broadcast case.
  static source_layout single(const update_metadata& meta);
};

/// A box of source tensor `source` (by name; global coordinates) placed at `at` in
/// the destination tensor (same rank; the extents are the box's).
struct dest_piece {
  std::string source;
  box from;
  std::vector<std::int64_t> at;
  friend bool operator==(const dest_piece&, const dest_piece&) = default;
};

/// One tensor a worker holds: its spec (local name, dtype, local shape) and the
/// pieces that fill it. Pieces must not overlap; bytes no piece covers (padding)
/// are never written.
struct dest_tensor {
  tensor_spec spec;
  std::vector<dest_piece> pieces;
  friend bool operator==(const dest_tensor&, const dest_tensor&) = default;
};

/// What one worker holds.
struct dest_layout {
  std::vector<dest_tensor> tensors;

  /// The local tensors' metadata (what the worker's model is told of).
  update_metadata metadata() const;
  friend bool operator==(const dest_layout&, const dest_layout&) = default;
};

/// Checks a destination layout against the source's tensors: every piece names a
/// source tensor of the same dtype and rank, its box lies inside that tensor and
/// its placement inside the destination, and no two pieces of a tensor overlap.
/// Throws invalid_argument naming the worker, the tensor and the piece.
void validate(const dest_layout& dest, const source_layout& source, std::size_t worker = 0);
/// Every worker's layout (worker w named as w).
void validate(std::span<const dest_layout> workers, const source_layout& source);

// ---------------------------------------------------------------- tensor-parallel rules

/// How a model tensor is split across tensor-parallel ranks (vLLM's layers).
enum class parallel_style {
  replicated,  ///< every rank holds the whole tensor
  column,      ///< ColumnParallelLinear: dim 0 split; rank r holds rows [r*n/tp, (r+1)*n/tp)
  row,         ///< RowParallelLinear: dim 1 split; a 1-D tensor (its bias) is replicated
  vocab,       ///< VocabParallelEmbedding / ParallelLMHead: dim 0 padded to a multiple of
               ///< the padding, then split evenly; rows past the vocabulary are padding
};

/// Tensors whose model name matches `pattern` (std::regex, ECMAScript, searched
/// anywhere in the name) are split as `style`. The first matching rule wins;
/// tensors no rule matches are replicated.
struct shard_rule {
  std::string pattern;
  parallel_style style = parallel_style::replicated;
};

/// Checkpoint tensors stacked along dim 0 into one model tensor, as vLLM's
/// stacked_params_mapping: a name containing components[i] loads into the name with
/// that substring replaced by `fused`, at the offset of the components before it.
/// Components may differ in size (GQA: k and v smaller than q); under tensor
/// parallelism each is sharded first and the rank's shards are stacked.
struct fused_param {
  std::string fused;                    ///< "qkv_proj"
  std::vector<std::string> components;  ///< {"q_proj", "k_proj", "v_proj"}, in stacking order
  /// Optional dim-0 sizes of the components, unsharded (the checkpoint's sizes).
  /// Needed only for updates that carry some components of a fused tensor but not
  /// all (require_complete = false); otherwise the sizes come from the update.
  std::vector<std::int64_t> sizes;
};

/// What a tensor-parallel destination layout is built from.
struct tp_layout_options {
  tp_layout_options() = default;
  std::vector<fused_param> fused;
  std::vector<shard_rule> shards;
  /// vocab-style tensors pad dim 0 to a multiple of this before splitting (vLLM's
  /// DEFAULT_VOCAB_PADDING_SIZE).
  std::int64_t vocab_padding = 64;
  /// Checkpoint names matching one of these regexes are not sent to the worker.
  std::vector<std::string> ignore;
};

/// Makes `name` a destination preset of read_dest_layouts ({"preset": name,
/// "tp_size": N}): `options()` gives its rules. "replicated" (no rules) is built
/// in; a framework's adapter registers its own, e.g. lib/adapters/vllm.h's
/// "vllm_llama". Registering a name again replaces it.
void register_tp_preset(const std::string& name, std::function<tp_layout_options()> options);

/// Worker `tp_rank` of `tp_size`'s tensors when a checkpoint of `global` (Hugging
/// Face names, global shapes) loads with `options`: fused tensors in order of
/// their first component, each component sharded then stacked. Throws
/// invalid_argument for a split dim that does not divide (column, row), an
/// incomplete fused tensor or a bad rule.
dest_layout tensor_parallel_layout(const update_metadata& global, int tp_size, int tp_rank,
                                   const tp_layout_options& options);

// ---------------------------------------------------------------- JSON

/// A source layout as JSON (read_source_layout reads it): {"mesh": [2], "ranks":
/// [...] (optional), "placements": ["shard(0)"] (every tensor), "tensors": {"name":
/// ["replicate"], ...} (optional overrides)}, in the compact form when every
/// tensor has the same placements.
json write_source_layout(const source_layout& layout);

/// Reads what write_source_layout writes, over the global `meta`; throws
/// invalid_argument naming the member path.
source_layout read_source_layout(json_reader& r, const update_metadata& meta);

/// {"preset": "vllm_llama", "tp_size": N (, "vocab_padding": 64)} or {"workers":
/// [[{"name", "dtype", "shape", "pieces": [{"source", "offset", "extent", "at"}]}]]}:
/// every worker's layout.
std::vector<dest_layout> read_dest_layouts(json_reader& r, const update_metadata& global);

// ---------------------------------------------------------------- bytes

/// Calls `run(byte_offset, bytes)` for each maximal contiguous byte run of box `b`
/// inside a row-major tensor of `shape` with `element` bytes per element, in the
/// box's row-major order: the same byte sequence for any two boxes of equal
/// extents, however each is cut into runs.
void for_each_run(std::span<const std::int64_t> shape, const box& b, std::size_t element,
                  const std::function<void(std::uint64_t offset, std::uint64_t bytes)>& run);
/// The number of runs for_each_run would call.
std::uint64_t run_count(std::span<const std::int64_t> shape, const box& b);

/// Copies box `from` of a host tensor (`src`, `src_shape`) to `at` of another
/// (`dst`, `dst_shape`); both of `element` bytes per element.
void copy_box(const std::byte* src, std::span<const std::int64_t> src_shape, const box& from, std::byte* dst,
              std::span<const std::int64_t> dst_shape, std::span<const std::int64_t> at, std::size_t element);

}  // namespace refit
