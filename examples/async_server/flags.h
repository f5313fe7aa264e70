// Command-line flags of the async server example: "--name value" or "--name=value".
#pragma once

#include <cstdio>
#include <cstdlib>
#include <iostream>
#include <optional>
#include <string>

#include <refit/error.h>

namespace refit::example {

class flag_parser {
 public:
  flag_parser(int argc, char** argv, const char* usage) : argc_(argc), argv_(argv), usage_(usage) {}

  /// Moves to the next flag; false at the end. --help prints the usage and exits.
  bool next() {
    if (++i_ >= argc_) return false;
    name_ = argv_[i_];
    value_.reset();
    if (auto eq = name_.find('='); eq != std::string::npos) {
      value_ = name_.substr(eq + 1);
      name_ = name_.substr(0, eq);
    }
    if (name_ == "--help" || name_ == "-h") {
      std::cout << usage_;
      std::exit(0);
    }
    return true;
  }
  bool is(const char* name) const { return name_ == name; }
  const std::string& name() const { return name_; }

  std::string value() {
    if (value_) return *value_;
    if (i_ + 1 >= argc_) throw_error(errc::invalid_argument, name_ + " needs a value");
    return argv_[++i_];
  }
  long integer(long lo, long hi) {
    const std::string v = value();
    char* end = nullptr;
    const long n = std::strtol(v.c_str(), &end, 10);
    if (v.empty() || !end || *end || n < lo || n > hi)
      throw_error(errc::invalid_argument, name_ + ": expected an integer in [" + std::to_string(lo) + ", " +
                                              std::to_string(hi) + "], got '" + v + "'");
    return n;
  }
  [[noreturn]] void unknown() const { throw_error(errc::invalid_argument, "unknown flag '" + name_ + "'\n" + usage_); }

 private:
  int argc_;
  char** argv_;
  std::string usage_;
  int i_ = 0;
  std::string name_;
  std::optional<std::string> value_;
};

}  // namespace refit::example
