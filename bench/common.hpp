#pragma once

// Helpers shared by the benchmark programs: command-line parsing (on the demo's parser,
// examples/common/cli.hpp), statistics over samples, machine description, memcpy bandwidth and
// a minimal JSON writer.

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <map>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "common/cli.hpp"

namespace consort::bench {

// -- command line -------------------------------------------------------------------------------

/// The options of a program: `--name value` or `--name=value`, each name declared with its
/// default and help text, parsed by the parser the demo uses too (examples/common/cli.hpp, on
/// CLI11). `--help` prints the usage and exits 0; an unknown or incomplete option exits 2.
///
/// Thread safety: not thread-safe; use it from main() only.
class options {
public:
  options(std::string program, std::string summary) : parser_(std::move(program), summary) {}

  options(const options&) = delete;
  options& operator=(const options&) = delete;

  /// Declares option `name` (without the dashes) with its default value and help text.
  void add(const std::string& name, std::string default_value, std::string help) {
    auto& value = values_[name];
    value = std::move(default_value);
    parser_.value(name, value, help);
  }

  /// Parses argv; exits with status 0 after `--help` and 2 after an unknown or incomplete option.
  void parse(int argc, char** argv) { parser_.parse(argc, argv); }

  const std::string& str(const std::string& name) const { return values_.at(name); }

  int64_t integer(const std::string& name) const {
    const auto& text = str(name);
    char* end = nullptr;
    auto v = std::strtoll(text.c_str(), &end, 10);
    if (text.empty() || *end != '\0')
      fail("--" + name + " expects an integer, got '" + text + "'");
    return v;
  }

  /// A byte count with an optional binary suffix: "4", "64K", "64M", "1G" (as nccl-tests).
  int64_t bytes(const std::string& name) const {
    const auto& text = str(name);
    char* end = nullptr;
    auto v = std::strtoll(text.c_str(), &end, 10);
    int64_t scale = 1;
    std::string suffix = end;
    if (suffix == "K" || suffix == "k")
      scale = int64_t{1} << 10;
    else if (suffix == "M" || suffix == "m")
      scale = int64_t{1} << 20;
    else if (suffix == "G" || suffix == "g")
      scale = int64_t{1} << 30;
    else if (!suffix.empty())
      fail("--" + name + " expects a byte count such as 4, 64K or 64M, got '" + text + "'");
    if (text.empty() || end == text.c_str() || v < 0)
      fail("--" + name + " expects a byte count such as 4, 64K or 64M, got '" + text + "'");
    return v * scale;
  }

  /// A comma-separated list of positive integers, e.g. "1,2,4,8".
  std::vector<int> int_list(const std::string& name) const {
    std::vector<int> out;
    std::stringstream in{str(name)};
    std::string item;
    while (std::getline(in, item, ',')) {
      char* end = nullptr;
      auto v = std::strtol(item.c_str(), &end, 10);
      if (item.empty() || *end != '\0' || v <= 0)
        fail("--" + name + " expects positive integers separated by commas, got '" + str(name) +
             "'");
      out.push_back(static_cast<int>(v));
    }
    if (out.empty())
      fail("--" + name + " is empty");
    return out;
  }

  [[noreturn]] void fail(const std::string& message) const { parser_.fail(message); }

private:
  cli::parser parser_;
  /// The values by name; a std::map never moves its elements, so the parser may bind to them.
  std::map<std::string, std::string> values_;
};

// -- statistics ---------------------------------------------------------------------------------

/// Order statistics of a set of samples (same unit as the samples).
struct stats {
  double p50 = 0;
  double p99 = 0;
  double avg = 0;
  double min = 0;
  double max = 0;
};

/// The nearest-rank percentile `p` (0 < p <= 100) of sorted samples.
inline double percentile(const std::vector<double>& sorted, double p) {
  if (sorted.empty())
    return 0;
  auto rank = static_cast<size_t>(std::ceil(p / 100.0 * static_cast<double>(sorted.size())));
  return sorted[std::clamp<size_t>(rank, 1, sorted.size()) - 1];
}

inline stats summarize(std::vector<double> samples) {
  stats s;
  if (samples.empty())
    return s;
  std::sort(samples.begin(), samples.end());
  s.p50 = percentile(samples, 50);
  s.p99 = percentile(samples, 99);
  s.min = samples.front();
  s.max = samples.back();
  double sum = 0;
  for (auto v : samples)
    sum += v;
  s.avg = sum / static_cast<double>(samples.size());
  return s;
}

/// Microseconds between two steady_clock time points.
inline double micros(std::chrono::steady_clock::time_point a,
                     std::chrono::steady_clock::time_point b) {
  return std::chrono::duration<double, std::micro>(b - a).count();
}

// -- machine ------------------------------------------------------------------------------------

/// The "model name" line of /proc/cpuinfo (what `lscpu | grep 'Model name'` shows).
inline std::string cpu_model() {
  std::ifstream in{"/proc/cpuinfo"};
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind("model name", 0) == 0) {
      auto colon = line.find(':');
      if (colon != std::string::npos) {
        auto v = line.substr(colon + 1);
        v.erase(0, v.find_first_not_of(" \t"));
        return v;
      }
    }
  }
  return "unknown";
}

