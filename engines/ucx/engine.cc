// The UCX worker: register the staging slots and offer them (address and remote
// keys) to whoever sends to it (the trainer, or in a chain or tree the worker
// relaying to it), then per bucket grant it a destination the pipeline has
// acquired, wait for its "done", and send the bucket on to this worker's own
// children, if any. Joining, the subtree's update header and confirmation, and
// deltas' answers are links::stream_engine's.
#include <algorithm>
#include <cstdlib>
#include <future>
#include <map>

#include <asio/co_spawn.hpp>
#include <asio/detached.hpp>

#include <refit/backend/async/all_of.h>
#include <refit/backend/async/event.h>
#include <refit/backend/async/offload.h>
#include <refit/backend/checksum.h>
#include <refit/backend/hex.h>
#include <refit/backend/links/relay_io.h>
#include <refit/backend/links/status_io.h>
#include <refit/backend/links/wire.h>
#include <refit/backend/net.h>
#include <refit/engines/ucx/ucx.h>
#include "device_memory.h"  // private to this engine
#include "downstream.h"     // private to this engine
#include "registry.h"       // private to this engine
#include "ucp.h"            // private to this engine
#include "upstream.h"       // private to this engine
#include "wire.h"           // private to this engine

namespace refit::ucx {

init_info init_info::read(json_reader& r) {
  init_info info;
  static_cast<links::join_info&>(info) = links::join_info::read(r);
  info.topology = links::topology::parse(r.optional<std::string>("topology", "star"),
                                         r.context() + ": member '" + r.member_path("topology") + "'");
  info.require_transports = r.optional<std::vector<std::string>>("require_transports", {});
  info.put_into_model = r.maybe<bool>("put_into_model");
  info.device_memory = r.maybe<bool>("device_memory");
  return info;
}

json endpoint_report::to_json() const {
  return {{"transports", transports},
          {"put_transports", put_transports},
          {"mode", mode},
          {"peer_failure_handling", peer_failure_handling}};
}

endpoint_report endpoint_report::from_json(const json& j, const std::string& what) {
  json_reader r(j, what);
  endpoint_report out;
  out.transports = r.required<std::vector<std::string>>("transports");
  out.put_transports = r.required<std::vector<std::string>>("put_transports");
  out.mode = r.required<std::string>("mode");
  out.peer_failure_handling = r.required<bool>("peer_failure_handling");
  r.finish();
  if (out.mode != "put" && out.mode != "tag") r.fail("member 'mode' is '" + out.mode + "', expected put or tag");
  return out;
}

namespace {
std::string joined(const std::vector<std::string>& v) {
  std::string out;
  for (const auto& s : v) out += (out.empty() ? "" : ", ") + s;
  return out.empty() ? "none" : out;
}

bool matches(const std::string& wanted, const std::string& t) {
  if (wanted == t) return true;
  if (wanted == "sm") return shared_memory_transport(t);
  if (wanted == "rdma") return t.starts_with("rc") || t.starts_with("dc") || t.starts_with("ud");
  return t.starts_with(wanted + "_");  // "rc" matches rc_mlx5 and rc_verbs
}
}  // namespace

std::string check_required(const endpoint_report& report, const std::vector<std::string>& required) {
  if (required.empty()) return {};
  const auto& data = report.mode == "put" ? report.put_transports : report.transports;
  for (const auto& want : required)
    for (const auto& t : data)
      if (matches(want, t)) return {};
  return "require_transports [" + joined(required) + "] not met: UCX carries the data over " + joined(data) + " (" +
         (report.mode == "put" ? "one-sided puts" : "two-sided tagged sends: puts would be emulated") +
         "; the endpoint's transports: " + joined(report.transports) + "; set UCX_TLS/UCX_NET_DEVICES or fix the " +
         "RDMA setup)";
}

// Staging slots registered with UCX (and the assembly buffer for tensors larger
// than a slot, registered whenever it grows), on the host or on the CUDA device
// the worker receives on (registered as device memory). Region ids: slot i is i;
// each assembly allocation takes the next id from slot_count() on.
class registered_staging final : public staging_memory {
 public:
  registered_staging(std::shared_ptr<context> ctx, std::size_t count, std::uint64_t bytes, refit::device where)
      : ctx_(std::move(ctx)), where_(where), slot_bytes_(bytes), next_id_(static_cast<std::uint32_t>(count)) {
    for (std::size_t i = 0; i < count; ++i) {
      slots_.push_back(allocate(bytes));
      regs_.push_back(std::make_unique<registration>(ctx_, slots_.back().get(), bytes, where_));
    }
  }
  refit::device device() const noexcept override { return where_; }
  std::size_t slot_count() const noexcept override { return slots_.size(); }
  std::span<std::byte> slot(std::size_t index) override {
    return {slots_.at(index).get(), static_cast<std::size_t>(slot_bytes_)};
  }
  std::span<std::byte> assembly(std::uint64_t bytes) override {
    if (bytes > assembly_bytes_) {
      assembly_reg_.reset();  // unregistered and freed first: peak memory is the new size
      assembly_.reset();
      assembly_bytes_ = 0;
      assembly_ = allocate(bytes);
      assembly_reg_ = std::make_unique<registration>(ctx_, assembly_.get(), bytes, where_);
      assembly_id_ = next_id_++;
      assembly_bytes_ = bytes;
    }
    return {assembly_.get(), static_cast<std::size_t>(bytes)};
  }
  std::uint64_t allocated_bytes() const noexcept override { return slot_bytes_ * slots_.size() + assembly_bytes_; }

