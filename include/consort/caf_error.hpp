#pragma once

// The glue between consort's errors and CAF's: every layer that reports errors as caf::error
// (transport, actors) makes them here, and every caller that hands them to users converts them
// here. It lives in core (core/caf_error.cpp) so that no layer re-declares it and none depends
// upward on the actors for it. Only core/caf_error.cpp registers errc with CAF
// (CAF_ERROR_CODE_ENUM, which needs CAF's message headers); everything else goes through these.

#include <consort/error.hpp>

#include <caf/error.hpp>

#include <string>

namespace consort {

/// A caf::error of category "consort" with `code` and `message` as its context.
caf::error make_caf_error(errc code, std::string message);

/// Converts any CAF error to a consort::error: ours keep their code and message, CAF's own
/// (`sec::request_timeout`, ...) get a consort code and a message saying what timed out;
/// `what` (when not empty) prefixes the message of the latter.
error to_consort_error(const caf::error& err, const std::string& what);

} // namespace consort
