// The main job's command line. One table of flags (flags()) drives both the
// parser and the usage text, so a flag cannot be accepted without being described.
// Both --name value and --name=value are accepted.
#pragma once

#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include <refit/config.h>

namespace refit::example::weight_sync {

struct endpoint {
  std::string host;  // empty: --listen's address
  std::uint16_t port = 0;
};

struct options {
  std::string role = "trainer";
  std::string engine = "tcp";
  int workers = 2;
  std::uint64_t model_bytes = 1ull << 30;
  int layers = 16;
  std::int64_t vocab = 32000;
  int updates = 3;
  std::uint64_t buffer_bytes = 64ull << 20;
  std::uint32_t num_buffers = 2;
  double process_cost = 0;  // seconds of simulated post-processing per GB
  std::int64_t timeout_ms = 60000;
  bool quiet = false;
  bool print_layout = false;
  bool help = false;                       // --help: print usage() and exit 0 (nothing after it is parsed)
  bool no_direct = false;                  // receive through staging even where the model offers memory
  std::optional<bool> ucx_put_into_model;  // ucx: the workers' "put_into_model" (nullopt: the engine's default)
  bool checksums = false;
  commit_mode commit = commit_mode::in_place;
  bool fleet_atomic = false;               // trainer: two-phase updates (every worker votes before any commits)
  std::string listen = "127.0.0.1";        // workers' control address; the trainer's data address
  std::vector<endpoint> connect;           // trainer: use running workers instead of starting them
  bool load_model = false;                 // trainer: have --connect workers allocate the model first
  bool one_tensor = false;                 // the model is one bf16 tensor of --model-bytes
  std::uint16_t master_port = 0;           // trainer: data port (0: any free port)
  std::vector<std::uint16_t> advertise;    // trainer: data ports workers are told (proxies in front), one or one each
  int first_round = 1;                     // trainer: number of the first update (its weights)
  std::int64_t hold_before_finish_ms = 0;  // trainer: pause between update_weights and finish (fault suite)
  std::string topology;                    // trainer: tcp's "star", "chain" or "tree:K" (empty: the engine's default)
  bool delta = false;                      // trainer: tcp star only; send what changed since the last update
  double change_fraction = 0;              // (0, 1]: each update after the first changes this fraction (0: all)
  std::string replay;                      // trainer: a recorded trajectory's directory (tests/bench/delta_density.py)
  // Sharded transfers: M trainer ranks with FSDP Shard(0) shards, N workers in
  // vLLM's tensor-parallel layout (fused qkv/gate_up, column/row, vocab-parallel).
  int trainers = 1;
  int tp = 1;
  bool broadcast = false;  // --tp N: today's broadcast, each worker slicing on arrival
  bool workers_given = false;
  int rank = 0;                              // trainer-rank: this rank
  std::vector<std::uint16_t> trainer_ports;  // trainer-rank: (unused ports of the others are 0)
  int slice_tp = 0, tp_rank = 0;             // worker: slice a broadcast to tp rank tp_rank of slice_tp
  std::string stats_file;                    // trainer-rank: where its JSON stats go
  std::vector<std::string> spawn_hosts;      // sharded job: its workers' then ranks 1..'s addresses (empty: listen)
  std::string spawn_via;                     // a launcher command the job's processes start under (with the address)

  bool sharded_job() const { return trainers > 1 || tp > 1; }
  std::string secret_file;  // shared secret for every connection
  std::string secret;       // loaded from secret_file
};

/// A flag's value as the command line gives it (after = in --name=value, or the next
/// argument), read and checked by the flag's setter.
class flag_reader {
 public:
  flag_reader(std::string name, std::string inline_value, int argc, char** argv, int& index)
      : name_(std::move(name)), inline_(std::move(inline_value)), argc_(argc), argv_(argv), index_(index) {}

  const std::string& name() const { return name_; }
  /// The value; invalid_argument when there is none.
  std::string value();
  /// The value as an integer in [lo, hi]; invalid_argument naming the flag otherwise.
  long integer(long lo, long hi);

 private:
  std::string name_, inline_;
  int argc_;
  char** argv_;
  int& index_;
};

/// One flag of the table.
struct flag {
  std::string_view name;   // --workers
  std::string_view value;  // what it takes, as the usage shows it ("N"); empty for a switch
  std::string_view help;   // one or more lines ('\n' between them)
  void (*set)(options&, flag_reader&);
};

/// Every flag the program accepts (-h is accepted as --help).
std::span<const flag> flags();

/// The usage text (what --help prints), made from flags().
const std::string& usage();

/// Parses argv and checks the combination; invalid_argument says what is wrong
/// (an unknown flag's message ends with the usage). Reads the secret file. At
/// --help it returns at once with `help` set.
options parse_args(int argc, char** argv);

}  // namespace refit::example::weight_sync
