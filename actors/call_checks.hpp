#pragma once

// The checks and the arithmetic of one collective call, free of actors: what every participant
// must agree on (call_signature), the checks of a call's own arguments and of a call against the
// first arrival, the result of a complete set of calls, and the text of both. The collective
// actor's matching (collective_actor.cpp) and the cross-worker paths (cross_phase.cpp) use them;
// tests/actors/call_checks_test.cpp tests them without an actor system.

#include "actors/protocol.hpp"

#include <consort/nest.hpp>
#include <consort/tensor.hpp>

#include <caf/error.hpp>

#include <exception>
#include <string>
#include <vector>

namespace consort::detail {

/// What every participant of one (step, seq) must agree on, taken from the first arrival.
struct call_signature {
  collective_kind kind = collective_kind::all_reduce;
  reduce_op op = reduce_op::sum;
  int64_t axis = 0;
  int root = 0;
  std::string structure;
  std::vector<dtype> dtypes;
  std::vector<shape_t> shapes;

  bool operator==(const call_signature&) const = default;
};

/// "all_reduce(SUM)", "all_gather(axis=1)", "broadcast(root=0)".
std::string describe_call(const call_signature& sig);

/// "[0, 2]".
std::string join_ids(const std::vector<int>& ids);

/// The signature of `call` as its replica sent it (`leaves` = flatten of its value); the axis is
/// as given, not normalised.
call_signature signature_from(const collective_call& call, const std::vector<tensor>& leaves);
/// The same, written into `sig`, whose vectors keep their capacity (a signature reused call after
/// call allocates nothing).
void signature_from(const collective_call& call, const std::vector<tensor>& leaves,
                    call_signature& sig);

/// "all_reduce(SUM) #3 of step 7".
std::string describe_slot(const call_signature& sig, step_id step, uint32_t seq);

/// An error message when `call` cannot take part in a collective described by `sig` (kind, op,
/// axis, root, structure, dtype or shape differ), naming `call.replica` and `first_replica`;
/// empty when it can.
std::string check_against(const call_signature& sig, const collective_call& call, int first_replica,
                          const std::vector<tensor>& leaves);

/// Validates the arguments of a call on their own (broadcast root in [0, num_replicas),
/// all_gather of rank >= 1 with an axis in range and the same for every leaf); sets
/// `*normalized_axis` for an all_gather. An error message, or empty.
std::string check_arguments(const collective_call& call, const std::vector<tensor>& leaves,
                            int num_replicas, int64_t* normalized_axis);

/// The result of a complete set of calls: `leaves[r]` is participant r's flattened value (in
/// replica-id order), packed as `structure`.
nest compute(const call_signature& sig, const std::vector<std::vector<tensor>>& leaves,
             const nest& structure);

/// A consort::error's code and text as a caf::error; any other exception is invalid_argument.
caf::error error_of(const std::exception& e);

/// What every worker must agree on for a call: structure, dtypes and shapes (a gather's axis
/// extent may differ). The text of the calling thread's last signature is kept: a step's calls
/// mostly repeat it, and comparing costs less than formatting.
std::string signature_of(const call_signature& sig);

/// fnv1a(signature_of(sig)) without making the text: the hash that a call's descriptor carries,
/// computed on every call; the text is made only when the workers disagree. The calling thread
/// keeps its last signature and hash (a copy of the signature, which may throw bad_alloc).
uint64_t signature_hash(const call_signature& sig);

/// The partial sum that an all-reduce MEAN sends between workers: floats as a SUM, integers
/// widened to float64 (integer MEAN is float64, never truncated).
tensor mean_partial(const std::vector<tensor>& inputs);

} // namespace consort::detail
