#include <consort/error.hpp>

#include "core/report.hpp"

#include <cstdio>
#include <exception>

namespace consort {

const char* to_string(errc code) noexcept {
  switch (code) {
  case errc::none:
    return "none";
  case errc::invalid_argument:
    return "invalid_argument";
  case errc::shape_mismatch:
    return "shape_mismatch";
  case errc::dtype_mismatch:
    return "dtype_mismatch";
  case errc::structure_mismatch:
    return "structure_mismatch";
  case errc::unknown_reduce_op:
    return "unknown_reduce_op";
  case errc::unknown_device:
    return "unknown_device";
  case errc::unsupported:
    return "unsupported";
  case errc::collective_mismatch:
    return "collective_mismatch";
  case errc::collective_timeout:
    return "collective_timeout";
  case errc::collective_aborted:
    return "collective_aborted";
  case errc::step_failed:
    return "step_failed";
  case errc::step_timeout:
    return "step_timeout";
  case errc::peer_lost:
    return "peer_lost";
  case errc::shutdown:
    return "shutdown";
  case errc::out_of_range:
    return "out_of_range";
  case errc::wait_timeout:
    return "wait_timeout";
  case errc::device_error:
    return "device_error";
  case errc::peer_left:
    return "peer_left";
  case errc::membership_changed:
    return "membership_changed";
  case errc::data_loss:
    return "data_loss";
  case errc::io_error:
    return "io_error";
  }
  // A value outside the enumeration (e.g. one deserialised from a newer peer).
  return "unknown_errc";
}

void throw_error(errc code, const std::string& message) {
  throw error(code, message);
}

} // namespace consort

namespace consort::detail {

void report_once(std::atomic<bool>& once, const char* what, const char* cause) noexcept {
  if (once.exchange(true, std::memory_order_relaxed))
    return;
  std::fprintf(stderr, "consort: %s: %s (reported once)\n", what, cause);
}

void report_once(std::atomic<bool>& once, const char* what) noexcept {
  if (once.load(std::memory_order_relaxed))
    return;
  const auto current = std::current_exception();
  if (!current) {
    report_once(once, what, "no exception");
    return;
  }
  try {
    std::rethrow_exception(current);
  } catch (const std::exception& e) {
    report_once(once, what, e.what());
  } catch (...) {
    report_once(once, what, "an exception that is not a std::exception");
  }
}

} // namespace consort::detail
