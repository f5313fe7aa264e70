// A ready-made model_target: named tensors (host memory by default, device memory
// through a tensor_memory) that an engine receives into directly, checked against
// every update before any byte moves, with a reader API that always shows bytes
// and weight version together.
//
//   refit::tensor_map_target model;                       // reader_lock mode
//   auto w = model.add({"w", refit::dtype::bfloat16, {4096, 4096}});  // zeroed, owned
//   model.add({"b", refit::dtype::float32, {4096}}, my_span);         // the application's memory
//   ctx.model = &model;
//   refit::control::worker_host host(config, ctx, model.as_load_weights());
//   host.set_hooks(refit::control::tensor_map_hooks(host, model));
//   // after each session: model.finish(version) / model.abort(reason), as the
//   // host's state says (see "Updates" below)
//   ...
//   { auto r = model.read();                              // any thread
//     serve(r.version(), r.view("w")); }                  // bytes of exactly r.version()
//
// Tensors. add(spec) allocates zeroed memory the target owns (from its
// tensor_memory: on the host, 64-byte aligned, faulted in at add(), never on the
// event loop); add(spec, span) wraps host memory the application owns (exactly
// spec.nbytes() bytes, else invalid_argument; it must outlive the target);
// add(view) wraps the application's memory on the target's device (the view's
// device must be the memory's, else invalid_argument). Populate before first use:
// add() is refused (invalid_state) once the target has been read, updated or
// fingerprinted.
//
// Device tensors. tensor_map_target_options::memory says where the tensors live
// and how bytes move there (lib/model/tensor_memory.h; null: host memory). With device
// memory (CUDA builds: refit::cuda::device_tensor_memory, lib/cuda/tensor_memory.h)
// every tensor is allocated on that device, and:
//  * the views readers see (and destination() offers) carry the memory's device;
//    readers read them with the device's API (e.g. kernels on that GPU);
//  * load_weights copies every view through memory->copy_in: views on the host
//    (an engine's host staging: tcp, loopback) are copied host -> device, views on
//    the memory's device device -> device; a view on any other device is refused
//    (unsupported, naming the tensor and both devices) before anything is written;
//  * fingerprint copies each tensor to a host buffer with memory->copy_out and
//    hashes that: the fingerprints are those of host tensors of the same bytes;
//  * direct receive is off unless direct_receive_on_device is set too (see
//    "Direct receive");
//  * double buffering swaps pointers, as for host memory: nothing is copied at
//    finish.
// The initial weights: add(spec) returns the memory served first, on the device:
// write it with the device's API (or memory->copy_in) before first use.
//
// Checks. begin_update (called by the engine base before any byte of a chunk
// moves) refuses an update naming a tensor the target does not hold, or one whose
// dtype or shape differs, with refit::error(invalid_argument) naming the tensor and
// what differs; the engine then receives nothing and the weights stay untouched.
// load_weights checks every view of a batch the same way before writing any of it
// (for use without begin_update, i.e. without engine_context::model). An update may
// carry any subset of the tensors.
//
// Direct receive. destination(spec) returns the tensor's own memory (in
// double_buffered mode: its back copy) when spec matches it exactly, so the engine
// receives straight into it; load_weights copies only views that are not already
// that memory. direct_receive = false in the options turns this off (every update
// goes through the engine's staging and is copied by load_weights). With device
// memory destination() offers memory only when direct_receive_on_device is set as
// well: engines refuse a destination on another device than the one they receive
// on (tcp and loopback receive on the host), so the default for device memory is
// no direct receive (the engine stages on the host, load_weights copies in). Set
// it when the engine receives on the memory's device (its engine_context::device
// is memory->device(), e.g. cuda_ipc or nccl).
//
// Updates. An update is one session of one or more chunks (each a receive_weights /
// update_weights): it opens with the first begin_update, direct_write_begins or
// load_weights after the previous update ended (or with start()), and ends with
// finish(version) or abort(reason). The target cannot see the session verbs, so the
// worker host or the application calls them: finish(version) once the session's
// finish_weight_update has completed (deferred processing drained), abort(reason)
// once its abort_weight_update has completed or a chunk failed and the session will
// not be finished. Both are refused (invalid_state) while a load_weights call of
// the update is still running. finish(v) makes v the served version (nullopt:
// unlabelled) and the weights clean; it relabels even when the update wrote
// nothing (the trainer vouches for them). A target used with a bare engine, without
// sessions, calls finish after each receive_weights + drain_pending. With a worker
// host's session hooks (started / finished at a version / failed with a reason,
// called on the event loop after the session's bookkeeping): started -> start(),
// finished(v) -> finish(v), failed(reason) -> abort(reason); all three are short
// (O(tensors), no waiting) and fit a hook that must not block the loop.
//
// Reader modes (target_options::mode):
//
//  * reader_lock (default): one copy of every tensor. read() returns a guard that
//    holds the shared side of a reader/writer lock. An update takes the exclusive
//    side at its first byte (direct_write_begins, or its first load_weights,
//    whichever comes first) and keeps it until finish/abort, so between those
//    readers block in read() (try_read() returns nullopt) and a guard never sees
//    bytes that change under it. The version a guard shows changes at finish,
//    together with the bytes. Writers have preference: once an update waits, new
//    readers wait behind it. After abort of an update that had written anything the
//    target is dirty: guards show dirty() with dirty_reason() and version()
//    nullopt (the bytes are a mix of two versions) until the next finish. An abort
//    before any byte landed changes nothing.
//    Cost: the update's first write waits for the guards held at that moment
//    (on the event loop, for direct receive): keep guards to one request.
//
//  * double_buffered: two copies of every tensor (twice the memory; with add(spec,
//    span) the application's span is one of the two copies, so which copy holds the
//    served bytes alternates: always read through a guard). Readers read the front
//    copies and never block; the update receives into the back copies. finish()
//    swaps, per tensor, the front and back of the tensors the update wrote and
//    publishes a new generation atomically (shared_ptr snapshots): a guard taken
//    before keeps the old fronts, consistent, until it is released. Tensors the
//    update did not carry keep their front; their back copy is never read and is
//    not copied (each update writes whole tensors), so no copy is made at finish.
//    abort() discards the back copies: the front stays clean at its version.
//    Before the first byte of an update lands in a back copy, the update waits for
//    guards of generations older than the current one to be released (they may
//    still read what is now the back copy); guards of the current generation never
//    delay an update.
//
// Threading contract (what the engines do: lib/engine.cc, lib/backend/pipeline.cc,
// lib/backend/links/engine_base.cc, and what the application may do concurrently):
//
//  * begin_update, destination, direct_write_begins: on the engine's event loop
//    (engine_context::executor). begin_update and destination are O(tensors in
//    the update) and O(1) lookups, no allocation beyond a small vector; they never
//    wait. direct_write_begins may wait, as described above (reader_lock: for held
//    guards; double_buffered: for guards of old generations).
//  * Direct-receive writes: done by the engine's transport into the memory
//    destination() returned, after direct_write_begins and before the chunk's
//    receive completes; tcp reads the socket into it on the event loop thread; the
//    loopback engine's sender copies into it on the trainer's executor.
//  * load_weights: on the engine's processing executor (a pool of
//    config.processing_threads, or engine_context::processing_executor), never
//    concurrently with itself for one update, possibly concurrently with the event
//    loop's calls above. It may wait like direct_write_begins. Its copies
//    (memory->copy_in: memcpy on the host, a synchronous device copy for device
//    memory) run there too, after the wait, outside the target's lock, and are
//    complete when load_weights returns.
//  * fingerprint: on the processing executor (worker_host's weight_fingerprint),
//    concurrently with anything. It never waits: in reader_lock mode while an
//    update holds the weights it throws invalid_state (waiting there could starve
//    the update's own load_weights on a one-thread pool); in double_buffered mode it
//    hashes the front copies. With device memory its copy_out calls run on the
//    calling thread, under a reader guard, possibly concurrently with an update's
//    copy_in into the back copies (double_buffered).
//  * finish, abort, start: any thread, but not concurrently with an update's
//    load_weights (see Updates); usually the event loop, in the session's hooks.
//  * read, try_read, the guards, version/dirty/generation queries: any thread,
//    concurrently with everything. A guard must not outlive the target; do not hold
//    one on the event loop across a co_await that waits for an update (the update
//    would wait for the guard: a deadlock). Readers must not write through views.
//  * add: before first use, on one thread (it allocates: memory->allocate_zeroed;
//    the target's destruction releases: memory->release).
#pragma once

