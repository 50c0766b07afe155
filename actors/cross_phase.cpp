#include "actors/cross_phase.hpp"

#include <consort/caf_error.hpp>
#include <consort/error.hpp>
#include <consort/ops.hpp>

#include <array>

namespace consort {
namespace detail {

namespace {

/// Divides a MEAN's sum by its count as a single worker's reduce along an axis does (element by
/// element, in the tensor's dtype), so that both give the same bits.
void divide_by(tensor& t, double count) {
  // The 16-bit floats divide in float32 and round once, as a single worker's reduce does.
  if (t.dtype() == dtype::float16) {
    auto* p = t.mutable_data<float16_t>();
    for (int64_t i = 0; i < t.num_elements(); ++i)
      p[i] = float16_t(static_cast<float>(p[i]) / static_cast<float>(count));
    return;
  }
  if (t.dtype() == dtype::bfloat16) {
    auto* p = t.mutable_data<bfloat16_t>();
    for (int64_t i = 0; i < t.num_elements(); ++i)
      p[i] = bfloat16_t(static_cast<float>(p[i]) / static_cast<float>(count));
    return;
  }
  if (t.dtype() == dtype::float32) {
    auto* p = t.mutable_data<float>();
    auto d = static_cast<float>(count);
    for (int64_t i = 0; i < t.num_elements(); ++i)
      p[i] /= d;
  } else {
    auto* p = t.mutable_data<double>();
    for (int64_t i = 0; i < t.num_elements(); ++i)
      p[i] /= count;
  }
}

/// Whether a lone replica's all-reduce can hand its own leaves to the exchange as they are: host
/// tensors, and no integer MEAN (which widens to float64 first), as local_part decides per leaf.
bool reads_in_place(const call_signature& sig, const std::vector<tensor>& leaves) {
  if (sig.kind != collective_kind::all_reduce)
    return false;
  for (const auto& t : leaves)
    if (t.on_gpu() || (sig.op == reduce_op::mean && !is_floating(t.dtype())))
      return false;
  return true;
}

} // namespace

transport::group_call cross_call_for(const call_signature& sig, std::string what, step_id step,
                                     uint32_t seq, std::chrono::milliseconds timeout) {
  transport::group_call cc;
  cc.kind = sig.kind;
  cc.op = sig.op;
  cc.axis = sig.axis;
  cc.root = sig.root;
  cc.what = std::move(what);
  cc.step = step;
  cc.seq = seq;
  cc.signature = signature_of(sig);
  cc.timeout = timeout;
  return cc;
}

void local_part(transport::group_call& cc, const call_signature& sig,
                const std::vector<std::vector<tensor>>& leaves, std::optional<size_t> root_pos) {
  auto n = sig.dtypes.size();
  std::vector<tensor> inputs(leaves.size());
  for (size_t i = 0; i < n; ++i) {
    for (size_t r = 0; r < leaves.size(); ++r)
      inputs[r] = leaves[r][i];
    switch (sig.kind) {
    case collective_kind::all_reduce:
      if (leaves.size() == 1 && !inputs.front().on_gpu() &&
          (sig.op != reduce_op::mean || is_floating(inputs.front().dtype()))) {
        // A lone replica's value is its partial: no copy here, the cross-worker phase reads it
        // in place and writes the result to a tensor of its own (an integer MEAN still widens
        // to float64 first).
        cc.leaves.push_back(inputs.front());
        cc.leaves_are_inputs = true;
      } else {
        cc.leaves.push_back(sig.op == reduce_op::mean ? mean_partial(inputs)
                                                      : reduce_elementwise(sig.op, inputs));
      }
      break;
    case collective_kind::all_gather:
      cc.leaves.push_back(concat(inputs, sig.axis));
      break;
    case collective_kind::broadcast:
      cc.leaves.push_back(root_pos ? leaves[*root_pos][i]
                                   : tensor::empty(sig.dtypes[i], sig.shapes[i]));
      break;
    }
  }
  // The TCP algorithms work on host memory: a GPU replica's partial goes through the host (the
  // replicas copy the result back to their GPUs).
  for (auto& t : cc.leaves)
    if (t.on_gpu())
      t = t.to("CPU:0");
  cc.count = static_cast<double>(leaves.size());
}

/// Strategy.reduce with several workers: this worker's partial on the host lane, then the
/// cross-worker all-reduce (MEAN divides by the true count over every worker), leaf by leaf (each
/// leaf of a MEAN along an axis has its own count).
caf::expected<nest> cross_reduce(transport::communicator& cross, std::chrono::milliseconds timeout,
                                 const host_reduce& req, uint64_t index) {
  auto what =
      std::string{"reduce("} + to_string(req.op) + ") #" + std::to_string(index) + " on the host";
  auto prepare = [&](transport::group_call& cc, const std::vector<tensor>& components) {
    auto local = reduce_components(req.op == reduce_op::mean ? reduce_op::sum : req.op, components,
                                   req.axis);
    // The values this worker reduced: replicas, or elements along the axis.
    double count = static_cast<double>(components.size());
    if (req.axis) {
      count = 0;
      for (const auto& c : components)
        count += static_cast<double>(
            c.shape()[static_cast<size_t>(normalize_axis(*req.axis, c.rank(), "reduce"))]);
    }
    // Integers travel as float64 sums (MEAN of integers is float64).
    if (req.op == reduce_op::mean && !is_floating(local.dtype()))
      local = reduce_elementwise(reduce_op::mean, {local}, 1.0);
    cc.signature = std::string{"reduce("} + to_string(req.op) + ") of " + to_string(local.dtype()) +
                   to_string(local.shape());
    cc.leaves = {std::move(local)};
    cc.count = count;
  };
  // Per-leaf components, validated like a single-worker reduce.
  std::vector<std::vector<tensor>> per_leaf;
  nest structure;
  caf::error failure;
  try {
    if (req.components.empty())
      throw_error(errc::invalid_argument, "reduce needs at least one component");
    structure = req.components.front();
    for (const auto& c : req.components) {
      if (c.structure_string() != structure.structure_string())
        throw_error(errc::structure_mismatch, "reduce: components have different structures: " +
                                                  structure.structure_string() + " and " +
                                                  c.structure_string());
      auto leaves = flatten(c);
      per_leaf.resize(leaves.size());
      for (size_t i = 0; i < leaves.size(); ++i)
        per_leaf[i].push_back(std::move(leaves[i]));
    }
  } catch (const std::exception& e) {
    failure = error_of(e);
  }
  // Every worker must run the same number of calls: a local failure still takes part once.
  if (failure || per_leaf.empty()) {
    transport::group_call cc;
    cc.what = what;
    cc.step = index;
    cc.timeout = timeout;
    cc.local_failure = failure;
    cc.signature = "reduce of no tensors";
    auto out = cross.run(transport::communicator::lane::host, cc);
    if (!out)
      return out.error();
    return structure;
  }
  std::vector<tensor> results;
  for (size_t i = 0; i < per_leaf.size(); ++i) {
    transport::group_call cc;
    cc.kind = collective_kind::all_reduce;
    cc.op = req.op;
    cc.what = per_leaf.size() == 1 ? what : what + ", leaf " + std::to_string(i);
    cc.step = index;
    cc.seq = static_cast<uint32_t>(i);
    cc.timeout = timeout;
    try {
      prepare(cc, per_leaf[i]);
    } catch (const std::exception& e) {
      cc.leaves.clear();
      cc.local_failure = error_of(e);
    }
    // Along an axis, MEAN divides the total like a single worker's reduce does.
    cc.defer_mean = req.axis.has_value();
    auto out = cross.run(transport::communicator::lane::host, cc);
    if (!out)
      return out.error();
    auto result = std::move(out->front());
    if (cc.defer_mean && req.op == reduce_op::mean)
      divide_by(result, cc.total_count);
    results.push_back(std::move(result));
  }
  try {
    return pack_as(structure, results);
  } catch (const std::exception& e) {
    return error_of(e);
  }
}

/// Strategy.gather with several workers: this worker's concatenation, then the cross-worker
/// ragged all-gather along the same axis (worker order = replica-id order).
caf::expected<nest> cross_gather(transport::communicator& cross, std::chrono::milliseconds timeout,
                                 const host_gather& req, uint64_t index) {
  transport::group_call cc;
  cc.kind = collective_kind::all_gather;
  cc.what = "gather #" + std::to_string(index) + " on the host";
  cc.step = index;
  cc.timeout = timeout;
  nest structure;
  try {
    if (req.components.empty())
      throw_error(errc::invalid_argument, "gather needs at least one component");
    auto local = concat_components(req.components, req.axis);
    auto leaves = flatten(local);
    cc.axis = normalize_axis(req.axis, leaves.front().rank(), "gather");
    call_signature sig;
    sig.kind = collective_kind::all_gather;
    sig.axis = cc.axis;
    sig.structure = local.structure_string();
    for (const auto& leaf : leaves) {
      sig.dtypes.push_back(leaf.dtype());
      sig.shapes.push_back(leaf.shape());
    }
    cc.signature = signature_of(sig);
    cc.leaves = std::move(leaves);
    structure = local;
  } catch (const std::exception& e) {
    cc.local_failure = error_of(e);
  }
  auto out = cross.run(transport::communicator::lane::host, cc);
  if (!out)
    return out.error();
  try {
    return pack_as(structure, *out);
  } catch (const std::exception& e) {
    return error_of(e);
  }
}

namespace {

/// What a lone replica's call builds before the exchange, kept by its thread from one call to the
/// next: the vectors keep their capacity, so that a call allocates none of them.
struct lone_scratch {
  std::vector<tensor> leaves;
  /// The signature of a call that is not an all-reduce of one tensor.
  call_signature sig;
  /// The signatures of recent all-reduces of one tensor, with their hashes and their flight
  /// recorder's form, by a hash of what they are made from: a step makes the same calls step after
  /// step, and a call like one of these needs none of them made again (8 slots, the last call of
  /// each kept).
  struct tensor_call {
    bool set = false;
    reduce_op op = reduce_op::sum;
    dtype type = dtype::float32;
    shape_t shape;
    call_signature sig;
    uint64_t hash = 0;
    flight_signature flight;
    bool same(reduce_op o, const tensor& t) const noexcept {
      return set && o == op && t.dtype() == type && t.shape() == shape;
    }
  };
  std::array<tensor_call, 8> tensor_calls;
  tensor_call& slot_for(reduce_op op, const tensor& t) noexcept {
    uint64_t h = static_cast<uint64_t>(op) * 31 + static_cast<uint64_t>(t.dtype());
    for (auto extent : t.shape())
      h = h * 1099511628211ull + static_cast<uint64_t>(extent);
    return tensor_calls[(h ^ (h >> 29)) % tensor_calls.size()];
  }
  /// The result's vector, given back after each call (group_call::result_capacity).
  std::vector<tensor> results;
  bool busy = false;
};

/// This thread's scratch for one call, or (for a call made while another is in progress on this
/// thread, which nothing does today) one of its own. The leaves are let go at the end of the
/// call: a tensor held here would make the caller's next write to it copy its storage.
class scratch_lease {
public:
  scratch_lease() {
    // (Made only when needed, and not on the stack: it is a few kilobytes, which even an empty
    // std::optional of it clears on every call.)
    thread_local lone_scratch kept;
    if (kept.busy)
      own_ = std::make_unique<lone_scratch>();
    s_ = kept.busy ? own_.get() : &kept;
    s_->busy = true;
  }
  ~scratch_lease() {
    s_->leaves.clear();
    s_->results.clear();
    s_->busy = false;
  }
  scratch_lease(const scratch_lease&) = delete;
  scratch_lease& operator=(const scratch_lease&) = delete;
  lone_scratch& operator*() const noexcept { return *s_; }
  lone_scratch* operator->() const noexcept { return s_; }

private:
  std::unique_ptr<lone_scratch> own_;
  lone_scratch* s_ = nullptr;
};

/// The signature of an all-reduce of one tensor, from the scratch's slot for calls like it (made
/// and kept there when the last such call was another).
const lone_scratch::tensor_call& tensor_signature(lone_scratch& scratch, reduce_op op,
                                                  const tensor& value) {
  auto& known = scratch.slot_for(op, value);
  if (known.same(op, value))
    return known;
  known.set = false;
  auto& sig = known.sig;
  sig.kind = collective_kind::all_reduce;
  sig.op = op;
  sig.axis = 0;
  sig.root = 0;
  sig.structure = nest(value).structure_string();
  sig.dtypes.assign(1, value.dtype());
  sig.shapes.assign(1, value.shape());
  known.op = op;
  known.type = value.dtype();
  known.shape = value.shape();
  known.hash = signature_hash(sig);
  known.flight = flight_signature_of(sig);
  known.set = true;
  return known;
}

/// A lone replica's call as the exchange sees it: its signature and names (the texts are made
/// only for an error), its deadline, and its entry in the flight recorder, with the times its
/// descriptor carries. Outlives the exchange: the group call's functions refer to it.
struct lone_frame {
  const call_signature* sig = nullptr;
  int64_t given_axis = 0; // the axis as the replica gave it
  step_id step = 0;
  uint32_t seq = 0;
  std::chrono::milliseconds timeout{};
  uint64_t hash = 0;
  std::vector<tensor>* results = nullptr; // the scratch's, for group_call::result_capacity
  recorded_call rec;
  std::chrono::steady_clock::time_point entered{};
  int64_t entered_unix_ns = 0;
  std::atomic<uint64_t>* arrivals = nullptr;
  transport::call_lateness* lateness = nullptr;
  int64_t clock_offset_ns = 0;

