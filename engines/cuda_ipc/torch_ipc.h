// The "torch_ipc" engine, and what a PyTorch trainer hands over per tensor: the pieces of
// torch.multiprocessing.reductions.reduce_tensor(t) for a CUDA tensor (the storage's
// cudaIpcMemHandle_t, where the storage starts in that allocation and how large it
// is, the tensor's element offset, sizes and strides), as JSON the "torch_ipc"
// engine reads from its update_info. examples/torch_ipc/refit_ipc.py writes it:
//
//   "ipc_handles": [                       one object per tensor, in "names" order
//     {"GPU-6f1c...": {                    keyed by the GPU's UUID (nvidia-smi spelling)
//        "handle": "<hex>",                the storage's handle as reduce_tensor gives
//                                          it: the 64-byte cudaIpcMemHandle_t (older
//                                          torch, e.g. 1.13), or the caching
//                                          allocator's shareable handle (version
//                                          byte, 'c', cudaIpcMemHandle_t; torch 2.x)
//        "storage_offset_bytes": int,      storage start inside the allocation
//        "storage_bytes": int,             storage size
//        "offset": int,                    tensor start inside the storage, elements
//        "size": [int], "stride": [int]}}  the tensor's; strides must be contiguous
//   ]
//
// Everything is checked when the update info is read, before any byte moves: a bad
// entry is invalid_argument naming the tensor and the member.
#pragma once

#include <string>
#include <string_view>
#include <vector>

#include <refit/engines/cuda_ipc/cuda_ipc.h>
#include <refit/json_reader.h>
#include <refit/metadata.h>

namespace refit::cuda_ipc {

/// "GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx" (nvidia-smi's and NVML's spelling).
std::string format_gpu_uuid(const gpu_uuid& uuid);
/// Parses format_gpu_uuid's output, with or without the "GPU-" prefix (PyTorch's
/// str(torch.cuda.get_device_properties(i).uuid) has none), any case;
/// invalid_argument naming `what` otherwise.
gpu_uuid parse_gpu_uuid(std::string_view text, const std::string& what);

/// One tensor's place in a PyTorch trainer's memory.
struct torch_tensor_handle {
  gpu_uuid gpu{};
  handle_bytes handle{};  ///< of the allocation holding the storage
  std::uint64_t storage_offset_bytes = 0;
  std::uint64_t storage_bytes = 0;
  std::uint64_t offset_bytes = 0;  ///< tensor start inside the storage
  /// Where the tensor's first byte is, given where the allocation is mapped.
  std::uint64_t byte_offset() const noexcept { return storage_offset_bytes + offset_bytes; }
};

/// Per tensor of an update, the handles its trainer offers (one per GPU it is on).
using torch_handle_table = std::vector<std::vector<torch_tensor_handle>>;

/// Reads the "ipc_handles" member of `r` (required) for the tensors of `meta`, as
/// described above.
torch_handle_table read_torch_handles(json_reader& r, const update_metadata& meta);

/// The handle of `tensor` to open on the GPU `mine`: its entry for `mine`, else its
/// only entry (opened on the GPU it names); invalid_argument naming the tensor and
/// the GPUs offered otherwise.
const torch_tensor_handle& pick_handle(const std::vector<torch_tensor_handle>& offered, const gpu_uuid& mine,
                                       const tensor_spec& tensor);

/// "torch_ipc" init info: only the receive pipeline's shape (optional members
/// "buffer_bytes", "num_buffers"; checksums refused). There is nothing to connect
/// to: a PyTorch trainer sends its handles in each update_info.
struct torch_init_info final : refit::init_info {
  wire_params wire;
  static torch_init_info read(json_reader& r);
};

/// "torch_ipc" update info: the tensors' metadata, the optional commit mode and,
/// per tensor, where it lives in the trainer's memory (torch_handles.h).
struct torch_update_info final : refit::update_info {
  torch_handle_table handles;
  static torch_update_info read(json_reader& r);
};

/// Worker side for PyTorch trainers without refit ("torch_ipc"): each update's
/// update_info carries, per tensor, what torch.multiprocessing.reductions.
/// reduce_tensor gives (examples/torch_ipc/refit_ipc.py builds it). Every handle
/// is opened before any byte moves (tensors that share an allocation share a
/// mapping; an empty tensor, which has no memory to share, opens nothing), then
/// the tensors are copied in buckets (batched: thousands of small tensors cost a
/// few launches) into staging or straight into the model's memory, and
/// load_weights runs on the processing stream while the next bucket is copied.
/// receive_weights completes when every byte has been copied out of the trainer's
/// memory, so the trainer may change its tensors as soon as its update_weights
/// call returns. Mappings stay open across sessions while the trainer keeps
/// offering the same allocations (handle_cache): a trainer whose storages live
/// pays for its opens once, not per update.
class torch_engine final : public backend::typed_engine<torch_init_info, torch_update_info> {
 public:
  torch_engine(const weight_transfer_config& config, const engine_context& context,
               std::shared_ptr<ipc_provider> provider);
  std::string_view backend() const noexcept override { return "torch_ipc"; }
  /// Direct receive into device memory (the trainer's IPC buffers are copied
  /// into the model's tensors on the device); processing deferred; needs a GPU.
  static engine_capabilities capabilities_of() {
    return {.direct_receive = true, .device_memory = true, .defers_processing = true, .needs_gpu = true};
  }
  const handle_cache& handles() const noexcept { return *handles_; }
  std::string staged_commit_refusal() const override {
    return pipeline_ && pipeline_->staging_device().is_cuda()
               ? "the trainer's tensors are copied in device memory and a staged commit holds the whole update in "
                 "host memory"
               : std::string();
  }

 protected:
  asio::awaitable<void> init(const torch_init_info& info) override;
  asio::awaitable<void> receive(const torch_update_info& info, load_weights_fn load_weights) override;
  void do_shutdown() override;
  void do_session_finished() override { handles_->end_session(); }

 private:
  std::shared_ptr<ipc_provider> provider_;
  std::unique_ptr<handle_cache> handles_;
  std::unique_ptr<receive_pipeline> pipeline_;
  gpu_uuid gpu_{};
};

}  // namespace refit::cuda_ipc
