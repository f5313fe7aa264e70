#include <refit/backend/pipeline.h>

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <cstring>
#include <limits>

#include <asio/bind_executor.hpp>
#include <asio/strand.hpp>

#include <refit/backend/async/offload.h>

namespace refit {

using clock_type = std::chrono::steady_clock;

static double seconds_since(clock_type::time_point t) {
  return std::chrono::duration<double>(clock_type::now() - t).count();
}

// load_weights threw: keep the user's words, add where it happened.
static std::exception_ptr processing_error(std::exception_ptr cause, std::uint64_t bucket,
                                           const std::vector<tensor_view>& views) {
  std::string what;
  try {
    std::rethrow_exception(cause);
  } catch (const error& e) {
    what = e.message();
  } catch (const std::exception& e) {
    what = e.what();
  } catch (...) {
    what = "a non-standard exception";
  }
  std::string where = "bucket " + std::to_string(bucket) + " (";
  for (std::size_t i = 0; i < views.size() && i < 4; ++i) where += (i ? ", '" : "'") + std::string(views[i].name) + "'";
  where += views.size() > 4 ? ", ... " + std::to_string(views.size()) + " tensors)" : ")";
  return std::make_exception_ptr(error(errc::processing_failed, "load_weights failed on " + where + ": " + what));
}

void host_staging::free_deleter::operator()(std::byte* p) const noexcept { std::free(p); }

host_staging::buffer host_staging::allocate(std::uint64_t bytes) {
  constexpr std::uint64_t page = 4096;
  std::uint64_t rounded = (bytes + page - 1) / page * page;
  void* p = std::aligned_alloc(page, rounded == 0 ? page : rounded);
  if (!p) throw_error(errc::io_error, "host staging: cannot allocate " + std::to_string(bytes) + " bytes");
  return buffer(static_cast<std::byte*>(p));
}

host_staging::host_staging(std::size_t count, std::uint64_t bytes) : slot_bytes_(bytes) {
  slots_.reserve(count);
  for (std::size_t i = 0; i < count; ++i) {
    slots_.push_back(allocate(bytes));
    // Fault the pages in now, at init, not during the first update.
    std::memset(slots_.back().get(), 0, static_cast<std::size_t>(bytes));
  }
}

std::span<std::byte> host_staging::slot(std::size_t index) {
  return {slots_.at(index).get(), static_cast<std::size_t>(slot_bytes_)};
}

std::span<std::byte> host_staging::assembly(std::uint64_t bytes) {
  if (bytes > assembly_bytes_) {
    assembly_.reset();  // free first: peak memory is the new size, not old + new
    assembly_bytes_ = 0;
    assembly_ = allocate(bytes);
    // Faulted in now (the pipeline grows it on the processing executor before the
    // update's first byte), not page by page while bytes arrive.
    std::memset(assembly_.get(), 0, static_cast<std::size_t>(bytes));
    assembly_bytes_ = bytes;
  }
  return {assembly_.get(), static_cast<std::size_t>(bytes)};
}

std::uint64_t host_staging::allocated_bytes() const noexcept { return slot_bytes_ * slots_.size() + assembly_bytes_; }

std::function<void()> bucket_transport::decode(const bucket& b, std::span<const std::byte>,
                                               std::vector<decode_target>) {
  throw_error(errc::unsupported, "bucket " + std::to_string(b.index) + " arrived encoded; this transport decodes none");
}

// What in-flight processing needs after receive() returns (the caller's metadata
// and callback may be gone by then).
struct receive_pipeline::update_state {
  update_state(update_metadata meta, load_weights_fn load, asio::strand<asio::any_io_executor> strand,
               clock_type::time_point start, asio::any_io_executor loop)
      : meta(std::move(meta)), load(std::move(load)), strand(std::move(strand)), start(start), loop(loop),
        checks_done(loop), turn(loop) {}
  update_metadata meta;
  load_weights_fn load;
  asio::strand<asio::any_io_executor> strand;
  clock_type::time_point start;
  asio::any_io_executor loop;
  // The first processing step not to be loaded: a failed check's own step, or the
  // one after a failed load (buckets before a failure are loaded as usual). Set on
  // the event loop or the strand, read on both.
  std::atomic<std::uint64_t> failed_from{std::numeric_limits<std::uint64_t>::max()};
  void fail_from(std::uint64_t step) {
    std::uint64_t seen = failed_from.load();
    while (step < seen && !failed_from.compare_exchange_weak(seen, step)) {
    }
  }
  bool skips(std::uint64_t step) const { return step >= failed_from.load(); }
  // Transport checks (event loop): how many are still to run, and the first failure.
  std::size_t checks_left = 0;
  std::exception_ptr check_failure;
  async::event checks_done;
  // Loads are handed to the strand in bucket order, whatever order the checks
  // (which run concurrently) finish in (event loop).
  std::uint64_t spawned = 0;    // processing steps started
  std::uint64_t next_turn = 0;  // the step whose load goes to the strand next
  async::event turn;
};

receive_pipeline::receive_pipeline(asio::any_io_executor executor, asio::any_io_executor processing, wire_params params,
                                   std::unique_ptr<staging_memory> staging)
    : executor_(executor), processing_(processing), params_((params.validate(), params)), staging_(std::move(staging)),
      slots_(executor, params.num_buffers), assembly_(executor, 1) {
  if (!staging_ || staging_->slot_count() != params_.num_buffers)
    throw_error(errc::invalid_argument, "receive_pipeline: staging must have num_buffers slots");
}

void receive_pipeline::process(std::shared_ptr<update_state> state, std::vector<tensor_view> views,
                               std::optional<std::size_t> slot, bool assembly, std::uint64_t bucket_index,
                               bucket_checks checks, async::drain_scope& scope, update_stats& stats) {
  if (checks) ++state->checks_left;
  scope.spawn(
      process_bucket(std::move(state), std::move(views), slot, assembly, bucket_index, std::move(checks), stats));
}

asio::awaitable<void> receive_pipeline::process_bucket(std::shared_ptr<update_state> state,
                                                       std::vector<tensor_view> views, std::optional<std::size_t> slot,
                                                       bool assembly, std::uint64_t bucket_index, bucket_checks checks,
                                                       update_stats& stats) {
  const std::uint64_t step = state->spawned++;
  std::exception_ptr error;
  // 1. The transport's own use of the bytes ending (always awaited, failure or
  //    not: the slot is released below), then its check (a checksum), on the
  //    processing executor, concurrently with other buckets' checks and loads: a
  //    load never waits behind it.
  if (checks) {
    std::exception_ptr check_error;
    try {
      if (checks.settle) co_await checks.settle();
      if (checks.check && !state->skips(step)) co_await async::offload(processing_, [&checks] { checks.check(); });
    } catch (...) {
      check_error = std::current_exception();
      state->fail_from(step);
    }
    if (check_error && !state->check_failure) state->check_failure = check_error;
    if (--state->checks_left == 0) state->checks_done.set();
  }
  // 2. The load, on the strand, in bucket order: each step hands its load over
  //    only after the step before it did.
  while (state->next_turn != step) {
    state->turn.reset();
    co_await state->turn.wait();
  }
  const bool skip = views.empty() || state->skips(step);  // a check-only chunk, or after a failure
  double busy = -1;
  bool loaded = false;
  if (!skip) {
    async::event done(state->loop);
    std::exception_ptr load_error;
    async::offload(
        state->strand,
        [&state, &views, step] {
          if (state->skips(step)) return -1.0;  // a failure reported after this load was handed over
          auto t0 = clock_type::now();
          try {
            state->load(std::span<const tensor_view>(views));
          } catch (...) {
            state->fail_from(step + 1);
            throw;
          }
          return seconds_since(t0);
        },
        asio::bind_executor(state->loop, [&](std::exception_ptr e, double seconds) {
          load_error = e;
          busy = seconds;
          done.set();
        }));
    ++state->next_turn;
    state->turn.set();
    co_await done.wait();
    loaded = true;
    if (load_error) error = processing_error(load_error, bucket_index, views);
  } else {
    ++state->next_turn;
    state->turn.set();
  }
  if (loaded && !error && busy >= 0) {
    stats.process_s += busy;
    stats.tensors += views.size();
  }
  stats.wall_s = std::max(stats.wall_s, seconds_since(state->start));
  if (slot) slots_.release(*slot);
  if (assembly) assembly_.release(0);
  if (error) std::rethrow_exception(error);
}

}  // namespace refit

