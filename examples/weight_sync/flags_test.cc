// The main job's flags: the usage text describes every flag the parser accepts,
// the parser accepts every flag of the table (with a value where it takes one)
// and refuses any other, and the sources name no flag outside the table (a flag
// parsed, or passed to a child, without an entry there fails here).
#include <sys/stat.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <regex>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include <refit/error.h>
#include "examples/weight_sync/flags.h"

namespace refit::example::weight_sync {
namespace {

std::set<std::string> table_names() {
  std::set<std::string> names;
  for (const auto& f : flags()) names.insert(std::string(f.name));
  return names;
}

options parse(std::vector<std::string> args) {
  args.insert(args.begin(), "weight_sync");
  std::vector<char*> argv;
  for (auto& a : args) argv.push_back(a.data());
  return parse_args(static_cast<int>(argv.size()), argv.data());
}

TEST(WeightSyncFlags, TableHoldsEveryFlag) {
  const auto names = table_names();
  EXPECT_EQ(names.size(), flags().size()) << "a flag is in the table twice";
  // Flags the trainer passes to the processes it starts, once missing from the usage.
  for (const char* name : {"--role", "--rank", "--slice-tp", "--tp-rank", "--stats-file", "--workers", "--help"})
    EXPECT_TRUE(names.count(name)) << name;
}

TEST(WeightSyncFlags, UsageDescribesEveryFlag) {
  const std::string& text = usage();
  for (const auto& f : flags()) {
    // A line of its own: "  --name VALUE   help".
    std::string head = "\n  " + std::string(f.name);
    if (!f.value.empty()) head += " " + std::string(f.value);
    const auto at = text.find(head);
    ASSERT_NE(at, std::string::npos) << f.name << " is not in the usage:\n" << text;
    const char after = text[at + head.size()];
    EXPECT_TRUE(after == ' ' || after == '\n') << f.name;
    EXPECT_FALSE(f.help.empty()) << f.name << " has no help text";
  }
}

TEST(WeightSyncFlags, ParserAcceptsEveryFlag) {
  // A secret file the auth flag can read (mode 0600, as read_secret_file demands).
  char path[] = "/tmp/weight_sync_flags_test.XXXXXX";
  const int fd = mkstemp(path);
  ASSERT_GE(fd, 0);
  ASSERT_EQ(write(fd, "secret\n", 7), 7);
  close(fd);
  ASSERT_EQ(chmod(path, 0600), 0);
  unsetenv("REFIT_AUTH_SECRET_FILE");
  // A valid value for each kind of value the usage shows.
  const std::map<std::string, std::string> sample = {
      {"N", "1"},
      {"M", "1"},
      {"SIZE", "1M"},
      {"MS", "1000"},
      {"NAME", "tcp"},
      {"ADDRESS", "127.0.0.1"},
      {"PATH", path},
      {"SECONDS_PER_GB", "0.5"},
      {"N[,N...]", "4001"},
      {"[HOST:]PORT,...", "127.0.0.1:4001"},
      {"F", "0.5"},
      {"DIR", "/tmp"},
      {"ADDRESS,...", "10.0.0.2,10.0.0.3"},
      {"COMMAND", "ip netns exec"},
  };
  for (const auto& f : flags()) {
    std::vector<std::vector<std::string>> forms;
    if (f.value.empty()) {
      forms.push_back({std::string(f.name)});
    } else {
      std::string v(f.value);
      if (auto bar = v.find('|'); bar != std::string::npos)
        v = v.substr(0, bar);  // alternatives: the first one
      else if (auto it = sample.find(v); it != sample.end())
        v = it->second;
      else
        FAIL() << f.name << ": no sample value for " << f.value << " (add one here)";
      forms.push_back({std::string(f.name), v});
      forms.push_back({std::string(f.name) + "=" + v});
    }
    // Flags that are for one engine only come with it.
    if (std::string_view(f.name).starts_with("--ucx-"))
      for (auto& form : forms) form.insert(form.end(), {"--engine", "ucx"});
    if (std::string_view(f.name) == "--spawn-hosts")  // the sharded job's: workers 0 and 1
      for (auto& form : forms) form.insert(form.end(), {"--tp", "2"});
    for (const auto& args : forms) {
      try {
        parse(args);
      } catch (const std::exception& e) {
        ADD_FAILURE() << args[0] << ": " << e.what();
      }
    }
  }
  std::remove(path);
}

TEST(WeightSyncFlags, ParserRefusesUnknownFlags) {
  for (const char* bad : {"--no-such-flag", "--tp-ran", "--worker", "-x", "workers"}) {
    try {
      parse({bad});
      ADD_FAILURE() << bad << " accepted";
    } catch (const error& e) {
      EXPECT_EQ(e.kind(), errc::invalid_argument);
      EXPECT_NE(e.message().find("unknown flag '" + std::string(bad) + "'"), std::string::npos) << e.message();
      EXPECT_NE(e.message().find(usage()), std::string::npos) << "the usage follows the message";
    }
  }
  EXPECT_THROW(parse({"--workers"}), error);  // a value flag without its value
}

// The message of the invalid_argument parse(args) throws ("" and a failure if none).
std::string refusal(std::vector<std::string> args) {
  try {
    parse(args);
  } catch (const error& e) {
    EXPECT_EQ(e.kind(), errc::invalid_argument) << e.message();
    return e.message();
  }
  ADD_FAILURE() << "accepted: " << ::testing::PrintToString(args);
  return "";
}

TEST(WeightSyncFlags, ChangeFraction) {
  EXPECT_EQ(parse({}).change_fraction, 0);  // off: every byte changes
  EXPECT_EQ(parse({"--change-fraction", "0.01"}).change_fraction, 0.01);
  EXPECT_EQ(parse({"--change-fraction=1"}).change_fraction, 1);
  for (const char* bad : {"0", "-0.1", "1.5", "x", "0.1x", "nan", ""})
    EXPECT_NE(refusal({"--change-fraction=" + std::string(bad)}).find("--change-fraction"), std::string::npos) << bad;
}

TEST(WeightSyncFlags, DeltaOnlyOverTcpStar) {
  EXPECT_FALSE(parse({}).delta);
  // The sharded job's engine follows --engine's transport family.
  EXPECT_EQ(parse({"--tp", "2"}).engine, "tcp_sharded");
  EXPECT_EQ(parse({"--engine", "ucx", "--trainers", "2", "--tp", "2"}).engine, "ucx_sharded");
  EXPECT_EQ(parse({"--engine", "ucx", "--tp", "2", "--broadcast"}).engine, "ucx");
  EXPECT_EQ(parse({"--engine", "ucx_sharded", "--tp", "2"}).engine, "ucx_sharded");
  EXPECT_NE(refusal({"--engine", "loopback", "--tp", "2"}).find("runs over tcp or ucx"), std::string::npos);
  // The sharded job commits staged and fleet-atomic too.
  EXPECT_TRUE(parse({"--trainers", "2", "--tp", "2", "--fleet-atomic"}).fleet_atomic);
  EXPECT_EQ(parse({"--tp", "2", "--commit", "staged"}).commit, commit_mode::staged);
  EXPECT_NE(refusal({"--tp", "2", "--connect", "127.0.0.1:1"}).find("one-trainer job"), std::string::npos);
  // Where the sharded job's processes listen: one address per worker, then per rank > 0.
  EXPECT_EQ(parse({"--trainers", "2", "--tp", "2", "--spawn-hosts", "10.0.0.2,10.0.0.3,10.0.0.4"}).spawn_hosts.size(),
            3u);
  EXPECT_NE(refusal({"--trainers", "2", "--tp", "2", "--spawn-hosts", "10.0.0.2,10.0.0.3"}).find("N + M - 1"),
            std::string::npos);
  EXPECT_NE(refusal({"--workers", "2", "--spawn-hosts", "10.0.0.2,10.0.0.3"}).find("sharded job"), std::string::npos);
  EXPECT_NE(refusal({"--tp", "2", "--spawn-hosts", "10.0.0.2,,"}).find("expected addresses"), std::string::npos);
  EXPECT_NE(refusal({"--ucx-puts"}).find("for --engine ucx"), std::string::npos);
  EXPECT_EQ(parse({"--engine", "ucx", "--ucx-tagged"}).ucx_put_into_model, false);
  EXPECT_TRUE(parse({"--delta"}).delta);  // tcp, two workers: a star by default
  EXPECT_TRUE(parse({"--delta", "--workers", "4", "--topology", "star", "--checksums"}).delta);
  EXPECT_TRUE(parse({"--delta", "--connect", "4001,4002,4003", "--topology", "star"}).delta);
  EXPECT_TRUE(parse({"--delta", "--workers", "3"}).delta);  // a chain: relays forward the deltas
  EXPECT_TRUE(parse({"--delta", "--topology", "tree:2", "--workers", "4"}).delta);
  EXPECT_TRUE(parse({"--delta", "--commit", "staged"}).delta);  // a session's commit records the version
  EXPECT_TRUE(parse({"--delta", "--engine", "ucx"}).delta);     // two workers: a star
  EXPECT_TRUE(parse({"--delta", "--engine", "ucx", "--workers", "4", "--topology", "star"}).delta);
  EXPECT_TRUE(parse({"--delta", "--engine", "ucx", "--workers", "3"}).delta);  // ucx relays forward them too
  EXPECT_TRUE(parse({"--delta", "--tp", "2"}).delta);                          // tcp_sharded, per (rank, worker)
  EXPECT_TRUE(parse({"--delta", "--trainers", "2", "--tp", "2", "--change-fraction", "0.01"}).delta);
  const std::vector<std::pair<std::vector<std::string>, std::string>> refused = {
      {{"--delta", "--engine", "tcp_sharded"}, "the tcp and ucx engines"},
      {{"--delta", "--no-direct"}, "--no-direct"},
      {{"--delta", "--tp", "2", "--broadcast", "--topology", "star"}, "--broadcast workers slice"},
      {{"--delta", "--engine", "ucx", "--tp", "2"}, "the tcp and ucx engines"},  // ucx_sharded: none
  };
  for (const auto& [args, says] : refused) {
    const std::string message = refusal(args);
    EXPECT_NE(message.find("--delta"), std::string::npos) << message;
    EXPECT_NE(message.find(says), std::string::npos) << ::testing::PrintToString(args) << ": " << message;
  }
}

TEST(WeightSyncFlags, HelpStopsParsing) {
  EXPECT_TRUE(parse({"--help", "--no-such-flag"}).help);
  EXPECT_TRUE(parse({"-h"}).help);
  EXPECT_FALSE(parse({"--quiet"}).help);
}

// Every "--flag" string literal in the binary's sources is a flag of the table:
// the parser's, the usage's and the ones the trainer passes to its children.
TEST(WeightSyncFlags, SourcesNameOnlyTableFlags) {
  const auto names = table_names();
  const std::regex literal("\"(--[a-z][a-z0-9-]*)");
  std::set<std::string> files;
  for (const auto& entry : std::filesystem::directory_iterator("examples/weight_sync")) {
    const std::string name = entry.path().filename().string();
    if ((name.ends_with(".cc") || name.ends_with(".h")) && !name.ends_with("_test.cc")) files.insert(name);
  }
  // The roles that start processes of this binary must be among what was read.
  for (const char* must : {"flags.cc", "trainer.cc", "sharded.cc", "main.cc"}) ASSERT_TRUE(files.count(must)) << must;
  std::set<std::string> seen;
  for (const auto& name : files) {
    std::ifstream in("examples/weight_sync/" + name);
    std::stringstream text;
    text << in.rdbuf();
    const std::string s = text.str();
    for (std::sregex_iterator it(s.begin(), s.end(), literal), end; it != end; ++it) {
      const std::string flag = (*it)[1];
      seen.insert(flag);
      EXPECT_TRUE(names.count(flag)) << name << " names " << flag << ", which is not in flags()";
    }
  }
  for (const char* child_flag : {"--slice-tp", "--tp-rank", "--rank", "--stats-file"})
    EXPECT_TRUE(seen.count(child_flag)) << child_flag << " not found in the sources: the scan reads nothing";
}

}  // namespace
}  // namespace refit::example::weight_sync