  /// The registered region holding [p, p + n), if any.
  std::pair<std::uint32_t, const registration*> find(const std::byte* p, std::uint64_t n) const {
    for (std::size_t i = 0; i < regs_.size(); ++i)
      if (regs_[i]->contains(p, n)) return {static_cast<std::uint32_t>(i), regs_[i].get()};
    if (assembly_reg_ && assembly_reg_->contains(p, n)) return {assembly_id_, assembly_reg_.get()};
    return {0, nullptr};
  }
  const registration& slot_registration(std::size_t i) const { return *regs_.at(i); }

 private:
  using buffer = std::shared_ptr<std::byte>;
  buffer allocate(std::uint64_t bytes) const {
    if (!where_.is_cpu()) return allocate_device(where_, bytes);
    const std::uint64_t rounded = (bytes + 4095) / 4096 * 4096;
    auto* p = static_cast<std::byte*>(std::aligned_alloc(4096, static_cast<std::size_t>(rounded)));
    if (!p) throw_error(errc::resource_exhausted, "ucx worker: cannot allocate " + std::to_string(bytes) + " bytes");
    std::memset(p, 0, static_cast<std::size_t>(rounded));  // faulted in now, not under the first put
    return buffer(p, [](std::byte* q) { std::free(q); });
  }

