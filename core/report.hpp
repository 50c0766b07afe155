#pragma once

// Reports of failures that a noexcept cleanup path can only survive, never throw: a stream that
// could not be ordered, a cache that could not take a block back, a thread that could not start.
// Each site reports once per process (its own flag), on stderr, with the cause, so that a run that
// went wrong says why without flooding its log when the GPU stays in trouble.

#include <atomic>

namespace consort::detail {

/// Prints "consort: <what>: <cause> (reported once)" on stderr the first time `once` is seen
/// unset, where the cause is the exception being handled (call it inside a catch block) or
/// "no exception" outside one. Never throws.
void report_once(std::atomic<bool>& once, const char* what) noexcept;

/// As above with the cause given as text (a CUDA or NCCL error string, say).
void report_once(std::atomic<bool>& once, const char* what, const char* cause) noexcept;

} // namespace consort::detail
