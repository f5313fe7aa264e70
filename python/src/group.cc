// _WorkerGroup, which refit/_group.py wraps: the trainer's control client of many
// workers (init, update, calls and fingerprints), sending through a _Sender.
#include <refit/control/fleet.h>
#include <refit/control/worker_group.h>
#include <refit/error.h>
#include <refit/integrity/auth.h>

#include "bindings.h"
#include "sender.h"

namespace refit::py {
namespace {

using control::worker_group;

std::vector<control::worker_endpoint> read_endpoints(nb::handle endpoints) {
  std::vector<control::worker_endpoint> out;
  for (nb::handle e : endpoints) {
    control::worker_endpoint ep;
    if (PyUnicode_Check(e.ptr())) {
      std::string text = nb::cast<std::string>(e);
      auto colon = text.rfind(':');
      if (colon == std::string::npos)
        throw_error(errc::invalid_argument, "WorkerGroup: expected 'host:port', got '" + text + "'");
      ep.host = text.substr(0, colon);
      try {
        int port = std::stoi(text.substr(colon + 1));
        if (port <= 0 || port > 65535) throw std::out_of_range("port");
        ep.port = static_cast<std::uint16_t>(port);
      } catch (const std::exception&) {
        throw_error(errc::invalid_argument, "WorkerGroup: bad port in '" + text + "'");
      }
    } else {
      auto pair = nb::cast<std::pair<std::string, int>>(e);
      if (pair.second <= 0 || pair.second > 65535)
        throw_error(errc::invalid_argument, "WorkerGroup: bad port " + std::to_string(pair.second));
      ep.host = pair.first;
      ep.port = static_cast<std::uint16_t>(pair.second);
    }
    out.push_back(std::move(ep));
  }
  if (out.empty()) throw_error(errc::invalid_argument, "WorkerGroup: no endpoints");
  return out;
}

class py_worker_group {
 public:
  py_worker_group(nb::handle endpoints, std::int64_t timeout_ms, const std::optional<std::string>& secret_file) {
    if (timeout_ms <= 0) throw_error(errc::invalid_argument, "timeout_ms: expected a positive number");
    std::string secret = secret_file && !secret_file->empty() ? auth::read_secret_file(*secret_file) : std::string();
    group_ = std::make_unique<worker_group>(runtime::get().executor(), std::chrono::milliseconds(timeout_ms),
                                            std::move(secret), read_endpoints(endpoints));
  }
  ~py_worker_group() { teardown(destroy(std::move(group_))); }
  static asio::awaitable<void> destroy(std::unique_ptr<worker_group> group) {
    group->close();
    group.reset();
    co_return;
  }

  asio::awaitable<void> connect() { co_await group_->connect(); }
  static asio::awaitable<json> init(worker_group* group, weight_sender* sender, json args,
                                    control::init_options options) {
    co_return co_await group->init(*sender, std::move(args), options);
  }
  static asio::awaitable<json> update(worker_group* group, weight_sender* sender, std::shared_ptr<held_tensors> held,
                                      std::shared_ptr<const update_metadata> meta, std::int64_t version,
                                      control::update_options options) {
    auto result = co_await group->update(*sender, *meta, held->views(), version, options);
    json out;
    out["version"] = result.version;
    out["seconds"] = result.seconds;
    out["verified"] = result.verified;
    out["workers"] = json::array();
    for (const auto& w : result.workers) out["workers"].push_back(json{{"seconds", w.seconds}, {"stats", w.stats}});
    co_return out;
  }
  static asio::awaitable<json> call_all(worker_group* group, std::string method, json params) {
    auto answers = co_await group->call_all(std::move(method), std::move(params));
    co_return json(answers);
  }
  static asio::awaitable<json> reconcile(worker_group* group) { co_return co_await group->reconcile(); }
  static asio::awaitable<json> differences(worker_group* group, fingerprint_list expected, std::int64_t version) {
    auto diffs = co_await group->fingerprint_differences(std::move(expected), version);
    co_return json(diffs);
  }
  void close() {
    on_loop([this] {
      group_->close();
      return 0;
    });
  }
  std::size_t size() const { return group_->size(); }
  worker_group& group() { return *group_; }

