#pragma once

// Every task of a cluster must have been given the same cluster (TF_CONFIG or its cluster
// resolver). A worker's Join carries a digest of the cluster it was given and the cluster's list
// as text; the chief compares the digest with its own and refuses a Join whose cluster differs,
// naming both lists (issue 35, item 6: without it, a worker with a longer list waited for a view
// that did not match, and a chief with a longer one waited out its rendezvous).
//
// The canonical cluster: every task of every job but "evaluator" (which TF lets stand apart from
// the cluster), as "job:index=address", sorted by job name and then by index; without
// `options::cluster`, the tasks of `options::tasks` alone, as "job:index". Its text is
// "[worker:0=10.0.0.1:2222, worker:1=10.0.0.2:2222]"; its digest is the 64-bit FNV-1a hash of
// the entries, one a line after the label "consort-cluster-v1", with 0 replaced by 1 (0 marks a
// Join without a digest).
//
// Private to transport/membership.

#include "transport/membership/codec.hpp"

#include <consort/cluster.hpp>
#include <consort/transport/membership.hpp>

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace consort::transport::membership::cluster_check {

/// The cluster a service was given, canonical.
struct identity {
  /// "job:index=address" (or "job:index" without `options::cluster`), sorted.
  std::vector<std::string> entries;

  /// "[" the entries, separated by ", " "]".
  std::string text;

  /// The digest of the entries (see the file comment); never 0.
  uint64_t digest = 0;
};

/// The canonical cluster of `opts`: `opts.cluster` when it is not empty, else `opts.tasks`.
identity of(const options& opts);

/// The digest of canonical entries (see the file comment).
uint64_t digest_of(const std::vector<std::string>& entries);

/// `list` (a text of `identity::text`'s form) cut after an entry so that it is at most `limit`
/// bytes long, ending ", ...]" ("[...]" when not even one entry fits; "" below 5 bytes).
std::string abbreviate(const std::string& list, std::size_t limit);

/// `text` cut to at most `limit` bytes, ending " ..." when cut.
std::string bounded(const std::string& text, std::size_t limit);

/// Chief: the reason to refuse `j`, whose digest differs from `chief`'s, the cluster of
/// `chief_task`. Names both lists, each cut to `list_limit` bytes, where the cluster comes from,
/// and last where the lists first differ when that can be told.
std::string mismatch(const identity& chief, const consort::task_id& chief_task,
                     const codec::join& j, std::size_t list_limit);

} // namespace consort::transport::membership::cluster_check