  std::shared_ptr<context> ctx_;
  refit::device where_;
  std::uint64_t slot_bytes_;
  // Buffers before registrations: a registration goes before its memory.
  std::vector<buffer> slots_;
  buffer assembly_;
  std::uint64_t assembly_bytes_ = 0;
  std::vector<std::unique_ptr<registration>> regs_;
  std::unique_ptr<registration> assembly_reg_;
  std::uint32_t assembly_id_ = 0;
  std::uint32_t next_id_;
};

namespace {

std::uint64_t tag_of(std::uint64_t seq, std::uint64_t index) { return (seq << 32) | (index & 0xffffffffu); }

// What one update's transport works with.
struct transport_args {
  asio::ip::tcp::socket& socket;  // from the trainer or the upstream worker
  std::shared_ptr<ucx::worker> worker;
  registered_staging& staging;
  std::vector<std::uint32_t>& announced;  // staging regions whose keys the sender has
  bool puts = false;                      // the endpoint carries puts (else every bucket comes tagged)
  std::uint64_t seq = 0;
  std::chrono::milliseconds timeout{0};
  std::string who;  // this worker, and the upstream worker it reads from (if not the trainer)
  bool checksums = false;
  const std::vector<std::shared_ptr<downstream>>& children;
  std::vector<bool> child_forms;  // per child: it took a delta offer (it reads each bucket's form)
  backend::delta_receive* delta = nullptr;
  update_registry* registry = nullptr;  // null: the model's memory is received tagged
};

// One update's buckets: a grant each (a registered slot for the sender's puts, or
// a tagged receive posted into wherever the pipeline wants the bytes), then the
// sender's "done" (with the bucket's checksum, when asked for, verified by
// check() on the processing executor before the bucket is loaded). With
// children, the bucket then goes on to each of them from where it landed, in the
// background: receive() returns at once, so the next bucket comes in from upstream
// while this one goes down. Forwards run one after another (each child's side
// channel carries one bucket's grant and done at a time); settled() is the
// bucket's, which the pipeline awaits before the bucket's check and load and the
// release of its slot: nothing changes or reuses the bytes before every child's
// flush completed, and a failed forward fails the update with its error.
class transport final : public bucket_transport {
 public:
  explicit transport(transport_args args) : a_(std::move(args)) {
    // The children's grants of this update come with fresh keys for the regions
    // they register for it (wire::first_update_region).
    for (const auto& c : a_.children) c->forget_update_regions();
  }

  // Deltas taken: the trainer says first in what form the bucket comes.
  asio::awaitable<void> begin(const bucket& b) override {
    encoded_.reset();
    if (!a_.delta || !a_.delta->accepted) co_return;
    const std::string what = a_.who + ": bucket " + std::to_string(b.index);
    std::array<std::byte, sizeof(wire::form)> raw;
    co_await net::read_exact(a_.socket, asio::buffer(raw), a_.timeout, what + ": waiting for its form");
    const auto f = wire::decode<wire::form>(raw);
    if (f.magic != wire::form_magic || f.index != b.index ||
        f.encoded_bytes >= std::max<std::uint64_t>(b.payload_bytes, 1))
      throw_error(errc::protocol_error, what + ": expected its form (a delta of fewer than " +
                                            std::to_string(b.payload_bytes) + " bytes, or 0), got bucket " +
                                            std::to_string(f.index) + " of " + std::to_string(f.encoded_bytes));
    if (f.encoded_bytes > 0) encoded_ = f.encoded_bytes;
  }
  std::optional<std::uint64_t> encoded_bytes(const bucket&) override { return encoded_; }
  std::function<void()> decode(const bucket& b, std::span<const std::byte> encoded,
                               std::vector<decode_target> pieces) override {
    if (!a_.delta)
      throw_error(errc::protocol_error, a_.who + ": bucket " + std::to_string(b.index) + ": an unexpected delta");
    return backend::delta_decode(*a_.delta, encoded, std::move(pieces), a_.who + ": bucket " + std::to_string(b.index));
  }

