#pragma once

// The command lines of the demo (examples/train/train.cpp) and of the benchmarks
// (bench/common.hpp): one parser, CLI11 (Debian's libcli11-dev), header-only. It gives `--help`,
// `--name value` and `--name=value`, and a clear error for an unknown option or a missing value;
// each program checks the values' meaning itself and says what it expected.

#include <CLI/CLI.hpp>

#include <cstdio>
#include <cstdlib>
#include <string>

namespace consort::cli {

/// A program's options on CLI11, with consort's conventions: `--help` prints the usage to stdout
/// and exits 0; an unknown option, an unexpected argument or a missing value prints
/// "PROGRAM: what was wrong" and the usage to stderr and exits 2.
///
/// Thread safety: not thread-safe; use it from main() only.
class parser {
public:
  parser(std::string program, const std::string& summary)
      : program_(std::move(program)), app_(summary, program_) {
    app_.allow_windows_style_options(false);
  }

  /// The CLI11 application, to declare options on.
  CLI::App& app() noexcept { return app_; }

  /// A value option `--name` bound to `target` (its current value is the default shown).
  template <class T>
  CLI::Option* value(const std::string& name, T& target, const std::string& help) {
    return app_.add_option("--" + name, target, help)->capture_default_str();
  }

  /// A pair of flags that set `target`: `--name` to true and `--no-name` to false.
  void flag_pair(const std::string& name, bool& target, const std::string& help) {
    app_.add_flag("--" + name + ",!--no-" + name, target, help)->capture_default_str();
  }

  /// Parses argv; exits as the class comment says.
  void parse(int argc, char** argv) {
    try {
      app_.parse(argc, argv);
    } catch (const CLI::CallForHelp&) {
      std::fputs(app_.help().c_str(), stdout);
      std::exit(0);
    } catch (const CLI::ParseError& e) {
      fail(e.what());
    }
  }

  /// Prints "PROGRAM: message" and the usage to stderr, and exits 2.
  [[noreturn]] void fail(const std::string& message) const {
    std::fprintf(stderr, "%s: %s\n\n%s", program_.c_str(), message.c_str(), app_.help().c_str());
    std::exit(2);
  }

private:
  std::string program_;
  CLI::App app_;
};

} // namespace consort::cli
