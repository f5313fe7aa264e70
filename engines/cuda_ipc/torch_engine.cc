// The "torch_ipc" worker: tensors of a PyTorch trainer, copied out of its memory
// through the handles its update_info carries (torch_ipc.h).
#include <refit/backend/async/offload.h>
#include <refit/backend/pipeline.h>
#include <refit/config.h>
#include <refit/engines/cuda_ipc/torch_ipc.h>
#include <refit/metadata.h>

namespace refit::cuda_ipc {

torch_init_info torch_init_info::read(json_reader& r) {
  torch_init_info info;
  info.wire = wire_params::read(r);
  if (info.wire.checksums)
    r.fail("member 'checksums' is not supported by torch_ipc (its bytes cross no byte stream to checksum)");
  info.wire.validate();
  return info;
}

torch_update_info torch_update_info::read(json_reader& r) {
  torch_update_info info;
  info.metadata = read_update_metadata(r);
  info.commit = read_commit_mode(r);
  info.handles = read_torch_handles(r, info.metadata);
  return info;
}

namespace {

// Copies each bucket's pieces from the mapped trainer memory into the places the
// pipeline scatters the bucket's payload to (padding between pieces is skipped).
class torch_transport final : public bucket_transport {
 public:
  torch_transport(const bucket_plan& plan, std::vector<const std::byte*> sources, ipc_provider& provider)
      : plan_(plan), sources_(std::move(sources)), provider_(provider) {}

  asio::awaitable<void> receive(const bucket& b, std::span<const asio::mutable_buffer> dest) override {
    batch_.clear();
    std::size_t d = 0;          // current destination buffer
    std::uint64_t d_start = 0;  // payload offset where dest[d] starts
    for (const bucket_piece& p : plan_.pieces_of(b)) {
      // A split bucket's payload is one chunk of its tensor, at payload offset 0.
      std::uint64_t at = b.split ? 0 : p.bucket_offset;
      std::uint64_t left = b.split ? b.payload_bytes : p.bytes;
      if (left == 0) continue;  // an empty tensor: no memory behind it
      const std::byte* src = sources_[p.tensor] + p.tensor_offset;
      while (left > 0) {
        while (d < dest.size() && d_start + dest[d].size() <= at) d_start += dest[d++].size();
        if (d == dest.size())
          throw_error(errc::protocol_error,
                      "torch_ipc: bucket " + std::to_string(b.index) + " has more bytes than its destination");
        const std::uint64_t inside = at - d_start;
        const std::uint64_t n = std::min<std::uint64_t>(left, dest[d].size() - inside);
        batch_.push_back({src, static_cast<std::byte*>(dest[d].data()) + inside, n});
        src += n;
        at += n;
        left -= n;
      }
    }
    co_await provider_.copy_batch(batch_);
  }

 private:
  const bucket_plan& plan_;
  std::vector<const std::byte*> sources_;
  ipc_provider& provider_;
  std::vector<copy_piece> batch_;
};

}  // namespace

torch_engine::torch_engine(const weight_transfer_config& config, const engine_context& context,
                           std::shared_ptr<ipc_provider> provider)
    : typed_engine(config, context, capabilities_of()), provider_(std::move(provider)) {
  if (!provider_) throw_error(errc::invalid_argument, "torch_ipc engine: an ipc provider is required");
  handles_ = std::make_unique<handle_cache>(provider_);
}

asio::awaitable<void> torch_engine::init(const torch_init_info& info) {
  gpu_ = provider_->uuid_of(context().device);
  handles_->clear();
  // Staging is allocated once here and reused by every update, on the processing
  // executor (not the event loop).
  if (!pipeline_ || !(pipeline_->params() == info.wire)) {
    pipeline_.reset();
    const wire_params wire = info.wire;
    ipc_provider* provider = provider_.get();  // the engine owns it while this runs
    std::unique_ptr<staging_memory> staging = co_await async::offload(processing_executor(), [provider, wire] {
      return provider->make_staging(wire.num_buffers, wire.buffer_bytes);
    });
    pipeline_ =
        std::make_unique<receive_pipeline>(context().executor, processing_executor(), info.wire, std::move(staging));
  }
}

asio::awaitable<void> torch_engine::receive(const torch_update_info& info, load_weights_fn load_weights) {
  const auto& tensors = info.metadata.tensors;
  // Every handle is opened before any byte moves: a bad one fails the update with
  // the model untouched. An empty tensor has no memory to map (PyTorch gives its
  // storage no handle; refit_ipc.py sends zeros): nothing is opened or read.
  // Mappings the cache lacks are opened on the processing executor (each open takes
  // milliseconds; a trainer's first update may bring hundreds).
  std::vector<const std::byte*> sources(tensors.size());
  std::vector<std::size_t> missing;
  for (std::size_t i = 0; i < tensors.size(); ++i) {
    if (tensors[i].nbytes() == 0) continue;
    const torch_tensor_handle& h = pick_handle(info.handles[i], gpu_, tensors[i]);
    if (std::byte* p = handles_->find(h.handle, h.gpu))
      sources[i] = p + h.byte_offset();
    else
      missing.push_back(i);
  }
  if (!missing.empty())
    co_await async::offload(processing_executor(), [&] {
      for (std::size_t i : missing) {
        const torch_tensor_handle& h = pick_handle(info.handles[i], gpu_, tensors[i]);
        try {
          sources[i] = handles_->get(h.handle, h.gpu) + h.byte_offset();
        } catch (const error& e) {
          throw error(e.code(), "torch_ipc: cannot map the memory of tensor '" + tensors[i].name + "' (on " +
                                    format_gpu_uuid(h.gpu) + "): " + e.message());
        }
      }
    });
  bucket_plan plan = plan_buckets(info.metadata, pipeline_->params());
  torch_transport transport(plan, std::move(sources), *provider_);
  co_await pipeline_->receive(info.metadata, plan, transport, provider_->processing(std::move(load_weights)),
                              deferred(), mutable_stats(), receive_target());
}

void torch_engine::do_shutdown() {
  handles_->clear();
  pipeline_.reset();
}

}  // namespace refit::cuda_ipc
