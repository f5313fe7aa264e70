#include <refit/backend/engine.h>

#include <sys/mman.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <new>
#include <unordered_map>

#include <asio/co_spawn.hpp>
#include <asio/post.hpp>

#include <refit/backend/async/offload.h>

namespace refit::backend {

// Forwards to the context's model and records that the update being received
// reached it (a direct destination was handed out or load_weights was called).
class engine::tracking_target final : public model_target {
 public:
  tracking_target(model_target& inner, std::atomic<bool>& touched) : inner_(inner), touched_(touched) {}
  void load_weights(std::span<const tensor_view> weights) override {
    touched_ = true;
    inner_.load_weights(weights);
  }
  void begin_update(const update_metadata& meta) override { inner_.begin_update(meta); }
  std::optional<tensor_view> destination(const tensor_spec& spec) override { return inner_.destination(spec); }
  void direct_write_begins() override {
    touched_ = true;  // bytes land in the model's memory from now on
    inner_.direct_write_begins();
  }
  std::vector<std::pair<std::string, std::uint64_t>> fingerprint(const std::vector<std::string>& names) override {
    return inner_.fingerprint(names);
  }

 private:
  model_target& inner_;
  std::atomic<bool>& touched_;
};

// Host memory for staged commits: the tensors of an update session's chunks, one
// after the other, each at a 64-byte aligned offset. Anonymous memory, grown with
// mremap (the kernel moves page tables: earlier chunks are not copied, and the
// peak is the new size, not old + new), kept for later sessions, unmapped by the
// destructor. Grown and faulted in on the processing executor, never on the loop.
class engine::stage_area {
 public:
  stage_area() = default;
  stage_area(const stage_area&) = delete;
  stage_area& operator=(const stage_area&) = delete;
  ~stage_area() {
    if (memory_) ::munmap(memory_, capacity_);
  }

  // Makes room for `bytes` more after what the session holds and returns where
  // they start; throws resource_exhausted (naming the bytes) when the stage would
  // exceed `limit` (0: none) or cannot grow.
  std::uint64_t take(std::uint64_t bytes, std::uint64_t limit, const std::string& who) {
    const std::uint64_t at = used_;
    const std::uint64_t needed = at + bytes;
    if (limit != 0 && needed > limit)
      throw_error(errc::resource_exhausted,
                  who + ": staged commit: the stage would hold " + std::to_string(needed) + " bytes (" +
                      std::to_string(at) + " of this session's earlier chunks + " + std::to_string(bytes) +
                      " of this one), more than max_stage_bytes " + std::to_string(limit) +
                      "; nothing of this chunk was received (use commit \"in_place\", or larger bounds)");
    if (needed > capacity_) grow(needed, who);
    used_ = needed;
    return at;
  }
  // Back to `used` bytes (a failed chunk, the end of a session).
  void release_to(std::uint64_t used) noexcept { used_ = std::min(used_, used); }
  std::byte* base() const noexcept { return static_cast<std::byte*>(memory_); }
  std::uint64_t used() const noexcept { return used_; }
  std::uint64_t capacity() const noexcept { return capacity_; }

 private:
  void grow(std::uint64_t needed, const std::string& who) {
    constexpr std::uint64_t huge_page = 2u << 20;
    const std::uint64_t rounded = (needed + huge_page - 1) / huge_page * huge_page;
    void* p = memory_ ? ::mremap(memory_, capacity_, rounded, MREMAP_MAYMOVE)
                      : ::mmap(nullptr, rounded, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) {
      const int e = errno;
      throw_error(errc::resource_exhausted, who + ": staged commit: cannot allocate " + std::to_string(rounded) +
                                                " bytes of host memory for the stage (" + std::to_string(used_) +
                                                " held by this session's earlier chunks, " +
                                                std::to_string(needed - used_) + " for this one): " + std::strerror(e) +
                                                "; nothing of this chunk was received (use commit \"in_place\")");
    }
    // Faulted in now, in huge pages where the kernel allows: not during the
    // transfer, not on the loop. Only the new part: the rest was faulted before.
    auto* bytes = static_cast<std::byte*>(p);
    (void)::madvise(bytes + capacity_, rounded - capacity_, MADV_HUGEPAGE);
    auto* touch = static_cast<volatile std::byte*>(p);
    for (std::uint64_t i = capacity_; i < rounded; i += 4096) touch[i] = std::byte{0};
    memory_ = p;
    capacity_ = rounded;
  }

