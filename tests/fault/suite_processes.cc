// The fault suite's processes: workers and trainers of the main job (suite.h).
#include "tests/fault/suite.h"

extern char** environ;

namespace refit::fault {

process start(const std::vector<std::string>& args, const std::string& log) {
  int fds[2];
  if (pipe2(fds, O_CLOEXEC) != 0) throw_error(errc::io_error, std::string("pipe: ") + std::strerror(errno));
  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  posix_spawn_file_actions_adddup2(&actions, fds[1], STDOUT_FILENO);
  posix_spawn_file_actions_addopen(&actions, STDERR_FILENO, log.c_str(), O_WRONLY | O_CREAT | O_APPEND, 0644);
  std::vector<std::string> copy = args;
  std::vector<char*> argv;
  for (auto& a : copy) argv.push_back(a.data());
  argv.push_back(nullptr);
  process p;
  int rc = posix_spawn(&p.pid, copy[0].c_str(), &actions, nullptr, argv.data(), environ);
  posix_spawn_file_actions_destroy(&actions);
  close(fds[1]);
  if (rc != 0) {
    close(fds[0]);
    throw_error(errc::io_error, "cannot start " + copy[0] + ": " + std::strerror(rc));
  }
  p.out = fds[0];
  return p;
}

// Waits for the process to exit, up to `limit`; nullopt if it did not (a hang).
std::optional<int> wait_exit(pid_t pid, std::chrono::milliseconds limit) {
  std::optional<int> result;
  testing::poll_until(
      [&] {
        int status = 0;
        const pid_t r = waitpid(pid, &status, WNOHANG);
        if (r == pid) result = status;
        if (r < 0) result = -1;
        return result.has_value();
      },
      limit, 10ms);
  return result;
}

int count_entries(const std::string& dir) {
  int n = 0;
  if (DIR* d = opendir(dir.c_str())) {
    while (auto* e = readdir(d))
      if (e->d_name[0] != '.') ++n;
    closedir(d);
  }
  return n;
}

worker suite::start_worker(int index) {
  worker w;
  w.proc = start({o_.binary, "--role", "worker", "--engine", o_.engine, "--timeout-ms", std::to_string(o_.timeout_ms),
                  "--auth-secret-file", secret_file_},
                 dir_ + "/worker" + std::to_string(index) + ".log");
  std::string line;
  const auto until = clock_type::now() + 10s;
  while (line.find('\n') == std::string::npos) {
    pollfd p{w.proc.out, POLLIN, 0};
    auto left = std::chrono::duration_cast<std::chrono::milliseconds>(until - clock_type::now()).count();
    if (left <= 0 || poll(&p, 1, static_cast<int>(left)) <= 0)
      throw_error(errc::timeout, "worker " + std::to_string(index) + " did not report its port");
    char buf[128];
    ssize_t n = ::read(w.proc.out, buf, sizeof buf);
    if (n <= 0) throw_error(errc::peer_lost, "worker " + std::to_string(index) + " exited at start");
    line.append(buf, static_cast<std::size_t>(n));
  }
  unsigned port = 0;
  if (std::sscanf(line.c_str(), "REFIT_WORKER_PORT %u", &port) != 1)
    throw_error(errc::protocol_error, "worker printed '" + line + "'");
  w.port = static_cast<std::uint16_t>(port);
  w.client =
      std::make_unique<control::client>(io_.get_executor(), std::chrono::milliseconds(o_.timeout_ms * 2), secret_);
  run_sync(w.client->connect("127.0.0.1", w.port));
  return w;
}

void suite::stop_worker(worker& w) {
  if (w.client) w.client->close();
  if (w.proc.pid > 0) {
    kill(w.proc.pid, SIGTERM);
    if (!wait_exit(w.proc.pid, 5s)) {
      kill(w.proc.pid, SIGKILL);
      wait_exit(w.proc.pid, 5s);
    }
    close(w.proc.out);
    w.proc.pid = -1;
  }
}

suite::running_trainer suite::start_trainer(const std::vector<std::string>& extra, const std::string& log) {
  std::vector<std::string> args = {o_.binary,        "--quiet",
                                   "--engine",       o_.engine,
                                   "--model-bytes",  o_.model_bytes,
                                   "--layers",       std::to_string(model_layers),
                                   "--vocab",        std::to_string(model_vocab),
                                   "--buffer-bytes", "1M",
                                   "--num-buffers",  "2",
                                   "--timeout-ms",   std::to_string(o_.timeout_ms)};
  std::string ports;
  for (auto& w : workers_) ports += (ports.empty() ? "" : ",") + std::to_string(w.port);
  args.push_back("--connect");
  args.push_back(ports);
  args.insert(args.end(), extra.begin(), extra.end());
  running_trainer t;
  t.proc = start(args, log);
  auto reader = [](asio::io_context& io, int fd, std::shared_ptr<std::string> text, std::shared_ptr<bool> eof,
                   std::shared_ptr<std::uint16_t> master_port) -> asio::awaitable<void> {
    asio::posix::stream_descriptor d(io, ::dup(fd));
    char buf[4096];
    for (;;) {
      std::error_code ec;
      std::size_t n = co_await d.async_read_some(asio::buffer(buf), asio::redirect_error(asio::use_awaitable, ec));
      if (ec) break;
      text->append(buf, n);
      constexpr std::string_view tag = "REFIT_MASTER_PORT ";
      if (auto at = text->find(tag); *master_port == 0 && at != std::string::npos) {
        unsigned port = 0;
        if (text->find('\n', at) != std::string::npos && std::sscanf(text->c_str() + at + tag.size(), "%u", &port) == 1)
          *master_port = static_cast<std::uint16_t>(port);
      }
    }
    *eof = true;
  };
  asio::co_spawn(io_, reader(io_, t.proc.out, t.text, t.eof, t.master_port), asio::detached);
  return t;
}

// Serves the loop until the trainer's stdout ends or `limit` passes; a trainer
// that does not exit then is killed (a hang).
suite::trainer_result suite::wait_trainer(running_trainer& t, std::chrono::milliseconds limit,
                                          std::vector<std::unique_ptr<proxy>>* proxies) {
  const auto until = clock_type::now() + limit;
  if (proxies)
    for (auto& px : *proxies) px->forward_to(t.master_port);
  io_.restart();
  while (!*t.eof && clock_type::now() < until) io_.run_for(20ms);
  trainer_result r;
  if (auto st = wait_exit(t.proc.pid, *t.eof ? std::chrono::milliseconds(o_.timeout_ms * 2) : 0ms)) {
    r.exited = true;
    r.status = *st;
  } else {
    kill(t.proc.pid, SIGKILL);
    wait_exit(t.proc.pid, 5s);
  }
  if (proxies)
    for (auto& px : *proxies) px->stop();
  io_.restart();
  io_.poll();
  close(t.proc.out);
  const std::string& text = *t.text;
  auto nl = text.find_last_of('\n', text.size() >= 2 ? text.size() - 2 : 0);
  std::string last = text.substr(nl == std::string::npos ? 0 : nl + 1);
  r.last = json::parse(last, nullptr, false);
  return r;
}

// Starts a trainer and serves its proxies until it exits (or is found hung).
suite::trainer_result suite::run_trainer(const std::vector<std::string>& extra,
                                         std::vector<std::unique_ptr<proxy>>* proxies, const std::string& log,
                                         process* out_proc) {
  running_trainer t = start_trainer(extra, log);
  if (out_proc) *out_proc = t.proc;
  // Generous: a trainer must end within a few deadlines of its last progress.
  return wait_trainer(t, std::chrono::milliseconds(o_.timeout_ms * 6) + 20s, proxies);
}

}  // namespace refit::fault
