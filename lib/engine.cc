#include <refit/engine.h>

#include <sys/mman.h>

#include <cstdlib>
#include <cstring>
#include <unordered_map>

#include <asio/co_spawn.hpp>

#include <refit/async/offload.h>

namespace refit {

std::vector<std::pair<std::string, std::uint64_t>> model_target::fingerprint(const std::vector<std::string>&) {
  throw_error(errc::unsupported, "this model target offers no weight fingerprint");
}

// Forwards to the context's model and records that the update being received
// reached it (a direct destination was handed out or load_weights was called).
class weight_transfer_engine::tracking_target final : public model_target {
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

// Host memory for staged commits: every tensor of an update at a 64-byte aligned
// offset, in metadata order. Grown on demand, kept for later updates.
class weight_transfer_engine::stage_area {
 public:
  // Lays out `meta` (sizes checked) and resets what has arrived.
  void prepare(const update_metadata& meta) {
    offsets_.assign(meta.tensors.size(), 0);
    sizes_.assign(meta.tensors.size(), 0);
    arrived_.assign(meta.tensors.size(), 0);
    index_.clear();
    std::uint64_t at = 0;
    for (std::size_t i = 0; i < meta.tensors.size(); ++i) {
      offsets_[i] = at;
      sizes_[i] = meta.tensors[i].nbytes();
      index_.emplace(meta.tensors[i].name, i);  // views into `meta`, alive for the update
      at += (meta.tensors[i].nbytes() + 63) / 64 * 64;
    }
    if (at > capacity_) {
      memory_.reset();  // free first: peak is the new size, not old + new
      capacity_ = 0;
      const std::uint64_t rounded = (at + (2u << 20) - 1) / (2u << 20) * (2u << 20);
      void* p = at == 0 ? nullptr : std::aligned_alloc(2u << 20, rounded);
      if (at != 0 && !p)
        throw_error(errc::io_error, "staged commit: cannot allocate " + std::to_string(at) +
                                        " bytes of host memory for the update (use commit \"in_place\")");
      memory_.reset(static_cast<std::byte*>(p));
      if (p) {
        // Faulted in now (this runs on the processing executor), in huge pages
        // where the kernel allows: not during the transfer, not on the loop.
        (void)::madvise(p, rounded, MADV_HUGEPAGE);
        auto* bytes = static_cast<volatile std::byte*>(p);
        for (std::uint64_t i = 0; i < rounded; i += 4096) bytes[i] = std::byte{0};
      }
      capacity_ = at;
    }
  }
  // Where `spec` is staged: received there directly (no copy into the stage).
  std::optional<tensor_view> destination(const tensor_spec& spec) const {
    auto it = index_.find(spec.name);
    if (it == index_.end() || !memory_ || spec.nbytes() != sizes_[it->second]) return std::nullopt;
    return tensor_view(spec, memory_.get() + offsets_[it->second]);
  }
  // load_weights of the receive phase: copies each tensor into its place.
  void stage(const update_metadata& meta, std::span<const tensor_view> views) {
    for (const auto& v : views) {
      auto it = index_.find(v.name);  // no allocation per tensor
      if (it == index_.end())
        throw_error(errc::protocol_error, "staged commit: tensor '" + std::string(v.name) + "' is not in the update");
      const auto& spec = meta.tensors[it->second];
      if (v.nbytes() != spec.nbytes())
        throw_error(errc::protocol_error, "staged commit: tensor '" + spec.name + "' arrived with " +
                                              std::to_string(v.nbytes()) + " bytes, expected " +
                                              std::to_string(spec.nbytes()));
      if (!(v.device == device::cpu()))
        throw_error(errc::unsupported, "staged commit: tensor '" + spec.name + "' arrived on " +
                                           to_string(v.device) +
                                           "; this engine stages on its device, use commit \"in_place\"");
      std::byte* at = memory_.get() + offsets_[it->second];
      if (spec.nbytes() != 0 && v.data != at) std::memcpy(at, v.data, spec.nbytes());  // not received in place
      arrived_[it->second] = 1;
    }
  }
  // Views of the whole update, once every tensor has arrived.
  std::vector<tensor_view> views(const update_metadata& meta) const {
    std::vector<tensor_view> out;
    out.reserve(meta.tensors.size());
    for (std::size_t i = 0; i < meta.tensors.size(); ++i) {
      if (!arrived_[i])
        throw_error(errc::protocol_error, "staged commit: tensor '" + meta.tensors[i].name +
                                              "' never arrived; the update is not committed");
      out.emplace_back(meta.tensors[i], memory_.get() + offsets_[i]);
    }
    return out;
  }
  std::uint64_t capacity() const noexcept { return capacity_; }

