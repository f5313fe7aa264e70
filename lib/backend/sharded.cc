#include <refit/backend/sharded.h>

#include <cstring>
#include <utility>

#include <xxhash.h>

#include <refit/backend/async/all_of.h>
#include <refit/backend/async/offload.h>
#include <refit/backend/hex.h>
#include <refit/backend/links/status_io.h>
#include <refit/config.h>
#include <refit/engine.h>
#include <refit/error.h>
#include <refit/layout/layout.h>
#include <refit/metadata.h>
#include <refit/tensor.h>

namespace refit::backend {

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

sharded_join_info sharded_join_info::read(json_reader& r) {
  sharded_join_info info;
  const json trainers = r.required<json>("trainers");
  const std::string path = r.member_path("trainers");
  if (!trainers.is_array() || trainers.empty()) r.fail("member '" + path + "' must be a non-empty array");
  for (std::size_t i = 0; i < trainers.size(); ++i) {
    json_reader t(trainers[i], r.context(), path + "[" + std::to_string(i) + "]");
    rank_endpoint e;
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

int sharded_join_info::worker_number(int tp_rank, std::string_view engine) const {
  const int number = rank_offset - 1 + tp_rank;
  if (number < 0 || number >= workers)
    throw_error(errc::invalid_argument, std::string(engine) + ": rank_offset " + std::to_string(rank_offset) +
                                            " and tp_rank " + std::to_string(tp_rank) + " make worker " +
                                            std::to_string(number) + ", not below workers " + std::to_string(workers));
  return number;
}

sharded_trainer_args sharded_trainer_args::read(json_reader& r, std::chrono::milliseconds default_timeout) {
  sharded_trainer_args a;
  a.rank = r.required<int>("rank");
  const json trainers = r.required<json>("trainers");
  a.workers = r.required<int>("workers");
  a.layout = r.required<json>("layout");
  a.wire = wire_params::read(r);
  a.timeout = std::chrono::milliseconds(r.optional<std::int64_t>("timeout_ms", default_timeout.count()));
  if (!trainers.is_array() || trainers.empty()) r.fail("member 'trainers' must be a non-empty array");
  if (a.rank < 0 || a.rank >= static_cast<int>(trainers.size()))
    r.fail("member 'rank' is " + std::to_string(a.rank) + ", not one of the " + std::to_string(trainers.size()) +
           " trainers");
  if (a.workers < 1) r.fail("member 'workers' must be at least 1");
  if (!a.layout.is_object()) r.fail("member 'layout' must be an object");
  if (a.timeout.count() < 1) r.fail("member 'timeout_ms' must be positive");
  for (std::size_t i = 0; i < trainers.size(); ++i) {
    json_reader t(trainers[i], r.context(), "trainers[" + std::to_string(i) + "]");
    a.trainers.push_back({t.required<std::string>("address"), t.required<std::uint16_t>("port")});
    t.finish();
  }
  return a;
}

json sharded_trainer_args::worker_init_info(std::uint16_t port) const {
  json list = json::array();
  for (std::size_t i = 0; i < trainers.size(); ++i)
    list.push_back({{"address", trainers[i].address}, {"port", static_cast<int>(i) == rank ? port : trainers[i].port}});
  json info = {
      {"trainers", std::move(list)}, {"workers", workers}, {"rank_offset", 1}, {"timeout_ms", timeout.count()}};
  wire.write(info);
  return info;
}

std::uint64_t pair_digest(std::uint64_t plan_digest, int rank, int worker) {
  const std::uint64_t words[3] = {plan_digest, static_cast<std::uint64_t>(rank), static_cast<std::uint64_t>(worker)};
  return XXH3_64bits(words, sizeof words);
}

std::string pair_header_refusal(const links::wire::update& u, std::uint64_t last_seq, std::uint64_t digest,
                                std::uint64_t plan_digest, const pair_plan& pair, std::uint64_t frames) {
  if (u.seq <= last_seq)
    return "update sequence " + std::to_string(u.seq) + " is not after " + std::to_string(last_seq);
  if (u.digest != digest)
    return "the transfer plans differ: the trainer rank planned another layout or other metadata than this "
           "worker's update_info (plan digest " +
           to_hex(plan_digest) + " here)";
  if (u.tensors != pair.items.size() || u.buckets != frames || u.payload_bytes != pair.bytes)
    return "the pair's stream differs: the trainer sends " + std::to_string(u.tensors) + " boxes, " +
           std::to_string(u.payload_bytes) + " bytes in " + std::to_string(u.buckets) +
           " frames; this worker expects " + std::to_string(pair.items.size()) + ", " + std::to_string(pair.bytes) +
           " in " + std::to_string(frames) + " (are both on the same refit version?)";
  return {};
}

asio::awaitable<sharded_destination> place_destination(const dest_layout& dest, model_target* target,
                                                       model_target* model, bool staged,
                                                       std::vector<std::byte>& fallback,
                                                       asio::any_io_executor processing) {
  sharded_destination out;
  out.current = std::make_shared<std::vector<const std::byte*>>(dest.tensors.size(), nullptr);
  out.bases.assign(dest.tensors.size(), nullptr);
  std::vector<std::uint64_t> fallback_at(dest.tensors.size(), ~0ull);
  std::uint64_t fallback_bytes = 0;
  const auto host_view = [](model_target* m, const tensor_spec& spec) -> std::optional<tensor_view> {
    std::optional<tensor_view> d = m ? m->destination(spec) : std::nullopt;
    if (d && d->device.is_cpu() && d->nbytes() == spec.nbytes() && (d->data || spec.nbytes() == 0)) return d;
    return std::nullopt;
  };
  for (std::size_t i = 0; i < dest.tensors.size(); ++i) {
    // Thousands of lookups in the model: in stretches, the loop is shared.
    if (i % 512 == 511) co_await async::yield_now();
    const auto& spec = dest.tensors[i].spec;
    if (auto d = host_view(target, spec)) {
      out.bases[i] = d->data;
      out.direct = true;
      if (!staged) (*out.current)[i] = d->data;
    } else {
      fallback_at[i] = fallback_bytes;
      fallback_bytes += (spec.nbytes() + 63) / 64 * 64;
    }
    if (staged)
      if (auto m = host_view(model, spec)) (*out.current)[i] = m->data;
  }
  if (fallback.size() < fallback_bytes) {
    // Allocated and faulted in on the processing executor, not the event loop.
    auto* area = &fallback;
    co_await async::offload(processing, [area, fallback_bytes] { area->resize(fallback_bytes); });
  }
  for (std::size_t i = 0; i < dest.tensors.size(); ++i)
    if (fallback_at[i] != ~0ull) out.bases[i] = fallback.data() + fallback_at[i];
  std::vector<std::pair<std::byte*, std::uint64_t>> zero;
  for (std::size_t i = 0; i < dest.tensors.size(); ++i) {
    if (!staged && fallback_at[i] == ~0ull) continue;  // the model's memory: left as it is
    const auto& t = dest.tensors[i];
    std::uint64_t covered = 0;
    for (const auto& p : t.pieces) covered += static_cast<std::uint64_t>(p.from.numel()) * element_size(t.spec.dtype);
    if (covered < t.spec.nbytes()) zero.emplace_back(out.bases[i], t.spec.nbytes());
  }
  if (!zero.empty()) {
    auto* z = &zero;
    co_await async::offload(processing, [z] {
      for (auto [p, n] : *z) std::memset(p, 0, n);
    });
  }
  co_return out;
}

std::unique_ptr<sharded_update_info> read_sharded_update_info(const json& j, std::string_view engine, int worker,
                                                              int workers, int trainers, layout_cache& cache) {
  const std::string context = std::string(engine) + " update_info";
  json_reader r(j, context);
  auto info = std::make_unique<sharded_update_info>();
  const update_metadata global = read_update_metadata(r);
  info->commit = read_commit_mode(r);
  const json spec = r.required<json>("layout");
  r.finish();
  if (worker < 0)
    throw_error(errc::invalid_state, context +
                                         ": parsed before init_transfer_engine (the worker's number among "
                                         "the destinations comes from its init_info)");
  info->layouts = cache.get(global, spec, context + ": member 'layout'");
  const auto& l = *info->layouts;
  if (static_cast<int>(l.workers.size()) != workers)
    throw_error(errc::invalid_argument, context + ": the layout has " + std::to_string(l.workers.size()) +
                                            " destinations, init_info said " + std::to_string(workers) + " workers");
  if (l.source.ranks() != trainers)
    throw_error(errc::invalid_argument, context + ": the layout's mesh has " + std::to_string(l.source.ranks()) +
                                            " trainer ranks, init_info listed " + std::to_string(trainers));
  info->metadata = l.workers[worker].metadata();
  return info;
}

asio::awaitable<std::shared_ptr<const sharded_layouts>> plan_for_rank(asio::any_io_executor pool, layout_cache& cache,
                                                                      const update_metadata& declared, const json& spec,
                                                                      int ranks, int workers, std::string who) {
  std::shared_ptr<const sharded_layouts> layouts;
  {
    auto* c = &cache;
    auto* meta = &declared;
    auto* sp = &spec;
    auto* out = &layouts;
    const std::string context = who + ": layout";
    auto* ctx = &context;
    co_await async::offload(pool, [c, meta, sp, out, ctx] { *out = c->get(*meta, *sp, *ctx); });
  }
  const auto& plan = *layouts->plan;
  if (plan.ranks != ranks || plan.workers != workers)
    throw_error(errc::invalid_argument, who + ": the layout plans " + std::to_string(plan.ranks) + " ranks and " +
                                            std::to_string(plan.workers) + " workers, trainer_args said " +
                                            std::to_string(ranks) + " and " + std::to_string(workers));
  co_return layouts;
}

asio::awaitable<void> run_pairs(std::vector<asio::awaitable<void>> pairs,
                                std::vector<std::shared_ptr<asio::ip::tcp::socket>> sockets,
                                const std::vector<std::uint64_t>& last_seq) {
  struct shared {
    std::vector<std::shared_ptr<asio::ip::tcp::socket>> sockets;
    bool failed = false;
  };
  auto s = std::make_shared<shared>();
  s->sockets = std::move(sockets);
  std::vector<asio::awaitable<void>> guarded;
  for (std::size_t r = 0; r < pairs.size(); ++r)
    guarded.push_back(
        [](asio::awaitable<void> pair, std::shared_ptr<shared> s, std::size_t r) -> asio::awaitable<void> {
          std::exception_ptr failure;
          try {
            co_await std::move(pair);
          } catch (...) {
            failure = std::current_exception();
          }
          if (failure) {
            if (!std::exchange(s->failed, true))
              for (std::size_t k = 0; k < s->sockets.size(); ++k) {
                std::error_code ignored;
                if (k != r) s->sockets[k]->cancel(ignored);
              }
            std::rethrow_exception(failure);
          }
        }(std::move(pairs[r]), s, r));
  std::exception_ptr failure;
  try {
    co_await async::all_of(std::move(guarded));
  } catch (...) {
    failure = std::current_exception();
  }
  if (!failure) co_return;
  // Every trainer rank learns why (not just a reset).
  co_await tell_ranks(s->sockets, failure, last_seq);
  std::rethrow_exception(failure);
}

asio::awaitable<void> tell_ranks(const std::vector<std::shared_ptr<asio::ip::tcp::socket>>& sockets,
                                 std::exception_ptr failure, const std::vector<std::uint64_t>& last_seq) {
  for (std::size_t r = 0; r < sockets.size(); ++r) {
    try {
      co_await links::tell_failure(*sockets[r], failure, last_seq.at(r));
    } catch (...) {
    }
  }
}

asio::awaitable<void> load_sharded(const dest_layout& dest, std::uint64_t ingress, const std::vector<std::byte*>& bases,
                                   load_weights_fn& load_weights, asio::any_io_executor processing, update_stats& stats,
                                   std::chrono::steady_clock::time_point start) {
  using clock = std::chrono::steady_clock;
  const auto since = [](clock::time_point t) { return std::chrono::duration<double>(clock::now() - t).count(); };
  stats.bytes = ingress;
  stats.tensors = dest.tensors.size();
  stats.receive_s = since(start);
  std::vector<tensor_view> views;
  views.reserve(dest.tensors.size());
  for (std::size_t i = 0; i < dest.tensors.size(); ++i) views.emplace_back(dest.tensors[i].spec, bases[i]);
  const auto loading = clock::now();
  auto* v = &views;
  auto* load = &load_weights;
  co_await async::offload(processing, [v, load] { (*load)(*v); });
  stats.process_s = since(loading);
  stats.wall_s = since(start);
  stats.finalize();
}

std::vector<std::byte*> local_shards(tensor_source& source, const update_metadata& local, const std::string& who) {
  std::vector<std::byte*> bases(local.tensors.size(), nullptr);
  for (std::size_t i = 0; i < local.tensors.size(); ++i) {
    auto v = source.next();
    if (!v)
      throw_error(errc::invalid_argument, who + ": the tensors ended after " + std::to_string(i) + " of the " +
                                              std::to_string(local.tensors.size()) + " declared");
    check_matches_declared(local.tensors[i], *v, i);
    if (!v->device.is_cpu() && v->nbytes() > 0)
      throw_error(errc::unsupported, who + ": tensor '" + local.tensors[i].name + "' is on " + to_string(v->device) +
                                         "; sharded engines send host memory");
    bases[i] = v->data;
  }
  if (source.next())
    throw_error(errc::invalid_argument,
                who + ": the tensors go on past the " + std::to_string(local.tensors.size()) + " declared");
  return bases;
}

}  // namespace refit::backend
