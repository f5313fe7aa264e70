#include "examples/weight_sync/flags.h"

#include <cstdlib>

#include <refit/error.h>
#include <refit/integrity/auth.h>
#include "examples/weight_sync/model.h"

namespace refit::example::weight_sync {
namespace {

// "4001,10.0.0.2:4002" -> endpoints (hosts only where `hosts` allows them).
std::vector<endpoint> endpoint_list(const std::string& flag, const std::string& list, bool hosts) {
  std::vector<endpoint> out;
  std::size_t at = 0;
  for (;;) {
    auto comma = list.find(',', at);
    std::string item = list.substr(at, comma == std::string::npos ? std::string::npos : comma - at);
    endpoint e;
    bool bad_host = false;
    if (auto colon = item.rfind(':'); hosts && colon != std::string::npos) {
      e.host = item.substr(0, colon);
      item = item.substr(colon + 1);
      bad_host = e.host.empty();
    }
    char* end = nullptr;
    long port = std::strtol(item.c_str(), &end, 10);
    if (bad_host || item.empty() || !end || *end || port < 1 || port > 65535)
      throw_error(errc::invalid_argument, flag +
                                              (hosts ? ": expected [HOST:]PORT entries like 4001,10.0.0.2:4002, got '"
                                                     : ": expected ports like 4001,4002, got '") +
                                              list + "'");
    e.port = static_cast<std::uint16_t>(port);
    out.push_back(std::move(e));
    if (comma == std::string::npos) return out;
    at = comma + 1;
  }
}

std::vector<std::uint16_t> port_list(const std::string& flag, const std::string& list) {
  std::vector<std::uint16_t> out;
  for (const auto& e : endpoint_list(flag, list, false)) out.push_back(e.port);
  return out;
}

int small(flag_reader& r, long lo, long hi) { return static_cast<int>(r.integer(lo, hi)); }

// In the order the usage lists them.
const flag table[] = {
    {"--role", "trainer|worker|trainer-rank",
     "trainer (default): run the job. worker: serve the control\n"
     "verbs; prints REFIT_WORKER_PORT <port>. trainer-rank: one more\n"
     "rank of --trainers (started by the trainer; prints its data\n"
     "port the same way)",
     [](options& o, flag_reader& r) { o.role = r.value(); }},
    {"--engine", "NAME", "the refit backend (default tcp)", [](options& o, flag_reader& r) { o.engine = r.value(); }},
    {"--workers", "N", "worker processes (default 2)",
     [](options& o, flag_reader& r) { o.workers = small(r, 1, 64), o.workers_given = true; }},
    {"--model-bytes", "SIZE", "the synthetic model's bf16 size (default 1G)",
     [](options& o, flag_reader& r) { o.model_bytes = parse_bytes(r.value(), r.name()); }},
    {"--layers", "N", "its decoder layers (default 16)",
     [](options& o, flag_reader& r) { o.layers = small(r, 1, 4096); }},
    {"--vocab", "N", "its vocabulary (default 32000)",
     [](options& o, flag_reader& r) { o.vocab = r.integer(1, 1 << 22); }},
    {"--one-tensor", "", "the model is one bf16 tensor of --model-bytes",
     [](options& o, flag_reader&) { o.one_tensor = true; }},
    {"--updates", "N", "updates to send and verify (default 3)",
     [](options& o, flag_reader& r) { o.updates = small(r, 1, 100000); }},
    {"--buffer-bytes", "SIZE", "staging buffer size (default 64M)",
     [](options& o, flag_reader& r) { o.buffer_bytes = parse_bytes(r.value(), r.name()); }},
    {"--num-buffers", "N", "staging buffers (default 2)",
     [](options& o, flag_reader& r) { o.num_buffers = static_cast<std::uint32_t>(r.integer(1, 64)); }},
    {"--process-cost", "SECONDS_PER_GB",
     "simulated post-processing on the workers\n"
     "(default 0)",
     [](options& o, flag_reader& r) {
       std::string v = r.value();
       char* end = nullptr;
       o.process_cost = std::strtod(v.c_str(), &end);
       if (!end || *end || o.process_cost < 0 || o.process_cost > 1000)
         throw_error(errc::invalid_argument, "--process-cost: expected seconds per GB in [0, 1000], got '" + v + "'");
     }},
    {"--timeout-ms", "MS", "deadline of every wait on a peer (default 60000)",
     [](options& o, flag_reader& r) { o.timeout_ms = r.integer(1, 86400000); }},
    {"--no-direct", "",
     "receive through staging, not into the model's\n"
     "memory",
     [](options& o, flag_reader&) { o.no_direct = true; }},
    {"--ucx-puts", "",
     "ucx: the trainer's puts write the model's memory\n"
     "(put_into_model true; by default only over RDMA)",
     [](options& o, flag_reader&) { o.ucx_put_into_model = true; }},
    {"--ucx-tagged", "",
     "ucx: the model's memory is received as tagged\n"
     "messages (put_into_model false)",
     [](options& o, flag_reader&) { o.ucx_put_into_model = false; }},
    {"--checksums", "",
     "per-bucket XXH3 checksums verified by every\n"
     "worker",
     [](options& o, flag_reader&) { o.checksums = true; }},
    {"--commit", "in_place|staged", "how updates reach the model (default in_place)",
     [](options& o, flag_reader& r) {
       std::string v = r.value();
       if (v == "staged")
         o.commit = commit_mode::staged;
       else if (v == "in_place")
         o.commit = commit_mode::in_place;
       else
         throw_error(errc::invalid_argument, "--commit: expected in_place or staged, got '" + v + "'");
     }},
    {"--fleet-atomic", "",
     "two-phase updates: staged on every worker, each votes, none\n"
     "commits unless all voted yes (implies --commit staged)",
     [](options& o, flag_reader&) {
       o.fleet_atomic = true;
       o.commit = commit_mode::staged;
     }},
    {"--auth-secret-file", "PATH",
     "authenticate every connection (mode 0600;\n"
     "default $REFIT_AUTH_SECRET_FILE)",
     [](options& o, flag_reader& r) { o.secret_file = r.value(); }},
    {"--listen", "ADDRESS",
     "address workers and the trainer listen on\n"
     "(default 127.0.0.1)",
     [](options& o, flag_reader& r) { o.listen = r.value(); }},
    {"--quiet", "", "no progress lines on stderr", [](options& o, flag_reader&) { o.quiet = true; }},
    {"--print-layout", "", "print the model's update_info JSON and exit",
     [](options& o, flag_reader&) { o.print_layout = true; }},
    {"--connect", "[HOST:]PORT,...",
     "trainer: drive running workers, do not start any\n"
     "(HOST defaults to --listen's address)",
     [](options& o, flag_reader& r) { o.connect = endpoint_list(r.name(), r.value(), true); }},
    {"--load-model", "",
     "trainer: have --connect workers allocate the model\n"
     "first",
     [](options& o, flag_reader&) { o.load_model = true; }},
    {"--master-port", "N", "trainer: its data port (default 0: any free port)",
     [](options& o, flag_reader& r) { o.master_port = static_cast<std::uint16_t>(r.integer(0, 65535)); }},
    {"--advertise-port", "N[,N...]",
     "trainer: the data port(s) workers are told (proxies\n"
     "in front): one, or one per worker; prints\n"
     "REFIT_MASTER_PORT <port> (the one they forward to)",
     [](options& o, flag_reader& r) { o.advertise = port_list(r.name(), r.value()); }},
    {"--first-round", "N",
     "trainer: number of the first update (its weights;\n"
     "default 1)",
     [](options& o, flag_reader& r) { o.first_round = small(r, 1, 1 << 30); }},
    {"--hold-before-finish-ms", "MS",
     "trainer: a window between update and finish\n"
     "(fault suite)",
     [](options& o, flag_reader& r) { o.hold_before_finish_ms = r.integer(0, 600000); }},
    {"--topology", "star|chain|tree:K", "tcp: how the stream reaches the workers",
     [](options& o, flag_reader& r) { o.topology = r.value(); }},
    {"--delta", "",
     "tcp, ucx, tcp_sharded: send each worker only what changed\n"
     "since the update it holds (docs/delta.md)",
     [](options& o, flag_reader&) { o.delta = true; }},
    {"--change-fraction", "F",
     "each update after the first changes about F of every\n"
     "tensor's elements, 0 < F <= 1 (default: all bytes)",
     [](options& o, flag_reader& r) {
       std::string v = r.value();
       char* end = nullptr;
       o.change_fraction = std::strtod(v.c_str(), &end);
       if (v.empty() || !end || *end || !(o.change_fraction > 0 && o.change_fraction <= 1))
         throw_error(errc::invalid_argument, "--change-fraction: expected a fraction in (0, 1], got '" + v + "'");
     }},
    {"--replay", "DIR",
     "trainer: send a recorded trajectory instead of the synthetic\n"
     "model: DIR/layout.json and one DIR/step-NNNN.bin per update\n"
     "(tests/bench/delta_density.py --record DIR)",
     [](options& o, flag_reader& r) { o.replay = r.value(); }},
    {"--trainers", "M",
     "M trainer processes with FSDP Shard(0) shards send the\n"
     "--tp workers only what each keeps (tcp_sharded; with\n"
     "--engine ucx: ucx_sharded)",
     [](options& o, flag_reader& r) { o.trainers = small(r, 1, 64); }},
    {"--tp", "N",
     "the workers are the N tensor-parallel ranks of\n"
     "one engine",
     [](options& o, flag_reader& r) { o.tp = small(r, 1, 64); }},
    {"--broadcast", "",
     "with --tp N: one trainer broadcasts, every worker slices\n"
     "on arrival",
     [](options& o, flag_reader&) { o.broadcast = true; }},
    {"--rank", "N",
     "trainer-rank: this rank of --trainers (set by the\n"
     "trainer)",
     [](options& o, flag_reader& r) { o.rank = small(r, 0, 63); }},
    {"--stats-file", "PATH",
     "trainer-rank: where its JSON figures go (set by the\n"
     "trainer)",
     [](options& o, flag_reader& r) { o.stats_file = r.value(); }},
    {"--slice-tp", "N",
     "worker: keep one of N tp ranks' slices of a broadcast\n"
     "(set by the trainer)",
     [](options& o, flag_reader& r) { o.slice_tp = small(r, 1, 64); }},
    {"--tp-rank", "N",
     "worker: which tp rank, with --slice-tp (set by the\n"
     "trainer)",
     [](options& o, flag_reader& r) { o.tp_rank = small(r, 0, 63); }},
    {"--spawn-hosts", "ADDRESS,...",
     "sharded job: where the processes it starts listen:\n"
     "workers 0..N-1, then trainer ranks 1..M-1 (default:\n"
     "all on --listen)",
     [](options& o, flag_reader& r) {
       o.spawn_hosts.clear();
       const std::string v = r.value();
       for (std::size_t at = 0;;) {
         const auto comma = v.find(',', at);
         o.spawn_hosts.push_back(v.substr(at, comma == std::string::npos ? std::string::npos : comma - at));
         if (o.spawn_hosts.back().empty())
           throw_error(errc::invalid_argument,
                       r.name() + ": expected addresses like 10.0.0.2,10.0.0.3, got '" + v + "'");
         if (comma == std::string::npos) break;
         at = comma + 1;
       }
     }},
    {"--spawn-via", "COMMAND",
     "start each process the job starts as COMMAND ADDRESS\n"
     "BINARY ARGS... (COMMAND: words split on spaces; e.g. a\n"
     "script entering ADDRESS's network namespace that execs\n"
     "the rest)",
     [](options& o, flag_reader& r) { o.spawn_via = r.value(); }},
    {"--help", "", "print this text and exit (also -h)", [](options& o, flag_reader&) { o.help = true; }},
};

std::string make_usage() {
  std::string text =
      "usage: weight_sync [FLAG [VALUE] | FLAG=VALUE]...\n"
      "The main job: a trainer pushes --updates rounds of a synthetic LLM's weights to\n"
      "--workers processes and verifies every tensor on every worker; the last line on\n"
      "stdout is one JSON object.\n";
  constexpr std::size_t column = 34;
  for (const auto& f : table) {
    std::string head = "  " + std::string(f.name);
    if (!f.value.empty()) head += " " + std::string(f.value);
    // The help starts in `column` (on the next line when the flag is wider).
    text +=
        head.size() < column ? head + std::string(column - head.size(), ' ') : head + "\n" + std::string(column, ' ');
    std::string_view help = f.help;
    for (auto nl = help.find('\n'); nl != std::string_view::npos; nl = help.find('\n')) {
      text += std::string(help.substr(0, nl)) + "\n" + std::string(column, ' ');
      help.remove_prefix(nl + 1);
    }
    text += std::string(help) + "\n";
  }
  text += "SIZE: bytes with an optional K/M/G suffix (powers of 1024), e.g. 1G or 512M.\n";
  return text;
}

}  // namespace

std::string flag_reader::value() {
  if (!inline_.empty()) return inline_;
  if (index_ + 1 >= argc_) throw_error(errc::invalid_argument, name_ + " needs a value");
  return argv_[++index_];
}

long flag_reader::integer(long lo, long hi) {
  std::string v = value();
  char* end = nullptr;
  long n = std::strtol(v.c_str(), &end, 10);
  if (!end || *end || n < lo || n > hi)
    throw_error(errc::invalid_argument, name_ + ": expected an integer in [" + std::to_string(lo) + ", " +
                                            std::to_string(hi) + "], got '" + v + "'");
  return n;
}

std::span<const flag> flags() { return table; }

const std::string& usage() {
  static const std::string text = make_usage();
  return text;
}

options parse_args(int argc, char** argv) {
  options o;
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    std::string value;
    if (auto eq = a.find('='); eq != std::string::npos) {
      value = a.substr(eq + 1);
      a = a.substr(0, eq);
    }
    if (a == "-h") a = "--help";
    const flag* f = nullptr;
    for (const auto& candidate : table)
      if (candidate.name == a) f = &candidate;
    if (!f) throw_error(errc::invalid_argument, "unknown flag '" + a + "'\n" + usage());
    flag_reader reader(a, value, argc, argv, i);
    f->set(o, reader);
    if (o.help) return o;
  }
  if (o.role != "trainer" && o.role != "worker" && o.role != "trainer-rank")
    throw_error(errc::invalid_argument, "--role: expected trainer or worker, got '" + o.role + "'");
  if (o.sharded_job()) {
    if (o.workers_given && o.workers != o.tp)
      throw_error(errc::invalid_argument, "--workers " + std::to_string(o.workers) + " and --tp " +
                                              std::to_string(o.tp) +
                                              ": with --tp the workers are the tp ranks of one engine (give one)");
    o.workers = o.tp;
    if (o.broadcast && o.trainers != 1)
      throw_error(errc::invalid_argument, "--broadcast: one trainer sends the whole model (drop --trainers)");
    if (!o.connect.empty() || o.one_tensor || !o.advertise.empty())
      throw_error(errc::invalid_argument,
                  "--trainers/--tp: --connect, --one-tensor and --advertise-port are for the one-trainer job");
    if (!o.topology.empty() && !o.broadcast)
      throw_error(errc::invalid_argument,
                  "--topology: sharded transfers connect every worker to every rank (use it with --broadcast)");
    // --engine picks the transport family: tcp (tcp_sharded) or ucx (ucx_sharded).
    const bool over_ucx = o.engine == "ucx" || o.engine == "ucx_sharded";
    if (!over_ucx && o.engine != "tcp" && o.engine != "tcp_sharded")
      throw_error(errc::invalid_argument,
                  "--trainers/--tp: the sharded job runs over tcp or ucx (tcp_sharded, "
                  "ucx_sharded; --broadcast: tcp, ucx), not '" +
                      o.engine + "'");
    o.engine = o.broadcast ? (over_ucx ? "ucx" : "tcp") : (over_ucx ? "ucx_sharded" : "tcp_sharded");
  }
  if (!o.spawn_hosts.empty() &&
      (!o.sharded_job() || o.broadcast || o.spawn_hosts.size() != static_cast<std::size_t>(o.tp + o.trainers - 1)))
    throw_error(errc::invalid_argument,
                "--spawn-hosts: the sharded job's (--trainers M --tp N, not --broadcast) N + M - 1 addresses: "
                "workers 0..N-1, then trainer ranks 1..M-1");
  if (!o.replay.empty() && (o.sharded_job() || o.one_tensor || o.change_fraction > 0))
    throw_error(errc::invalid_argument,
                "--replay: the trajectory is the model and its changes (drop --trainers/--tp, --one-tensor and "
                "--change-fraction)");
  if (o.delta) {
    if (o.sharded_job() && o.broadcast)
      throw_error(errc::invalid_argument,
                  "--delta: --broadcast workers slice whole tensors on arrival and hold no base to decode against");
    if (o.sharded_job() ? o.engine != "tcp_sharded" : o.engine != "tcp" && o.engine != "ucx")
      throw_error(errc::invalid_argument,
                  "--delta: the tcp and ucx engines (tcp_sharded in the sharded job) send "
                  "deltas, not '" +
                      o.engine + "'");
    if (o.no_direct)
      throw_error(errc::invalid_argument,
                  "--delta: a worker decodes deltas against its model's memory, which --no-direct hides");
  }
  if (o.ucx_put_into_model && o.engine != "ucx" && o.engine != "ucx_sharded")
    throw_error(errc::invalid_argument, "--ucx-puts/--ucx-tagged: for --engine ucx, not '" + o.engine + "'");
  if (o.secret_file.empty())
    if (const char* env = std::getenv("REFIT_AUTH_SECRET_FILE")) o.secret_file = env;
  if (!o.secret_file.empty()) o.secret = auth::read_secret_file(o.secret_file);
  if (!o.connect.empty()) o.workers = static_cast<int>(o.connect.size());
  if (o.connect.empty()) o.load_model = true;  // workers this trainer starts always get the model
  if (o.advertise.size() > 1 && o.advertise.size() != static_cast<std::size_t>(o.workers))
    throw_error(errc::invalid_argument,
                "--advertise-port: give one port, or one per worker (" + std::to_string(o.workers) + ")");
  return o;
}

}  // namespace refit::example::weight_sync
