#pragma once

// Authentication of membership connections (docs/multi_worker.md, "Authentication"): the proofs of
// the shared secret and their checks, over transport/auth.hpp's HMAC-SHA256.
//
// With a shared secret, a mutual challenge-response. The chief's Challenge carries its nonce Nc;
// the worker's Join carries its nonce Nw and
// HMAC(secret, "consort-membership-v1|join", Nc, Nw, task, address); the View sent to that worker
// carries HMAC(secret, "consort-membership-v1|view", Nc, Nw, task, epoch, group id). Both nonces
// are fresh per connection, so a recorded Join or View proves nothing on another connection, and
// the two labels keep one side's proof from being reflected as the other's. Without a secret the
// nonces still flow (one protocol), and a proof presented anyway is refused: both sides must
// agree on having a secret.
//
// Each check returns "" when it passes, else the reason, which the chief sends back in its
// Refusal or the worker puts in its rendezvous error.

#include "transport/membership/codec.hpp"

#include <consort/cluster.hpp>

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace consort::transport::membership::proofs {

/// The worker's proof of the secret in its Join. It binds the role (the label), both nonces (the
/// chief's challenge makes it fresh; the worker's own ties the view's proof to this connection),
/// and the identity the worker claims: its task (hence its rank) and its collective address.
std::vector<std::byte> join_proof(const std::string& secret,
                                  const std::vector<std::byte>& chief_nonce,
                                  const std::vector<std::byte>& worker_nonce,
                                  const consort::task_id& task, const std::string& address);

/// The chief's proof of the secret in the view it sends a worker: the other role's label, both
/// nonces of that worker's connection, the worker's task, and the epoch and group id of the view
/// (the group id the mesh handshakes then bind).
std::vector<std::byte> view_proof(const std::string& secret,
                                  const std::vector<std::byte>& chief_nonce,
                                  const std::vector<std::byte>& worker_nonce,
                                  const consort::task_id& task, uint64_t epoch, uint64_t group_id);

/// Worker: whether the chief's Challenge carries a nonce of an acceptable size.
std::string check_challenge(const codec::challenge& ch);

/// Chief: whether `j`, received on the connection it challenged with `chief_nonce`, carries an
/// acceptable nonce and proves `secret` (or, with no secret, proves nothing).
std::string check_join(const std::string& secret, const std::vector<std::byte>& chief_nonce,
                       const codec::join& j);

/// Worker: whether the view `m`, received on the connection of `chief_nonce` and `worker_nonce`
/// (its own Join's), proves `secret` for `task` (or, with no secret, proves nothing).
std::string check_view(const std::string& secret, const std::vector<std::byte>& chief_nonce,
                       const std::vector<std::byte>& worker_nonce, const consort::task_id& task,
                       const codec::view_message& m);

} // namespace consort::transport::membership::proofs