  asio::awaitable<void> receive(const bucket& b, std::span<const asio::mutable_buffer> dest) override {
    const std::string what = a_.who + ": bucket " + std::to_string(b.index);
    wire::grant g;
    g.index = b.index;
    g.payload_bytes = asio::buffer_size(dest);  // a delta's bytes, or the bucket's
    std::vector<std::byte> key;
    std::unique_ptr<tag_receive> posted;
    const registration* reg = nullptr;
    std::uint32_t id = 0;
    if (g.payload_bytes == 0) {
      reg = &a_.staging.slot_registration(0);  // nothing is put; any granted region will do
    } else if (a_.puts && dest.size() == 1) {
      std::tie(id, reg) = a_.staging.find(static_cast<const std::byte*>(dest[0].data()), dest[0].size());
    }
    std::vector<std::byte> pieces;  // mode_put_pieces: the records and their keys
    if (!reg && a_.puts && a_.registry) {
      // The model's memory or the stage: puts into each piece, registered for this
      // update (the trainer writes there; nothing is copied on this side).
      std::vector<asio::mutable_buffer> nonempty;
      for (const auto& d : dest)
        if (d.size() > 0) nonempty.push_back(d);
      const auto regions = co_await a_.registry->cover(nonempty);
      pieces = put_pieces_grant(
          nonempty, regions, [](update_registry::region& r) { return !std::exchange(r.announced, true); }, g);
    } else if (reg) {
      g.mode = wire::mode_put;
      g.region = id;
      g.remote = g.payload_bytes == 0 ? reinterpret_cast<std::uint64_t>(reg->base())
                                      : reinterpret_cast<std::uint64_t>(dest[0].data());
      if (std::find(a_.announced.begin(), a_.announced.end(), id) == a_.announced.end()) {
        key = reg->packed_rkey();
        g.rkey_bytes = static_cast<std::uint32_t>(key.size());
        g.region_base = reinterpret_cast<std::uint64_t>(reg->base());
        g.region_bytes = reg->bytes();
        a_.announced.push_back(id);
      }
    } else {
      // Not a registered slot (the model's memory, the stage) or puts would be
      // emulated: the bytes come as one tagged message, received in place.
      g.mode = wire::mode_tag;
      g.tag = tag_of(a_.seq, b.index);
      posted = std::make_unique<tag_receive>(a_.worker, dest, g.tag, what + " (tagged receive)");
    }
    const auto raw = wire::encode(g);
    std::vector<asio::const_buffer> out{asio::buffer(raw)};
    if (!key.empty()) out.push_back(asio::buffer(key));
    if (!pieces.empty()) out.push_back(asio::buffer(pieces));
    co_await net::write_all(a_.socket, out, a_.timeout, what + ": granting its destination");
    expected_ = co_await read_done(a_.socket, b.index, a_.checksums, a_.timeout, what);
    if (posted) co_await posted->wait(a_.timeout);
    if (!a_.children.empty()) {
      // The bucket goes on to every child at once, in the background; the first
      // failure names it and fails this bucket's check.
      std::optional<std::uint64_t> sum;
      if (a_.checksums) sum = expected_;  // the trainer's, passed on unchanged
      // The bytes as they came: a delta's (then each child decodes it against its
      // own base) or the bucket's; a child that took the deltas hears which first.
      std::vector<std::optional<std::uint64_t>> forms(a_.children.size());
      for (std::size_t i = 0; i < forms.size(); ++i)
        if (a_.child_forms.at(i)) forms[i] = encoded_.value_or(0);
      auto st = std::make_shared<forwarding>(a_.worker->executor());
      asio::co_spawn(a_.worker->executor(),
                     forward(std::exchange(last_, st), st, a_.worker, a_.children,
                             std::vector<asio::const_buffer>(dest.begin(), dest.end()), b.index, a_.seq, sum,
                             std::move(forms), a_.timeout),
                     asio::detached);
      forwards_[b.index] = std::move(st);
    }
  }

  std::function<asio::awaitable<void>()> settled(const bucket& b) override {
    auto it = forwards_.find(b.index);
    if (it == forwards_.end()) return {};
    std::shared_ptr<forwarding> st = std::move(it->second);
    forwards_.erase(it);
    return [st]() -> asio::awaitable<void> {
      co_await st->done.wait();
      if (st->error) std::rethrow_exception(st->error);
    };
  }

  std::function<void()> check(const bucket& b, std::span<const asio::mutable_buffer> dest) override {
    if (!a_.checksums && !a_.delta) return {};
    // With a delta header every bucket is hashed (checksums or not): the hashes make
    // the fingerprint of the version this worker then holds.
    return backend::bucket_hash_check(dest, a_.checksums ? std::optional<std::uint64_t>(expected_) : std::nullopt,
                                      a_.delta ? &a_.delta->hashes.at(b.index) : nullptr,
                                      a_.who + ": bucket " + std::to_string(b.index), encoded_.has_value());
  }