  void* memory_ = nullptr;
  std::uint64_t capacity_ = 0;
  std::uint64_t used_ = 0;
};

// One staged chunk of a session: its metadata (a copy: the caller's update_info
// lives only for the chunk), where each tensor sits in the stage, what has
// arrived, and the load_weights its commit calls.
struct engine::staged_chunk {
  update_metadata meta;
  std::vector<std::uint64_t> offsets;  // from the stage's base (which may move as it grows)
  std::vector<char> arrived;
  std::unordered_map<std::string_view, std::size_t> index;  // names in `meta`: the chunk is never moved
  std::uint64_t begin = 0, bytes = 0;                       // its span of the stage
  load_weights_fn load;

  // Lays out `m` at `at` (sizes from the specs, 64-byte aligned).
  static std::uint64_t laid_out_bytes(const update_metadata& m) {
    std::uint64_t n = 0;
    for (const auto& t : m.tensors) n += (t.nbytes() + 63) / 64 * 64;
    return n;
  }
  void lay_out(std::uint64_t at) {
    begin = at;
    offsets.resize(meta.tensors.size());
    arrived.assign(meta.tensors.size(), 0);
    index.reserve(meta.tensors.size());
    for (std::size_t i = 0; i < meta.tensors.size(); ++i) {
      offsets[i] = at;
      index.emplace(meta.tensors[i].name, i);
      at += (meta.tensors[i].nbytes() + 63) / 64 * 64;
    }
    bytes = at - begin;
  }
  // Where `spec` is staged: received there directly (no copy into the stage).
  std::optional<tensor_view> destination(const tensor_spec& spec, std::byte* base) const {
    auto it = index.find(spec.name);
    if (it == index.end() || !base || spec.nbytes() != meta.tensors[it->second].nbytes()) return std::nullopt;
    return tensor_view(spec, base + offsets[it->second]);
  }
  // load_weights of the receive phase: copies each tensor into its place.
  void stage(std::span<const tensor_view> views, std::byte* base) {
    for (const auto& v : views) {
      auto it = index.find(v.name);  // no allocation per tensor
      if (it == index.end())
        throw_error(errc::protocol_error, "staged commit: tensor '" + std::string(v.name) + "' is not in the update");
      const auto& spec = meta.tensors[it->second];
      if (v.nbytes() != spec.nbytes())
        throw_error(errc::protocol_error, "staged commit: tensor '" + spec.name + "' arrived with " +
                                              std::to_string(v.nbytes()) + " bytes, expected " +
                                              std::to_string(spec.nbytes()));
      if (!(v.device == device::cpu()))
        throw_error(errc::unsupported, "staged commit: tensor '" + spec.name + "' arrived on " + to_string(v.device) +
                                           "; this engine stages on its device, use commit \"in_place\"");
      std::byte* at = base + offsets[it->second];
      if (spec.nbytes() != 0 && v.data != at) std::memcpy(at, v.data, spec.nbytes());  // not received in place
      arrived[it->second] = 1;
    }
  }
  // Views of the whole chunk, once every tensor has arrived.
  std::vector<tensor_view> views(std::byte* base) const {
    std::vector<tensor_view> out;
    out.reserve(meta.tensors.size());
    for (std::size_t i = 0; i < meta.tensors.size(); ++i) {
      if (!arrived[i])
        throw_error(errc::protocol_error,
                    "staged commit: tensor '" + meta.tensors[i].name + "' never arrived; the update is not committed");
      out.emplace_back(meta.tensors[i], base + offsets[i]);
    }
    return out;
  }
};

// A staged chunk's receive target: the stage offers each tensor's place in it, so
// the engine receives there directly; the model is not reached.
class engine::stage_target final : public model_target {
 public:
  stage_target(const stage_area& stage, const staged_chunk& chunk) : stage_(stage), chunk_(chunk) {}
  void load_weights(std::span<const tensor_view>) override {
    throw_error(errc::invalid_state, "staged commit: the stage is not loaded through its target");
  }
  std::optional<tensor_view> destination(const tensor_spec& spec) override {
    return chunk_.destination(spec, stage_.base());
  }

