// A libtorch trainer syncs a small Llama-like module to a tensor-parallel worker
// group, and checks that the workers compute what the trainer computes.
//
//   bazel run //examples/torch_module_sync            # tp 2: two worker processes
//
// The trainer (this process) holds the model the way Hugging Face names it (q/k/v,
// gate/up unfused, whole). It starts `--tp` workers (this binary, --role worker),
// each holding the model the way vLLM does: fused qkv_proj and gate_up_proj and
// only its rank's shards of the column- and row-parallel layers (model.h),
// initialised from another seed. Each round the trainer streams its parameters
// (lib/torch torch_source) over the TCP engine; each worker loads them through a
// module_target (renames none, vllm_stacked_params, vllm_llama_shards) that is also
// the engine context's model, so every update is validated against the worker's
// module before a byte is written, and written in place (the trainer checks that
// the parameters' addresses never move). Round 2 and later first take an Adam step
// on a next-token loss, so each sync carries new values. Last, an update whose
// metadata does not fit (one KV head too many) must be refused by every worker
// before any byte moves, leaving the weights as they were.
//
// After each sync the trainer runs the forward pass on the workers and compares it
// with its own. Workers are separate processes with no collective between them,
// so THE TRAINER PLAYS THE ALL-REDUCE of Megatron-style tensor parallelism: for
// every attention and MLP block it sends the residual stream to every worker
// ("forward_partial"), each answers its row-parallel layer's output before the
// all-reduce (o_proj or down_proj over its own heads or slice), and the trainer
// sums the answers and adds the residual. The replicated parts (embedding, final
// norm and lm_head) are computed and compared on every worker. Compared: the
// embedding and lm_head outputs of each worker and the residual stream after each
// block, against the trainer's full forward; float32 on both sides, so the only
// differences are summation order (tolerance 1e-4).
//
// Progress goes to stderr; the LAST line on stdout is one JSON object (workers, tp,
// parameters, bytes, max_abs_diff, outputs_match, ...). Exit status 0 only if every
// compared output matched and the workers' parameters stayed in place.
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <iostream>
#include <string>
#include <thread>
#include <vector>

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/nn/functional/loss.h>
#include <torch/optim/adam.h>
#include <torch/utils.h>
#include <asio/co_spawn.hpp>
#include <asio/io_context.hpp>

#include <refit/control/worker_group.h>
#include <refit/control/worker_host.h>
#include <refit/factory.h>
#include <refit/json_reader.h>
#include <refit/torch/source.h>
#include <refit/torch/target.h>
#include "examples/common/worker_process.h"
#include "examples/torch_module_sync/model.h"