  /// Records the call's start under its job-wide number (this worker's lane runs its calls in
  /// the order every worker does), with one clock read: its start in the ring, its entry time on
  /// the system clock, and where its deadline counts from.
  void start(flight_recorder* recorder, int replica, const flight_signature& flight) {
    if (recorder == nullptr || !recorder->enabled())
      return;
    entered = std::chrono::steady_clock::now();
    entered_unix_ns = recorder->unix_ns(entered);
    rec.recorder = recorder;
    rec.h = recorder->collective(step, seq, replica, flight, flight_state::waiting, {}, entered);
    arrivals = recorder->arrivals(rec.h);
    lateness = recorder->lateness(rec.h);
    clock_offset_ns = recorder->chief_offset_ns();
  }

  /// The call between the workers as the general path makes it (the lean one hands it this form
  /// when the peers' calls are not plainly its own).
  void fill(transport::group_call& cc) const {
    cc.result_capacity = results;
    cc.kind = sig->kind;
    cc.op = sig->op;
    cc.axis = sig->axis;
    cc.root = sig->root;
    cc.step = step;
    cc.seq = seq;
    cc.timeout = timeout;
    cc.signature_hash = hash;
    cc.make_signature = [s = sig] {
      return signature_of(*s);
    };
    cc.make_what = [this] {
      auto as_given = *sig;
      as_given.axis = given_axis;
      return describe_slot(as_given, step, seq);
    };
    cc.entered = entered;
    cc.entered_unix_ns = entered_unix_ns;
    cc.arrivals = arrivals;
    cc.lateness = lateness;
    cc.clock_offset_ns = clock_offset_ns;
  }

