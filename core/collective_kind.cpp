#include <consort/collective_kind.hpp>

namespace consort {

const char* to_string(collective_kind kind) noexcept {
  switch (kind) {
  case collective_kind::all_reduce:
    return "all_reduce";
  case collective_kind::all_gather:
    return "all_gather";
  case collective_kind::broadcast:
    return "broadcast";
  }
  return "unknown collective";
}

} // namespace consort
