// Worker processes of an example: the trainer starts its own binary again in a
// worker role; each worker prints "REFIT_WORKER_PORT <port>" once its control plane
// listens, and dies with the trainer.
#pragma once

#include <signal.h>
#include <sys/types.h>

#include <chrono>
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include <asio/io_context.hpp>

#include <refit/control/worker_host.h>

namespace refit::example {

struct worker_process {
  pid_t pid = -1;
  std::uint16_t port = 0;
};

/// Starts this binary (/proc/self/exe) with `args` (argv[0] first) and reads the
/// control port it prints within `timeout`. A worker that exits first is
/// peer_lost, one that is too slow timeout, one that prints something else
/// protocol_error; in each case it is killed and reaped, and the error names
/// `who`. The child finds this process's pid in REFIT_TRAINER_PID (see
/// die_with_trainer). A `launcher` (e.g. {"ip", "netns", "exec", "ns1"}, or a
/// script that enters a host's network namespace and execs the rest) runs the
/// child as `launcher... <this binary> args[1:]`; it must exec it in its own
/// process, so that the child is this process's, as without one.
worker_process start_worker_process(const std::vector<std::string>& args, std::chrono::milliseconds timeout,
                                    const std::string& who, const std::vector<std::string>& launcher = {});

/// Waits for a worker to exit, at most `timeout`; then kills it. Returns its wait
/// status (-1 when it had to be killed).
int reap_worker(pid_t pid, std::chrono::milliseconds timeout);

/// Prints "REFIT_WORKER_PORT <port>" (the line start_worker_process waits for),
/// then points stdout at stderr: the parent reads that one line and closes its
/// end, so anything later printed on stdout (UCX logs there by default) would
/// end this process with SIGPIPE.
void report_port(unsigned port);

/// The worker's side of start_worker_process: adds a "shutdown" control method
/// (calls `on_shutdown`, then stops `host`), prints "REFIT_WORKER_PORT <port>" and
/// serves on `io` until the host stops and nothing else runs there (so
/// `on_shutdown` stops what the worker added to `io`, e.g. a lag probe). Returns 0.
int serve_worker(asio::io_context& io, control::worker_host& host, std::uint16_t port,
                 std::function<void()> on_shutdown = {});

/// Called first by a worker: it gets `signal` when its trainer dies, and exits at
/// once if the trainer (REFIT_TRAINER_PID) already died before this call (the
/// parent-death signal only covers deaths after it is set). SIGKILL for a worker
/// that may be stuck where SIGTERM cannot stop it (in a CUDA call).
void die_with_trainer(int signal = SIGTERM);

}  // namespace refit::example
