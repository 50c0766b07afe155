#pragma once

// The cross-worker executors on the host: this worker's part of a call (local_part), the call's
// descriptor (cross_call_for), Strategy.reduce/gather across workers (cross_reduce,
// cross_gather, on the host lane), and the lone replica's whole call on its own thread
// (alone_on_worker). The collective actor decides when each runs
// (collective_actor.cpp); the communicator (transport/communicator.hpp) moves the bytes.

#include "actors/call_checks.hpp"
#include "actors/flight_recorder.hpp"
#include "actors/protocol.hpp"
#include "transport/communicator.hpp"

#include <caf/expected.hpp>

#include <chrono>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace consort::detail {

/// The descriptor of call `seq` of `step` with signature `sig`, for the cross-worker lane.
transport::group_call cross_call_for(const call_signature& sig, std::string what, step_id step,
                                     uint32_t seq, std::chrono::milliseconds timeout);

/// This worker's part of a complete call into `cc.leaves`: the local replicas' values combined
/// (reduced, concatenated, or the root's), on the host; `leaves[r]` is local replica r's.
void local_part(transport::group_call& cc, const call_signature& sig,
                const std::vector<std::vector<tensor>>& leaves, std::optional<size_t> root_pos);

/// The call of a worker's only (CPU) replica in a group of several workers, on its own thread:
/// the argument checks, then the communicator's call, with no hop to the collective actor or a
/// lane thread. An argument error still meets the other workers (they fail with its reason).
/// @throws error with the code every worker reports. A tensor request's tensor is moved out of
/// `call`. `recorder` (may be null) records the call under its job-wide number, and a failure names
/// it with the recorder's diagnosis.
nest alone_on_worker(transport::communicator& cross, collective_call& call,
                     int num_replicas_in_sync, flight_recorder* recorder = nullptr);

/// alone_on_worker's all-reduce of one tensor, read where it lies (no nest, no request): the
/// call `seq` of `step` on replica `replica`, with its deadline `timeout` (the lean path of
/// transport::lone_all_reduce first, when it fits). @throws error as alone_on_worker.
tensor alone_all_reduce(transport::communicator& cross, const tensor& value, reduce_op op,
                        step_id step, uint32_t seq, int replica, std::chrono::milliseconds timeout,
                        flight_recorder* recorder = nullptr);

/// Strategy.reduce with several workers: this worker's partial, then the cross-worker
/// all-reduce (MEAN divides by the true count over every worker), leaf by leaf. Call `index` of
/// the host lane.
caf::expected<nest> cross_reduce(transport::communicator& cross, std::chrono::milliseconds timeout,
                                 const host_reduce& req, uint64_t index);

/// Strategy.gather with several workers: this worker's concatenation, then the cross-worker
/// ragged all-gather along the same axis (worker order = replica-id order).
caf::expected<nest> cross_gather(transport::communicator& cross, std::chrono::milliseconds timeout,
                                 const host_gather& req, uint64_t index);

} // namespace consort::detail
