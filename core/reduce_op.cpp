#include <consort/error.hpp>
#include <consort/reduce_op.hpp>

#include <array>
#include <cctype>
#include <utility>

namespace consort {

namespace {

constexpr std::array<std::pair<const char*, reduce_op>, 5> reduce_op_names{{
    {"SUM", reduce_op::sum},
    {"MEAN", reduce_op::mean},
    {"MIN", reduce_op::min},
    {"MAX", reduce_op::max},
    {"PROD", reduce_op::prod},
}};

bool equals_ignoring_case(std::string_view input, std::string_view upper) {
  if (input.size() != upper.size())
    return false;
  for (size_t i = 0; i < input.size(); ++i)
    if (std::toupper(static_cast<unsigned char>(input[i])) != upper[i])
      return false;
  return true;
}

} // namespace

const char* to_string(reduce_op op) noexcept {
  for (const auto& [name, value] : reduce_op_names)
    if (value == op)
      return name;
  return "UNKNOWN";
}

reduce_op parse_reduce_op(std::string_view name) {
  for (const auto& [spelling, value] : reduce_op_names)
    if (equals_ignoring_case(name, spelling))
      return value;
  std::string valid;
  for (const auto& entry : reduce_op_names) {
    if (!valid.empty())
      valid += ", ";
    valid += entry.first;
  }
  throw_error(errc::unknown_reduce_op, "unknown reduce op \"" + std::string{name} +
                                           "\": expected one of " + valid + " (in any case)");
}

} // namespace consort
