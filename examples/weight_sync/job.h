// What the roles of the main job share (flags.h has the command line):
//   worker.cc   --role worker: a model in host memory behind a control::worker_host
//   trainer.cc  the job: start or --connect workers, send rounds, verify, print JSON
//   sharded.cc  --trainers/--tp: FSDP-sharded trainer ranks to tensor-parallel
//               workers, and --role trainer-rank (one of those ranks)
//   verify.h    every round's check of every worker's tensors (all jobs)
#pragma once

#include <cstddef>
#include <cstdint>
#include <exception>
#include <span>
#include <string>
#include <vector>

#include <refit/tensor.h>
#include "examples/common/worker_process.h"
#include "examples/weight_sync/flags.h"
#include "examples/weight_sync/model.h"

namespace refit::example::weight_sync {

/// --role worker: serves the control verbs until its trainer shuts it down.
int run_worker(const options& o);
/// The one-trainer job (--workers N); prints the JSON line, returns the exit status.
int run_trainer(const options& o);
/// The sharded job (--trainers M and/or --tp N); the same.
int run_sharded_trainer(const options& o);
/// --role trainer-rank: one rank > 0 of the sharded job.
int run_trainer_rank(const options& o);

/// Starts this binary as worker `index` of the job and reads its control port.
worker_process start_worker(const options& o, int index);

/// The address the job's started process `child` listens on (workers 0..N-1, then
/// trainer ranks 1..M-1): --spawn-hosts' entry, or --listen.
std::string host_of(const options& o, std::size_t child);
/// What it starts under: --spawn-via's words, then its address (empty: nothing).
std::vector<std::string> launcher_of(const options& o, std::size_t child);

/// Bytes [offset, offset + out.size()) of tensor `index`'s weights in round `round`:
/// 64-bit words x + k * C (k the word's index in the whole tensor), so a rank that
/// holds a shard of a tensor makes exactly the bytes the whole tensor has there.
void fill_pattern(std::span<std::byte> out, std::size_t index, int round, std::uint64_t offset);

/// --change-fraction F's change to tensor `index` (of `total` bytes of `type`) in
/// round `round` (see trainer_model::step), applied to `out`, which holds its
/// bytes [offset, offset + out.size()): a rank holding a shard changes exactly
/// what the whole tensor changes there.
void change_elements(std::span<std::byte> out, dtype type, double fraction, std::size_t index, int round,
                     std::uint64_t offset, std::uint64_t total);

/// The trainer's copy of the model: one arena, tensors back to back.
struct trainer_model {
  model_layout layout;
  std::vector<std::byte> arena;
  std::vector<tensor_view> views;

  /// --change-fraction: 0 (off) refills every byte each step; F in (0, 1] changes
  /// about F of each tensor's elements after the first step (see step()).
  double change_fraction = 0;

  explicit trainer_model(model_layout l, double change_fraction = 0);
  /// New weights for round `r`: a cheap pattern that differs per tensor and round.
  /// With change_fraction F, only the first step fills; each later one adds +-1 or
  /// +-2 to the raw 16-bit value of about F of each tensor's bf16 elements (bytes
  /// for other dtypes), scattered uniformly like an optimizer step's: geometric gaps
  /// from a PRNG seeded by round and tensor. The trainer's bytes are what the
  /// workers are verified against, so any deterministic change serves.
  void step(int r);
  /// The bytes of every tensor, in layout order, from `path` (a recorded state of
  /// a trajectory: exactly the layout's bytes, else invalid_argument).
  void load(const std::string& path);

 private:
  bool filled_ = false;
};

/// "kind: message" for a refit::error, what() for another exception.
std::string describe(std::exception_ptr e);

}  // namespace refit::example::weight_sync