namespace refit {

namespace {

// Where each tensor's bytes go when its owner offers them directly; nullptr means
// staging. Checked once per update, before any byte moves.
std::vector<std::byte*> direct_destinations(const update_metadata& meta, model_target* target, device dev) {
  std::vector<std::byte*> out(meta.tensors.size(), nullptr);
  if (!target) return out;
  for (std::size_t i = 0; i < meta.tensors.size(); ++i) {
    const auto& spec = meta.tensors[i];
    auto d = target->destination(spec);
    if (!d) continue;
    if (d->nbytes() != spec.nbytes() || !(d->device == dev) || (d->data == nullptr && spec.nbytes() != 0))
      throw_error(errc::invalid_argument, "model target: destination of '" + spec.name + "' is " +
                                              std::to_string(d->nbytes()) + " bytes on " + to_string(d->device) +
                                              ", expected " + std::to_string(spec.nbytes()) + " bytes on " +
                                              to_string(dev));
    out[i] = d->data;
  }
  return out;
}

// The padding of a decoded bucket, for its check (never written).
alignas(64) std::byte zero_padding[wire_params::alignment] = {};

// An encoded bucket's work on the processing executor: decode, then check.
std::function<void()> decode_then_check(std::function<void()> decode, std::function<void()> check) {
  return [decode = std::move(decode), check = std::move(check)] {
    decode();
    if (check) check();
  };
}

// Appends [data, data + n) to a scatter list, merging with the previous range when
// they touch (a staged bucket stays one buffer).
void append(std::vector<asio::mutable_buffer>& list, std::byte* data, std::uint64_t n) {
  if (n == 0) return;
  if (!list.empty()) {
    auto& last = list.back();
    if (static_cast<std::byte*>(last.data()) + last.size() == data) {
      last = asio::mutable_buffer(last.data(), last.size() + static_cast<std::size_t>(n));
      return;
    }
  }
  list.emplace_back(data, static_cast<std::size_t>(n));
}

}  // namespace

asio::awaitable<void> receive_pipeline::receive(const update_metadata& meta, bucket_transport& transport,
                                                load_weights_fn load_weights, async::drain_scope& scope,
                                                update_stats& stats, model_target* target) {
  co_await receive(meta, plan_buckets(meta, params_), transport, std::move(load_weights), scope, stats, target);
}

// One receive()'s state while its buckets arrive (on receive()'s frame).
struct receive_pipeline::receive_call {
  std::shared_ptr<update_state> state;
  const bucket_plan& plan;
  bucket_transport& transport;
  async::drain_scope& scope;
  update_stats& stats;
  model_target* target;
  device dev;
  std::vector<std::byte*> direct;             // direct_destinations()
  std::vector<asio::mutable_buffer> scatter;  // where the current bucket's bytes go
  bool direct_started = false;

