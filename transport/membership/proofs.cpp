// The proofs of the shared secret on membership connections, and their checks (see proofs.hpp).

#include "transport/membership/proofs.hpp"

#include "transport/auth.hpp"

namespace consort::transport::membership::proofs {

using auth::max_nonce_bytes;
using auth::min_nonce_bytes;

std::vector<std::byte> join_proof(const std::string& secret,
                                  const std::vector<std::byte>& chief_nonce,
                                  const std::vector<std::byte>& worker_nonce,
                                  const consort::task_id& task, const std::string& address) {
  auto mac = auth::transcript("consort-membership-v1|join")
                 .bytes(chief_nonce)
                 .bytes(worker_nonce)
                 .text(task.type)
                 .u32(static_cast<uint32_t>(task.index))
                 .text(address)
                 .sign(secret);
  return {mac.begin(), mac.end()};
}

std::vector<std::byte> view_proof(const std::string& secret,
                                  const std::vector<std::byte>& chief_nonce,
                                  const std::vector<std::byte>& worker_nonce,
                                  const consort::task_id& task, uint64_t epoch, uint64_t group_id) {
  auto mac = auth::transcript("consort-membership-v1|view")
                 .bytes(chief_nonce)
                 .bytes(worker_nonce)
                 .text(task.type)
                 .u32(static_cast<uint32_t>(task.index))
                 .u64(epoch)
                 .u64(group_id)
                 .sign(secret);
  return {mac.begin(), mac.end()};
}

std::string check_challenge(const codec::challenge& ch) {
  if (ch.nonce.size() < min_nonce_bytes || ch.nonce.size() > max_nonce_bytes)
    return "protocol error: its challenge has " + std::to_string(ch.nonce.size()) +
           " bytes of nonce, expected " + std::to_string(min_nonce_bytes) + " to " +
           std::to_string(max_nonce_bytes);
  return {};
}

std::string check_join(const std::string& secret, const std::vector<std::byte>& chief_nonce,
                       const codec::join& j) {
  auto who = to_string(j.task);
  // The nonce first: the proof covers it.
  if (j.nonce.size() < min_nonce_bytes || j.nonce.size() > max_nonce_bytes)
    return "its Join has " + std::to_string(j.nonce.size()) + " bytes of nonce, expected " +
           std::to_string(min_nonce_bytes) + " to " + std::to_string(max_nonce_bytes);
  if (!secret.empty()) {
    if (j.auth_proof.empty())
      return "authentication failed: " + who +
             " presented no proof of the shared secret, which this cluster requires (set the "
             "same secret on every task)";
    if (!auth::equal(join_proof(secret, chief_nonce, j.nonce, j.task, j.address), j.auth_proof))
      return "authentication failed: the shared secret does not match (or the Join was not "
             "made for this connection's challenge: a replay)";
  } else if (!j.auth_proof.empty()) {
    return "authentication failed: " + who +
           " presented a proof of a shared secret, but this chief has none (set the same "
           "secret on every task, or none on all)";
  }
  return {};
}

std::string check_view(const std::string& secret, const std::vector<std::byte>& chief_nonce,
                       const std::vector<std::byte>& worker_nonce, const consort::task_id& task,
                       const codec::view_message& m) {
  if (!secret.empty()) {
    auto expected =
        view_proof(secret, chief_nonce, worker_nonce, task, m.view.epoch, m.view.group_id);
    if (!auth::equal(expected, m.auth_proof))
      return "it did not prove the shared secret (the view's proof does not match): it is not "
             "the chief of this cluster, or its secret differs";
  } else if (!m.auth_proof.empty()) {
    return "it proves a shared secret but this worker has none (set the same secret on every "
           "task)";
  }
  return {};
}

} // namespace consort::transport::membership::proofs
