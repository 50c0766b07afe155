#pragma once

// The engine side of a replica_context (include/consort/replica_context.hpp): what a collective
// call carries from the replica to the collective actor, and the interface that the replica actor
// implements. Private to the library (never installed): the public header only forward-declares
// replica_services.

#include <consort/nest.hpp>
#include <consort/reduce_op.hpp>
#include <consort/replica_context.hpp>

#include <chrono>
#include <cstdint>
#include <optional>
#include <typeinfo>
#include <vector>

namespace consort::detail {

/// What a collective call carries from the replica to the collective actor.
struct collective_request {
  collective_kind kind = collective_kind::all_reduce;
  reduce_op op = reduce_op::sum; // all_reduce only
  int64_t axis = 0;              // all_gather only
  int root = 0;                  // broadcast only: replica id in sync group
  nest value;
  std::optional<std::chrono::milliseconds> timeout;
};

/// The engine side of a replica_context (implemented by the replica actor).
class replica_services {
public:
  virtual ~replica_services() = default;
  /// Runs one collective and blocks the replica's thread until its result or error (bounded by
  /// the collective's deadline). @throws consort::error.
  virtual nest collective(collective_request request) = 0;
  /// An all-reduce of one tensor: collective() of that request, without a nest where the
  /// replica's call needs none (a lone CPU replica's, read in place). @throws consort::error.
  virtual tensor all_reduce(reduce_op op, const tensor& value,
                            std::optional<std::chrono::milliseconds> timeout) = 0;
  /// Waits for the work queued on the replica's device so far. @throws consort::error.
  virtual void synchronize() = 0;
  /// One merge_call (replica_context::merge_call): returns this replica's part of the result.
  /// @throws consort::error.
  virtual nest merge(merge_function fn, std::vector<nest> args,
                     const std::type_info& signature) = 0;
};

} // namespace consort::detail