  // The target learns when bytes start landing in its memory (a header refused
  // before that leaves the model untouched).
  void before_direct_bytes() {
    if (direct_started || !target) return;
    direct_started = true;
    target->direct_write_begins();
  }
};

asio::awaitable<void> receive_pipeline::receive(const update_metadata& meta, bucket_plan plan,
                                                bucket_transport& transport, load_weights_fn load_weights,
                                                async::drain_scope& scope, update_stats& stats, model_target* target) {
  auto state = std::make_shared<update_state>(meta, std::move(load_weights), asio::make_strand(processing_),
                                              clock_type::now(), executor_);
  const device dev = staging_->device();
  receive_call call{state, plan, transport, scope, stats, target, dev, direct_destinations(state->meta, target, dev)};
  co_await grow_assembly(call);

  std::exception_ptr failure;
  try {
    for (const bucket& b : plan.buckets) {
      call.scatter.clear();
      if (b.split)
        co_await receive_chunk(call, b);
      else
        co_await receive_bucket(call, b);
    }
    // Every byte is here; the update is received once every check has passed.
    if (state->checks_left > 0) {
      state->checks_done.reset();
      co_await state->checks_done.wait();
    }
    if (state->check_failure) std::rethrow_exception(state->check_failure);
  } catch (...) {
    failure = std::current_exception();
  }
  if (failure) {
    try {
      co_await scope.join();  // in-flight processing still uses staging
    } catch (...) {
    }
    // Only a split tensor cut short can still hold the assembly buffer now.
    if (assembly_.available() == 0) assembly_.release(0);
    std::rethrow_exception(failure);
  }
  stats.wall_s = std::max(stats.wall_s, seconds_since(state->start));
}

// The assembly buffer for this update's largest split tensor (one with no direct
// destination) is grown now, on the processing executor: allocating and faulting
// in hundreds of MiB (or a cudaMalloc, which synchronises the device) is not work
// for the event loop. It is taken first, so processing of an earlier update that
// still reads it finishes before it moves.
asio::awaitable<void> receive_pipeline::grow_assembly(const receive_call& call) {
  std::uint64_t largest_split = 0;
  for (const bucket& b : call.plan.buckets) {
    const auto t = call.plan.pieces[b.first_piece].tensor;
    if (b.split && !call.direct[t]) largest_split = std::max(largest_split, call.state->meta.tensors[t].nbytes());
  }
  if (largest_split == 0) co_return;
  co_await assembly_.acquire();
  std::exception_ptr grow_error;
  try {
    co_await async::offload(processing_, [this, largest_split] { staging_->assembly(largest_split); });
  } catch (...) {
    grow_error = std::current_exception();
  }
  assembly_.release(0);
  if (grow_error) std::rethrow_exception(grow_error);
}

// A chunk of a split tensor. Chunks of one large tensor land at their offsets in
// its destination or in the assembly buffer; the tensor is handed over whole after
// its last chunk.
asio::awaitable<void> receive_pipeline::receive_chunk(receive_call& call, const bucket& b) {
  const bucket_piece& first = call.plan.pieces[b.first_piece];
  const auto& spec = call.state->meta.tensors[first.tensor];
  std::byte* base = call.direct[first.tensor];
  const bool assembled = base == nullptr;
  if (assembled) {
    if (first.tensor_offset == 0) co_await assembly_.acquire();
    base = staging_->assembly(spec.nbytes()).data();
  }
  append(call.scatter, base + first.tensor_offset, b.payload_bytes);
  auto t0 = clock_type::now();
  co_await call.transport.begin(b);
  if (auto encoded = call.transport.encoded_bytes(b)) {
    if (assembled)
      throw_error(errc::protocol_error, "bucket " + std::to_string(b.index) + " of '" + spec.name +
                                            "' arrived encoded, but the tensor has no destination to decode into");
    co_await receive_encoded_chunk(call, b, base, *encoded, t0);
    co_return;
  }
  if (!assembled) call.before_direct_bytes();
  co_await call.transport.receive(b, call.scatter);
  call.stats.receive_s += seconds_since(t0);
  call.stats.bytes += b.payload_bytes;
  call.stats.wire_bytes += b.payload_bytes;
  ++call.stats.buckets;
  bucket_checks checks{call.transport.settled(b), call.transport.check(b, call.scatter)};
  if (b.last_chunk)
    process(call.state, {tensor_view(spec, base, call.dev)}, std::nullopt, assembled, b.index, std::move(checks),
            call.scope, call.stats);
  else if (checks)  // an earlier chunk is only checked; the tensor is loaded after its last
    process(call.state, {}, std::nullopt, false, b.index, std::move(checks), call.scope, call.stats);
}

// A delta of a split tensor's chunk (begun, `encoded` bytes announced): into a
// slot, decoded into the tensor's memory at `base`.
asio::awaitable<void> receive_pipeline::receive_encoded_chunk(receive_call& call, const bucket& b, std::byte* base,
                                                              std::uint64_t encoded, clock_type::time_point t0) {
  const bucket_piece& first = call.plan.pieces[b.first_piece];
  const auto& spec = call.state->meta.tensors[first.tensor];
  const std::size_t slot = co_await slots_.acquire();
  const std::span<std::byte> mem = staging_->slot(slot).first(static_cast<std::size_t>(encoded));
  call.before_direct_bytes();
  try {
    const asio::mutable_buffer into(mem.data(), mem.size());
    co_await call.transport.receive(b, std::span<const asio::mutable_buffer>(&into, 1));
  } catch (...) {
    slots_.release(slot);
    throw;
  }
  call.stats.receive_s += seconds_since(t0);
  call.stats.bytes += b.payload_bytes;
  call.stats.wire_bytes += encoded;
  ++call.stats.buckets;
  std::vector<bucket_transport::decode_target> out{
      {first.tensor, first.tensor_offset,
       std::span<std::byte>(base + first.tensor_offset, static_cast<std::size_t>(b.payload_bytes))}};
  auto work = decode_then_check(call.transport.decode(b, mem, std::move(out)), call.transport.check(b, call.scatter));
  std::vector<tensor_view> views;
  if (b.last_chunk) views.emplace_back(spec, base, call.dev);
  process(call.state, std::move(views), slot, false, b.index, {call.transport.settled(b), std::move(work)}, call.scope,
          call.stats);
}

// A packed bucket (whole tensors at aligned offsets), through a staging slot.
// Staged pieces (and all padding) land at their offsets in the slot; direct pieces
// in their owners' memory.
asio::awaitable<void> receive_pipeline::receive_bucket(receive_call& call, const bucket& b) {
  std::size_t slot = co_await slots_.acquire();
  std::byte* mem = staging_->slot(slot).data();
  std::vector<tensor_view> views;
  views.reserve(b.piece_count);
  std::uint64_t at = 0;
  bool direct_piece = false;
  for (const auto& p : call.plan.pieces_of(b)) {
    const auto& spec = call.state->meta.tensors[p.tensor];
    if (std::byte* d = call.direct[p.tensor]) {
      append(call.scatter, mem + at, p.bucket_offset - at);
      append(call.scatter, d, p.bytes);
      direct_piece |= p.bytes != 0;
      views.emplace_back(spec, d, call.dev);
    } else {
      append(call.scatter, mem + at, p.bucket_offset + p.bytes - at);
      views.emplace_back(spec, mem + p.bucket_offset, call.dev);
    }
    at = p.bucket_offset + p.bytes;
    call.stats.bytes += p.bytes;
  }
  auto t0 = clock_type::now();
  std::function<void()> work;
  try {
    co_await call.transport.begin(b);
    if (auto encoded = call.transport.encoded_bytes(b)) {
      work = co_await receive_encoded_bucket(call, b, mem, *encoded);
    } else {
      if (direct_piece) call.before_direct_bytes();
      co_await call.transport.receive(b, call.scatter);
      call.stats.wire_bytes += b.payload_bytes;
      work = call.transport.check(b, call.scatter);
    }
  } catch (...) {
    slots_.release(slot);
    throw;
  }
  call.stats.receive_s += seconds_since(t0);
  ++call.stats.buckets;
  process(call.state, std::move(views), slot, false, b.index, {call.transport.settled(b), std::move(work)}, call.scope,
          call.stats);
}

// A delta of a bucket (begun, `encoded` bytes announced): the encoded bytes into
// the slot at `mem`; returns the work that decodes them on the processing executor
// into each piece's destination and checks the decoded bytes, padding as zeros.
asio::awaitable<std::function<void()>> receive_pipeline::receive_encoded_bucket(receive_call& call, const bucket& b,
                                                                                std::byte* mem, std::uint64_t encoded) {
  std::vector<bucket_transport::decode_target> out;
  std::vector<asio::mutable_buffer> decoded;
  std::uint64_t end = 0;
  for (const auto& p : call.plan.pieces_of(b)) {
    for (std::uint64_t pad = p.bucket_offset - end; pad > 0;) {
      const std::uint64_t n = std::min<std::uint64_t>(pad, sizeof zero_padding);
      decoded.emplace_back(zero_padding, static_cast<std::size_t>(n));
      pad -= n;
    }
    end = p.bucket_offset + p.bytes;
    if (p.bytes == 0) continue;
    std::byte* d = call.direct[p.tensor];
    if (!d)
      throw_error(errc::protocol_error, "bucket " + std::to_string(b.index) + " arrived encoded, but '" +
                                            call.state->meta.tensors[p.tensor].name +
                                            "' has no destination to decode into");
    std::span<std::byte> piece(d + p.tensor_offset, static_cast<std::size_t>(p.bytes));
    out.push_back({p.tensor, p.tensor_offset, piece});
    append(decoded, piece.data(), p.bytes);
  }
  const std::span<std::byte> encoded_mem = std::span<std::byte>(mem, static_cast<std::size_t>(encoded));
  call.before_direct_bytes();
  const asio::mutable_buffer into(encoded_mem.data(), encoded_mem.size());
  co_await call.transport.receive(b, std::span<const asio::mutable_buffer>(&into, 1));
  call.stats.wire_bytes += encoded;
  co_return decode_then_check(call.transport.decode(b, encoded_mem, std::move(out)), call.transport.check(b, decoded));
}

}  // namespace refit
