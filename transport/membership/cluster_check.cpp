// The check that every task was given the same cluster (see cluster_check.hpp).

#include "transport/membership/cluster_check.hpp"

#include <algorithm>
#include <tuple>

namespace consort::transport::membership::cluster_check {

namespace {

/// The label the digest starts with; a change of the canonical form changes it.
constexpr const char* digest_label = "consort-cluster-v1";

/// The entries of `list` (identity::text's form), and whether it is complete (not cut by
/// `abbreviate`); none when `list` is not of that form.
std::vector<std::string> entries_of(const std::string& list, bool& complete) {
  complete = false;
  std::vector<std::string> out;
  if (list.size() < 2 || list.front() != '[' || list.back() != ']')
    return out;
  auto inner = list.substr(1, list.size() - 2);
  complete = true;
  if (inner.empty())
    return out;
  std::size_t from = 0;
  for (;;) {
    auto at = inner.find(", ", from);
    out.push_back(inner.substr(from, at == std::string::npos ? std::string::npos : at - from));
    if (at == std::string::npos)
      break;
    from = at + 2;
  }
  if (out.back() == "...") {
    out.pop_back();
    complete = false;
  }
  return out;
}

/// Where the chief's entries and the worker's list first differ, or "" when that cannot be told
/// (the worker's list was cut before the difference, or is not a list).
std::string first_difference(const std::vector<std::string>& chief, const std::string& list,
                             const std::string& who) {
  bool complete = false;
  auto theirs = entries_of(list, complete);
  if (theirs.empty() && !complete)
    return {};
  for (std::size_t i = 0;; ++i) {
    bool mine = i < chief.size(), their = i < theirs.size();
    if (!their && !complete)
      return {};
    if (!mine && !their)
      return {};
    if (mine && their && chief[i] == theirs[i])
      continue;
    return "the lists first differ at entry " + std::to_string(i + 1) + ": " + who + " has " +
           (their ? bounded(theirs[i], 256) : std::string("no entry")) + ", the chief has " +
           (mine ? bounded(chief[i], 256) : std::string("no entry"));
  }
}

} // namespace

uint64_t digest_of(const std::vector<std::string>& entries) {
  uint64_t h = 14695981039346656037ull;
  auto add = [&h](const std::string& s) {
    for (unsigned char c : s) {
      h ^= c;
      h *= 1099511628211ull;
    }
    h ^= static_cast<unsigned char>('\n');
    h *= 1099511628211ull;
  };
  add(digest_label);
  for (const auto& e : entries)
    add(e);
  return h == 0 ? 1 : h;
}

identity of(const options& opts) {
  identity id;
  if (!opts.cluster.empty()) {
    for (const auto& [job, tasks] : opts.cluster.as_dict()) {
      if (job == "evaluator")
        continue;
      for (const auto& [index, address] : tasks)
        id.entries.push_back(job + ":" + std::to_string(index) + "=" + address);
    }
  } else {
    auto tasks = opts.tasks;
    std::sort(tasks.begin(), tasks.end(), [](const task_id& a, const task_id& b) {
      return std::tie(a.type, a.index) < std::tie(b.type, b.index);
    });
    for (const auto& t : tasks)
      id.entries.push_back(to_string(t));
  }
  // Appended piece by piece: GCC 12 warns (-Wrestrict) about assigning or adding literals here.
  id.text.push_back('[');
  for (std::size_t i = 0; i < id.entries.size(); ++i) {
    if (i != 0)
      id.text.append(", ");
    id.text.append(id.entries[i]);
  }
  id.text.push_back(']');
  id.digest = digest_of(id.entries);
  return id;
}

std::string abbreviate(const std::string& list, std::size_t limit) {
  if (list.size() <= limit)
    return list;
  static const std::string tail = ", ...]";
  if (limit < tail.size() + 1)
    return limit < 5 ? std::string{} : std::string("[...]");
  // The last entry boundary that leaves room for the tail.
  auto cut = list.rfind(", ", limit - tail.size());
  if (cut == std::string::npos || cut == 0)
    return "[...]";
  return list.substr(0, cut) + tail;
}

std::string bounded(const std::string& text, std::size_t limit) {
  if (text.size() <= limit)
    return text;
  static const std::string tail = " ...";
  if (limit <= tail.size())
    return text.substr(0, limit);
  return text.substr(0, limit - tail.size()) + tail;
}

std::string mismatch(const identity& chief, const consort::task_id& chief_task,
                     const codec::join& j, std::size_t list_limit) {
  auto who = to_string(j.task);
  auto theirs =
      j.cluster.empty() ? std::string("a list it did not send") : abbreviate(j.cluster, list_limit);
  auto out = who + " was given another cluster than the chief (" + to_string(chief_task) +
             "): " + who + " has " + theirs + ", the chief has " +
             abbreviate(chief.text, list_limit);
  out += "; the cluster comes from TF_CONFIG (or the cluster resolver) and must be the same on "
         "every task";
  if (auto where = first_difference(chief.entries, j.cluster, who); !where.empty())
    out += "; " + where;
  return out;
}

} // namespace consort::transport::membership::cluster_check