 private:
  const stage_area& stage_;
  const staged_chunk& chunk_;
};

namespace {
// Runs before any member uses the executor.
engine_context checked(engine_context context) {
  if (!context.executor) throw_error(errc::invalid_argument, "engine_context: an executor is required");
  return context;
}
}  // namespace

engine::engine(weight_transfer_config config, engine_context context, engine_capabilities capabilities)
    : config_(std::move(config)), context_(checked(std::move(context))), capabilities_(capabilities),
      deferred_(context_.executor) {}

engine::~engine() = default;

void engine::mark_weights_dirty(std::string reason) {
  if (reason.empty()) reason = "marked dirty";
  dirty_reason_ = std::move(reason);
}

std::uint64_t engine::staged_bytes() const noexcept { return stage_ ? stage_->capacity() : 0; }

model_target* engine::receive_target() noexcept {
  if (mode_ == commit_mode::staged) return stage_target_.get();
  if (!context_.model) return nullptr;
  if (!tracker_) tracker_ = std::make_unique<tracking_target>(*context_.model, touched_);
  return tracker_.get();
}

void engine::note_failure(const std::string& what, std::exception_ptr error) {
  if (touched_)
    mark_weights_dirty(what + " failed after it had started changing the weights (" + std::string(to_string(mode_)) +
                       "): " + describe_error(error));
}

asio::any_io_executor engine::processing_executor() {
  if (context_.processing_executor) return context_.processing_executor;
  if (!own_pool_) own_pool_ = std::make_unique<asio::thread_pool>(config_.processing_threads);
  return own_pool_->get_executor();
}

asio::awaitable<void> engine::init_transfer_engine(const init_info& info) {
  const std::string name(backend());
  if (state_ == state::initializing || state_ == state::receiving)
    throw_error(errc::invalid_state,
                name + ": init_transfer_engine while " +
                    (state_ == state::receiving ? "an update is being received" : "another init is running"));
  if (reading_ > 0)
    throw_error(errc::invalid_state, name +
                                         ": init_transfer_engine while an update_info is being read "
                                         "(read_update_info)");
  if (state_ == state::ready) do_shutdown();  // re-init replaces the old connection
  state_ = state::initializing;
  try {
    co_await do_init(info);
  } catch (...) {
    state_ = state::created;
    do_shutdown();
    throw;
  }
  state_ = state::ready;
}

asio::awaitable<std::unique_ptr<update_info>> engine::read_update_info(const json& j) {
  ++reading_;
  struct done {
    int& n;
    ~done() { --n; }
  } guard{reading_};
  const json* p = &j;
  const weight_transfer_engine* self = this;
  co_return co_await async::offload(processing_executor(), [self, p] { return self->parse_update_info(*p); });
}

asio::awaitable<void> engine::receive_weights(const update_info& info, load_weights_fn load_weights) {
  const std::string name(backend());
  switch (state_) {
    case state::ready:
      break;
    case state::receiving:
      throw_error(errc::invalid_state, name + ": receive_weights while another update is being received");
    case state::committing:
      throw_error(errc::invalid_state, name + ": receive_weights while a staged update session is being committed");
    case state::shut_down:
      throw_error(errc::invalid_state, name + ": receive_weights after shutdown (call init_transfer_engine again)");
    default:
      throw_error(errc::invalid_state, name + ": receive_weights before init_transfer_engine");
  }
  if (!load_weights) throw_error(errc::invalid_argument, name + ": load_weights is empty");
  const commit_mode mode = info.commit.value_or(config_.commit);
  // Refusals before any byte moves reach the trainer at once (refuse_update).
  auto refuse = [&](errc kind, const std::string& message) {
    refuse_update(kind, message);
    throw_error(kind, message);
  };
  if (mode == commit_mode::staged) {
    if (const std::string why = staged_commit_refusal(); !why.empty())
      refuse(errc::unsupported, name + ": staged commits are not supported: " + why +
                                    "; use \"commit\": \"in_place\" (a failed update then marks the weights dirty)");
  }
  if (session_open_) {
    if (session_mode_ && *session_mode_ != mode)
      refuse(errc::invalid_argument, name + ": a chunk with commit \"" + std::string(to_string(mode)) +
                                         "\" in an update session whose earlier chunks are \"" +
                                         std::string(to_string(*session_mode_)) + "\"; one session commits one way");
    if (session_failed_)
      refuse(errc::invalid_state, name +
                                      ": an earlier chunk of this update session failed and the session's stage "
                                      "was discarded; abort the session and start a new one");
  }
  // Deferred work of an earlier update must not overlap this one's staging slots.
  if (deferred_.pending() > 0)
    throw_error(errc::invalid_state, name +
                                         ": receive_weights while the previous update's "
                                         "processing is pending (call drain_pending first)");
  // The model checks the whole update before any byte of it moves; a refusal
  // leaves the engine ready and the weights untouched.
  if (context_.model) {
    try {
      context_.model->begin_update(info.metadata);
    } catch (const error& e) {
      refuse_update(e.kind(), name + ": the model refused the update: " + e.message());
      throw;
    } catch (const std::exception& e) {
      refuse_update(errc::invalid_argument, name + ": the model refused the update: " + e.what());
      throw;
    }
  }
  state_ = state::receiving;
  stats_ = {};
  mode_ = mode;
  touched_ = false;
  if (session_open_) session_mode_ = mode;
  if (mode_ == commit_mode::staged) {
    co_await receive_staged(info, std::move(load_weights));
    co_return;
  }
  // in_place: the user's load_weights marks the model as reached.
  load_weights_fn tracked = [this, load = std::move(load_weights)](std::span<const tensor_view> w) {
    touched_ = true;
    load(w);
  };
  std::exception_ptr failure;
  try {
    co_await do_receive(info, std::move(tracked));
  } catch (...) {
    failure = std::current_exception();
  }
  if (failure) {
    // The processing of buckets that arrived may still run (engines that defer
    // it): it ends here, so the failed update leaves nothing pending and the next
    // one is taken at once. Its own error, if any, is not what failed the update.
    try {
      co_await deferred_.join();
    } catch (...) {
    }
  }
  if (state_ == state::receiving) state_ = state::ready;
  if (failure) {
    note_failure("an update", failure);
    std::rethrow_exception(failure);
  }
  if (!defers_processing()) co_await drain_pending();
}

asio::awaitable<void> engine::receive_staged(const update_info& info, load_weights_fn load_weights) {
  // Outside a session a staged receive is a session of one chunk, committed here.
  const bool own_session = !session_open_;
  if (own_session) {
    session_open_ = true;
    session_failed_ = false;
    session_mode_ = commit_mode::staged;
  }
  if (!stage_) stage_ = std::make_unique<stage_area>();
  const auto start = std::chrono::steady_clock::now();
  auto finish_stats = [this, start] {
    stats_.wall_s =
        std::max(stats_.wall_s, std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
    stats_.finalize();
  };
  // A failed chunk discards the whole stage: the session can no longer commit
  // all of its update, so it commits none of it.
  auto fail = [this, own_session, &finish_stats] {
    clear_stage();
    session_failed_ = true;
    if (own_session) {
      session_open_ = false;
      session_failed_ = false;
      session_mode_.reset();
    }
    if (state_ == state::receiving) state_ = state::ready;
    finish_stats();
  };
  // Before any byte: the chunk's place at the end of the stage (grown and faulted
  // in on the processing executor, not the loop; the metadata copied there too),
  // or its refusal, which the trainer learns at once.
  auto chunk = std::make_unique<staged_chunk>();
  std::exception_ptr failure;
  try {
    staged_chunk* c = chunk.get();
    stage_area* stage = stage_.get();
    const update_info* in = &info;
    const auto* earlier = &staged_;
    const std::uint64_t limit = config_.max_stage_bytes;
    const std::string name(backend());
    const std::string* who = &name;
    co_await async::offload(processing_executor(), [c, stage, in, earlier, limit, who] {
      // The stage holds each tensor once: with a model that knows its tensors, it
      // stays within the model's size.
      for (std::size_t k = 0; k < earlier->size(); ++k)
        for (const auto& t : in->metadata.tensors)
          if ((*earlier)[k]->index.count(t.name))
            throw_error(errc::invalid_argument, *who + ": staged commit: tensor '" + t.name +
                                                    "' is already staged by "
                                                    "chunk " +
                                                    std::to_string(k + 1) +
                                                    " of this update session; a "
                                                    "session stages each tensor once");
      c->meta = in->metadata;
      c->lay_out(stage->take(staged_chunk::laid_out_bytes(c->meta), limit, *who));
    });
  } catch (...) {
    failure = std::current_exception();
  }
  if (failure) {
    refuse_update(error_kind_of(failure), error_message_of(failure));
    fail();
    std::rethrow_exception(failure);
  }
  // The chunk, straight into its place in the stage; the model is not reached.
  stage_target_ = std::make_unique<stage_target>(*stage_, *chunk);
  staging_in_session_ = !own_session;
  try {
    staged_chunk* c = chunk.get();
    std::byte* base = stage_->base();  // the stage does not grow during a chunk
    co_await do_receive(info, [c, base](std::span<const tensor_view> w) { c->stage(w, base); });
    co_await deferred_.join();
  } catch (...) {
    failure = std::current_exception();
  }
  staging_in_session_ = false;
  if (failure) {
    // Nothing of this update may still use the stage (engines join their
    // in-flight processing before reporting a transport error; this is a no-op then).
    try {
      co_await deferred_.join();
    } catch (...) {
    }
    stage_target_.reset();
    chunk.reset();
    fail();
    std::rethrow_exception(failure);
  }
  stage_target_.reset();
  chunk->load = std::move(load_weights);
  staged_.push_back(std::move(chunk));
  if (!own_session) {
    if (state_ == state::receiving) state_ = state::ready;
    finish_stats();
    co_return;
  }
  // A session of one chunk: its commit is the end of this receive.
  session_open_ = false;
  session_mode_.reset();
  try {
    auto chunks = std::exchange(staged_, {});
    co_await commit_staged(std::move(chunks));
  } catch (...) {
    failure = std::current_exception();
  }
  stage_->release_to(0);
  if (state_ == state::receiving) state_ = state::ready;
  finish_stats();
  if (failure) std::rethrow_exception(failure);
}

namespace {

// The batches of a staged commit: views (or the specs they will have) of at most
// 64 MiB (one tensor may be more).
template <class T>
std::vector<std::span<const T>> batches_of(const std::vector<T>& views) {
  constexpr std::uint64_t batch_bytes = 64ull << 20;
  std::vector<std::span<const T>> out;
  std::size_t first = 0;
  while (first < views.size()) {
    std::size_t last = first;
    std::uint64_t bytes = 0;
    while (last < views.size() && (last == first || bytes + views[last].nbytes() <= batch_bytes))
      bytes += views[last++].nbytes();
    out.emplace_back(views.data() + first, last - first);
    first = last;
  }
  return out;
}

// A chunk whose load_weights is `model`'s own, which can exchange: its commit
// swaps model and stage bytes instead of reading back, loading and copying.
bool exchanges(const load_weights_fn& load, model_target* model) {
  const auto* own = load.target<model_target::own_loader>();
  return model && own && own->model == model && model->can_exchange();
}

// The steps of a staged commit on one batch, each on `pool` (the processing
// executor).
asio::awaitable<void> load_batch(asio::any_io_executor pool, load_weights_fn* load,
                                 std::span<const tensor_view> batch) {
  co_await async::offload(pool, [load, batch] { (*load)(batch); });
}

// One pass: the model takes the batch, the stage the previous bytes (an exchange
// that throws changed nothing).
asio::awaitable<void> exchange_batch(asio::any_io_executor pool, model_target* model,
                                     std::span<const tensor_view> batch) {
  co_await async::offload(pool, [model, batch] { model->exchange(batch); });
}

// The model's current bytes of the batch's tensors, one after the other.
asio::awaitable<void> read_back_batch(asio::any_io_executor pool, model_target* model,
                                      std::span<const tensor_view> batch, std::byte* scratch) {
  co_await async::offload(pool, [model, batch, scratch] {
    std::uint64_t at = 0;
    for (const auto& v : batch) {
      model->read_back(v.spec(), std::span<std::byte>(scratch + at, v.nbytes()));
      at += v.nbytes();
    }
  });
}

// Once the batch is loaded, its place in the stage holds the previous bytes.
asio::awaitable<void> keep_previous_in_stage(asio::any_io_executor pool, std::span<const tensor_view> batch,
                                             std::byte* scratch) {
  co_await async::offload(pool, [batch, scratch] {
    std::uint64_t at = 0;
    for (const auto& v : batch) {
      if (v.nbytes() != 0) std::memcpy(v.data, scratch + at, v.nbytes());
      at += v.nbytes();
    }
  });
}

}  // namespace

// What a commit that keeps its undo changed so far: what restore_previous loads
// back after a failure.
struct engine::commit_progress {
  struct batch {
    staged_chunk* chunk;
    std::size_t first, count;  // its tensors in the chunk
  };
  std::vector<batch> loaded;       // fully loaded, their stage holding the previous bytes
  std::optional<batch> in_flight;  // read back into the scratch, being loaded
};

asio::awaitable<void> engine::commit_staged(std::vector<std::unique_ptr<staged_chunk>> chunks, bool keep_undo) {
  // Everything arrived and was verified; each chunk's load_weights now sees its
  // tensors, chunk by chunk in order, in batches, on the processing executor.
  mode_ = commit_mode::staged;
  touched_ = false;
  const auto t0 = std::chrono::steady_clock::now();
  model_target* model = keep_undo ? context_.model : nullptr;
  if (keep_undo && !model)
    throw_error(errc::unsupported, std::string(backend()) + ": a commit that keeps its undo needs the model target");
  // With undo: each batch's previous bytes (read back just before it is loaded),
  // then written into the stage in place of the new ones. The scratch is reserved
  // at the vote (reserve_undo); a commit that was not prepared reserves it here,
  // before the model is touched.
  if (model) {
    std::exception_ptr refused;
    try {
      co_await reserve_scratch(chunks);
    } catch (...) {
      refused = std::current_exception();
    }
    if (refused) {
      dispose(std::move(chunks));
      note_failure("the commit of a staged update", refused);
      std::rethrow_exception(refused);
    }
  }
  commit_progress progress;
  std::exception_ptr failure;
  try {
    for (auto& chunk : chunks) co_await commit_chunk(*chunk, model, progress);
  } catch (...) {
    failure = std::current_exception();
  }
  if (failure && model && touched_) co_await restore_previous(progress, failure);
  const double took = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  stats_.process_s += took;
  stats_.wall_s += took;
  if (failure || !model) {
    dispose(std::move(chunks));
  } else {
    dispose(std::exchange(undo_, {}));
    undo_ = std::move(chunks);
  }
  if (failure) {
    note_failure("the commit of a staged update", failure);
    std::rethrow_exception(failure);
  }
}

asio::awaitable<void> engine::commit_chunk(staged_chunk& chunk, model_target* model, commit_progress& progress) {
  staged_chunk* c = &chunk;
  std::byte* base = stage_->base();
  std::vector<tensor_view> views = co_await async::offload(processing_executor(), [c, base] { return c->views(base); });
  touched_ = true;
  load_weights_fn* load = &c->load;
  std::byte* const scratch = undo_scratch_.get();
  const bool swap = exchanges(c->load, model);
  for (std::span<const tensor_view> batch : batches_of(views)) {
    const commit_progress::batch here{c, static_cast<std::size_t>(batch.data() - views.data()), batch.size()};
    if (!model) {
      co_await load_batch(processing_executor(), load, batch);
    } else if (swap) {
      co_await exchange_batch(processing_executor(), model, batch);
      progress.loaded.push_back(here);
    } else {
      co_await read_back_batch(processing_executor(), model, batch, scratch);
      progress.in_flight = here;
      co_await load_batch(processing_executor(), load, batch);
      co_await keep_previous_in_stage(processing_executor(), batch, scratch);
      progress.in_flight.reset();
      progress.loaded.push_back(here);
    }
  }
}

asio::awaitable<void> engine::restore_previous(const commit_progress& progress, std::exception_ptr failure) {
  // Back to the previous version: the batch that failed from its scratch, then
  // every loaded batch from the stage, each through its chunk's load_weights.
  try {
    if (progress.in_flight) {
      const commit_progress::batch& failed = *progress.in_flight;
      std::vector<tensor_view> previous;
      std::uint64_t at = 0;
      const auto& specs = failed.chunk->meta.tensors;
      for (std::size_t i = failed.first; i < failed.first + failed.count; ++i) {
        previous.emplace_back(specs[i], undo_scratch_.get() + at);
        at += specs[i].nbytes();
      }
      co_await load_batch(processing_executor(), &failed.chunk->load, previous);
    }
    for (auto it = progress.loaded.rbegin(); it != progress.loaded.rend(); ++it) {
      std::vector<tensor_view> views = it->chunk->views(stage_->base());
      co_await load_batch(processing_executor(), &it->chunk->load,
                          std::span<const tensor_view>(views.data() + it->first, it->count));
    }
    touched_ = false;  // the model holds the previous version again
  } catch (...) {
    mark_weights_dirty(
        "the commit of a staged update failed (" + describe_error(failure) +
        ") and loading the previous version back failed too: " + describe_error(std::current_exception()));
  }
}

asio::awaitable<void> engine::reserve_undo() { return reserve_scratch(staged_); }

asio::awaitable<void> engine::reserve_scratch(const std::vector<std::unique_ptr<staged_chunk>>& chunks) {
  std::uint64_t needed = 0;
  for (const auto& chunk : chunks) {
    if (exchanges(chunk->load, context_.model)) continue;  // no scratch: swapped in place
    for (std::span<const tensor_spec> batch : batches_of(chunk->meta.tensors)) {
      std::uint64_t bytes = 0;
      for (const auto& t : batch) bytes += t.nbytes();
      needed = std::max(needed, bytes);
    }
  }
  if (needed <= undo_scratch_bytes_) co_return;
  const std::string name(backend());
  const std::uint64_t limit = config_.max_stage_bytes;
  const std::uint64_t staged = stage_ ? stage_->used() : 0;
  if (limit != 0 && staged + needed > limit)
    throw_error(errc::resource_exhausted, name + ": the undo of this update needs a scratch of " +
                                              std::to_string(needed) + " bytes (its largest batch) beside the " +
                                              std::to_string(staged) + " staged, more than max_stage_bytes " +
                                              std::to_string(limit) +
                                              "; nothing was committed (a larger bound, or no fleet-atomic update)");
  undo_scratch_.reset();
  undo_scratch_bytes_ = 0;
  // Allocated and faulted in off the loop: the commit then cannot run out of it.
  std::unique_ptr<std::byte[]> scratch = co_await async::offload(processing_executor(), [needed] {
    std::unique_ptr<std::byte[]> p(new (std::nothrow) std::byte[needed]);
    if (p) std::memset(p.get(), 0, needed);
    return p;
  });
  if (!scratch)
    throw_error(errc::resource_exhausted, name + ": the undo of this update needs a scratch of " +
                                              std::to_string(needed) +
                                              " bytes (its largest batch) and the allocation failed; nothing was "
                                              "committed");
  undo_scratch_ = std::move(scratch);
  undo_scratch_bytes_ = needed;
}

std::string engine::undo_refusal(const update_metadata& meta) {
  if (!context_.model) return "its engine has no model target to read the previous version back from";
  for (const auto& t : meta.tensors)
    if (!context_.model->can_read_back(t)) return "its model cannot read back '" + t.name + "' to undo a commit";
  return {};
}

asio::awaitable<void> engine::rollback_session() {
  const std::string name(backend());
  if (undo_.empty()) throw_error(errc::invalid_state, name + ": rollback: no committed update with its undo is held");
  if (session_open_ || state_ == state::receiving || state_ == state::committing)
    throw_error(errc::invalid_state, name + ": rollback while an update session is open or being committed");
  const state before = state_;
  state_ = state::committing;
  mode_ = commit_mode::staged;
  touched_ = false;
  auto chunks = std::exchange(undo_, {});
  std::exception_ptr failure;
  try {
    for (auto it = chunks.rbegin(); it != chunks.rend(); ++it) {
      staged_chunk* c = it->get();
      std::vector<tensor_view> views = c->views(stage_->base());
      touched_ = true;
      load_weights_fn* load = &c->load;
      for (std::span<const tensor_view> batch : batches_of(views))
        co_await async::offload(processing_executor(), [load, batch] { (*load)(batch); });
    }
  } catch (...) {
    failure = std::current_exception();
  }
  dispose(std::move(chunks));
  if (stage_) stage_->release_to(0);
  if (state_ == state::committing) state_ = before;
  if (failure) {
    mark_weights_dirty("the rollback of a committed update failed part-way: " + describe_error(failure));
    std::rethrow_exception(failure);
  }
}

void engine::release_undo() noexcept {
  if (undo_.empty()) return;
  dispose(std::exchange(undo_, {}));
  if (stage_ && !session_open_ && staged_.empty() && state_ != state::committing) stage_->release_to(0);
}

void engine::dispose(std::vector<std::unique_ptr<staged_chunk>> chunks) noexcept {
  std::size_t tensors = 0;
  for (const auto& c : chunks) tensors += c->meta.tensors.size();
  // The metadata of 100k tensors takes milliseconds to free: not on the loop.
  if (tensors > 4096) {
    try {
      auto owned = std::make_shared<std::vector<std::unique_ptr<staged_chunk>>>(std::move(chunks));
      asio::post(processing_executor(), [owned]() mutable { owned.reset(); });
      return;
    } catch (...) {
    }
  }
  chunks.clear();
}

void engine::clear_stage() noexcept {
  dispose(std::exchange(staged_, {}));
  dispose(std::exchange(undo_, {}));
  if (stage_) stage_->release_to(0);
}

void engine::begin_session() {
  if (state_ == state::receiving || state_ == state::committing)
    throw_error(errc::invalid_state, std::string(backend()) + ": begin_session while an update is being " +
                                         (state_ == state::receiving ? "received" : "committed"));
  clear_stage();
  session_open_ = true;
  session_failed_ = false;
  session_mode_.reset();
}

asio::awaitable<void> engine::commit_session(bool keep_undo) {
  const std::string name(backend());
  if (state_ == state::receiving || state_ == state::committing)
    throw_error(errc::invalid_state,
                name + ": commit_session while " +
                    (state_ == state::receiving ? "a chunk is being received" : "the session is being committed"));
  if (!session_open_) co_return;
  const bool failed = session_failed_;
  session_open_ = false;
  session_failed_ = false;
  session_mode_.reset();
  if (failed) {
    clear_stage();
    throw_error(errc::invalid_state, name +
                                         ": a chunk of this update session failed and its stage was "
                                         "discarded; nothing of the session is committed");
  }
  if (staged_.empty()) co_return;
  const state before = state_;
  state_ = state::committing;
  std::exception_ptr failure;
  try {
    auto chunks = std::exchange(staged_, {});
    co_await commit_staged(std::move(chunks), keep_undo);
  } catch (...) {
    failure = std::current_exception();
  }
  if (stage_ && undo_.empty()) stage_->release_to(0);  // kept while it holds the previous version
  if (state_ == state::committing) state_ = before;
  if (failure) std::rethrow_exception(failure);
  do_session_committed();
}

void engine::discard_session() {
  if (state_ == state::receiving || state_ == state::committing)
    throw_error(errc::invalid_state, std::string(backend()) + ": discard_session while an update is being " +
                                         (state_ == state::receiving ? "received" : "committed"));
  session_open_ = false;
  session_failed_ = false;
  session_mode_.reset();
  clear_stage();
}

asio::awaitable<void> engine::drain_pending() {
  std::exception_ptr error;
  try {
    co_await deferred_.join();
  } catch (...) {
    error = std::current_exception();
  }
  stats_.finalize();
  if (error) {
    note_failure("processing of an update", error);
    std::rethrow_exception(error);
  }
}

void engine::shutdown() {
  // Deferred processing still reads staging memory that shutdown may free.
  if (deferred_.pending() > 0)
    throw_error(errc::invalid_state, std::string(backend()) + ": shutdown while " +
                                         std::to_string(deferred_.pending()) +
                                         " bucket(s) are still being processed; co_await drain_pending() first");
  // So does a staged commit (its load_weights read the stage).
  if (state_ == state::committing)
    throw_error(errc::invalid_state, std::string(backend()) +
                                         ": shutdown while a staged update session is being "
                                         "committed; let commit_session complete first");
  session_open_ = false;
  session_failed_ = false;
  session_mode_.reset();
  clear_stage();
  if (state_ == state::shut_down || state_ == state::created) {
    state_ = state::shut_down;
    stage_.reset();
    return;
  }
  state_ = state::shut_down;
  do_shutdown();
  stage_target_.reset();
  stage_.reset();
  undo_scratch_.reset();
  undo_scratch_bytes_ = 0;
}

}  // namespace refit::backend