#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <iterator>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include <refit/engine.h>
#include <refit/integrity/fingerprint.h>
#include <refit/metadata.h>
#include <refit/model/tensor_memory.h>
#include <refit/tensor.h>

namespace refit {

/// How readers are kept consistent with updates (see the top of this file).
enum class reader_mode {
  reader_lock,      ///< one copy; updates exclude readers from first byte to finish
  double_buffered,  ///< two copies; readers never block, finish swaps
};

/// "reader_lock" or "double_buffered".
std::string_view to_string(reader_mode mode) noexcept;

struct tensor_map_target_options {
  reader_mode mode = reader_mode::reader_lock;
  /// The version the initial bytes are served as (nullopt: unlabelled).
  std::optional<std::int64_t> initial_version;
  /// Offer the tensors' memory as destinations (direct receive).
  bool direct_receive = true;
  /// Where the tensors live and how bytes move there (null: host memory).
  std::shared_ptr<tensor_memory> memory;
  /// With memory on a device (not the host): offer it as destinations too (with
  /// direct_receive), because the engine receives on that device (its
  /// engine_context::device is memory->device()). Off by default: tcp and
  /// loopback receive on the host and refuse a device destination; they stage and
  /// load_weights copies in. Ignored for host memory.
  bool direct_receive_on_device = false;
};

class tensor_map_target final : public model_target {
  struct snapshot;

