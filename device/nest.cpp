#include "device/nest_paths.hpp"

#include <consort/error.hpp>
#include <consort/nest.hpp>

namespace consort {

namespace {

std::string quoted(const std::string& key) {
  return "\"" + key + "\"";
}

std::string keys_string(const nest::dict_type& items) {
  std::string out = "[";
  bool first = true;
  for (const auto& [key, child] : items) {
    if (!first)
      out += ", ";
    first = false;
    out += quoted(key);
  }
  return out + "]";
}

/// "a tensor", "a list of 2 items", "a dict with keys ["a", "b"]".
std::string describe(const nest& value) {
  if (value.is_tensor())
    return "a tensor";
  if (value.is_list()) {
    auto n = value.as_list().size();
    return "a list of " + std::to_string(n) + (n == 1 ? " item" : " items");
  }
  return "a dict with keys " + keys_string(value.as_dict());
}

std::string where(const std::string& path) {
  return path.empty() ? "at the top level" : "at " + path;
}

std::string compare(const nest& a, const nest& b, const std::string& path) {
  if (a.is_tensor() && b.is_tensor())
    return {};
  if (a.is_list() && b.is_list()) {
    const auto& xs = a.as_list();
    const auto& ys = b.as_list();
    if (xs.size() != ys.size())
      return where(path) + ": expected " + describe(a) + ", got " + describe(b);
    for (size_t i = 0; i < xs.size(); ++i) {
      auto diff = compare(xs[i], ys[i], path + "[" + std::to_string(i) + "]");
      if (!diff.empty())
        return diff;
    }
    return {};
  }
  if (a.is_dict() && b.is_dict()) {
    const auto& xs = a.as_dict();
    const auto& ys = b.as_dict();
    std::string missing;
    std::string unexpected;
    for (const auto& [key, child] : xs)
      if (!ys.count(key))
        missing += (missing.empty() ? "" : ", ") + quoted(key);
    for (const auto& [key, child] : ys)
      if (!xs.count(key))
        unexpected += (unexpected.empty() ? "" : ", ") + quoted(key);
    if (!missing.empty() || !unexpected.empty()) {
      std::string out = where(path) + ": expected " + describe(a) + ", got " + describe(b) + " (";
      if (!missing.empty())
        out += "missing " + missing;
      if (!unexpected.empty())
        out += std::string{missing.empty() ? "" : "; "} + "unexpected " + unexpected;
      return out + ")";
    }
    for (const auto& [key, child] : xs) {
      auto diff = compare(child, ys.at(key), path + "[" + quoted(key) + "]");
      if (!diff.empty())
        return diff;
    }
    return {};
  }
  return where(path) + ": expected " + describe(a) + ", got " + describe(b);
}

void flatten_into(const nest& value, std::vector<tensor>& out) {
  if (value.is_tensor()) {
    out.push_back(value.as_tensor());
  } else if (value.is_list()) {
    for (const auto& child : value.as_list())
      flatten_into(child, out);
  } else {
    for (const auto& [key, child] : value.as_dict())
      flatten_into(child, out);
  }
}

void flatten_paths_into(const nest& value, const std::string& path,
                        std::vector<std::pair<std::string, tensor>>& out) {
  if (value.is_tensor()) {
    out.emplace_back(path, value.as_tensor());
  } else if (value.is_list()) {
    const auto& xs = value.as_list();
    for (size_t i = 0; i < xs.size(); ++i)
      flatten_paths_into(xs[i], path + "[" + std::to_string(i) + "]", out);
  } else {
    for (const auto& [key, child] : value.as_dict())
      flatten_paths_into(child, path + "[" + quoted(key) + "]", out);
  }
}

nest pack_from(const nest& structure, const std::vector<tensor>& leaves, size_t& next) {
  if (structure.is_tensor())
    return nest{leaves[next++]};
  if (structure.is_list()) {
    nest::list_type items;
    items.reserve(structure.as_list().size());
    for (const auto& child : structure.as_list())
      items.push_back(pack_from(child, leaves, next));
    return nest::list(std::move(items));
  }
  nest::dict_type items;
  for (const auto& [key, child] : structure.as_dict())
    items.emplace(key, pack_from(child, leaves, next));
  return nest::dict(std::move(items));
}

std::string render(const nest& value, bool leaves_as_t) {
  if (value.is_tensor()) {
    if (leaves_as_t)
      return "T";
    const auto& t = value.as_tensor();
    if (!t.valid())
      return "invalid";
    return std::string{to_string(t.dtype())} + to_string(t.shape());
  }
  std::string out;
  if (value.is_list()) {
    out = "[";
    bool first = true;
    for (const auto& child : value.as_list()) {
      if (!first)
        out += ", ";
      first = false;
      out += render(child, leaves_as_t);
    }
    return out + "]";
  }
  out = "{";
  bool first = true;
  for (const auto& [key, child] : value.as_dict()) {
    if (!first)
      out += ", ";
    first = false;
    out += quoted(key) + ": " + render(child, leaves_as_t);
  }
  return out + "}";
}

} // namespace

// -- nest -----------------------------------------------------------------------------------------

nest nest::list(list_type items) {
  nest out;
  out.value_ = std::move(items);
  return out;
}

nest nest::dict(dict_type items) {
  nest out;
  out.value_ = std::move(items);
  return out;
}

const tensor& nest::as_tensor() const {
  if (!is_tensor())
    throw_error(errc::structure_mismatch, "expected a tensor, got " + describe(*this));
  return std::get<tensor>(value_);
}

const nest::list_type& nest::as_list() const {
  if (!is_list())
    throw_error(errc::structure_mismatch, "expected a list, got " + describe(*this));
  return std::get<list_type>(value_);
}

const nest::dict_type& nest::as_dict() const {
  if (!is_dict())
    throw_error(errc::structure_mismatch, "expected a dict, got " + describe(*this));
  return std::get<dict_type>(value_);
}

size_t nest::size() const noexcept {
  if (is_list())
    return std::get<list_type>(value_).size();
  if (is_dict())
    return std::get<dict_type>(value_).size();
  return 1;
}

const nest& nest::operator[](size_t index) const {
  if (!is_list())
    throw_error(errc::structure_mismatch, "cannot index " + describe(*this) + " with [" +
                                              std::to_string(index) +
                                              "]: integer indices need a list");
  const auto& items = std::get<list_type>(value_);
  if (index >= items.size())
    throw_error(errc::out_of_range,
                "list index " + std::to_string(index) + " is out of range for " + describe(*this));
  return items[index];
}

const nest& nest::operator[](const std::string& key) const {
  if (!is_dict())
    throw_error(errc::structure_mismatch, "cannot index " + describe(*this) + " with [" +
                                              quoted(key) + "]: string keys need a dict");
  const auto& items = std::get<dict_type>(value_);
  auto it = items.find(key);
  if (it == items.end())
    throw_error(errc::out_of_range, "key " + quoted(key) + " is not in " + describe(*this));
  return it->second;
}

size_t nest::num_leaves() const noexcept {
  if (is_tensor())
    return 1;
  size_t n = 0;
  if (is_list()) {
    for (const auto& child : std::get<list_type>(value_))
      n += child.num_leaves();
  } else {
    for (const auto& [key, child] : std::get<dict_type>(value_))
      n += child.num_leaves();
  }
  return n;
}

std::string nest::to_string() const {
  return render(*this, false);
}

std::string nest::structure_string() const {
  return render(*this, true);
}

bool operator==(const nest& a, const nest& b) {
  return a.value_ == b.value_;
}

// -- free functions -------------------------------------------------------------------------------

std::vector<tensor> flatten(const nest& value) {
  std::vector<tensor> out;
  flatten_into(value, out);
  return out;
}

nest pack_as(const nest& structure, const std::vector<tensor>& leaves) {
  auto expected = structure.num_leaves();
  if (leaves.size() != expected)
    throw_error(errc::structure_mismatch, "pack_as: the structure " + structure.structure_string() +
                                              " has " + std::to_string(expected) + " leaves, but " +
                                              std::to_string(leaves.size()) +
                                              " tensors were given");
  size_t next = 0;
  return pack_from(structure, leaves, next);
}

std::string compare_structure(const nest& a, const nest& b) {
  return compare(a, b, "");
}

void assert_same_structure(const nest& a, const nest& b) {
  auto diff = compare_structure(a, b);
  if (!diff.empty())
    throw_error(errc::structure_mismatch, "the two structures differ " + diff + " (first is " +
                                              a.structure_string() + ", second is " +
                                              b.structure_string() + ")");
}

namespace detail {

std::vector<std::pair<std::string, tensor>> flatten_with_paths(const nest& value) {
  std::vector<std::pair<std::string, tensor>> out;
  flatten_paths_into(value, "", out);
  return out;
}

std::string describe_leaf(const std::string& path) {
  return path.empty() ? "the value" : "leaf " + path;
}

} // namespace detail

} // namespace consort
