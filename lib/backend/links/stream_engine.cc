#include <refit/backend/links/stream_engine.h>

#include <utility>

#include <refit/backend/async/all_of.h>
#include <refit/backend/links/engine_base.h>
#include <refit/backend/links/status_io.h>
#include <refit/backend/net.h>

namespace refit::links {

stream_init_info stream_init_info::read(json_reader& r) {
  stream_init_info info;
  static_cast<join_info&>(info) = join_info::read(r);
  info.topology = topology::parse(r.optional<std::string>("topology", "star"),
                                  r.context() + ": member '" + r.member_path("topology") + "'");
  return info;
}

std::unique_ptr<update_info> stream_engine::parse_update_info(const json& j) const {
  json_reader r(j, std::string(backend()) + " update_info");
  auto info = std::make_unique<metadata_update_info>(metadata_update_info::read(r));
  r.finish();
  return info;
}

asio::awaitable<void> stream_engine::do_init(const refit::init_info& base) {
  const auto& info = downcast<stream_init_info>(base, "init_info");
  close();
  timeout_ = info.timeout.value_or(config().timeout);
  rank_ = worker_rank(info, context().ranks, std::string(backend()));
  position_ = {};
  // In a relay topology the hello says where this worker's children may connect.
  relay_listener relay;
  if (!info.topology.star())
    relay = [this](const asio::ip::address& local) {
      relay_ = std::make_unique<asio::ip::tcp::acceptor>(net::listen(context().executor, local.to_string(), 0));
      return relay_->local_endpoint().port();
    };
  auto j = co_await links::join(info.master_address, info.master_port, rank_, info.wire, config().auth_secret, timeout_,
                                who(), relay);
  socket_ = std::make_shared<asio::ip::tcp::socket>(std::move(j.socket));
  opened(*socket_);
  std::exception_ptr failure;
  try {
    co_await joined(info);
    // Staging is allocated once here and reused by every update.
    const bool serves = pipeline_ && staging_serves(pipeline_->staging());
    auto make = [this](const wire_params& wire) { return make_staging(wire); };
    co_await ensure_staging(pipeline_, info.wire, serves, context().executor, processing_executor(), make);
    if (!info.topology.star()) co_await join_relay(info);
    co_await connected(info);
  } catch (...) {
    failure = std::current_exception();
  }
  if (failure) {
    close();
    std::rethrow_exception(failure);
  }
  last_seq_ = 0;
}

asio::awaitable<void> stream_engine::join_relay(const stream_init_info& info) {
  // The trainer says where this worker sits once every worker has joined.
  position_ = co_await read_position(*socket_, info.topology, timeout_, who());
  // Connect upstream and accept the children at once: a chain forms in one step.
  auto connect_upstream = [](stream_engine* self, relay_position p, wire_params wire) -> asio::awaitable<void> {
    auto j = co_await links::join(p.upstream_address, p.upstream_port, self->rank_, wire, self->config().auth_secret,
                                  self->timeout_, self->who() + ": upstream worker rank " + std::to_string(p.upstream));
    self->upstream_ = std::make_shared<asio::ip::tcp::socket>(std::move(j.socket));
    self->opened(*self->upstream_);
  };
  auto accept_children = [](stream_engine* self, std::vector<int> ranks, wire_params wire) -> asio::awaitable<void> {
    auto members = co_await accept_members(*self->relay_, self->context().executor, self->config().auth_secret,
                                           self->timeout_, wire, ranks, self->who() + " (relay)");
    // In the order of `ranks` (accept_members sorts by rank, as are they).
    for (auto& m : members) {
      self->opened(*m.socket);
      self->children_.push_back(m.socket);
    }
  };
  std::vector<asio::awaitable<void>> both;
  if (position_.upstream != 0) both.push_back(connect_upstream(this, position_, info.wire));
  if (!position_.children.empty()) both.push_back(accept_children(this, position_.children, info.wire));
  co_await async::all_of(std::move(both));
  if (position_.children.empty()) relay_.reset();  // nobody will connect
}

asio::awaitable<void> stream_engine::do_receive(const refit::update_info& info, load_weights_fn load_weights) {
  co_await receive_update(downcast<metadata_update_info>(info, "update_info"), std::move(load_weights));
}

asio::awaitable<void> stream_engine::receive_update(const metadata_update_info& info, load_weights_fn load_weights) {
  check_connected(socket_ != nullptr, who());
  // Held: a disconnect closes them, never frees them under a read.
  const auto from = upstream();
  const auto children = children_;
  const std::vector<int> child_ranks = position_.children;
  const std::string me = who();
  // What reads from upstream names it: a lost relay shows up as that rank.
  const std::string source =
      position_.upstream > 0 ? me + ": upstream worker rank " + std::to_string(position_.upstream) : me;
  std::exception_ptr failure;
  try {
    stream_update u{info, *from, children, child_ranks, source};
    u.plan = plan_buckets(info.metadata, pipeline_->params());
    u.child_took.assign(children.size(), false);
    u.load_weights = std::move(load_weights);
    // Which version the weights hold is known only until this update changes them.
    const std::optional<backend::held_version> held = held_.take();
    // The header (and a delta header) goes down the tree; this worker accepts only
    // once its children did.
    std::optional<wire::delta_header> delta_header;
    last_seq_ = co_await accept_update_for_subtree(*from, children, child_ranks, last_seq_, info.metadata, u.plan,
                                                   timeout_, me, source, &delta_header);
    u.seq = last_seq_;
    std::optional<backend::delta_receive> delta;
    if (delta_header) u.child_took = co_await answer_delta_offer(u, *delta_header, held, delta.emplace());
    // A worker that takes no deltas whatever it holds hashes nothing either.
    const bool hashed = delta && delta_refusal().empty();
    if (hashed) u.delta = &*delta;
    co_await receive_buckets(u);
    // Every child confirms (its subtree has every byte, verified) before this one does.
    co_await confirm_update_for_subtree(*from, children, child_ranks, last_seq_, timeout_, me);
    // The weights now hold the trainer's version (its fingerprint is the hashes of
    // the bytes that arrived, so a worker that got other bytes never matches). A
    // chunk staged in an open update session holds it once the session commits.
    if (hashed) {
      held_.record({delta_header->version, backend::delta_fingerprint(metadata_digest(info.metadata), delta->hashes)},
                   receiving_into_open_session(), held);
    }
  } catch (...) {
    failure = std::current_exception();
  }
  if (failure) {
    // The upstream (the trainer or the worker relaying to this one) learns why,
    // so its error names this worker's reason (say, which child was lost). Then, as
    // the stream position is unknown, the connections and the transport close
    // (nothing lands in staging afterwards, and the children fail at once rather
    // than wait for bytes that never come).
    if (from->is_open()) co_await tell_failure(*from, failure, last_seq_);
    close();
    std::rethrow_exception(failure);
  }
}

asio::awaitable<std::vector<bool>> stream_engine::answer_delta_offer(stream_update& u, const wire::delta_header& d,
                                                                     const std::optional<backend::held_version>& held,
                                                                     backend::delta_receive& delta) {
  delta.meta = &u.info.metadata;
  delta.hashes.assign(u.plan.buckets.size(), 0);
  if ((d.flags & wire::delta_flag_has_base) == 0) co_return std::vector<bool>(u.children.size(), false);
  // Whether this worker holds the base (then its buckets may arrive encoded) or not
  // (then every bucket comes full), before any byte of the model changes; the
  // tensors' bytes are hashed (off the loop), so bytes written outside refit since
  // get the update full.
  // (Arguments named first: GCC 12 may destroy a temporary of a co_await
  // expression twice.)
  const bool staged = u.info.commit.value_or(config().commit) == commit_mode::staged;
  const std::string dirty = weights_dirty() ? dirty_reason() : std::string();
  model_target* const current = staged ? context().model : receive_target();
  const asio::any_io_executor processing = processing_executor();
  std::string why_full = delta_refusal();
  if (why_full.empty())
    why_full = co_await backend::check_delta_base(d, held, dirty, u.info.metadata, current, staged, u.plan, processing,
                                                  delta.base);
  // One stream carries one form of each bucket to the whole subtree: it takes the
  // deltas only when all of it holds the base (relay_io.h).
  const std::string me = who();
  const subtree_delta_answer answer = co_await answer_delta_offer_for_subtree(
      u.upstream, u.children, u.child_ranks, std::move(why_full), last_seq_, timeout_, me);
  delta.accepted = answer.why_full.empty();
  co_return answer.child_took;
}

void stream_engine::do_refuse_update(errc kind, const std::string& reason) noexcept {
  // The refusal goes upstream; children (whose header never comes) are closed.
  std::shared_ptr<asio::ip::tcp::socket> s =
      upstream_ ? std::exchange(upstream_, nullptr) : std::exchange(socket_, nullptr);
  refuse_upstream(context().executor, std::move(s), last_seq_ + 1, kind, reason, timeout_, who());
  close();
}

void stream_engine::close() noexcept {
  close_transport();
  for (auto* s : {socket_.get(), upstream_.get()})
    if (s) net::close(*s);
  for (auto& c : children_) net::close(*c);
  socket_.reset();
  upstream_.reset();
  children_.clear();
  if (relay_) {
    std::error_code ignored;
    relay_->close(ignored);
    relay_.reset();
  }
}

}  // namespace refit::links
