#include <refit/backend/sharded_engine.h>

#include <algorithm>
#include <utility>

#include <refit/backend/async/all_of.h>
#include <refit/backend/async/offload.h>
#include <refit/backend/links/engine_base.h>
#include <refit/backend/links/status_io.h>
#include <refit/backend/net.h>
#include <refit/json_reader.h>

namespace refit::backend {

namespace {
using clock_type = std::chrono::steady_clock;
double since(clock_type::time_point t) { return std::chrono::duration<double>(clock_type::now() - t).count(); }
}  // namespace

sharded_init_info sharded_init_info::read(json_reader& r) {
  sharded_init_info info;
  static_cast<sharded_join_info&>(info) = sharded_join_info::read(r);
  return info;
}

// ---------------------------------------------------------------- worker

std::unique_ptr<refit::update_info> sharded_worker_base::parse_update_info(const json& j) const {
  return read_sharded_update_info(j, backend(), worker_, workers_, trainers_, layouts_);
}

asio::awaitable<void> sharded_worker_base::do_init(const refit::init_info& base) {
  const auto& info = downcast<sharded_init_info>(base, "init_info");
  close();
  timeout_ = info.timeout.value_or(config().timeout);
  wire_ = info.wire;
  workers_ = info.workers;
  trainers_ = static_cast<int>(info.trainers.size());
  worker_ = info.worker_number(context().ranks.tp_rank, backend());
  std::vector<std::shared_ptr<asio::ip::tcp::socket>> sockets(info.trainers.size());
  auto join_rank = [](sharded_worker_base* self, const sharded_init_info* info, int rank,
                      std::shared_ptr<asio::ip::tcp::socket>* out) -> asio::awaitable<void> {
    const rank_endpoint& e = info->trainers.at(static_cast<std::size_t>(rank));
    auto j = co_await links::join(e.address, e.port, self->worker_ + 1, self->wire_, self->config().auth_secret,
                                  self->timeout_, self->who() + ": trainer rank " + std::to_string(rank));
    *out = std::make_shared<asio::ip::tcp::socket>(std::move(j.socket));
    co_await self->joined_rank(*info, rank, **out);
  };
  std::exception_ptr failure;
  try {
    co_await joining(info);
    std::vector<asio::awaitable<void>> joins;
    for (std::size_t r = 0; r < sockets.size(); ++r)
      joins.push_back(join_rank(this, &info, static_cast<int>(r), &sockets[r]));
    co_await async::all_of(std::move(joins));
  } catch (...) {
    failure = std::current_exception();
  }
  if (failure) {
    for (auto& s : sockets)
      if (s) net::close(*s);
    close();
    std::rethrow_exception(failure);
  }
  sockets_ = std::move(sockets);
  last_seq_.assign(sockets_.size(), 0);
}

asio::awaitable<void> sharded_worker_base::do_receive(const refit::update_info& base, load_weights_fn load_weights) {
  const auto& info = downcast<sharded_update_info>(base, "update_info");
  if (sockets_.empty())
    throw_error(errc::invalid_state, who() +
                                         ": the connections to the trainer ranks were closed by an earlier "
                                         "failure; call init_transfer_engine again");
  const auto start = clock_type::now();
  const auto& plan = *info.layouts->plan;
  const auto& dest = info.layouts->workers.at(worker_);
  if (plan.ranks != static_cast<int>(sockets_.size()))
    throw_error(errc::invalid_argument, who() + ": the layout's mesh has " + std::to_string(plan.ranks) +
                                            " trainer ranks, this worker connected to " +
                                            std::to_string(sockets_.size()));
  // Where each tensor lands: the model's own memory where it offers host memory,
  // else the engine's fallback area (load_weights then copies from it).
  model_target* target = receive_target();
  const bool staged = info.commit.value_or(config().commit) == commit_mode::staged;
  sharded_update u{info, info.layouts, {}, staged};
  u.placed = co_await place_destination(dest, target, context().model, staged, fallback_, processing_executor());
  // Told once the first pair's header is accepted: from then on bytes land in it.
  direct_target_ = u.placed.direct ? target : nullptr;
  std::exception_ptr failure;
  std::uint64_t wire_bytes = 0;
  try {
    wire_bytes = co_await receive_pairs(u);
  } catch (...) {
    failure = std::current_exception();
  }
  if (failure) {
    close();
    std::rethrow_exception(failure);
  }
  auto& stats = mutable_stats();
  stats.wire_bytes = wire_bytes;
  co_await load_sharded(dest, plan.ingress[worker_], u.placed.bases, load_weights, processing_executor(), stats, start);
  loaded();
}

asio::awaitable<std::vector<stream_frame>> sharded_worker_base::pair_frames(const sharded_layouts& layouts, int rank,
                                                                            const std::vector<std::byte*>& bases) {
  const auto* items = &layouts.plan->pair(rank, worker_).items;
  const auto* d = &layouts.workers.at(worker_);
  const auto* b = &bases;
  const std::uint64_t frame_bytes = wire_.buffer_bytes;
  co_return co_await async::offload(processing_executor(), [items, d, b, frame_bytes] {
    const auto runs = pair_runs(*items, item_side::destination, [&](const transfer_item& it) {
      const auto& spec = d->tensors[it.dest].spec;
      return tensor_place{(*b)[it.dest], spec.shape, element_size(spec.dtype)};
    });
    return cut_frames(runs, frame_bytes);
  });
}

asio::awaitable<std::uint64_t> sharded_worker_base::accept_pair(asio::ip::tcp::socket& socket, int rank,
                                                                const sharded_layouts& layouts, std::uint64_t frames,
                                                                std::string me,
                                                                std::optional<links::wire::delta_header>* delta) {
  namespace wire = links::wire;
  const auto& plan = *layouts.plan;
  std::array<std::byte, sizeof(wire::update)> raw;
  co_await net::read_exact(socket, asio::buffer(raw), timeout_, me + ": waiting for the update header");
  const auto u = wire::decode<wire::update>(raw);
  if (auto bad = wire::check_update_magic(u); !bad.empty()) throw_error(errc::protocol_error, me + ": " + bad);
  // The plan digest first (a layout that differs between the sides is named as
  // such), then the sizes.
  std::string refusal;
  if (delta && (u.flags & wire::update_flag_delta) != 0) {
    std::array<std::byte, sizeof(wire::delta_header)> raw_delta;
    co_await net::read_exact(socket, asio::buffer(raw_delta), timeout_, me + ": reading the delta header");
    *delta = wire::decode<wire::delta_header>(raw_delta);
    refusal = wire::check_delta_header(**delta);
  }
  const std::uint32_t known = delta ? wire::update_flag_delta : 0;
  if (!refusal.empty()) {
    // (the delta header is malformed)
  } else if ((u.flags & ~known) != 0) {
    refusal = delta ? "unknown update flags " + std::to_string(u.flags)
                    : "update flags " + std::to_string(u.flags) +
                          " (deltas, or a newer refit): " + std::string(backend()) + " takes plain updates only";
  } else {
    refusal =
        pair_header_refusal(u, last_seq_.at(static_cast<std::size_t>(rank)), pair_digest(plan.digest, rank, worker_),
                            plan.digest, plan.pair(rank, worker_), frames);
  }
  if (!refusal.empty()) {
    co_await links::send_status(socket, static_cast<std::uint32_t>(errc::protocol_error), u.seq, refusal, timeout_,
                                me + ": refusing the update");
    throw_error(errc::protocol_error, me + ": " + refusal);
  }
  co_await links::send_status(socket, 0, u.seq, {}, timeout_, me + ": accepting the update");
  last_seq_[static_cast<std::size_t>(rank)] = u.seq;
  co_return u.seq;
}

void sharded_worker_base::direct_write_begins() {
  if (auto* t = std::exchange(direct_target_, nullptr)) t->direct_write_begins();
}

asio::awaitable<void> sharded_worker_base::all_pairs(std::vector<asio::awaitable<void>> pairs) {
  co_await run_pairs(std::move(pairs), sockets_, last_seq_);
}

asio::awaitable<void> sharded_worker_base::tell_all(std::exception_ptr failure) {
  co_await tell_ranks(sockets_, failure, last_seq_);
}

void sharded_worker_base::do_refuse_update(errc kind, const std::string& reason) noexcept {
  // Every trainer rank is told at once, so its send fails now naming the reason.
  for (std::size_t r = 0; r < sockets_.size(); ++r)
    links::refuse_upstream(context().executor, sockets_[r], last_seq_[r] + 1, kind, reason, timeout_, who());
  sockets_.clear();
  close();
}

void sharded_worker_base::close() noexcept {
  for (auto& s : sockets_)
    if (s) net::close(*s);
  sockets_.clear();
  close_transport();
}

// ---------------------------------------------------------------- trainer rank

sharded_sender_base::sharded_sender_base(const weight_transfer_config& config, const trainer_context& context)
    : config_(config), context_(context) {
  if (!context_.executor) throw_error(errc::invalid_argument, "trainer_context: an executor is required");
}

sharded_sender_base::~sharded_sender_base() {
  // Let what the derived shutdown() queued on the pool run before it goes away.
  if (pool_) pool_->join();
}

json sharded_sender_base::prepare(const json& trainer_args) {
  json_reader r(trainer_args, std::string(backend()) + " trainer_args");
  auto args = sharded_trainer_args::read(r, config_.timeout);
  const std::function<void()> apply = read_args(r);
  r.finish();
  shutdown();
  args_ = std::move(args);
  if (apply) apply();
  if (!pool_) pool_ = std::make_unique<asio::thread_pool>(std::max(1u, pool_threads()));
  const auto& self = args_.trainers[static_cast<std::size_t>(args_.rank)];
  acceptor_ = std::make_unique<asio::ip::tcp::acceptor>(net::listen(context_.executor, self.address, self.port));
  return args_.worker_init_info(acceptor_->local_endpoint().port());
}

asio::awaitable<void> sharded_sender_base::connect_workers() {
  const std::string me = who();
  if (!acceptor_ || !acceptor_->is_open()) throw_error(errc::invalid_state, me + ": connect_workers before prepare");
  close();
  auto members = co_await links::accept_workers(*acceptor_, context_.executor, config_.auth_secret, args_.timeout,
                                                args_.wire, args_.workers + 1, me);
  std::sort(members.begin(), members.end(), [](const auto& a, const auto& b) { return a.rank < b.rank; });
  std::exception_ptr failure;
  try {
    co_await connected(std::move(members));
  } catch (...) {
    failure = std::current_exception();
  }
  if (failure) {
    close();
    std::rethrow_exception(failure);
  }
  ready_ = true;
  seq_ = 0;
}

void sharded_sender_base::close() noexcept {
  ready_ = false;
  close_transport();
}

void sharded_sender_base::shutdown() {
  close();
  if (acceptor_) {
    std::error_code ignored;
    acceptor_->close(ignored);
  }
}

std::vector<stream_frame> sharded_sender_base::frames_to(const sharded_send& s, int worker) const {
  const auto runs =
      pair_runs(s.layouts->plan->pair(args_.rank, worker).items, item_side::source, [&](const transfer_item& it) {
        const auto& spec = s.local.tensors[it.source];
        return tensor_place{s.bases[it.source], spec.shape, element_size(spec.dtype)};
      });
  return cut_frames(runs, args_.wire.buffer_bytes);
}

asio::awaitable<void> sharded_sender_base::send_weights(const update_metadata& declared, tensor_source& source) {
  send_begins();
  const std::string me = who();
  if (!ready_)
    throw_error(errc::invalid_state, me + ": send_weights before init (or after a failed update; call init again)");
  declared.validate();
  const auto start = clock_type::now();
  stats_ = {};
  plan_s_ = 0;
  // Planned once per layout (a cache hit costs a digest of the spec and metadata),
  // on the pool, not the loop.
  const int rank = args_.rank;
  const auto layouts = co_await plan_for_rank(pool_->get_executor(), layouts_, declared, args_.layout,
                                              static_cast<int>(args_.trainers.size()), args_.workers, me);
  plan_s_ = since(start);
  const auto& plan = *layouts->plan;
  // This rank's shards, each checked against what its placement gives it, before
  // any byte leaves.
  const update_metadata local = layouts->source.local_metadata(rank);
  const std::vector<std::byte*> bases = local_shards(source, local, me);
  sent_.assign(static_cast<std::size_t>(args_.workers), 0);
  for (int w = 0; w < args_.workers; ++w) sent_[static_cast<std::size_t>(w)] = plan.pair(rank, w).bytes;
  const sharded_send s{layouts, local, bases, ++seq_};
  std::exception_ptr failure;
  try {
    co_await send_pairs(s);
  } catch (...) {
    failure = std::current_exception();
  }
  if (failure) {
    close();  // the workers fail at once; init again before the next update
    std::rethrow_exception(failure);
  }
  stats_.bytes = plan.egress[rank];
  stats_.tensors = local.tensors.size();
  stats_.wall_s = since(start);
  stats_.receive_s = stats_.wall_s;
  stats_.finalize();
}

}  // namespace refit::backend