  /// The lean path of the commonest small call (transport::lone_all_reduce): one pass through
  /// the lockstep channel when every worker's call is plainly this one. Empty where the call is
  /// not one it takes (nothing was sent); @throws error when the call failed.
  std::optional<tensor> lean(transport::communicator& cross, const tensor& input) const {
    transport::lone_call lone;
    lone.op = sig->op;
    lone.axis = sig->axis;
    lone.root = sig->root;
    lone.step = step;
    lone.seq = seq;
    lone.signature_hash = hash;
    lone.input = &input;
    lone.timeout = timeout;
    lone.entered = entered;
    lone.entered_unix_ns = entered_unix_ns;
    lone.clock_offset_ns = clock_offset_ns;
    lone.arrivals = arrivals;
    lone.lateness = lateness;
    lone.complete = [&](transport::group_call& cc) {
      fill(cc);
      cc.leaves = {input};
      cc.leaves_are_inputs = true;
      cc.count = 1;
    };
    auto out = cross.run_lone(transport::communicator::lane::step, lone);
    if (!out)
      return std::nullopt;
    if (!*out)
      throw to_consort_error(rec.finish(out->error(), timeout), "");
    (void)rec.finish({}, timeout);
    return std::move(**out);
  }

  /// The call through the general exchange, with `cc` holding this worker's part (or its
  /// local failure); the leaves (this worker's inputs, read in place) back into `leaves`.
  std::vector<tensor> run(transport::communicator& cross, transport::group_call& cc,
                          std::vector<tensor>& leaves) const {
    auto out = cross.run(transport::communicator::lane::step, cc);
    if (cc.leaves_are_inputs)
      leaves.swap(cc.leaves); // the scratch's vector back, for the next call
    if (!out)
      throw to_consort_error(rec.finish(out.error(), cc.timeout), "");
    (void)rec.finish({}, cc.timeout);
    return std::move(*out);
  }
};

} // namespace

nest alone_on_worker(transport::communicator& cross, collective_call& call,
                     int num_replicas_in_sync, flight_recorder* recorder) {
  const auto timeout = call.request.timeout.value_or(std::chrono::seconds(30));
  if (call.request.kind == collective_kind::all_reduce && call.request.value.is_tensor()) {
    // (moved out: the caller's nest was made for this call)
    const tensor value = std::move(const_cast<tensor&>(call.request.value.as_tensor()));
    return nest(alone_all_reduce(cross, value, call.request.op, call.step, call.seq, call.replica,
                                 timeout, recorder));
  }
  scratch_lease scratch;
  auto& leaves = scratch->leaves;
  leaves = flatten(call.request.value);
  auto& sig = scratch->sig;
  signature_from(call, leaves, sig);
  const int64_t given_axis = sig.axis;
  int64_t axis = call.request.axis;
  auto problem = check_arguments(call, leaves, num_replicas_in_sync, &axis);
  if (problem.empty())
    sig.axis = axis;
  // No text on a call that succeeds: the workers compare the signature's hash, and the texts
  // (the call as the replica made it, with the axis it gave; the signature) are made only for an
  // error.
  lone_frame frame;
  frame.sig = &sig;
  frame.given_axis = given_axis;
  frame.step = call.step;
  frame.seq = call.seq;
  frame.timeout = timeout;
  frame.hash = signature_hash(sig);
  frame.results = &scratch->results;
  frame.start(recorder, call.replica, flight_signature_of(sig));
  const bool in_place = problem.empty() && reads_in_place(sig, leaves);
  transport::group_call cc;
  frame.fill(cc);
  if (!problem.empty()) {
    // The other workers learn the reason in this call's descriptor, as from the actor's path.
    cc.local_failure = make_caf_error(errc::invalid_argument, problem);
    (void)cross.run(transport::communicator::lane::step, cc);
    if (frame.rec.recorder != nullptr)
      frame.rec.recorder->ended(frame.rec.h, errc::invalid_argument);
    throw error(errc::invalid_argument, problem);
  }
  if (in_place) {
    // The replica's own values are this worker's part: the exchange reads them in place and
    // writes the result to tensors of its own (no partial to build, nothing copied).
    cc.leaves.swap(leaves);
    cc.leaves_are_inputs = true;
    cc.count = 1;
  } else {
    std::optional<size_t> root_pos;
    if (sig.kind == collective_kind::broadcast && sig.root == call.replica)
      root_pos = 0;
    try {
      local_part(cc, sig, {std::move(leaves)}, root_pos);
    } catch (const std::exception& e) {
      cc.leaves.clear();
      cc.local_failure = error_of(e);
    }
  }
  auto out = frame.run(cross, cc, leaves);
  nest result = call.request.value.is_tensor() && out.size() == 1
                    ? nest(std::move(out.front()))
                    : pack_as(call.request.value, out);
  scratch->results = std::move(out); // its capacity, for the next call
  return result;
}

tensor alone_all_reduce(transport::communicator& cross, const tensor& value, reduce_op op,
                        step_id step, uint32_t seq, int replica, std::chrono::milliseconds timeout,
                        flight_recorder* recorder) {
  scratch_lease scratch;
  const auto& known = tensor_signature(*scratch, op, value);
  lone_frame frame;
  frame.sig = &known.sig;
  frame.step = step;
  frame.seq = seq;
  frame.timeout = timeout;
  frame.hash = known.hash;
  frame.results = &scratch->results;
  frame.start(recorder, replica, known.flight);
  // A host tensor, and no integer MEAN (which widens to float64 first): the exchange reads the
  // tensor in place, first through the lean path.
  const bool in_place = !value.on_gpu() && (op != reduce_op::mean || is_floating(value.dtype()));
  if (in_place) {
    if (auto out = frame.lean(cross, value))
      return std::move(*out);
  }
  transport::group_call cc;
  frame.fill(cc);
  auto& leaves = scratch->leaves;
  if (in_place) {
    cc.leaves.assign(1, value);
    cc.leaves_are_inputs = true;
    cc.count = 1;
  } else {
    try {
      local_part(cc, known.sig, {{value}}, std::nullopt);
    } catch (const std::exception& e) {
      cc.leaves.clear();
      cc.local_failure = error_of(e);
    }
  }
  auto out = frame.run(cross, cc, leaves);
  if (out.size() != 1)
    throw error(errc::structure_mismatch, describe_slot(known.sig, step, seq) +
                                              ": came back with " + std::to_string(out.size()) +
                                              " tensors; expected one");
  tensor result = std::move(out.front());
  scratch->results = std::move(out);
  return result;
}

} // namespace detail
} // namespace consort
