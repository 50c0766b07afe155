#pragma once

#include <cstdint>

namespace consort {

/// The kinds of collective a replica can call (ReplicaContext.all_reduce, all_gather and
/// broadcast), and the kind a group of workers runs between them.
enum class collective_kind : uint8_t { all_reduce, all_gather, broadcast };

/// "all_reduce", "all_gather" or "broadcast".
const char* to_string(collective_kind kind) noexcept;

} // namespace consort