 private:
  transport_args a_;
  std::uint64_t expected_ = 0;
  std::optional<std::uint64_t> encoded_;  // the bucket begun arrives as a delta of this many bytes
  // A bucket's forward to the children: set when it ended, with its error.
  struct forwarding {
    explicit forwarding(asio::any_io_executor ex) : done(std::move(ex)) {}
    async::event done;
    std::exception_ptr error;
  };
  std::shared_ptr<forwarding> last_;                               // the latest one started
  std::map<std::uint64_t, std::shared_ptr<forwarding>> forwards_;  // by bucket, until settled() takes it

  // One bucket to every child, after the one before it (`prev`) ended; a failure
  // there fails this one too. Everything it uses is held by value.
  static asio::awaitable<void> forward(std::shared_ptr<forwarding> prev, std::shared_ptr<forwarding> st,
                                       std::shared_ptr<worker> w, std::vector<std::shared_ptr<downstream>> children,
                                       std::vector<asio::const_buffer> payload, std::uint64_t index, std::uint64_t seq,
                                       std::optional<std::uint64_t> sum,
                                       std::vector<std::optional<std::uint64_t>> forms,
                                       std::chrono::milliseconds timeout) {
    try {
      if (prev) {
        co_await prev->done.wait();
        if (prev->error) std::rethrow_exception(prev->error);
      }
      std::vector<asio::awaitable<void>> sends;
      for (std::size_t i = 0; i < children.size(); ++i)
        sends.push_back(
            with_peer_reason(send_bucket(w, children[i], index, payload, seq, sum, timeout, forms[i]), children[i]));
      co_await async::all_of(std::move(sends));
    } catch (...) {
      st->error = std::current_exception();
    }
    st->done.set();
  }
};

}  // namespace

engine::engine(const weight_transfer_config& config, const engine_context& context)
    : typed_init(config, context, capabilities_of()) {}

engine::~engine() {
  close();
  free_staging();  // registrations before the context
}

bool puts_into_model(const endpoint_report& report, std::optional<bool> asked) {
  if (report.mode != "put") return false;
  // By default only where RDMA carries the puts: over shared memory (cma) the
  // tagged receive measured faster here (docs/benchmarks.md, "The ucx engine").
  if (asked) return *asked;
  return std::any_of(report.put_transports.begin(), report.put_transports.end(),
                     [](const std::string& t) { return matches("rdma", t); });
}

bool engine::puts_into_model() const { return ucx::puts_into_model(report_, put_into_model_); }

registered_staging& engine::staging() const { return static_cast<registered_staging&>(pipeline()->staging()); }

json engine::transport_info() const {
  if (!worker_) return nullptr;
  json j = report_.to_json();
  j["rank"] = rank();
  j["put_into_model"] = puts_into_model();
  j["memory"] = to_string(pipeline() ? pipeline()->staging_device() : device::cpu());
  return j;
}

refit::device engine::receive_device(const init_info& info) const {
  // Only where asked: a model target whose memory is on the host (the engine's
  // device notwithstanding) takes no destination on a device.
  if (!info.device_memory.value_or(false)) return device::cpu();
  const refit::device dev = context().device;
  std::string why;
  if (dev.is_cpu()) {
    why = "the engine's device (engine_context::device) is the host";
  } else if (auto unavailable = device_memory_unavailable(); !unavailable.empty()) {
    why = unavailable;
  } else if (!ucp_->handles(dev)) {
    why = "the UCX loaded (" + context::version() + ") handles " + ucp_->memory_types() +
          " memory only (a UCX built with CUDA, e.g. PyPI's libucx-cu13, first on the library path handles " +
          to_string(dev) + ")";
  } else if (info.wire.checksums) {
    why = "the trainer asks for checksums, which are verified on the host";
  }
  if (!why.empty()) throw_error(errc::unsupported, who() + ": \"device_memory\": true, but " + why);
  return dev;
}

asio::awaitable<void> engine::joined(const links::stream_init_info& base) {
  const auto& info = downcast<init_info>(base, "init_info");
  put_into_model_ = info.put_into_model;  // nullopt: decided by the put lanes once connected
  // UCX's context (it loads its transport modules) and the registered staging are
  // made once, off the event loop, and kept across inits.
  if (!ucp_) ucp_ = co_await async::offload(processing_executor(), [] { return std::make_shared<ucx::context>(); });
  device_ = receive_device(info);
}

std::unique_ptr<staging_memory> engine::make_staging(const wire_params& wire) {
  return std::make_unique<registered_staging>(ucp_, wire.num_buffers, wire.buffer_bytes, device_);
}

asio::awaitable<void> engine::connected(const links::stream_init_info& base) {
  const auto& info = downcast<init_info>(base, "init_info");
  worker_ = worker::create(ucp_, context().executor);
  worker::engaged progressing(worker_);
  const std::vector<int>& ranks = children();
  for (std::size_t i = 0; i < ranks.size(); ++i) {
    auto c = std::make_shared<downstream>();
    c->rank = ranks[i];
    c->name = who() + ": downstream worker rank " + std::to_string(ranks[i]);
    c->socket = child_sockets().at(i);
    downstream_.push_back(std::move(c));
  }
  // This worker's offer goes upstream while its children's offers come in: the
  // endpoints to them are made on this worker's own UCX worker.
  std::vector<asio::awaitable<void>> both;
  both.push_back(offer_upstream(info));
  for (auto& c : downstream_) both.push_back(connect_downstream(c, worker_, timeout()));
  co_await async::all_of(std::move(both));
}

asio::awaitable<void> engine::offer_upstream(const init_info& info) {
  const auto socket = upstream();
  const std::string to =
      upstream_rank() == 0 ? "the trainer" : "upstream worker rank " + std::to_string(upstream_rank());
  // The offer: this worker's address and every slot's extent and key.
  std::vector<const registration*> regions;
  announced_.clear();
  for (std::size_t i = 0; i < staging().slot_count(); ++i) {
    regions.push_back(&staging().slot_registration(i));
    announced_.push_back(static_cast<std::uint32_t>(i));
  }
  report_ = co_await offer_and_agree(*socket, *worker_, regions, info.require_transports, {}, timeout(), who(), to);
}

std::string engine::delta_refusal() const {
  if (staging().device().is_cpu()) return {};
  return "it receives into device memory (" + to_string(staging().device()) + "): deltas are decoded on the host";
}

asio::awaitable<void> engine::receive_buckets(links::stream_update& u) {
  // Held: a disconnect closes them, never frees them under a read.
  const auto w = worker_;
  const auto children = downstream_;
  worker::engaged progressing(w);
  std::unique_ptr<update_registry> registry;  // released when the update ends, whichever way
  last_put_regions_ = 0;
  // Where puts carry the data, the model's memory (direct receive) and a stage are
  // registered as the pipeline grants them, for this update only.
  const bool puts = report_.mode == "put";
  if (puts && puts_into_model()) {
    if (!registrar_) registrar_ = std::make_unique<registrar>();
    registry = registrar_->open(ucp_, staging().device());
  }
  std::exception_ptr failure;
  try {
    transport t({.socket = u.upstream,
                 .worker = w,
                 .staging = staging(),
                 .announced = announced_,
                 .puts = puts,
                 .seq = u.seq,
                 .timeout = timeout(),
                 .who = u.source,
                 .checksums = pipeline()->params().checksums,
                 .children = children,
                 .child_forms = std::move(u.child_took),
                 .delta = u.delta,
                 .registry = registry.get()});
    co_await pipeline()->receive(u.info.metadata, std::move(u.plan), t, std::move(u.load_weights), deferred(),
                                 mutable_stats(), receive_target());
    last_put_regions_ = registry ? registry->size() : 0;
  } catch (...) {
    failure = std::current_exception();
  }
  // Every put completed (each done came after its flush) or the update failed.
  if (registry) co_await registrar_->close(std::move(registry));
  if (failure) std::rethrow_exception(failure);
}

void engine::close_transport() noexcept {
  // Children's keys and endpoints before the UCX worker they live on.
  for (auto& c : downstream_) c->close();
  downstream_.clear();
  if (worker_) {
    worker_->close();
    worker_.reset();
  }
}

}  // namespace refit::ucx