inline unsigned nproc() {
  return std::thread::hardware_concurrency();
}

/// Best single-thread memcpy bandwidth (GB/s, 1e9 bytes, bytes copied / time) of `bytes` over
/// `repeats` copies between two buffers that were touched beforehand.
inline double memcpy_bandwidth(size_t bytes, int repeats) {
  std::vector<char> src(bytes, 1);
  std::vector<char> dst(bytes, 0);
  double best = 1e300;
  for (int i = 0; i < repeats; ++i) {
    src[static_cast<size_t>(i) % bytes] = static_cast<char>(i);
    auto t0 = std::chrono::steady_clock::now();
    std::memcpy(dst.data(), src.data(), bytes);
    auto t1 = std::chrono::steady_clock::now();
    best = std::min(best, std::chrono::duration<double>(t1 - t0).count());
  }
  // Reads the destination so the copies cannot be elided.
  volatile char sink = dst[bytes / 2];
  (void)sink;
  return static_cast<double>(bytes) / best / 1e9;
}

// -- JSON ---------------------------------------------------------------------------------------

/// Builds one JSON object, keys in insertion order; values are numbers, strings, booleans or
/// nested objects and arrays already rendered as JSON.
///
/// Thread safety: not thread-safe; a value.
class json_object {
public:
  json_object& num(const std::string& key, double v) {
    std::ostringstream out;
    if (std::isfinite(v)) {
      out.precision(10);
      out << v;
    } else {
      out << "null";
    }
    return raw(key, out.str());
  }
  json_object& num(const std::string& key, int64_t v) { return raw(key, std::to_string(v)); }
  json_object& num(const std::string& key, int v) { return raw(key, std::to_string(v)); }
  json_object& boolean(const std::string& key, bool v) { return raw(key, v ? "true" : "false"); }
  json_object& str(const std::string& key, const std::string& v) { return raw(key, quote(v)); }
  json_object& obj(const std::string& key, const json_object& v) { return raw(key, v.render()); }
  json_object& arr(const std::string& key, const std::vector<json_object>& items) {
    std::string out = "[";
    for (size_t i = 0; i < items.size(); ++i)
      out += (i ? ",\n    " : "\n    ") + items[i].render();
    out += items.empty() ? "]" : "\n  ]";
    return raw(key, out);
  }
  json_object& raw(const std::string& key, std::string rendered) {
    fields_.emplace_back(key, std::move(rendered));
    return *this;
  }

  std::string render() const {
    std::string out = "{";
    for (size_t i = 0; i < fields_.size(); ++i)
      out += (i ? ", " : "") + quote(fields_[i].first) + ": " + fields_[i].second;
    return out + "}";
  }

  static std::string quote(const std::string& s) {
    std::string out = "\"";
    for (char c : s) {
      switch (c) {
      case '"':
        out += "\\\"";
        break;
      case '\\':
        out += "\\\\";
        break;
      case '\n':
        out += "\\n";
        break;
      default:
        if (static_cast<unsigned char>(c) < 0x20) {
          char buf[8];
          std::snprintf(buf, sizeof(buf), "\\u%04x", c);
          out += buf;
        } else {
          out += c;
        }
      }
    }
    return out + "\"";
  }

private:
  std::vector<std::pair<std::string, std::string>> fields_;
};

/// Writes `doc` to `path`; returns false (after printing why) when it cannot.
inline bool write_json(const std::string& path, const json_object& doc) {
  std::ofstream out{path};
  if (!out) {
    std::fprintf(stderr, "cannot open %s for writing\n", path.c_str());
    return false;
  }
  out << doc.render() << '\n';
  return static_cast<bool>(out);
}

/// "CPU:0,CPU:1,...": the devices of `n` CPU replicas.
inline std::vector<std::string> cpu_devices(int n) {
  std::vector<std::string> out;
  for (int i = 0; i < n; ++i)
    out.push_back("CPU:" + std::to_string(i));
  return out;
}

} // namespace consort::bench