 public:
  /// A consistent view of the weights, held until destroyed or release()d: the
  /// bytes it shows are exactly those of version() (when not dirty()).
  class reader {
   public:
    reader(reader&& other) noexcept;
    reader& operator=(reader&& other) noexcept;
    reader(const reader&) = delete;
    reader& operator=(const reader&) = delete;
    ~reader();

    /// The version these bytes are; nullopt when unlabelled or dirty().
    std::optional<std::int64_t> version() const noexcept;
    /// Bumped at every change of what readers are shown (finish, a dirtying abort).
    std::uint64_t generation() const noexcept;
    /// A failed update left the bytes a mix of two versions (reader_lock only).
    bool dirty() const noexcept;
    /// Why (empty when clean).
    const std::string& dirty_reason() const noexcept;

    /// The tensor named `name`; invalid_argument for an unknown name.
    tensor_view view(std::string_view name) const;
    /// The same, nullopt for an unknown name.
    std::optional<tensor_view> find(std::string_view name) const;
    /// Tensors in the order they were added.
    std::size_t size() const noexcept;
    tensor_view operator[](std::size_t index) const;

    class iterator {
     public:
      using iterator_category = std::forward_iterator_tag;
      using value_type = tensor_view;
      using difference_type = std::ptrdiff_t;
      using pointer = void;
      using reference = tensor_view;
      iterator() = default;
      tensor_view operator*() const { return (*r_)[i_]; }
      iterator& operator++() {
        ++i_;
        return *this;
      }
      iterator operator++(int) {
        auto t = *this;
        ++i_;
        return t;
      }
      friend bool operator==(const iterator& a, const iterator& b) noexcept { return a.i_ == b.i_; }

     private:
      friend class reader;
      iterator(const reader* r, std::size_t i) : r_(r), i_(i) {}
      const reader* r_ = nullptr;
      std::size_t i_ = 0;
    };
    iterator begin() const { return {this, 0}; }
    iterator end() const { return {this, size()}; }

    /// Gives the view up now (the guard is then empty; only destruction is allowed).
    void release() noexcept;

   private:
    friend class tensor_map_target;
    reader(const tensor_map_target* target, std::shared_ptr<const snapshot> snap, bool shared_lock)
        : target_(target), snap_(std::move(snap)), shared_lock_(shared_lock) {}
    const tensor_map_target* target_ = nullptr;
    std::shared_ptr<const snapshot> snap_;
    bool shared_lock_ = false;  // reader_lock mode: holds the shared side
  };

  explicit tensor_map_target(tensor_map_target_options options = {});
  ~tensor_map_target() override;
  tensor_map_target(const tensor_map_target&) = delete;
  tensor_map_target& operator=(const tensor_map_target&) = delete;

  /// Adds a tensor with zeroed memory of its own (two copies in double_buffered
  /// mode); returns the memory served first, for initial weights. invalid_argument
  /// for an empty or duplicate name or a bad shape; invalid_state after first use.
  std::span<std::byte> add(const tensor_spec& spec);
  /// Adds a tensor in the application's host memory (exactly spec.nbytes() bytes,
  /// else invalid_argument); in double_buffered mode it is one of the two copies.
  /// Host memory only (with device memory: invalid_argument, use add(view)).
  std::span<std::byte> add(const tensor_spec& spec, std::span<std::byte> external);
  /// Adds the tensor `external` describes (name, dtype, shape), in the
  /// application's memory it points to, which must be on the target's device
  /// (memory()->device(), else invalid_argument naming both) and outlive the
  /// target; in double_buffered mode it is one of the two copies. Returns the view
  /// served first (the target's spec, the target's device).
  tensor_view add(const tensor_view& external);

  /// Waits while an update holds the weights (reader_lock mode); never waits in
  /// double_buffered mode.
  reader read() const;
  /// nullopt instead of waiting.
  std::optional<reader> try_read() const;