namespace refit::example {
namespace {

using clock_type = std::chrono::steady_clock;
constexpr double tolerance = 1e-4;  // float32, summation order only
constexpr std::int64_t batch = 2, seq_len = 8;

struct options {
  std::string role = "trainer";
  int tp = 2;                    // trainer: workers to start (one per rank)
  int tp_rank = 0, tp_size = 1;  // worker
  int rounds = 2;
  std::int64_t timeout_ms = 30000;
  std::uint64_t seed = 7;
};

const char* usage =
    "usage: torch_module_sync [--tp 1|2] [--rounds N] [--timeout-ms MS] [--seed N]\n"
    "       torch_module_sync --role worker --tp-rank R --tp-size N [--timeout-ms MS] [--seed N]\n"
    "                         (started by the trainer; prints REFIT_WORKER_PORT <port>)\n";

options parse_args(int argc, char** argv) {
  options o;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto integer = [&](long lo, long hi) {
      if (i + 1 >= argc) throw_error(errc::invalid_argument, a + " needs a value");
      const std::string v = argv[++i];
      char* end = nullptr;
      const long n = std::strtol(v.c_str(), &end, 10);
      if (v.empty() || !end || *end || n < lo || n > hi)
        throw_error(errc::invalid_argument, a + ": expected an integer in [" + std::to_string(lo) + ", " +
                                                std::to_string(hi) + "], got '" + v + "'");
      return n;
    };
    if (a == "--role") {
      if (i + 1 >= argc) throw_error(errc::invalid_argument, "--role needs a value");
      o.role = argv[++i];
    } else if (a == "--tp")
      o.tp = static_cast<int>(integer(1, 2));  // 2 KV heads: at most 2 ranks
    else if (a == "--tp-rank")
      o.tp_rank = static_cast<int>(integer(0, 1));
    else if (a == "--tp-size")
      o.tp_size = static_cast<int>(integer(1, 2));
    else if (a == "--rounds")
      o.rounds = static_cast<int>(integer(1, 100));
    else if (a == "--timeout-ms")
      o.timeout_ms = integer(100, 3600000);
    else if (a == "--seed")
      o.seed = static_cast<std::uint64_t>(integer(0, 1L << 30));
    else if (a == "--help" || a == "-h") {
      std::cout << usage;
      std::exit(0);
    } else
      throw_error(errc::invalid_argument, "unknown flag '" + a + "'\n" + usage);
  }
  if (o.role != "trainer" && o.role != "worker")
    throw_error(errc::invalid_argument, "--role: expected trainer or worker, got '" + o.role + "'");
  if (o.tp_rank >= o.tp_size)
    throw_error(errc::invalid_argument,
                "--tp-rank " + std::to_string(o.tp_rank) + " is not below --tp-size " + std::to_string(o.tp_size));
  return o;
}

// Activations cross the control plane as {"shape": [...], "data": [...]}: small
// here, and float32 -> JSON double -> float32 is exact.
json to_json(const at::Tensor& t) {
  const at::Tensor c = t.detach().to(at::kFloat).contiguous();
  const float* p = c.data_ptr<float>();
  return json{{"shape", c.sizes().vec()}, {"data", std::vector<float>(p, p + c.numel())}};
}

json tokens_json(const at::Tensor& t) {
  const at::Tensor c = t.contiguous();
  const std::int64_t* p = c.data_ptr<std::int64_t>();
  return json{{"shape", c.sizes().vec()}, {"data", std::vector<std::int64_t>(p, p + c.numel())}};
}

template <class T>
at::Tensor from_json(json_reader r, const std::vector<std::int64_t>& expected_shape) {
  auto shape = r.required<std::vector<std::int64_t>>("shape");
  auto data = r.required<std::vector<T>>("data");
  r.finish();
  if (shape != expected_shape)
    r.fail("shape " + json(shape).dump() + " differs from the expected " + json(expected_shape).dump());
  std::int64_t n = 1;
  for (auto d : shape) n *= d;
  if (static_cast<std::int64_t>(data.size()) != n)
    r.fail("data has " + std::to_string(data.size()) + " values, shape " + json(shape).dump() + " has " +
           std::to_string(n));
  return at::tensor(at::ArrayRef<T>(data)).view(shape);
}

// ---------------------------------------------------------------- worker

int run_worker(const options& o) {
  // Never outlive the trainer: the signal covers its death from now on, the check
  // a death while this process was still loading libtorch.
  die_with_trainer();
  at::set_num_threads(1);
  torch::manual_seed(o.seed + 1000 + static_cast<std::uint64_t>(o.tp_rank));  // not the trainer's weights
  const model_config cfg;
  llama_model model(cfg, model_layout{.fused = true, .tp_rank = o.tp_rank, .tp_size = o.tp_size});
  libtorch::target_options topt;
  topt.fused = libtorch::vllm_stacked_params();
  topt.shards = libtorch::vllm_llama_shards();
  topt.tp_rank = o.tp_rank;
  topt.tp_size = o.tp_size;
  libtorch::module_target target(model, topt);

  asio::io_context io;
  weight_transfer_config config;
  config.backend = "tcp";
  config.timeout = std::chrono::milliseconds(o.timeout_ms);
  engine_context ctx;
  ctx.executor = io.get_executor();
  ctx.ranks.tp_rank = o.tp_rank;
  ctx.ranks.tp_size = o.tp_size;
  ctx.model = &target;  // the engine validates each update against the module first
  control::worker_host host(config, ctx, target.as_load_weights());
  const auto port = host.listen("127.0.0.1", 0);

  const std::vector<std::int64_t> hidden_shape = {batch, seq_len, cfg.hidden};
  // The replicated embedding: {"tokens": {"shape", "data"}} -> hidden states.
  host.add_method("embed", [&](const json& params) -> asio::awaitable<json> {
    json_reader r(params, "embed params");
    at::Tensor tokens = from_json<std::int64_t>(r.object("tokens"), {batch, seq_len});
    r.finish();
    if (tokens.min().item<std::int64_t>() < 0 || tokens.max().item<std::int64_t>() >= cfg.vocab)
      r.fail("tokens must lie in [0, " + std::to_string(cfg.vocab) + ")");
    torch::NoGradGuard no_grad;
    co_return to_json(model.embed(tokens));
  });
  // This rank's partial output of one block, before the all-reduce:
  // {"layer": int, "part": "attn" | "mlp", "input": residual stream}.
  host.add_method("forward_partial", [&](const json& params) -> asio::awaitable<json> {
    json_reader r(params, "forward_partial params");
    const auto layer = r.required<std::int64_t>("layer");
    const auto part = r.required<std::string>("part");
    at::Tensor h = from_json<float>(r.object("input"), hidden_shape);
    r.finish();
    if (layer < 0 || layer >= cfg.layers)
      r.fail("layer " + std::to_string(layer) + " is not in [0, " + std::to_string(cfg.layers) + ")");
    if (part != "attn" && part != "mlp") r.fail("part: expected \"attn\" or \"mlp\", got \"" + part + "\"");
    torch::NoGradGuard no_grad;
    co_return to_json(part == "attn" ? model.attention_partial(layer, h) : model.mlp_partial(layer, h));
  });
  // The replicated head: {"input": residual stream} -> logits.
  host.add_method("logits", [&](const json& params) -> asio::awaitable<json> {
    json_reader r(params, "logits params");
    at::Tensor h = from_json<float>(r.object("input"), hidden_shape);
    r.finish();
    torch::NoGradGuard no_grad;
    co_return to_json(model.logits(h));
  });
  // Where each parameter's data lives: in-place updates keep these.
  host.add_method("addresses", [&](const json&) -> asio::awaitable<json> {
    json out = json::object();
    for (const auto& [name, t] : target.tensors()) out[name] = reinterpret_cast<std::uintptr_t>(t.data_ptr());
    co_return out;
  });
  return serve_worker(io, host, port);
}

// ---------------------------------------------------------------- trainer

// Starts this binary as worker `rank` and reads the control port it prints.
pid_t start_worker(const options& o, int rank, std::uint16_t& port) {
  auto w = start_worker_process(
      {"torch_module_sync", "--role", "worker", "--tp-rank", std::to_string(rank), "--tp-size", std::to_string(o.tp),
       "--timeout-ms", std::to_string(o.timeout_ms), "--seed", std::to_string(o.seed)},
      std::chrono::milliseconds(o.timeout_ms), "worker " + std::to_string(rank));
  port = w.port;
  return w.pid;
}

struct comparison {
  double max_abs_diff = 0;
  std::string worst;  // where max_abs_diff was seen
  std::uint64_t values = 0;

