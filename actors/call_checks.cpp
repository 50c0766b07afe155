#include "actors/call_checks.hpp"

#include <consort/caf_error.hpp>
#include <consort/error.hpp>
#include <consort/ops.hpp>

#include <charconv>
#include <optional>
#include <sstream>
#include <string_view>

namespace consort::detail {

// Built with appends, not a stream: every cross-worker call formats these (issue 12's hot path).
std::string describe_call(const call_signature& sig) {
  std::string out = to_string(sig.kind);
  switch (sig.kind) {
  case collective_kind::all_reduce:
    out += '(';
    out += to_string(sig.op);
    break;
  case collective_kind::all_gather:
    out += "(axis=" + std::to_string(sig.axis);
    break;
  case collective_kind::broadcast:
    out += "(root=" + std::to_string(sig.root);
    break;
  }
  out += ')';
  return out;
}

std::string join_ids(const std::vector<int>& ids) {
  std::ostringstream out;
  out << '[';
  for (size_t i = 0; i < ids.size(); ++i)
    out << (i ? ", " : "") << ids[i];
  out << ']';
  return out.str();
}

call_signature signature_from(const collective_call& call, const std::vector<tensor>& leaves) {
  call_signature sig;
  signature_from(call, leaves, sig);
  return sig;
}

void signature_from(const collective_call& call, const std::vector<tensor>& leaves,
                    call_signature& sig) {
  sig.kind = call.request.kind;
  sig.op = call.request.op;
  sig.axis = call.request.axis;
  sig.root = call.request.root;
  sig.structure = call.request.value.structure_string();
  sig.dtypes.resize(leaves.size());
  sig.shapes.resize(leaves.size());
  for (size_t i = 0; i < leaves.size(); ++i) {
    sig.dtypes[i] = leaves[i].dtype();
    sig.shapes[i] = leaves[i].shape();
  }
}

std::string describe_slot(const call_signature& sig, step_id step, uint32_t seq) {
  return describe_call(sig) + " #" + std::to_string(seq) + " of step " + std::to_string(step);
}

std::string check_against(const call_signature& sig, const collective_call& call, int first_replica,
                          const std::vector<tensor>& leaves) {
  const auto& req = call.request;
  // The stream only on the way to an error: a call that passes formats nothing.
  std::optional<std::ostringstream> stream;
  auto prefix = [&]() -> std::ostringstream& {
    stream.emplace();
    *stream << "collective mismatch at step " << call.step << ", call #" << call.seq << ": ";
    return *stream;
  };
  call_signature mine;
  mine.kind = req.kind;
  mine.op = req.op;
  mine.axis = req.axis;
  mine.root = req.root;
  if (mine.kind != sig.kind || (sig.kind == collective_kind::all_reduce && mine.op != sig.op) ||
      (sig.kind == collective_kind::all_gather && mine.axis != sig.axis) ||
      (sig.kind == collective_kind::broadcast && mine.root != sig.root)) {
    auto& out = prefix();
    out << "replica " << call.replica << " called " << describe_call(mine) << " but replica "
        << first_replica << " called " << describe_call(sig)
        << "; every replica must make the same collective calls in the same order";
    return out.str();
  }
  auto structure = req.value.structure_string();
  if (structure != sig.structure) {
    auto& out = prefix();
    out << "replica " << call.replica << " passed structure " << structure << " but replica "
        << first_replica << " passed " << sig.structure;
    return out.str();
  }
  for (size_t i = 0; i < leaves.size(); ++i) {
    const auto& t = leaves[i];
    if (t.dtype() != sig.dtypes[i]) {
      auto& out = prefix();
      out << "leaf " << i << ": replica " << call.replica << " passed " << to_string(t.dtype())
          << " but replica " << first_replica << " passed " << to_string(sig.dtypes[i]);
      return out.str();
    }
    if (sig.kind == collective_kind::all_gather) {
      const auto& a = t.shape();
      const auto& b = sig.shapes[i];
      bool ok = a.size() == b.size();
      for (size_t d = 0; ok && d < a.size(); ++d)
        ok = static_cast<int64_t>(d) == sig.axis || a[d] == b[d];
      if (!ok) {
        auto& out = prefix();
        out << "leaf " << i << ": replica " << call.replica << " passed shape "
            << to_string(t.shape()) << " but replica " << first_replica << " passed "
            << to_string(b) << "; all_gather along axis " << sig.axis
            << " needs the same rank and the same extents on every other axis";
        return out.str();
      }
    } else if (t.shape() != sig.shapes[i]) {
      auto& out = prefix();
      out << "leaf " << i << ": replica " << call.replica << " passed shape "
          << to_string(t.shape()) << " but replica " << first_replica << " passed "
          << to_string(sig.shapes[i]) << "; " << to_string(sig.kind) << " needs equal shapes";
      return out.str();
    }
  }
  return {};
}

std::string check_arguments(const collective_call& call, const std::vector<tensor>& leaves,
                            int num_replicas, int64_t* normalized_axis) {
  const auto& req = call.request;
  // The stream only on the way to an error: a call that passes formats nothing.
  auto say = [](auto&&... parts) {
    std::ostringstream out;
    (out << ... << parts);
    return out.str();
  };
  if (req.kind == collective_kind::broadcast && (req.root < 0 || req.root >= num_replicas)) {
    return say("broadcast at step ", call.step, ", call #", call.seq, ": root replica ", req.root,
               " is out of range; expected 0 <= root < ", num_replicas);
  }
  if (req.kind == collective_kind::all_gather) {
    if (leaves.empty()) {
      return say("all_gather at step ", call.step, ", call #", call.seq,
                 ": the value has no tensors");
    }
    for (size_t i = 0; i < leaves.size(); ++i) {
      auto rank = leaves[i].rank();
      if (rank == 0) {
        return say("all_gather at step ", call.step, ", call #", call.seq, ": leaf ", i,
                   " is a scalar (rank 0); all_gather needs rank >= 1, reshape it to [1]");
      }
      if (req.axis < -rank || req.axis >= rank) {
        return say("all_gather at step ", call.step, ", call #", call.seq, ": axis ", req.axis,
                   " is out of range for leaf ", i, " of rank ", rank, "; expected -", rank,
                   " <= axis < ", rank);
      }
      auto axis = req.axis < 0 ? req.axis + rank : req.axis;
      if (i == 0)
        *normalized_axis = axis;
      else if (axis != *normalized_axis) {
        return say("all_gather at step ", call.step, ", call #", call.seq, ": axis ", req.axis,
                   " means axis ", axis, " for leaf ", i, " but axis ", *normalized_axis,
                   " for leaf 0; use a non-negative axis with leaves of different ranks");
      }
    }
  }
  return {};
}

nest compute(const call_signature& sig, const std::vector<std::vector<tensor>>& leaves,
             const nest& structure) {
  auto n = leaves.front().size();
  std::vector<tensor> out(n);
  std::vector<tensor> inputs(leaves.size());
  for (size_t i = 0; i < n; ++i) {
    switch (sig.kind) {
    case collective_kind::all_reduce:
      for (size_t r = 0; r < leaves.size(); ++r)
        inputs[r] = leaves[r][i];
      out[i] = reduce_elementwise(sig.op, inputs);
      break;
    case collective_kind::all_gather:
      for (size_t r = 0; r < leaves.size(); ++r)
        inputs[r] = leaves[r][i];
      out[i] = concat(inputs, sig.axis);
      break;
    case collective_kind::broadcast:
      out[i] = leaves[static_cast<size_t>(sig.root)][i];
      break;
    }
  }
  return pack_as(structure, out);
}

caf::error error_of(const std::exception& e) {
  if (auto* ce = dynamic_cast<const error*>(&e))
    return make_caf_error(ce->code(), ce->what());
  return make_caf_error(errc::invalid_argument, e.what());
}

namespace {

/// Writes a signature's text, piece by piece, into `out` (a string, or a hash that never holds
/// the text): the one definition of the format, so that the hash and the text cannot disagree.
template <class Out>
void write_signature(const call_signature& sig, Out& out) {
  char digits[24];
  auto number = [&](int64_t v) {
    auto end = std::to_chars(digits, digits + sizeof(digits), v).ptr;
    out.append(std::string_view(digits, static_cast<size_t>(end - digits)));
  };
  out.append(to_string(sig.kind));
  switch (sig.kind) {
  case collective_kind::all_reduce:
    out.append("(");
    out.append(to_string(sig.op));
    break;
  case collective_kind::all_gather:
    out.append("(axis=");
    number(sig.axis);
    break;
  case collective_kind::broadcast:
    out.append("(root=");
    number(sig.root);
    break;
  }
  out.append(") of ");
  out.append(sig.structure);
  out.append(" with ");
  for (size_t i = 0; i < sig.dtypes.size(); ++i) {
    if (i)
      out.append(", ");
    out.append(to_string(sig.dtypes[i]));
    out.append("[");
    const auto& shape = sig.shapes[i];
    for (size_t d = 0; d < shape.size(); ++d) {
      if (d)
        out.append(", ");
      const bool ragged =
          sig.kind == collective_kind::all_gather && static_cast<size_t>(sig.axis) == d;
      number(ragged ? -1 : shape[d]);
    }
    out.append("]");
  }
}

struct text_out {
  std::string text;
  void append(std::string_view s) { text.append(s); }
};

struct hash_out {
  uint64_t h = 1469598103934665603ull; // FNV-1a, as transport::fnv1a
  void append(std::string_view s) noexcept {
    for (unsigned char c : s) {
      h ^= c;
      h *= 1099511628211ull;
    }
  }
};

} // namespace

uint64_t signature_hash(const call_signature& sig) {
  // A step calls the same collectives step after step: a thread keeps its last signature's hash,
  // and comparing the signature costs less than hashing its 40-odd characters again.
  struct last_hash {
    bool set = false;
    call_signature sig;
    uint64_t h = 0;
  };
  thread_local last_hash last;
  if (last.set && last.sig == sig)
    return last.h;
  hash_out out;
  write_signature(sig, out);
  last.set = false; // until the copy below is whole
  last.sig = sig;
  last.h = out.h;
  last.set = true;
  return out.h;
}

std::string signature_of(const call_signature& sig) {
  struct last_signature {
    bool set = false;
    call_signature sig;
    std::string text;
  };
  thread_local last_signature last;
  if (last.set && last.sig == sig)
    return last.text;
  text_out out;
  write_signature(sig, out);
  last.sig = sig;
  last.text = out.text;
  last.set = true;
  return std::move(out.text);
}

tensor mean_partial(const std::vector<tensor>& inputs) {
  auto type = inputs.front().dtype();
  if (is_floating(type))
    return reduce_elementwise(reduce_op::sum, inputs);
  return reduce_elementwise(reduce_op::mean, inputs, 1.0);
}

} // namespace consort::detail
