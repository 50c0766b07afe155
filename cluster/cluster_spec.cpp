#include "cluster/detail.hpp"

#include <consort/error.hpp>

#include <charconv>
#include <climits>
#include <cstdlib>
#include <ostream>
#include <utility>

namespace consort {

namespace cluster_detail {

std::string quote(std::string_view text) {
  std::string out;
  out.reserve(text.size() + 2);
  out += '"';
  out += text;
  out += '"';
  return out;
}

std::string join(const std::vector<std::string>& items) {
  std::string out;
  for (const auto& item : items) {
    if (!out.empty())
      out += ", ";
    out += item;
  }
  return out;
}

std::string join(const std::vector<int>& items) {
  std::string out;
  for (int item : items) {
    if (!out.empty())
      out += ", ";
    out += std::to_string(item);
  }
  return out;
}

std::string describe(const nlohmann::json& value) {
  // Long values are cut so that a huge malformed TF_CONFIG does not flood the message.
  constexpr std::size_t max_text = 60;
  std::string text = value.dump();
  if (text.size() > max_text)
    text = text.substr(0, max_text) + "...";
  return std::string(value.type_name()) + " " + text;
}

nlohmann::json parse_json(const std::string& text, std::string_view what,
                          std::string_view expected) {
  try {
    return nlohmann::json::parse(text);
  } catch (const nlohmann::json::parse_error& e) {
    // nlohmann's message is "[json.exception.parse_error.101] parse error at line 1, column 9:
    // ..."; the bracketed id means nothing to a user, the position does.
    std::string message = e.what();
    if (auto close = message.find("] ");
        message.rfind("[json.exception", 0) == 0 && close != std::string::npos)
      message.erase(0, close + 2);
    throw_error(errc::invalid_argument, std::string(what) + " is not valid JSON: " + message +
                                            " (byte " + std::to_string(e.byte) + "); expected " +
                                            std::string(expected));
  }
}

std::optional<long long> parse_integer(std::string_view text, long long min, long long max) {
  if (text.empty())
    return std::nullopt;
  long long value = 0;
  const char* first = text.data();
  const char* last = text.data() + text.size();
  auto [end, ec] = std::from_chars(first, last, value);
  if (ec != std::errc() || end != last || value < min || value > max)
    return std::nullopt;
  return value;
}

bool is_host_port(std::string_view address) {
  auto colon = address.rfind(':');
  if (colon == std::string_view::npos || colon == 0)
    return false;
  auto port = parse_integer(address.substr(colon + 1), 1, 65535);
  return port.has_value();
}

cluster_spec cluster_from_json(const nlohmann::json& value, std::string_view where) {
  const std::string prefix(where);
  if (!value.is_object())
    throw_error(errc::invalid_argument,
                prefix + " must be an object from job name to the addresses of its tasks, got " +
                    describe(value));
  cluster_spec::job_map jobs;
  for (const auto& [job, tasks] : value.items()) {
    auto& job_tasks = jobs[job];
    auto address_of = [&](int index, const nlohmann::json& address) {
      if (!address.is_string())
        throw_error(errc::invalid_argument,
                    prefix + ": the address of task " + job + ":" + std::to_string(index) +
                        " must be a string \"host:port\", got " + describe(address));
      return address.get<std::string>();
    };
    if (tasks.is_array()) {
      int index = 0;
      for (const auto& address : tasks) {
        job_tasks.emplace(index, address_of(index, address));
        ++index;
      }
    } else if (tasks.is_object()) {
      for (const auto& [key, address] : tasks.items()) {
        auto index = parse_integer(key, LLONG_MIN, LLONG_MAX);
        if (!index || *index > INT_MAX)
          throw_error(errc::invalid_argument, prefix + ": job " + quote(job) + " has a task key " +
                                                  quote(key) +
                                                  "; expected a decimal task index such as \"0\"");
        if (*index < 0)
          throw_error(errc::invalid_argument, prefix + ": job " + quote(job) +
                                                  " has a negative task index " + key +
                                                  "; expected an index >= 0");
        int i = static_cast<int>(*index);
        if (!job_tasks.emplace(i, address_of(i, address)).second)
          throw_error(errc::invalid_argument,
                      prefix + ": job " + quote(job) + " gives task index " + std::to_string(i) +
                          " twice (key " + quote(key) + "); expected each index once");
      }
    } else {
      throw_error(errc::invalid_argument,
                  prefix + ": the tasks of job " + quote(job) +
                      " must be a list of addresses or an object from task index to address, "
                      "got " +
                      describe(tasks));
    }
  }
  return cluster_spec(std::move(jobs));
}

nlohmann::json cluster_to_json(const cluster_spec& spec) {
  auto out = nlohmann::json::object();
  for (const auto& [job, tasks] : spec.as_dict()) {
    if (spec.is_dense(job)) {
      auto list = nlohmann::json::array();
      for (const auto& [index, address] : tasks)
        list.push_back(address);
      out[job] = std::move(list);
    } else {
      auto map = nlohmann::json::object();
      for (const auto& [index, address] : tasks)
        map[std::to_string(index)] = address;
      out[job] = std::move(map);
    }
  }
  return out;
}

} // namespace cluster_detail

using cluster_detail::join;
using cluster_detail::quote;

namespace {

const std::map<int, std::string>& job_or_throw(const cluster_spec::job_map& jobs,
                                               const std::string& job) {
  auto it = jobs.find(job);
  if (it == jobs.end()) {
    std::vector<std::string> names;
    for (const auto& [name, tasks] : jobs)
      names.push_back(name);
    throw_error(errc::invalid_argument,
                "no job " + quote(job) + " in the cluster; expected one of its jobs: " +
                    (names.empty() ? std::string("(none, the cluster is empty)") : join(names)));
  }
  return it->second;
}

} // namespace

// -- cluster_spec ---------------------------------------------------------------------------------

cluster_spec::cluster_spec(job_map jobs) : jobs_(std::move(jobs)) {
  for (const auto& [job, tasks] : jobs_) {
    if (job.empty())
      throw_error(errc::invalid_argument,
                  "cluster_spec: a job has an empty name; expected a name such as \"worker\"");
    if (!tasks.empty() && tasks.begin()->first < 0)
      throw_error(errc::invalid_argument,
                  "cluster_spec: job " + quote(job) + " has a negative task index " +
                      std::to_string(tasks.begin()->first) + "; expected indices >= 0");
  }
}

cluster_spec cluster_spec::dense(const std::map<std::string, std::vector<std::string>>& jobs) {
  job_map map;
  for (const auto& [job, addresses] : jobs) {
    auto& tasks = map[job];
    for (std::size_t i = 0; i < addresses.size(); ++i)
      tasks.emplace(static_cast<int>(i), addresses[i]);
  }
  return cluster_spec(std::move(map));
}

cluster_spec cluster_spec::from_json(const std::string& json) {
  constexpr std::string_view expected =
      "an object from job name to addresses, e.g. {\"worker\": [\"host:port\", ...]}";
  return cluster_detail::cluster_from_json(
      cluster_detail::parse_json(json, "the cluster spec", expected), "the cluster spec");
}

std::vector<std::string> cluster_spec::jobs() const {
  std::vector<std::string> names;
  names.reserve(jobs_.size());
  for (const auto& [name, tasks] : jobs_)
    names.push_back(name);
  return names;
}

int cluster_spec::num_tasks(const std::string& job) const {
  return static_cast<int>(job_or_throw(jobs_, job).size());
}

std::vector<int> cluster_spec::task_indices(const std::string& job) const {
  std::vector<int> indices;
  for (const auto& [index, address] : job_or_throw(jobs_, job))
    indices.push_back(index);
  return indices;
}

const std::string& cluster_spec::task_address(const std::string& job, int index) const {
  const auto& tasks = job_or_throw(jobs_, job);
  auto it = tasks.find(index);
  if (it == tasks.end())
    throw_error(errc::out_of_range, "no task with index " + std::to_string(index) + " in job " +
                                        quote(job) + "; expected one of its indices: " +
                                        (tasks.empty() ? std::string("(none, the job has no tasks)")
                                                       : join(task_indices(job))));
  return it->second;
}

std::vector<std::string> cluster_spec::job_tasks(const std::string& job) const {
  const auto& tasks = job_or_throw(jobs_, job);
  if (tasks.empty())
    return {};
  std::vector<std::string> list(static_cast<std::size_t>(tasks.rbegin()->first) + 1);
  for (const auto& [index, address] : tasks)
    list[static_cast<std::size_t>(index)] = address;
  return list;
}

bool cluster_spec::is_dense(const std::string& job) const {
  const auto& tasks = job_or_throw(jobs_, job);
  return tasks.empty() || tasks.rbegin()->first + 1 == static_cast<int>(tasks.size());
}

std::string cluster_spec::to_json() const {
  return cluster_detail::cluster_to_json(*this).dump();
}

// -- task_id --------------------------------------------------------------------------------------

std::string to_string(const task_id& id) {
  return id.type + ":" + std::to_string(id.index);
}

std::ostream& operator<<(std::ostream& out, const task_id& id) {
  return out << to_string(id);
}

} // namespace consort