  void add(double d, const std::string& what, std::uint64_t n) {
    if (std::isnan(d)) d = INFINITY;  // NaN counts as the worst
    if (d > max_abs_diff || worst.empty()) {
      max_abs_diff = d;
      worst = what;
    }
    values += n;
  }
  void add(const at::Tensor& expected, const json& answer, const std::string& what) {
    at::Tensor got = from_json<float>(json_reader(answer, what), expected.sizes().vec());
    add((got - expected).abs().max().item<double>(), what, static_cast<std::uint64_t>(expected.numel()));
  }
  void add(const comparison& other, const std::string& prefix) {
    add(other.max_abs_diff, prefix + other.worst, other.values);
  }
};

constexpr const char* block_parts[] = {"attn", "mlp"};

// The workers' forward pass, the trainer summing the row-parallel partials, against
// the trainer's own (`expected`: llama_model::trace).
asio::awaitable<comparison> compare_forward(control::worker_group& workers, const at::Tensor& tokens,
                                            const std::vector<at::Tensor>& expected, std::int64_t layers) {
  comparison cmp;
  json embed_params = json::object();
  embed_params["tokens"] = tokens_json(tokens);
  auto embedded = co_await workers.call_all("embed", embed_params);
  for (std::size_t r = 0; r < embedded.size(); ++r)
    cmp.add(expected[0], embedded[r], "embedding (rank " + std::to_string(r) + ")");
  at::Tensor h = from_json<float>(json_reader(embedded[0], "embedding"), expected[0].sizes().vec());
  std::size_t step = 1;
  for (std::int64_t layer = 0; layer < layers; ++layer) {
    for (const char* part : block_parts) {
      json params = json::object();
      params["layer"] = layer;
      params["part"] = part;
      params["input"] = to_json(h);
      auto partials = co_await workers.call_all("forward_partial", params);
      at::Tensor sum = h.clone();  // the all-reduce, plus the residual
      for (std::size_t r = 0; r < partials.size(); ++r)
        sum += from_json<float>(json_reader(partials[r], "forward_partial answer"), h.sizes().vec());
      cmp.add((sum - expected[step]).abs().max().item<double>(),
              "layer " + std::to_string(layer) + " " + part + " output", static_cast<std::uint64_t>(sum.numel()));
      ++step;
      h = sum;
    }
  }
  json head_params = json::object();
  head_params["input"] = to_json(h);
  auto logits = co_await workers.call_all("logits", head_params);
  for (std::size_t r = 0; r < logits.size(); ++r)
    cmp.add(expected[step], logits[r], "logits (rank " + std::to_string(r) + ")");
  co_return cmp;
}

// Each worker's answer to an update that does not fit its module: both must refuse
// it (invalid_argument naming the fused tensor) before any byte moves, and stay
// clean at `version`. The trainer sends nothing: the workers refuse on the
// metadata alone.
asio::awaitable<std::string> check_refusal(control::worker_group& workers, const update_metadata& good,
                                           std::int64_t version) {
  update_metadata bad = good;
  const std::string victim = "model.layers.0.self_attn.k_proj.weight";
  const std::string fused = "model.layers.0.self_attn.qkv_proj.weight";  // what the refusal names
  for (auto& t : bad.tensors)
    if (t.name == victim) t.shape[0] += 16;  // one KV head too many
  json body = json::object();
  write_update_metadata(bad, body["update_info"]);
  const json empty = json::object();
  co_await workers.call_all("start_weight_update", empty);
  std::string problem;
  for (std::size_t i = 0; i < workers.size() && problem.empty(); ++i) {
    std::string message;
    try {
      co_await workers.at(i).call("update_weights", body);
      problem = "worker rank " + std::to_string(i) + " accepted an update with a wrong shape of " + victim;
    } catch (const error& e) {
      if (e.kind() != errc::invalid_argument || e.message().find(fused) == std::string::npos)
        problem = "worker rank " + std::to_string(i) + " refused the wrong update with: " + e.message();
      else
        message = e.message();
    }
    if (i == 0 && !message.empty())
      std::fprintf(stderr, "[torch_module_sync] wrong update refused: %s\n", message.c_str());
  }
  const auto infos = co_await workers.call_all("weight_info", empty);
  for (std::size_t i = 0; i < infos.size() && problem.empty(); ++i)
    if (infos[i]["state"] != "clean" || infos[i]["weight_version"] != version)
      problem = "worker rank " + std::to_string(i) + " after the refused update: state " + infos[i]["state"].dump() +
                ", weight_version " + infos[i]["weight_version"].dump();
  co_return problem;
}

struct report {
  int rounds_done = 0;
  bool refusal_checked = false;
  std::string refusal_problem;  // empty: the wrong update was refused and changed nothing
  comparison worst;             // over every comparison after a sync
  double diff_before_sync = 0;  // the workers' own initial weights: must differ
  bool addresses_stable = true;
  double sync_seconds = 0;  // all rounds
  std::vector<double> losses;
};

asio::awaitable<void> trainer_main(const options& o, const std::vector<std::uint16_t>& ports, llama_model& model,
                                   report& rep) {
  auto ex = co_await asio::this_coro::executor;
  const auto timeout = std::chrono::milliseconds(o.timeout_ms);
  std::vector<control::worker_endpoint> endpoints;
  for (auto port : ports) endpoints.push_back({"127.0.0.1", port});
  control::worker_group workers(ex, timeout, "", std::move(endpoints),
                                [](std::size_t i) { return "worker rank " + std::to_string(i); });
  co_await workers.connect();

  weight_transfer_config config;
  config.backend = "tcp";
  config.timeout = timeout;
  auto sender = engine_factory::instance().create_sender(config, trainer_context{ex, {}});
  json trainer_args = {
      {"master_address", "127.0.0.1"}, {"master_port", 0}, {"world_size", o.tp + 1}, {"timeout_ms", o.timeout_ms}};
  // The workers are one inference engine with tp ranks: the same init info for all,
  // each joins as rank_offset + tp_rank. A refusal also shuts the sender down, so
  // init fails now rather than at the sender's deadline.
  control::init_options init;
  init.ranks = control::rank_layout::shared;
  co_await workers.init(*sender, trainer_args, init);
  std::fprintf(stderr, "[torch_module_sync] %d workers (tp %d) connected over tcp\n", o.tp, o.tp);

  libtorch::torch_source source(model);
  const json empty = json::object();
  // The workers' forward pass is the check here (their modules hold the weights
  // fused and sharded, so no fingerprint of the trainer's would match).
  control::update_options unchecked;
  unchecked.verify = false;

  const at::Tensor tokens = at::randint(model.config().vocab, {batch, seq_len}, at::kLong);
  auto expected_now = [&] {
    torch::NoGradGuard no_grad;
    return model.trace(tokens);
  };
  const auto addresses = co_await workers.call_all("addresses", empty);

  const auto initial = expected_now();
  const comparison before = co_await compare_forward(workers, tokens, initial, model.config().layers);
  rep.diff_before_sync = before.max_abs_diff;
  std::fprintf(stderr, "[torch_module_sync] before any sync: max_abs_diff %.3g (the workers' own weights)\n",
               before.max_abs_diff);

  torch::optim::Adam optimizer(model.parameters(), torch::optim::AdamOptions(1e-2));
  for (int round = 1; round <= o.rounds; ++round) {
    if (round > 1) {  // a training step: new values in the same tensors
      optimizer.zero_grad();
      at::Tensor logits = model.trace(tokens).back();
      at::Tensor loss = torch::nn::functional::cross_entropy(
          logits.slice(1, 0, seq_len - 1).reshape({-1, model.config().vocab}), tokens.slice(1, 1).reshape({-1}));
      loss.backward();
      optimizer.step();
      rep.losses.push_back(loss.item<double>());
    }
    const auto t0 = clock_type::now();
    source.rewind();
    co_await workers.update(*sender, source.metadata(), source, round, unchecked);
    const double seconds = std::chrono::duration<double>(clock_type::now() - t0).count();
    rep.sync_seconds += seconds;

    const auto expected = expected_now();
    const comparison cmp = co_await compare_forward(workers, tokens, expected, model.config().layers);
    rep.worst.add(cmp, "round " + std::to_string(round) + ": ");
    const auto now = co_await workers.call_all("addresses", empty);
    const bool stable = now == addresses;
    rep.addresses_stable = rep.addresses_stable && stable;
    ++rep.rounds_done;
    std::fprintf(stderr,
                 "[torch_module_sync] round %d: %zu tensors, %llu bytes -> %d workers in %.3f s; %llu outputs "
                 "compared, max_abs_diff %.3g (%s)%s%s\n",
                 round, source.size(), static_cast<unsigned long long>(source.metadata().total_bytes()), o.tp, seconds,
                 static_cast<unsigned long long>(cmp.values), cmp.max_abs_diff, cmp.worst.c_str(),
                 cmp.max_abs_diff <= tolerance ? ", match" : ", MISMATCH", stable ? "" : "; worker parameters MOVED");
  }
  // Validation: a wrong update is refused by every worker, and the outputs still
  // match afterwards (nothing was written).
  rep.refusal_problem = co_await check_refusal(workers, source.metadata(), o.rounds);
  const auto expected = expected_now();
  const comparison after = co_await compare_forward(workers, tokens, expected, model.config().layers);
  rep.worst.add(after, "after the refused update: ");
  rep.refusal_checked = true;
  std::fprintf(stderr, "[torch_module_sync] after the refused update: max_abs_diff %.3g%s\n", after.max_abs_diff,
               after.max_abs_diff <= tolerance ? ", match" : ", MISMATCH");
  if (!rep.refusal_problem.empty())
    std::fprintf(stderr, "[torch_module_sync] validation: %s\n", rep.refusal_problem.c_str());
  try {
    co_await workers.call_all("shutdown", empty);
  } catch (const error&) {
  }
  sender->shutdown();
  workers.close();
}

int run_trainer(const options& o) {
  at::set_num_threads(1);
  torch::manual_seed(o.seed);
  const model_config cfg;
  llama_model model(cfg, model_layout{});
  const libtorch::torch_source layout(model);  // what each sync sends
  std::fprintf(stderr,
               "[torch_module_sync] trainer model: %zu tensors, %llu bytes float32 (vocab %lld, hidden %lld, %lld "
               "layers, %lld/%lld heads); libtorch %s\n",
               layout.size(), static_cast<unsigned long long>(layout.metadata().total_bytes()),
               static_cast<long long>(cfg.vocab), static_cast<long long>(cfg.hidden),
               static_cast<long long>(cfg.layers), static_cast<long long>(cfg.heads),
               static_cast<long long>(cfg.kv_heads), std::string(libtorch::libtorch_version()).c_str());

  std::vector<pid_t> pids;
  report rep;
  std::string failure;
  const auto t0 = clock_type::now();
  try {
    std::vector<std::uint16_t> ports(static_cast<std::size_t>(o.tp));
    for (int r = 0; r < o.tp; ++r) pids.push_back(start_worker(o, r, ports[static_cast<std::size_t>(r)]));
    asio::io_context io;
    std::exception_ptr error;
    asio::co_spawn(io, trainer_main(o, ports, model, rep), [&](std::exception_ptr e) { error = e; });
    io.run();
    if (error) std::rethrow_exception(error);
  } catch (const error& e) {
    failure = std::string(errc_name(e.kind())) + ": " + e.message();
  } catch (const std::exception& e) {
    failure = e.what();
  }
  if (!failure.empty()) std::fprintf(stderr, "[torch_module_sync] error: %s\n", failure.c_str());
  for (pid_t pid : pids) {
    if (!failure.empty()) kill(pid, SIGTERM);
    reap_worker(pid, std::chrono::milliseconds(o.timeout_ms));
  }
  const bool match = failure.empty() && rep.rounds_done == o.rounds && rep.worst.max_abs_diff <= tolerance;
  const bool refused = rep.refusal_checked && rep.refusal_problem.empty();
  json result = {{"workers", o.tp},
                 {"tp", o.tp},
                 {"engine", "tcp"},
                 {"parameters", layout.size()},
                 {"bytes", layout.metadata().total_bytes()},
                 {"rounds", rep.rounds_done},
                 {"outputs_compared", rep.worst.values},
                 {"max_abs_diff", rep.worst.max_abs_diff},
                 {"worst_output", rep.worst.worst},
                 {"tolerance", tolerance},
                 {"max_abs_diff_before_sync", rep.diff_before_sync},
                 {"outputs_match", match},
                 {"addresses_stable", failure.empty() && rep.addresses_stable},
                 {"wrong_update_refused", refused},
                 {"losses", rep.losses},
                 {"sync_seconds", rep.sync_seconds},
                 {"seconds", std::chrono::duration<double>(clock_type::now() - t0).count()},
                 {"libtorch", std::string(libtorch::libtorch_version())}};
  if (!failure.empty())
    result["error"] = failure;
  else if (!rep.refusal_problem.empty())
    result["error"] = rep.refusal_problem;
  std::cout << result.dump() << std::endl;
  return match && rep.addresses_stable && refused ? 0 : 1;
}

}  // namespace
}  // namespace refit::example

int main(int argc, char** argv) {
  using namespace refit::example;
  options o;
  try {
    o = parse_args(argc, argv);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "torch_module_sync: %s\n", e.what());
    return 2;
  }
  return o.role == "worker" ? run_worker(o) : run_trainer(o);
}