  /// Opens an update explicitly (optional: the first engine call opens it).
  void start();
  /// Ends the update: `version` is served from now on, with its bytes.
  void finish(std::optional<std::int64_t> version);
  /// Ends the update without a version: reader_lock mode turns dirty if any byte
  /// of it had landed; double_buffered mode discards it.
  void abort(const std::string& reason = {});

  /// Snapshots of what a read() would show now (without waiting).
  std::optional<std::int64_t> version() const;
  std::uint64_t generation() const;
  bool dirty() const;
  std::string dirty_reason() const;
  /// An update is open (started and not yet finished or aborted).
  bool updating() const;
  /// Bytes of the open update have started landing (reader_lock: the exclusive
  /// side is held).
  bool writing() const;

  reader_mode mode() const noexcept { return options_.mode; }
  /// Where the tensors live (never null: host_memory() when none was given).
  const std::shared_ptr<tensor_memory>& memory() const noexcept { return memory_; }
  /// memory()->device(): the device of every view the target hands out.
  refit::device device() const noexcept { return device_; }
  std::size_t size() const noexcept { return tensors_.size(); }
  /// The specs, in the order added.
  std::vector<tensor_spec> specs() const;
  /// Metadata of all tensors (e.g. for a trainer's layout).
  update_metadata metadata() const;

  // model_target
  void begin_update(const update_metadata& meta) override;
  std::optional<tensor_view> destination(const tensor_spec& spec) override;
  void direct_write_begins() override;
  void load_weights(std::span<const tensor_view> weights) override;
  fingerprint_list fingerprint(const std::vector<std::string>& names) override;
  /// Every tensor it holds (same dtype and shape) reads back: the served copy
  /// (reader_lock: the one copy; double_buffered: the front), through
  /// memory()->copy_out. Undo of a staged commit (lib/engine.h).
  bool can_read_back(const tensor_spec& spec) override;
  void read_back(const tensor_spec& spec, std::span<std::byte> out) override;
  /// In reader_lock mode on the host: load_weights that swaps (lib/engine.h), so
  /// a fleet-atomic commit keeps its undo in one pass with no scratch.
  bool can_exchange() const override;
  void exchange(std::span<const tensor_view> staged) override;

 private:
  // load_weights' checks of a whole batch (before anything is written): each
  // view's tensor index.
  std::vector<std::size_t> checked_batch(std::span<const tensor_view> weights);
  // Takes the write side for the tensors at `at` (counted in loads_: the caller
  // decrements it); where to write each.
  std::vector<std::byte*> begin_writing(const std::vector<std::size_t>& at);
  struct memory_deleter {
    tensor_memory* memory;  // no default member initializer: the deleter must be default-constructible here
    void operator()(std::byte* p) const noexcept;
  };
  struct entry {
    tensor_spec spec;
    std::uint64_t nbytes = 0;
    std::byte* buf[2] = {nullptr, nullptr};  // buf[1]: double_buffered only
    std::unique_ptr<std::byte, memory_deleter> own[2];
    int front = 0;  // double_buffered: the copy readers read (changed under mutex_)
  };

  std::span<std::byte> add_entry(const tensor_spec& spec, std::byte* external, std::uint64_t external_bytes,
                                 bool has_external);
  const entry* lookup(std::string_view name) const;
  void seal_locked() const;
  void acquire_write(std::unique_lock<std::mutex>& lock);
  std::shared_ptr<const snapshot> make_snapshot_locked(std::uint64_t generation, std::optional<std::int64_t> version,
                                                       std::string dirty_reason) const;
  std::shared_ptr<const snapshot> publish_locked(std::shared_ptr<const snapshot> next) const;
  void release_shared() const noexcept;
  std::byte* write_buffer_locked(const entry& e) const;

  tensor_map_target_options options_;
  std::shared_ptr<tensor_memory> memory_;  // declared before tensors_: released after them
  refit::device device_;
  std::deque<entry> tensors_;  // never relocated: views and the index point into it
  std::unordered_map<std::string_view, std::size_t> index_;

  mutable std::mutex mutex_;
  mutable std::condition_variable changed_;
  mutable std::shared_ptr<const snapshot> current_;  // null until first use (then add() is refused)
  mutable std::size_t live_snapshots_ = 0;           // snapshot objects not yet destroyed
  mutable std::size_t readers_ = 0;                  // reader_lock: guards holding the shared side
  std::size_t writers_waiting_ = 0;                  // reader_lock: updates waiting for the exclusive side
  bool open_ = false;                                // an update is open
  bool writing_ = false;                             // its bytes may be landing (exclusive held)
  int loads_ = 0;                                    // load_weights calls running
  std::vector<char> written_;                        // double_buffered: tensors the open update wrote
};

}  // namespace refit
