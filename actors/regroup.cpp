#include <consort/error.hpp>
#include <consort/regroup.hpp>

#include <utility>

namespace consort {

namespace {

const char* kind_of(const nest& n) {
  return n.is_tensor() ? "a tensor" : n.is_list() ? "a list" : "a dict";
}

} // namespace

regrouped::regrouped(per_replica<nest> values) : values_(std::move(values)) {
  if (values_.empty())
    throw_error(errc::invalid_argument, "regroup needs a per_replica value with at least one "
                                        "component; got none");
  for (size_t i = 1; i < values_.size(); ++i) {
    auto difference = compare_structure(values_[0], values_[i]);
    if (!difference.empty())
      throw_error(errc::structure_mismatch,
                  "regroup: local replica 0 has " + values_[0].structure_string() +
                      " and local replica " + std::to_string(i) + " has " +
                      values_[i].structure_string() + " (" + difference +
                      "); every replica must have the same structure");
  }
}

regrouped::regrouped(per_replica<nest> values, std::string path)
    : path_(std::move(path)), values_(std::move(values)) {}

bool regrouped::is_leaf() const noexcept {
  return values_.values().front().is_tensor();
}
bool regrouped::is_list() const noexcept {
  return values_.values().front().is_list();
}
bool regrouped::is_dict() const noexcept {
  return values_.values().front().is_dict();
}
size_t regrouped::size() const noexcept {
  return is_leaf() ? 0 : values_.values().front().size();
}

std::vector<std::string> regrouped::keys() const {
  const auto& first = values_.values().front();
  if (!first.is_dict())
    throw_error(errc::structure_mismatch,
                "regrouped" + path_ + " is " + kind_of(first) + ", not a dict: it has no keys");
  std::vector<std::string> out;
  for (const auto& [key, value] : first.as_dict())
    out.push_back(key);
  return out;
}

regrouped regrouped::operator[](size_t index) const {
  const auto& first = values_.values().front();
  if (!first.is_list())
    throw_error(errc::structure_mismatch, "regrouped" + path_ + " is " + kind_of(first) +
                                              ", not a list: it cannot be indexed with " +
                                              std::to_string(index));
  if (index >= first.size())
    throw_error(errc::out_of_range, "regrouped" + path_ + " is a list of " +
                                        std::to_string(first.size()) + "; index " +
                                        std::to_string(index) + " is out of range");
  std::vector<nest> items;
  for (const auto& v : values_)
    items.push_back(v[index]);
  return {per_replica<nest>(std::move(items)), path_ + "[" + std::to_string(index) + "]"};
}

regrouped regrouped::operator[](const std::string& key) const {
  const auto& first = values_.values().front();
  if (!first.is_dict())
    throw_error(errc::structure_mismatch, "regrouped" + path_ + " is " + kind_of(first) +
                                              ", not a dict: it has no key \"" + key + "\"");
  std::vector<nest> items;
  for (const auto& v : values_)
    items.push_back(v[key]); // out_of_range names the missing key and the keys there are
  return {per_replica<nest>(std::move(items)), path_ + "[\"" + key + "\"]"};
}

per_replica<tensor> regrouped::leaf() const {
  const auto& first = values_.values().front();
  if (!first.is_tensor())
    throw_error(errc::structure_mismatch, "regrouped" + path_ + " is " + kind_of(first) + " of " +
                                              std::to_string(first.size()) +
                                              ", not a leaf: index it down to a tensor first");
  std::vector<tensor> out;
  for (const auto& v : values_)
    out.push_back(v.as_tensor());
  return per_replica<tensor>(std::move(out));
}

} // namespace consort
