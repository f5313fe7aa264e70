// Engine-independent settings, the counterpart of vLLM's WeightTransferConfig.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

#include <refit/json.h>
#include <refit/json_reader.h>

namespace refit {

/// How an update reaches the model's weights.
enum class commit_mode {
  /// Tensors are loaded as their buckets arrive: the least memory. A failed update
  /// leaves the model partly written; it is marked dirty until a full update
  /// succeeds.
  in_place,
  /// Every tensor is received (and checksum-verified, when checksums are on) into
  /// host memory first; load_weights sees none of the update until its session's
  /// finish_weight_update (or, outside a session, until all of it has arrived). A
  /// failed transfer or an aborted session leaves the old weights intact and
  /// serving. Costs host memory for the whole session (kept for later updates);
  /// see weight_transfer_engine::begin_session.
  staged,
};

/// "in_place" or "staged".
std::string_view to_string(commit_mode mode) noexcept;

/// Which backend to use and the settings every backend honours.
struct weight_transfer_config {
  /// Registered backend name ("tcp", "tcp_sharded", "loopback"; "nccl", "cuda_ipc",
  /// "torch_ipc" in CUDA builds: engine_factory::available()).
  std::string backend = "tcp";
  /// Default deadline for every wait on a peer (connect, each bucket, each control
  /// call) unless an engine's init info sets its own.
  std::chrono::milliseconds timeout{60'000};
  /// Threads for CPU post-processing (load_weights) when the context brings none.
  std::size_t processing_threads = 1;
  /// Shared secret for authenticating every control and data connection
  /// (challenge-response with HMAC-SHA256, lib/integrity/auth.h); empty: unauthenticated.
  /// Both sides of a connection must agree. Never serialised by to_json; load it
  /// with auth::read_secret_file or from a secret store, never from init info.
  std::string auth_secret;
  /// Commit mode of updates whose update info names none.
  commit_mode commit = commit_mode::in_place;
  /// Kernel send/receive buffer of each data connection (net::set_buffers); 0: the
  /// kernel's autotuning. Raise it to bandwidth x round-trip time on long links.
  std::size_t socket_buffer_bytes = 0;
  /// Most host memory the stage of a staged update session may take (its chunks'
  /// tensors, each 64-byte aligned); a staged chunk that would take it further is
  /// refused before any of its bytes move, the trainer told at once
  /// (resource_exhausted, naming the bytes), as one whose stage cannot be
  /// allocated is. 0: no bound but the allocator's.
  std::uint64_t max_stage_bytes = 0;

  /// Reads {"backend": str, "timeout_ms": int, "processing_threads": int,
  /// "commit": "in_place" | "staged", "socket_buffer_bytes": int,
  /// "max_stage_bytes": int} strictly.
  static weight_transfer_config from_json(const json& j);
  json to_json() const;
};

/// Reads the optional member `name` ("in_place" or "staged") of an init or update
/// info; throws invalid_argument naming the member path otherwise.
std::optional<commit_mode> read_commit_mode(json_reader& r, const std::string& name = "commit");

}  // namespace refit
