#include "examples/common/worker_process.h"

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <spawn.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <thread>

#include <asio/co_spawn.hpp>
#include <asio/detached.hpp>
#include <asio/post.hpp>

#include <refit/error.h>

extern char** environ;

namespace refit::example {

namespace {
constexpr const char* trainer_pid_variable = "REFIT_TRAINER_PID";

void kill_and_reap(pid_t pid) {
  kill(pid, SIGKILL);
  waitpid(pid, nullptr, 0);
}
}  // namespace

worker_process start_worker_process(const std::vector<std::string>& args, std::chrono::milliseconds timeout,
                                    const std::string& who, const std::vector<std::string>& launcher) {
  int fds[2];
  if (pipe2(fds, O_CLOEXEC) != 0) throw_error(errc::io_error, std::string("pipe: ") + std::strerror(errno));
  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  posix_spawn_file_actions_adddup2(&actions, fds[1], STDOUT_FILENO);
  std::vector<std::string> strings = args;
  if (!launcher.empty()) {
    // The launcher runs this binary by its path: /proc/self/exe would be its own.
    char self[4096];
    const ssize_t n = readlink("/proc/self/exe", self, sizeof self - 1);
    if (n <= 0) throw_error(errc::io_error, std::string("readlink /proc/self/exe: ") + std::strerror(errno));
    strings = launcher;
    strings.emplace_back(self, static_cast<std::size_t>(n));
    strings.insert(strings.end(), args.begin() + (args.empty() ? 0 : 1), args.end());
  }
  std::vector<char*> argv;
  for (auto& a : strings) argv.push_back(a.data());
  argv.push_back(nullptr);
  // The environment, with this process's pid for die_with_trainer.
  std::string mine = std::string(trainer_pid_variable) + "=" + std::to_string(getpid());
  std::vector<char*> env;
  for (char** e = environ; *e; ++e)
    if (std::strncmp(*e, trainer_pid_variable, std::strlen(trainer_pid_variable)) != 0 ||
        (*e)[std::strlen(trainer_pid_variable)] != '=')
      env.push_back(*e);
  env.push_back(mine.data());
  env.push_back(nullptr);
  worker_process w;
  const int rc = launcher.empty()
                     ? posix_spawn(&w.pid, "/proc/self/exe", &actions, nullptr, argv.data(), env.data())
                     : posix_spawnp(&w.pid, launcher[0].c_str(), &actions, nullptr, argv.data(), env.data());
  posix_spawn_file_actions_destroy(&actions);
  close(fds[1]);
  if (rc != 0) {
    close(fds[0]);
    throw_error(errc::io_error, "cannot start " + who + ": " + std::strerror(rc));
  }
  // The port line must come within the timeout; a worker that dies says so.
  std::string line;
  const auto give_up = std::chrono::steady_clock::now() + timeout;
  while (line.find('\n') == std::string::npos) {
    const auto left =
        std::chrono::duration_cast<std::chrono::milliseconds>(give_up - std::chrono::steady_clock::now()).count();
    pollfd p{fds[0], POLLIN, 0};
    char buf[128];
    const ssize_t n = left > 0 && poll(&p, 1, static_cast<int>(left)) > 0 ? read(fds[0], buf, sizeof buf) : -2;
    if (n <= 0) {
      close(fds[0]);
      kill_and_reap(w.pid);
      if (n == -2) throw_error(errc::timeout, who + " did not report its port in time");
      throw_error(errc::peer_lost, who + " exited before reporting its port");
    }
    line.append(buf, static_cast<std::size_t>(n));
  }
  close(fds[0]);
  unsigned port = 0;
  if (std::sscanf(line.c_str(), "REFIT_WORKER_PORT %u", &port) != 1 || port == 0 || port > 65535) {
    kill_and_reap(w.pid);
    throw_error(errc::protocol_error, who + " printed '" + line.substr(0, line.find('\n')) + "'");
  }
  w.port = static_cast<std::uint16_t>(port);
  return w;
}

int reap_worker(pid_t pid, std::chrono::milliseconds timeout) {
  const auto give_up = std::chrono::steady_clock::now() + timeout;
  int status = 0;
  while (waitpid(pid, &status, WNOHANG) == 0) {
    if (std::chrono::steady_clock::now() >= give_up) {
      kill_and_reap(pid);
      return -1;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  return status;
}

int serve_worker(asio::io_context& io, control::worker_host& host, std::uint16_t port,
                 std::function<void()> on_shutdown) {
  host.add_method("shutdown", [&io, &host, on_shutdown](const json&) -> asio::awaitable<json> {
    asio::post(io, [&host, on_shutdown] {
      if (on_shutdown) on_shutdown();
      host.stop();
    });
    co_return json::object();
  });
  report_port(port);
  asio::co_spawn(io, host.serve(), asio::detached);
  io.run();
  return 0;
}

void report_port(unsigned port) {
  std::printf("REFIT_WORKER_PORT %u\n", port);
  std::fflush(stdout);
  if (dup2(STDERR_FILENO, STDOUT_FILENO) < 0)
    throw_error(errc::io_error, std::string("pointing stdout at stderr: ") + std::strerror(errno));
}

void die_with_trainer(int signal) {
  prctl(PR_SET_PDEATHSIG, signal);
  if (const char* pid = std::getenv(trainer_pid_variable); pid && std::atol(pid) != static_cast<long>(getppid()))
    std::_Exit(1);  // the trainer died before the signal was set
}

}  // namespace refit::example
