#include <refit/backend/bucket_send.h>

#include <refit/backend/checksum.h>
#include <refit/backend/links/links.h>
#include <refit/backend/send_cursor.h>

namespace refit::backend {

asio::awaitable<void> send_buckets(bucket_send_transport& t, bucket_update& u, tensor_source& source,
                                   delta_sending deltas) {
  t.reset_peers();
  deltas.stats = {};
  std::exception_ptr failure;
  try {
    gather_update(u, source);
    if (deltas.on) offer_deltas(u, deltas);
    co_await t.transmit(u);
    if (u.work) {
      // Every bucket was encoded and copied into the snapshot, and every worker
      // confirmed: the snapshot is this version's bytes, the next update's base.
      finish_delta_send(deltas.base, *u.work, deltas.stats);
      for (const auto& p : t.delta_outcomes()) {
        deltas.stats.delta_workers += p.took_delta ? p.workers : 0;
        deltas.stats.full_fallbacks += p.fell_back ? p.workers : 0;
      }
    }
  } catch (...) {
    failure = std::current_exception();
  }
  if (failure) {
    t.failed(u, failure);
    std::rethrow_exception(failure);
  }
}

void gather_update(bucket_update& u, tensor_source& source) {
  // Walk (and check) every tensor the source yields before any byte leaves: a
  // divergent or extra tensor fails the update while workers have nothing of it.
  u.header = links::update_header(u.seq, u.declared, u.plan);
  u.payloads.resize(u.plan.buckets.size());
  send_cursor cursor(u.declared, u.plan, source);
  for (const bucket& b : u.plan.buckets) {
    const auto& payload = cursor.gather(b);
    u.payloads[b.index].assign(payload.begin(), payload.end());
  }
  cursor.finish();
  u.tensors.resize(u.declared.tensors.size());
  for (std::size_t i = 0; i < u.declared.tensors.size(); ++i) u.tensors[i] = cursor.view(i).data;
}

void offer_deltas(bucket_update& u, const delta_sending& deltas) {
  // Number this version, offer deltas against the base when the snapshot holds the
  // last update's bytes of these same tensors, and prepare the work that encodes
  // each bucket and refreshes the snapshot. An update larger than the bound goes
  // plain, and the snapshot is let go.
  u.offer = start_delta_send(deltas.base, deltas.version, deltas.max_bytes, u.declared, u.plan, deltas.allow_base,
                             u.header, deltas.stats);
  if (!u.offer) return;
  u.encoded.resize(u.plan.buckets.size());
  u.work = std::make_shared<bucket_delta_work>();
  u.work->prepare(u.plan, u.declared, u.tensors, u.offer->has_base, &u.encoded);
}

bool hash_buckets(bucket_update& u, delta_snapshot& base, const std::function<void(std::size_t, std::uint64_t)>& each,
                  const std::atomic<bool>* stop) {
  bucket_delta_work* work = u.work.get();
  if (work) work->snapshot = base.reserve(base.payload_bytes);  // the snapshot grows here, off the event loop
  for (std::size_t k = 0; k < u.payloads.size(); ++k) {
    if (stop && *stop) return false;
    const std::uint64_t h = checksum(u.payloads[k]);
    if (work) work->encode_bucket(k, h, u.payloads[k]);
    each(k, h);
  }
  if (work) base.fingerprint = delta_fingerprint(base.digest, work->hashes);
  return true;
}

}  // namespace refit::backend
