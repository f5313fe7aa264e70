// Tensors between Python and refit, without copies: any object with __dlpack__
// (torch, numpy, cupy, ...) becomes a tensor_view of its own memory, and refit's
// views become torch tensors (or numpy arrays) over refit's memory.
#pragma once

#include <deque>
#include <span>
#include <string>
#include <vector>

#include <nanobind/nanobind.h>

#include <refit/metadata.h>
#include <refit/tensor.h>

#include "bridge.h"

namespace refit::py {

/// What load_weights is given: torch tensors, or numpy arrays (bf16 and fp8 as
/// their raw bits, uint16 and uint8, which numpy has no type for).
enum class framework { torch, numpy };
/// "torch", "numpy" or "auto" (torch when it can be imported). GIL held.
framework parse_framework(const std::string& name);

/// What a sender saw in its last update, so the next one costs less Python: a torch
/// tensor whose name, dtype, shape, contiguity, device and data pointer all read as
/// before is taken as before (its layout and dtype need not be looked up again, nor
/// its entry rebuilt), and when every tensor is, the metadata is reused. Nothing is
/// referenced: each update reads every tensor's data pointer afresh, so a parameter
/// given new memory is sent from its new memory. GIL held.
class tensor_cache {
 public:
  struct entry {
    std::string name;
    PyObject* torch_dtype = nullptr;  // a torch.dtype (interned singletons, never freed)
    refit::dtype type{};
    std::vector<std::int64_t> shape;
    refit::device device;
    void* data = nullptr;
  };
  /// The last update's tensors. Shared, not copied: a send in flight keeps the
  /// entries its views point into while a later update replaces them.
  std::shared_ptr<const std::vector<entry>> entries;
  std::shared_ptr<const update_metadata> meta;  // of `entries`
  std::uint64_t hits = 0, misses = 0;
};

/// Python tensors held for as long as refit reads or writes their memory: their
/// views, and references to the objects (released under the GIL, on any thread).
class held_tensors {
 public:
  /// From a mapping {name: tensor} or an iterable of (name, tensor) pairs (what
  /// named_parameters() yields). Each must be C-contiguous, of a dtype refit
  /// moves, in host or CUDA memory; otherwise invalid_argument naming it. torch
  /// tensors that require grad are detached (a view of the same memory). GIL held.
  /// With `cache`, torch tensors read as in the cache's last update are taken from it
  /// (and the cache is updated to this one).
  static held_tensors from_python(nb::handle tensors, const std::string& what, tensor_cache* cache = nullptr);

  std::span<const tensor_view> views() const { return views_; }
  /// Names, dtypes and shapes, in order (the cache's when every tensor hit it).
  update_metadata metadata() const;
  /// The same, shared (not copied) when it is the cache's.
  std::shared_ptr<const update_metadata> shared_metadata() const;
  std::size_t size() const { return views_.size(); }

 private:
  struct item {
    std::string name;
    std::vector<std::int64_t> shape;
  };
  std::deque<item> items_;  // stable addresses: the views point into them
  std::vector<tensor_view> views_;
  shared_object owners_;                                                    // a list of the Python objects
  std::shared_ptr<const std::vector<tensor_cache::entry>> cached_entries_;  // what hits' views point into
  std::shared_ptr<const update_metadata> cached_meta_;                      // when every tensor hit
};

/// A Python view of `v`'s memory (no copy, no owner: valid while refit keeps the
/// memory, i.e. during the load_weights call it is given to). GIL held.
nb::object python_view(const tensor_view& v, framework fw);

/// The (name, tensor) list load_weights gets for `views`. GIL held.
nb::list python_batch(std::span<const tensor_view> views, framework fw);

}  // namespace refit::py