 private:
  struct free_deleter {
    void operator()(std::byte* p) const noexcept { std::free(p); }
  };
  std::unique_ptr<std::byte[], free_deleter> memory_;
  std::uint64_t capacity_ = 0;
  std::vector<std::uint64_t> offsets_, sizes_;
  std::vector<char> arrived_;
  std::unordered_map<std::string_view, std::size_t> index_;
};

// A staged update's receive target: the stage offers each tensor's place in it, so
// the engine receives there directly; the model is not reached.
class weight_transfer_engine::stage_target final : public model_target {
 public:
  explicit stage_target(const stage_area& stage) : stage_(stage) {}
  void load_weights(std::span<const tensor_view>) override {
    throw_error(errc::invalid_state, "staged commit: the stage is not loaded through its target");
  }
  std::optional<tensor_view> destination(const tensor_spec& spec) override { return stage_.destination(spec); }

 private:
  const stage_area& stage_;
};

static std::string message_of(std::exception_ptr e) {
  try {
    std::rethrow_exception(e);
  } catch (const error& x) {
    return std::string(errc_name(x.kind())) + ": " + x.message();
  } catch (const std::exception& x) {
    return x.what();
  } catch (...) {
    return "a non-standard exception";
  }
}

namespace {
// Runs before any member uses the executor.
engine_context checked(engine_context context) {
  if (!context.executor) throw_error(errc::invalid_argument, "engine_context: an executor is required");
  return context;
}
}  // namespace

weight_transfer_engine::weight_transfer_engine(weight_transfer_config config,
                                               engine_context context)
    : config_(std::move(config)), context_(checked(std::move(context))), deferred_(context_.executor) {}

weight_transfer_engine::~weight_transfer_engine() = default;

void weight_transfer_engine::mark_weights_dirty(std::string reason) {
  if (reason.empty()) reason = "marked dirty";
  dirty_reason_ = std::move(reason);
}

std::uint64_t weight_transfer_engine::staged_bytes() const noexcept { return stage_ ? stage_->capacity() : 0; }

model_target* weight_transfer_engine::receive_target() noexcept {
  if (mode_ == commit_mode::staged) return stage_target_.get();
  if (!context_.model) return nullptr;
  if (!tracker_) tracker_ = std::make_unique<tracking_target>(*context_.model, touched_);
  return tracker_.get();
}

void weight_transfer_engine::note_failure(const std::string& what, std::exception_ptr error) {
  if (touched_) mark_weights_dirty(what + " failed after it had started changing the weights (" +
                                   std::string(to_string(mode_)) + "): " + message_of(error));
}

asio::any_io_executor weight_transfer_engine::processing_executor() {
  if (context_.processing_executor) return context_.processing_executor;
  if (!own_pool_) own_pool_ = std::make_unique<asio::thread_pool>(config_.processing_threads);
  return own_pool_->get_executor();
}

asio::awaitable<void> weight_transfer_engine::init_transfer_engine(const init_info& info) {
  const std::string name(backend());
  if (state_ == state::initializing || state_ == state::receiving)
    throw_error(errc::invalid_state, name + ": init_transfer_engine while " +
                                         (state_ == state::receiving ? "an update is being received"
                                                                     : "another init is running"));
  if (reading_ > 0)
    throw_error(errc::invalid_state, name + ": init_transfer_engine while an update_info is being read "
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

asio::awaitable<std::unique_ptr<update_info>> weight_transfer_engine::read_update_info(const json& j) {
  ++reading_;
  struct done {
    int& n;
    ~done() { --n; }
  } guard{reading_};
  const json* p = &j;
  const weight_transfer_engine* self = this;
  co_return co_await async::offload(processing_executor(), [self, p] { return self->parse_update_info(*p); });
}

asio::awaitable<void> weight_transfer_engine::receive_weights(const update_info& info,
                                                              load_weights_fn load_weights) {
  const std::string name(backend());
  switch (state_) {
    case state::ready: break;
    case state::receiving:
      throw_error(errc::invalid_state, name + ": receive_weights while another update is being received");
    case state::shut_down:
      throw_error(errc::invalid_state, name + ": receive_weights after shutdown (call init_transfer_engine again)");
    default:
      throw_error(errc::invalid_state, name + ": receive_weights before init_transfer_engine");
  }
  if (!load_weights) throw_error(errc::invalid_argument, name + ": load_weights is empty");
  if (info.commit.value_or(config_.commit) == commit_mode::staged) {
    if (const std::string why = staged_commit_refusal(); !why.empty()) {
      const std::string message = name + ": staged commits are not supported: " + why +
                                  "; use \"commit\": \"in_place\" (a failed update then marks the weights dirty)";
      refuse_update(errc::unsupported, message);
      throw_error(errc::unsupported, message);
    }
  }
  // Deferred work of an earlier update must not overlap this one's staging slots.
  if (deferred_.pending() > 0)
    throw_error(errc::invalid_state, name + ": receive_weights while the previous update's "
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
  mode_ = info.commit.value_or(config_.commit);
  touched_ = false;
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
  if (state_ == state::receiving) state_ = state::ready;
  if (failure) {
    note_failure("an update", failure);
    std::rethrow_exception(failure);
  }
  if (!defers_processing()) co_await drain_pending();
}

asio::awaitable<void> weight_transfer_engine::receive_staged(const update_info& info, load_weights_fn load_weights) {
  if (!stage_) stage_ = std::make_unique<stage_area>();
  const auto start = std::chrono::steady_clock::now();
  auto finish_stats = [this, start] {
    stats_.wall_s = std::max(stats_.wall_s,
                             std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
    stats_.finalize();
  };
  std::exception_ptr failure;
  try {
    // Allocating and faulting in a model-sized stage is not work for the loop.
    stage_area* stage = stage_.get();
    const update_metadata* meta_for_prepare = &info.metadata;
    co_await async::offload(processing_executor(), [stage, meta_for_prepare] { stage->prepare(*meta_for_prepare); });
    if (!stage_target_) stage_target_ = std::make_unique<stage_target>(*stage_);
    const update_metadata* meta = &info.metadata;
    // Phase 1: every tensor into the stage; the model is not reached.
    co_await do_receive(info, [stage, meta](std::span<const tensor_view> w) { stage->stage(*meta, w); });
    co_await deferred_.join();
  } catch (...) {
    failure = std::current_exception();
  }
  if (failure) {
    // Nothing of this update may still use the stage (engines join their
    // in-flight processing before reporting a transport error; this is a no-op then).
    try {
      co_await deferred_.join();
    } catch (...) {
    }
    if (state_ == state::receiving) state_ = state::ready;
    finish_stats();
    std::rethrow_exception(failure);
  }
  // Phase 2: the commit. Everything arrived and was verified; load_weights now
  // sees the whole update, in batches, on the processing executor.
  std::vector<tensor_view> views;
  try {
    views = stage_->views(info.metadata);
    touched_ = true;
    const auto t0 = std::chrono::steady_clock::now();
    constexpr std::uint64_t batch_bytes = 64ull << 20;
    std::size_t first = 0;
    while (first < views.size()) {
      std::size_t last = first;
      std::uint64_t bytes = 0;
      while (last < views.size() && (last == first || bytes + views[last].nbytes() <= batch_bytes))
        bytes += views[last++].nbytes();
      std::span<const tensor_view> batch(views.data() + first, last - first);
      co_await async::offload(processing_executor(), [&load_weights, batch] { load_weights(batch); });
      first = last;
    }
    stats_.process_s += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  } catch (...) {
    failure = std::current_exception();
  }
  if (state_ == state::receiving) state_ = state::ready;
  finish_stats();
  if (failure) {
    note_failure("the commit of a staged update", failure);
    std::rethrow_exception(failure);
  }
}

asio::awaitable<void> weight_transfer_engine::drain_pending() {
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

void weight_transfer_engine::shutdown() {
  // Deferred processing still reads staging memory that shutdown may free.
  if (deferred_.pending() > 0)
    throw_error(errc::invalid_state, std::string(backend()) + ": shutdown while " +
                                         std::to_string(deferred_.pending()) +
                                         " bucket(s) are still being processed; co_await drain_pending() first");
  if (state_ == state::shut_down || state_ == state::created) {
    state_ = state::shut_down;
    return;
  }
  state_ = state::shut_down;
  do_shutdown();
  stage_target_.reset();
  stage_.reset();
}

}  // namespace refit
