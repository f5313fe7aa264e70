// Sharded TCP: the worker side (connects to every trainer rank, receives each
// pair's frames straight into its tensors) and one trainer rank's sender.
#include <refit/engines/tcp/sharded.h>

#include <algorithm>
#include <cstring>
#include <thread>

#include <xxhash.h>
#include <asio/co_spawn.hpp>
#include <asio/detached.hpp>
#include <asio/use_awaitable.hpp>

#include <refit/backend/async/all_of.h>
#include <refit/backend/async/offload.h>
#include <refit/backend/checksum.h>
#include <refit/backend/infos.h>
#include <refit/backend/links/links.h>
#include <refit/backend/links/status_io.h>
#include <refit/backend/links/wire.h>
#include <refit/backend/net.h>
#include <refit/backend/shard_io.h>
#include <refit/internal/hex.h>

namespace refit::tcp {

namespace wire = links::wire;

namespace {

using clock_type = std::chrono::steady_clock;

double since(clock_type::time_point t) { return std::chrono::duration<double>(clock_type::now() - t).count(); }

// The digest a pair's header carries: the plan's, tied to the pair, so a stream
// that reaches the wrong worker (or from the wrong rank) is refused too.
std::uint64_t pair_digest(std::uint64_t plan_digest, int rank, int worker) {
  const std::uint64_t words[3] = {plan_digest, static_cast<std::uint64_t>(rank), static_cast<std::uint64_t>(worker)};
  return XXH3_64bits(words, sizeof words);
}

std::vector<asio::mutable_buffer> mutable_buffers(const stream_frame& f) {
  std::vector<asio::mutable_buffer> out;
  out.reserve(f.runs.size());
  for (const auto& r : f.runs) out.emplace_back(r.data, r.bytes);
  return out;
}

void close_socket(asio::ip::tcp::socket& s) noexcept {
  std::error_code ignored;
  s.shutdown(asio::ip::tcp::socket::shutdown_both, ignored);
  s.close(ignored);
}

}  // namespace

// ---------------------------------------------------------------- layouts

std::shared_ptr<const sharded_layouts> layout_cache::get(const update_metadata& global, const json& spec,
                                                         const std::string& context) {
  const std::string text = spec.dump();
  const std::uint64_t key = metadata_digest(global) ^ XXH3_64bits(text.data(), text.size());
  {
    std::lock_guard lock(mutex_);
    if (last_ && key == key_) return last_;
  }
  if (!spec.is_object()) throw_error(errc::invalid_argument, context + ": the layout must be an object");
  auto out = std::make_shared<sharded_layouts>();
  out->global = global;
  json_reader r(spec, context);
  {
    auto source = r.object("source");
    out->source = read_source_layout(source, global);
    source.finish();
  }
  {
    auto dest = r.object("destination");
    out->workers = read_dest_layouts(dest, global);
    dest.finish();
  }
  r.finish();
  try {
    out->plan = std::make_shared<const transfer_plan>(plan_transfer(out->source, out->workers));
  } catch (const error& e) {
    throw error(e.code(), context + ": " + e.message());
  }
  std::lock_guard lock(mutex_);
  key_ = key;
  last_ = out;
  return out;
}

sharded_init_info sharded_init_info::read(json_reader& r) {
  sharded_init_info info;
  const json trainers = r.required<json>("trainers");
  const std::string path = r.member_path("trainers");
  if (!trainers.is_array() || trainers.empty()) r.fail("member '" + path + "' must be a non-empty array");
  for (std::size_t i = 0; i < trainers.size(); ++i) {
    json_reader t(trainers[i], r.context(), path + "[" + std::to_string(i) + "]");
    endpoint e;
    e.address = t.required<std::string>("address");
    e.port = t.required<std::uint16_t>("port");
    t.finish();
    if (e.port == 0) r.fail("member '" + path + "[" + std::to_string(i) + "].port' must not be 0");
    info.trainers.push_back(std::move(e));
  }
  info.workers = r.required<int>("workers");
  if (info.workers < 1) r.fail("member '" + r.member_path("workers") + "' must be at least 1");
  info.rank_offset = r.optional<int>("rank_offset", 1);
  info.wire = wire_params::read(r);
  if (auto ms = r.maybe<std::int64_t>("timeout_ms")) {
    if (*ms < 1) r.fail("member '" + r.member_path("timeout_ms") + "' must be positive");
    info.timeout = std::chrono::milliseconds(*ms);
  }
  return info;
}

// ---------------------------------------------------------------- worker

sharded_engine::sharded_engine(const weight_transfer_config& config, const engine_context& context)
    : engine(config, context, capabilities_of()) {}

sharded_engine::~sharded_engine() { do_shutdown(); }

std::unique_ptr<refit::init_info> sharded_engine::parse_init_info(const json& j) const {
  json_reader r(j, "tcp_sharded init_info");
  auto info = std::make_unique<sharded_init_info>(sharded_init_info::read(r));
  r.finish();
  return info;
}

std::unique_ptr<refit::update_info> sharded_engine::parse_update_info(const json& j) const {
  const std::string context = "tcp_sharded update_info";
  json_reader r(j, context);
  auto info = std::make_unique<sharded_update_info>();
  const update_metadata global = read_update_metadata(r);
  info->commit = read_commit_mode(r);
  const json spec = r.required<json>("layout");
  r.finish();
  if (worker_ < 0)
    throw_error(errc::invalid_state, context +
                                         ": parsed before init_transfer_engine (the worker's number among "
                                         "the destinations comes from its init_info)");
  info->layouts = layouts_.get(global, spec, context + ": member 'layout'");
  const auto& l = *info->layouts;
  if (static_cast<int>(l.workers.size()) != workers_)
    throw_error(errc::invalid_argument, context + ": the layout has " + std::to_string(l.workers.size()) +
                                            " destinations, init_info said " + std::to_string(workers_) + " workers");
  if (l.source.ranks() != trainers_)
    throw_error(errc::invalid_argument, context + ": the layout's mesh has " + std::to_string(l.source.ranks()) +
                                            " trainer ranks, init_info listed " + std::to_string(trainers_));
  info->metadata = l.workers[worker_].metadata();
  return info;
}

asio::awaitable<void> sharded_engine::do_init(const refit::init_info& base) {
  const auto& info = downcast<sharded_init_info>(base, "init_info");
  do_shutdown();
  timeout_ = info.timeout.value_or(config().timeout);
  wire_ = info.wire;
  workers_ = info.workers;
  trainers_ = static_cast<int>(info.trainers.size());
  const int number = info.rank_offset - 1 + context().ranks.tp_rank;
  if (number < 0 || number >= info.workers)
    throw_error(errc::invalid_argument, "tcp_sharded: rank_offset " + std::to_string(info.rank_offset) +
                                            " and tp_rank " + std::to_string(context().ranks.tp_rank) +
                                            " make worker " + std::to_string(number) + ", not below workers " +
                                            std::to_string(info.workers));
  worker_ = number;
  std::vector<socket_ptr> sockets(info.trainers.size());
  std::vector<asio::awaitable<void>> joins;
  for (std::size_t r = 0; r < info.trainers.size(); ++r)
    joins.push_back([](socket_ptr* out, sharded_init_info::endpoint e, int rank, wire_params wire, std::string secret,
                       std::chrono::milliseconds timeout, std::string who,
                       std::size_t buffers) -> asio::awaitable<void> {
      auto j = co_await links::join(e.address, e.port, rank, wire, std::move(secret), timeout, who);
      *out = std::make_shared<asio::ip::tcp::socket>(std::move(j.socket));
      net::set_buffers(**out, buffers);
    }(&sockets[r], info.trainers[r], worker_ + 1, wire_, config().auth_secret, timeout_,
                                            who() + ": trainer rank " + std::to_string(r),
                                            config().socket_buffer_bytes));
  try {
    co_await async::all_of(std::move(joins));
  } catch (...) {
    for (auto& s : sockets)
      if (s) close_socket(*s);
    throw;
  }
  sockets_ = std::move(sockets);
  last_seq_.assign(sockets_.size(), 0);
}

asio::awaitable<void> sharded_engine::do_receive(const refit::update_info& base, load_weights_fn load_weights) {
  const auto& info = downcast<sharded_update_info>(base, "update_info");
  if (sockets_.empty())
    throw_error(errc::invalid_state, who() +
                                         ": the connections to the trainer ranks were closed by an earlier "
                                         "failure; call init_transfer_engine again");
  const auto start = clock_type::now();
  auto layouts = info.layouts;
  const auto& plan = *layouts->plan;
  const auto& dest = layouts->workers.at(worker_);
  if (plan.ranks != static_cast<int>(sockets_.size()))
    throw_error(errc::invalid_argument, who() + ": the layout's mesh has " + std::to_string(plan.ranks) +
                                            " trainer ranks, this worker connected to " +
                                            std::to_string(sockets_.size()));
  // Where each tensor lands: the model's own memory where it offers host memory,
  // else the engine's fallback area (load_weights then copies from it).
  model_target* target = receive_target();
  std::vector<std::byte*> bases(dest.tensors.size(), nullptr);
  std::vector<std::uint64_t> fallback_at(dest.tensors.size(), ~0ull);
  std::uint64_t fallback_bytes = 0;
  bool direct = false;
  for (std::size_t i = 0; i < dest.tensors.size(); ++i) {
    // Thousands of lookups in the model: in stretches, the loop is shared.
    if (i % 512 == 511) co_await async::yield_now();
    const auto& spec = dest.tensors[i].spec;
    std::optional<tensor_view> d = target ? target->destination(spec) : std::nullopt;
    if (d && d->device.is_cpu() && d->nbytes() == spec.nbytes()) {
      bases[i] = d->data;
      direct = true;
    } else {
      fallback_at[i] = fallback_bytes;
      fallback_bytes += (spec.nbytes() + 63) / 64 * 64;
    }
  }
  if (fallback_.size() < fallback_bytes) {
    // Allocated and faulted in on the processing executor, not the event loop.
    auto* area = &fallback_;
    co_await async::offload(processing_executor(), [area, fallback_bytes] { area->resize(fallback_bytes); });
  }
  for (std::size_t i = 0; i < dest.tensors.size(); ++i)
    if (fallback_at[i] != ~0ull) bases[i] = fallback_.data() + fallback_at[i];
  // Padding (bytes no piece covers) is never sent. In memory that is not the
  // model's own (the staged commit's stage, the fallback area) it would reach the
  // model as whatever was there before: zero it, as vLLM's padded rows are.
  {
    const bool staged = info.commit.value_or(config().commit) == commit_mode::staged;
    std::vector<std::pair<std::byte*, std::uint64_t>> zero;
    for (std::size_t i = 0; i < dest.tensors.size(); ++i) {
      if (!staged && fallback_at[i] == ~0ull) continue;  // the model's memory: left as it is
      const auto& t = dest.tensors[i];
      std::uint64_t covered = 0;
      for (const auto& p : t.pieces) covered += static_cast<std::uint64_t>(p.from.numel()) * element_size(t.spec.dtype);
      if (covered < t.spec.nbytes()) zero.emplace_back(bases[i], t.spec.nbytes());
    }
    if (!zero.empty()) {
      auto* z = &zero;
      co_await async::offload(processing_executor(), [z] {
        for (auto [p, n] : *z) std::memset(p, 0, n);
      });
    }
  }
  // Told once the first pair's header is accepted: from then on bytes land in it.
  direct_target_ = direct ? target : nullptr;

  // Every pair at once; the first failure cancels the others' reads, so no stream
  // waits out its deadline for bytes that will not come.
  struct shared {
    std::vector<socket_ptr> sockets;
    bool failed = false;
  };
  auto s = std::make_shared<shared>();
  s->sockets = sockets_;
  std::vector<asio::awaitable<void>> pairs;
  for (std::size_t r = 0; r < sockets_.size(); ++r)
    pairs.push_back([](sharded_engine* self, std::shared_ptr<shared> s, int r, std::shared_ptr<const sharded_layouts> l,
                       std::vector<std::byte*> bases) -> asio::awaitable<void> {
      std::exception_ptr failure;
      try {
        co_await self->receive_pair(s->sockets[r], r, std::move(l), std::move(bases));
      } catch (...) {
        failure = std::current_exception();
      }
      if (failure) {
        if (!s->failed) {
          s->failed = true;
          for (std::size_t k = 0; k < s->sockets.size(); ++k) {
            std::error_code ignored;
            if (static_cast<int>(k) != r) s->sockets[k]->cancel(ignored);
          }
        }
        std::rethrow_exception(failure);
      }
    }(this, s, static_cast<int>(r), layouts, bases));
  std::exception_ptr failure;
  try {
    co_await async::all_of(std::move(pairs));
  } catch (...) {
    failure = std::current_exception();
  }
  if (failure) {
    // Every trainer rank learns why (not just a reset), then the connections close.
    for (std::size_t r = 0; r < s->sockets.size(); ++r) {
      try {
        co_await links::tell_failure(*s->sockets[r], failure, last_seq_[r]);
      } catch (...) {
      }
    }
    do_shutdown();
    std::rethrow_exception(failure);
  }
  auto& stats = mutable_stats();
  stats.bytes = plan.ingress[worker_];
  stats.wire_bytes = stats.bytes;
  stats.tensors = dest.tensors.size();
  stats.receive_s = since(start);
  // The update, whole: views of the model's memory (received in place) or of the
  // fallback area, loaded on the processing executor.
  std::vector<tensor_view> views;
  views.reserve(dest.tensors.size());
  for (std::size_t i = 0; i < dest.tensors.size(); ++i) views.emplace_back(dest.tensors[i].spec, bases[i]);
  const auto loading = clock_type::now();
  auto* v = &views;
  auto* load = &load_weights;
  co_await async::offload(processing_executor(), [v, load] { (*load)(*v); });
  stats.process_s = since(loading);
  stats.wall_s = since(start);
  stats.finalize();
}

asio::awaitable<void> sharded_engine::receive_pair(socket_ptr socket, int rank,
                                                   std::shared_ptr<const sharded_layouts> layouts,
                                                   std::vector<std::byte*> bases) {
  const std::string me = who() + ": trainer rank " + std::to_string(rank);
  const auto& plan = *layouts->plan;
  const auto& pair = plan.pair(rank, worker_);
  const auto& dest = layouts->workers[worker_];
  // The pair's runs over this worker's tensors, made off the loop (a row-parallel
  // shard is one run per row).
  std::vector<stream_frame> frames;
  {
    auto* f = &frames;
    auto* d = &dest;
    auto* b = &bases;
    auto* items = &pair.items;
    const std::uint64_t frame_bytes = wire_.buffer_bytes;
    co_await async::offload(processing_executor(), [f, d, b, items, frame_bytes] {
      const auto runs = pair_runs(*items, item_side::destination, [&](const transfer_item& it) {
        const auto& spec = d->tensors[it.dest].spec;
        return tensor_place{(*b)[it.dest], spec.shape, element_size(spec.dtype)};
      });
      *f = cut_frames(runs, frame_bytes);
    });
  }
  // The pair's header: its plan digest first (a layout that differs between the
  // sides is named as such), then its size; a refusal is sent back before any byte.
  {
    std::array<std::byte, sizeof(wire::update)> raw;
    co_await net::read_exact(*socket, asio::buffer(raw), timeout_, me + ": waiting for the update header");
    const auto u = wire::decode<wire::update>(raw);
    if (auto bad = wire::check_update_magic(u); !bad.empty()) throw_error(errc::protocol_error, me + ": " + bad);
    std::string refusal;
    if (u.seq <= last_seq_[rank])
      refusal = "update sequence " + std::to_string(u.seq) + " is not after " + std::to_string(last_seq_[rank]);
    else if (u.digest != pair_digest(plan.digest, rank, worker_))
      refusal =
          "the transfer plans differ: the trainer rank planned another layout or other metadata than this "
          "worker's update_info (plan digest " +
          to_hex(plan.digest) + " here)";
    else if (u.tensors != pair.items.size() || u.buckets != frames.size() || u.payload_bytes != pair.bytes)
      refusal = "the pair's stream differs: the trainer sends " + std::to_string(u.tensors) + " boxes, " +
                std::to_string(u.payload_bytes) + " bytes in " + std::to_string(u.buckets) +
                " frames; this worker expects " + std::to_string(pair.items.size()) + ", " +
                std::to_string(pair.bytes) + " in " + std::to_string(frames.size()) +
                " (are both on the same refit version?)";
    if (!refusal.empty()) {
      co_await links::send_status(*socket, static_cast<std::uint32_t>(errc::protocol_error), u.seq, refusal, timeout_,
                                  me + ": refusing the update");
      throw_error(errc::protocol_error, me + ": " + refusal);
    }
    co_await links::send_status(*socket, 0, u.seq, {}, timeout_, me + ": accepting the update");
    last_seq_[rank] = u.seq;
  }
  if (auto* t = std::exchange(direct_target_, nullptr)) t->direct_write_begins();
  for (std::size_t k = 0; k < frames.size(); ++k) {
    const std::string what = me + ": frame " + std::to_string(k);
    std::array<std::byte, sizeof(wire::bucket_header)> raw;
    co_await net::read_exact(*socket, asio::buffer(raw), timeout_, what + " header");
    const auto h = wire::decode<wire::bucket_header>(raw);
    if (auto bad = wire::check_bucket_header(h, k, frames[k].bytes, wire_.checksums); !bad.empty())
      throw_error(errc::protocol_error, what + ": " + bad);
    auto buffers = mutable_buffers(frames[k]);
    // At most a loop's budget of bytes per system call: the loop is shared.
    co_await net::read_exact(*socket, buffers, timeout_, what, net::loop_bytes_per_call);
    if (wire_.checksums) {
      auto* b = &buffers;
      const std::uint64_t got = co_await async::offload(
          processing_executor(), [b] { return checksum(std::span<const asio::mutable_buffer>(*b)); });
      if (got != h.checksum)
        throw_error(errc::integrity_error,
                    what + ": payload checksum " + to_hex(got) + " differs from the trainer's " + to_hex(h.checksum));
    }
  }
  co_await links::confirm_update(*socket, last_seq_[rank], timeout_, me);
}

void sharded_engine::do_refuse_update(errc kind, const std::string& reason) noexcept {
  // Every trainer rank is told at once, so its send fails now naming the reason.
  try {
    for (std::size_t r = 0; r < sockets_.size(); ++r)
      asio::co_spawn(context().executor,
                     links::refuse_update(sockets_[r], last_seq_[r] + 1, kind, reason,
                                          std::min(timeout_, std::chrono::milliseconds(2000)), who()),
                     asio::detached);
  } catch (...) {
  }
  sockets_.clear();
}

void sharded_engine::do_shutdown() {
  for (auto& s : sockets_)
    if (s) close_socket(*s);
  sockets_.clear();
}

// ---------------------------------------------------------------- trainer rank

sharded_sender::sharded_sender(const weight_transfer_config& config, const trainer_context& context)
    : config_(config), context_(context) {
  if (!context_.executor) throw_error(errc::invalid_argument, "trainer_context: an executor is required");
}

sharded_sender::~sharded_sender() {
  shutdown();
  if (io_pool_) io_pool_->join();
}

json sharded_sender::prepare(const json& trainer_args) {
  json_reader r(trainer_args, "tcp_sharded trainer_args");
  const int rank = r.required<int>("rank");
  const json trainers = r.required<json>("trainers");
  const int workers = r.required<int>("workers");
  json layout = r.required<json>("layout");
  const wire_params wire = wire_params::read(r);
  const auto timeout = std::chrono::milliseconds(r.optional<std::int64_t>("timeout_ms", config_.timeout.count()));
  if (!trainers.is_array() || trainers.empty()) r.fail("member 'trainers' must be a non-empty array");
  if (rank < 0 || rank >= static_cast<int>(trainers.size()))
    r.fail("member 'rank' is " + std::to_string(rank) + ", not one of the " + std::to_string(trainers.size()) +
           " trainers");
  if (workers < 1) r.fail("member 'workers' must be at least 1");
  if (!layout.is_object()) r.fail("member 'layout' must be an object");
  if (timeout.count() < 1) r.fail("member 'timeout_ms' must be positive");
  std::vector<sharded_init_info::endpoint> endpoints;
  for (std::size_t i = 0; i < trainers.size(); ++i) {
    json_reader t(trainers[i], r.context(), "trainers[" + std::to_string(i) + "]");
    endpoints.push_back({t.required<std::string>("address"), t.required<std::uint16_t>("port")});
    t.finish();
  }
  r.finish();
  shutdown();
  rank_ = rank;
  ranks_ = static_cast<int>(endpoints.size());
  workers_ = workers;
  layout_spec_ = std::move(layout);
  wire_ = wire;
  timeout_ = timeout;
  if (!io_pool_) {
    const unsigned cores = std::max(1u, std::thread::hardware_concurrency());
    io_pool_ = std::make_unique<asio::thread_pool>(std::min<unsigned>(cores, static_cast<unsigned>(workers_)));
  }
  acceptor_ = std::make_unique<asio::ip::tcp::acceptor>(
      net::listen(context_.executor, endpoints[rank].address, endpoints[rank].port));
  endpoints[rank].port = acceptor_->local_endpoint().port();
  json list = json::array();
  for (const auto& e : endpoints) list.push_back({{"address", e.address}, {"port", e.port}});
  json info = {
      {"trainers", std::move(list)}, {"workers", workers_}, {"rank_offset", 1}, {"timeout_ms", timeout_.count()}};
  wire_.write(info);
  init_info_ = info;
  return info;
}

asio::awaitable<void> sharded_sender::connect_workers() {
  if (!acceptor_ || !acceptor_->is_open())
    throw_error(errc::invalid_state, "tcp_sharded trainer: connect_workers before prepare");
  fail_all();
  const std::string who = "tcp_sharded trainer rank " + std::to_string(rank_);
  auto members = co_await links::accept_workers(*acceptor_, context_.executor, config_.auth_secret, timeout_, wire_,
                                                workers_ + 1, who);
  peers_.clear();
  for (auto& m : members) {
    auto strand = asio::make_strand(io_pool_->get_executor());
    const auto protocol = m.socket->local_endpoint().protocol();
    asio::ip::tcp::socket moved(strand);
    moved.assign(protocol, m.socket->release());
    net::set_buffers(moved, config_.socket_buffer_bytes);
    peers_.push_back(std::make_shared<peer>(peer{m.rank - 1, strand, std::move(moved)}));
  }
  std::sort(peers_.begin(), peers_.end(), [](const auto& a, const auto& b) { return a->worker < b->worker; });
  seq_ = 0;
}

void sharded_sender::fail_all() {
  for (auto& p : peers_) asio::post(p->strand, [p] { close_socket(p->socket); });
  peers_.clear();
}

void sharded_sender::shutdown() {
  fail_all();
  if (acceptor_) {
    std::error_code ignored;
    acceptor_->close(ignored);
  }
}

asio::awaitable<void> sharded_sender::send_weights(const update_metadata& declared, tensor_source& source) {
  const std::string who = "tcp_sharded trainer rank " + std::to_string(rank_);
  if (peers_.empty())
    throw_error(errc::invalid_state, who + ": send_weights before init (or after a failed update; call init again)");
  declared.validate();
  const auto start = clock_type::now();
  stats_ = {};
  plan_s_ = 0;
  // Planned once per layout; a cache hit costs a digest of the spec and metadata.
  const auto plan_start = clock_type::now();
  std::shared_ptr<const sharded_layouts> layouts;
  {
    auto* cache = &layouts_;
    auto* meta = &declared;
    auto* spec = &layout_spec_;
    auto* out = &layouts;
    const std::string context = who + ": layout";
    auto* ctx = &context;
    co_await async::offload(io_pool_->get_executor(),
                            [cache, meta, spec, out, ctx] { *out = cache->get(*meta, *spec, *ctx); });
  }
  plan_s_ = since(plan_start);
  const auto& plan = *layouts->plan;
  if (plan.ranks != ranks_ || plan.workers != workers_)
    throw_error(errc::invalid_argument, who + ": the layout plans " + std::to_string(plan.ranks) + " ranks and " +
                                            std::to_string(plan.workers) + " workers, trainer_args said " +
                                            std::to_string(ranks_) + " and " + std::to_string(workers_));
  // This rank's shards, each checked against what its placement gives it, before
  // any byte leaves.
  const update_metadata local = layouts->source.local_metadata(rank_);
  std::vector<std::byte*> bases(local.tensors.size(), nullptr);
  for (std::size_t i = 0; i < local.tensors.size(); ++i) {
    auto v = source.next();
    if (!v)
      throw_error(errc::invalid_argument, who + ": the tensors ended after " + std::to_string(i) + " of the " +
                                              std::to_string(local.tensors.size()) + " declared");
    check_matches_declared(local.tensors[i], *v, i);
    if (!v->device.is_cpu() && v->nbytes() > 0)
      throw_error(errc::unsupported, who + ": tensor '" + local.tensors[i].name + "' is on " + to_string(v->device) +
                                         "; tcp_sharded sends host memory");
    bases[i] = v->data;
  }
  if (source.next())
    throw_error(errc::invalid_argument,
                who + ": the tensors go on past the " + std::to_string(local.tensors.size()) + " declared");
  const std::uint64_t seq = ++seq_;
  sent_.assign(workers_, 0);
  std::vector<asio::awaitable<void>> streams;
  for (int w = 0; w < workers_; ++w) {
    const auto& pair = plan.pair(rank_, w);
    auto runs = pair_runs(pair.items, item_side::source, [&](const transfer_item& it) {
      const auto& spec = local.tensors[it.source];
      return tensor_place{bases[it.source], spec.shape, element_size(spec.dtype)};
    });
    auto frames = std::make_shared<const std::vector<stream_frame>>(cut_frames(runs, wire_.buffer_bytes));
    const auto header =
        links::update_header(seq, pair.items.size(), pair_digest(plan.digest, rank_, w), frames->size(), pair.bytes);
    sent_[w] = pair.bytes;
    auto p = peers_.at(w);
    streams.push_back(asio::co_spawn(p->strand, stream_to(p, header, std::move(frames), seq), asio::use_awaitable));
  }
  std::exception_ptr failure;
  try {
    co_await async::all_of(std::move(streams));
  } catch (...) {
    failure = std::current_exception();
  }
  if (failure) {
    fail_all();  // the workers fail at once; init again before the next update
    std::rethrow_exception(failure);
  }
  stats_.bytes = plan.egress[rank_];
  stats_.tensors = local.tensors.size();
  stats_.wall_s = since(start);
  stats_.receive_s = stats_.wall_s;
  stats_.finalize();
}

asio::awaitable<void> sharded_sender::stream_to(std::shared_ptr<peer> p, std::array<std::byte, 48> header,
                                                std::shared_ptr<const std::vector<stream_frame>> frames,
                                                std::uint64_t seq) {
  const std::string who = "tcp_sharded trainer rank " + std::to_string(rank_) + ": worker " + std::to_string(p->worker);
  std::exception_ptr failure;
  try {
    co_await links::announce_update(p->socket, header, timeout_, who);
    std::vector<asio::const_buffer> buffers;
    for (std::size_t k = 0; k < frames->size(); ++k) {
      const auto& f = (*frames)[k];
      buffers.clear();
      for (const auto& r : f.runs) buffers.emplace_back(r.data, r.bytes);
      wire::bucket_header h;
      h.index = k;
      h.payload_bytes = f.bytes;
      if (wire_.checksums) {
        h.flags |= wire::flag_checksum;
        h.checksum = checksum(std::span<const asio::const_buffer>(buffers));  // on this I/O thread
      }
      const auto raw = wire::encode(h);
      buffers.insert(buffers.begin(), asio::buffer(raw));
      co_await net::write_all(p->socket, buffers, timeout_, who + ": frame " + std::to_string(k));
    }
    co_await links::await_confirmation(p->socket, seq, timeout_, who);
  } catch (...) {
    failure = std::current_exception();
  }
  // A worker that fails says why before it closes: that reason is the error.
  if (failure) co_await links::rethrow_with_peer_reason(p->socket, failure, who);
}

}  // namespace refit::tcp