 private:
  std::unique_ptr<worker_group> group_;
};

control::init_options make_init_options(const std::string& ranks) {
  control::init_options o;
  if (ranks == "per_worker")
    o.ranks = control::rank_layout::per_worker;
  else if (ranks == "shared")
    o.ranks = control::rank_layout::shared;
  else
    throw_error(errc::invalid_argument, "ranks: expected 'per_worker' or 'shared', got '" + ranks + "'");
  return o;
}

control::update_options make_update_options(bool verify, const std::optional<std::string>& commit,
                                            nb::handle update_info, nb::handle expected, std::optional<bool> delta,
                                            std::optional<std::uintptr_t> stream, bool fleet_atomic) {
  control::update_options o;
  o.verify = verify;
  o.fleet_atomic = fleet_atomic;
  o.delta = delta;
  o.producer_stream = producer_stream(stream);
  if (commit) {
    if (*commit == "in_place")
      o.commit = commit_mode::in_place;
    else if (*commit == "staged")
      o.commit = commit_mode::staged;
    else
      throw_error(errc::invalid_argument, "commit: expected 'in_place' or 'staged', got '" + *commit + "'");
  }
  if (!update_info.is_none()) o.update_info = to_json(update_info);
  if (!expected.is_none()) o.expected = fingerprints_from_python(expected);
  return o;
}

}  // namespace

void bind_worker_group(nb::module_& m) {
  auto to_py = [](json& j) { return to_python(j); };
  nb::class_<py_worker_group>(m, "_WorkerGroup")
      .def(nb::init<nb::handle, std::int64_t, const std::optional<std::string>&>(), nb::arg("endpoints"),
           nb::arg("timeout_ms"), nb::arg("auth_secret_file").none())
      .def("__len__", &py_worker_group::size)
      .def("close", &py_worker_group::close)
      .def("connect", [](py_worker_group& g) { block_on(g.connect()); })
      .def(
          "_start_connect",
          [](py_worker_group& g, nb::object done) { return start_void(g.connect(), std::move(done)); }, nb::arg("done"))
      .def(
          "init",
          [to_py](py_worker_group& g, py_sender& s, nb::handle args, const std::string& ranks) {
            json a = to_json(args);
            if (a.is_null()) a = json::object();
            json out = block_on(py_worker_group::init(&g.group(), &s.sender(), std::move(a), make_init_options(ranks)));
            return nb::cast<nb::dict>(to_py(out));
          },
          nb::arg("sender"), nb::arg("trainer_args").none(), nb::arg("ranks"))
      .def(
          "_start_init",
          [to_py](py_worker_group& g, py_sender& s, nb::handle args, const std::string& ranks, nb::object done) {
            json a = to_json(args);
            if (a.is_null()) a = json::object();
            return start<json>(py_worker_group::init(&g.group(), &s.sender(), std::move(a), make_init_options(ranks)),
                               to_py, std::move(done));
          },
          nb::arg("sender"), nb::arg("trainer_args").none(), nb::arg("ranks"), nb::arg("done"))
      .def(
          "update",
          [to_py](py_worker_group& g, py_sender& s, nb::handle tensors, std::int64_t version, bool verify,
                  std::optional<std::string> commit, nb::handle update_info, nb::handle expected, nb::handle metadata,
                  std::optional<bool> delta, std::optional<std::uintptr_t> stream, bool fleet_atomic) {
            auto [held, declared] = hold_for_send(tensors, metadata, "update", &s.cache());
            auto options = make_update_options(verify, commit, update_info, expected, delta, stream, fleet_atomic);
            json out = block_on(py_worker_group::update(&g.group(), &s.sender(), std::move(held), std::move(declared),
                                                        version, std::move(options)));
            return nb::cast<nb::dict>(to_py(out));
          },
          nb::arg("sender"), nb::arg("tensors"), nb::arg("version"), nb::arg("verify"), nb::arg("commit").none(),
          nb::arg("update_info").none(), nb::arg("expected").none(), nb::arg("metadata").none(),
          nb::arg("delta").none() = nb::none(), nb::arg("stream").none() = nb::none(), nb::arg("fleet_atomic") = false)
      .def(
          "_start_update",
          [to_py](py_worker_group& g, py_sender& s, nb::handle tensors, std::int64_t version, bool verify,
                  std::optional<std::string> commit, nb::handle update_info, nb::handle expected, nb::handle metadata,
                  std::optional<bool> delta, std::optional<std::uintptr_t> stream, bool fleet_atomic, nb::object done) {
            auto [held, declared] = hold_for_send(tensors, metadata, "update", &s.cache());
            auto options = make_update_options(verify, commit, update_info, expected, delta, stream, fleet_atomic);
            return start<json>(py_worker_group::update(&g.group(), &s.sender(), std::move(held), std::move(declared),
                                                       version, std::move(options)),
                               to_py, std::move(done));
          },
          nb::arg("sender"), nb::arg("tensors"), nb::arg("version"), nb::arg("verify"), nb::arg("commit").none(),
          nb::arg("update_info").none(), nb::arg("expected").none(), nb::arg("metadata").none(),
          nb::arg("delta").none(), nb::arg("stream").none(), nb::arg("fleet_atomic"), nb::arg("done"))
      .def(
          "call_all",
          [to_py](py_worker_group& g, const std::string& method, nb::handle params) {
            json p = to_json(params);
            if (p.is_null()) p = json::object();
            json out = block_on(py_worker_group::call_all(&g.group(), method, std::move(p)));
            return nb::cast<nb::list>(to_py(out));
          },
          nb::arg("method"), nb::arg("params").none())
      .def(
          "_start_call_all",
          [to_py](py_worker_group& g, const std::string& method, nb::handle params, nb::object done) {
            json p = to_json(params);
            if (p.is_null()) p = json::object();
            return start<json>(py_worker_group::call_all(&g.group(), method, std::move(p)), to_py, std::move(done));
          },
          nb::arg("method"), nb::arg("params").none(), nb::arg("done"))
      .def(
          "fingerprint_differences",
          [to_py](py_worker_group& g, nb::handle expected, std::int64_t version) {
            json out = block_on(py_worker_group::differences(&g.group(), fingerprints_from_python(expected), version));
            return nb::cast<nb::list>(to_py(out));
          },
          nb::arg("expected"), nb::arg("version"))
      .def("reconcile",
           [to_py](py_worker_group& g) {
             json out = block_on(py_worker_group::reconcile(&g.group()));
             return nb::cast<nb::dict>(to_py(out));
           })
      .def(
          "_start_reconcile",
          [to_py](py_worker_group& g, nb::object done) {
            return start<json>(py_worker_group::reconcile(&g.group()), to_py, std::move(done));
          },
          nb::arg("done"));
}

namespace {

control::call_outcome parse_outcome(const std::string& s) {
  if (s == "ok") return control::call_outcome::ok;
  if (s == "failed") return control::call_outcome::failed;
  if (s == "unknown") return control::call_outcome::unknown;
  throw_error(errc::invalid_argument,
              "fleet: a call's outcome is \"ok\", \"failed\" or \"unknown\", got \"" + s + "\"");
}

}  // namespace

// refit.integration.fleet: the fleet protocol's rules (lib/control/fleet.h) for
// drivers written in Python (refit.vllm's FleetClient).
void bind_fleet(nb::module_& m) {
  m.def(
      "_fleet_settle_failed_commit",
      [](const std::vector<std::string>& commits, const std::vector<std::string>& rollbacks) {
        std::vector<control::call_outcome> c, r;
        for (const auto& s : commits) c.push_back(parse_outcome(s));
        for (const auto& s : rollbacks) r.push_back(parse_outcome(s));
        const control::settlement settled = control::settle_failed_commit(c, r);
        json out = json::object();
        out["phases"] = json::array();
        for (auto p : settled.phases) out["phases"].push_back(std::string(control::to_string(p)));
        out["summary"] = settled.summary;
        return to_python(out);
      },
      nb::arg("commits"), nb::arg("rollbacks"));
  m.def(
      "_fleet_plan_reconcile",
      [](nb::handle members_in) {
        const json members_json = to_json(members_in);
        if (!members_json.is_array()) throw_error(errc::invalid_argument, "fleet: members must be a list of dicts");
        std::vector<control::fleet_member> members;
        for (const json& j : members_json) {
          if (!j.is_object()) throw_error(errc::invalid_argument, "fleet: each member is a dict, got " + j.dump());
          control::fleet_member mem;
          mem.name = j.value("name", std::string("member ") + std::to_string(members.size()));
          mem.session_open = j.value("session_open", false);
          mem.clean = j.value("clean", false);
          mem.version = j.value("version", json(nullptr));
          mem.holds_undo = j.value("holds_undo", false);
          mem.undo_version = j.value("undo_version", json(nullptr));
          members.push_back(std::move(mem));
        }
        const control::reconcile_plan plan = control::plan_reconcile(members);
        json out = json::object();
        out["version"] = plan.version;
        out["actions"] = json::array();
        for (auto a : plan.actions) out["actions"].push_back(std::string(control::to_string(a)));
        return to_python(out);
      },
      nb::arg("members"));
}

}  // namespace refit::py
