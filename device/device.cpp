#include <consort/device.hpp>
#include <consort/error.hpp>

#include "device/gpu.hpp"

#include <cctype>
#include <charconv>
#include <climits>
#include <vector>

namespace consort {

namespace {

constexpr const char* expected_forms =
    "expected \"CPU:<i>\" or \"GPU:<i>\" with an index i >= 0 (any case), optionally written as "
    "\"/device:CPU:<i>\", \"/cpu:<i>\" or \"/job:<name>/replica:<r>/task:<t>/device:CPU:<i>\"";

[[noreturn]] void fail(std::string_view name, const std::string& reason) {
  throw_error(errc::unknown_device,
              "unknown device \"" + std::string{name} + "\": " + reason + "; " + expected_forms);
}

std::string lower(std::string_view text) {
  std::string out{text};
  for (auto& c : out)
    c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return out;
}

/// Parses a non-negative decimal integer of digits only (no sign, no spaces).
bool parse_index(std::string_view text, int& out) {
  if (text.empty())
    return false;
  for (char c : text)
    if (c < '0' || c > '9')
      return false;
  auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), out);
  return ec == std::errc{} && end == text.data() + text.size();
}

std::vector<std::string_view> split(std::string_view text, char sep) {
  std::vector<std::string_view> parts;
  size_t start = 0;
  for (;;) {
    auto pos = text.find(sep, start);
    if (pos == std::string_view::npos) {
      parts.push_back(text.substr(start));
      return parts;
    }
    parts.push_back(text.substr(start, pos - start));
    start = pos + 1;
  }
}

/// Parses "KIND:i" or "device:KIND:i" (the last component of a device name).
device_spec parse_device_part(std::string_view name, std::string_view part) {
  auto fields = split(part, ':');
  if (fields.size() == 3 && lower(fields[0]) == "device")
    fields.erase(fields.begin());
  if (fields.size() != 2)
    fail(name, "the device part \"" + std::string{part} + "\" is not of the form KIND:INDEX");
  device_spec spec;
  auto kind = lower(fields[0]);
  if (kind == "cpu")
    spec.kind = device_kind::cpu;
  else if (kind == "gpu")
    spec.kind = device_kind::gpu;
  else
    fail(name, "the device kind \"" + std::string{fields[0]} + "\" is neither CPU nor GPU");
  if (!parse_index(fields[1], spec.index))
    fail(name, "the device index \"" + std::string{fields[1]} + "\" is not a non-negative integer");
  return spec;
}

} // namespace

std::string device_spec::to_string() const {
  return (kind == device_kind::cpu ? "CPU:" : "GPU:") + std::to_string(index);
}

device_spec parse_device(std::string_view name) {
  if (name.empty())
    fail(name, "the name is empty");
  if (name.front() != '/')
    return parse_device_part(name, name);
  // TF's full form: /job:<name>/replica:<r>/task:<t>/device:<KIND>:<i>, where any of the job,
  // replica and task parts may be left out, but the device part must come last.
  auto parts = split(name.substr(1), '/');
  for (size_t i = 0; i + 1 < parts.size(); ++i) {
    auto fields = split(parts[i], ':');
    auto key = fields.size() == 2 ? lower(fields[0]) : std::string{};
    int ignored = 0;
    bool ok = (key == "job" && !fields[1].empty()) ||
              ((key == "replica" || key == "task") && parse_index(fields[1], ignored));
    if (!ok) {
      // Appended piecewise: g++ 12 -O3 reports a false -Wrestrict for "literal" + string&&.
      std::string reason = "\"";
      reason += parts[i];
      reason += "\" is not a job:<name>, replica:<r> or task:<t> part";
      fail(name, reason);
    }
  }
  return parse_device_part(name, parts.back());
}

int num_gpus() noexcept {
  return detail::gpu::count();
}

std::string gpus_unavailable_reason() {
  return num_gpus() > 0 ? std::string{} : detail::gpu::unavailable_reason();
}

void* current_cuda_stream() noexcept {
  return detail::gpu::current_stream();
}

} // namespace consort
