#include "trainer.hpp"

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cmath>
#include <condition_variable>
#include <exception>
#include <fstream>
#include <iomanip>
#include <limits>
#include <map>
#include <set>
#include <sstream>
#include <stdexcept>
#include <thread>

namespace consort::train {

using steady = std::chrono::steady_clock;

// -- tracing -------------------------------------------------------------------------------------

tracer::tracer(bool on)
    : on_(on), steady0_(steady::now()),
      unix0_us_(std::chrono::duration_cast<std::chrono::microseconds>(
                    std::chrono::system_clock::now().time_since_epoch())
                    .count()) {}

void tracer::add(const std::string& name, int pid, int tid, steady::time_point begin,
                 steady::time_point end, const std::string& flow) {
  if (!on_)
    return;
  auto us = [&](steady::time_point t) {
    return unix0_us_ + std::chrono::duration_cast<std::chrono::microseconds>(t - steady0_).count();
  };
  event e{name, pid, tid, us(begin), std::max<int64_t>(us(end) - us(begin), 1), flow};
  std::lock_guard<std::mutex> guard{mtx_};
  events_.push_back(std::move(e));
}

std::string tracer::events_json(int64_t shift_us) const {
  auto out = nlohmann::json::array();
  std::lock_guard<std::mutex> guard{mtx_};
  for (const auto& e : events_)
    out.push_back({{"name", e.name},
                   {"pid", e.pid},
                   {"tid", e.tid},
                   {"ts", e.ts_us + shift_us},
                   {"dur", e.dur_us},
                   {"flow", e.flow}});
  return out.dump();
}

void tracer::write(const std::string& path) const {
  write_job(path, {events_json()}, {"worker:0"});
}

void tracer::write_job(const std::string& path, const std::vector<std::string>& events,
                       const std::vector<std::string>& workers) {
  std::vector<nlohmann::json> parsed;
  int64_t zero = std::numeric_limits<int64_t>::max();
  for (size_t w = 0; w < events.size(); ++w) {
    auto doc = nlohmann::json::parse(events[w], nullptr, /*allow_exceptions=*/false);
    if (!doc.is_array())
      throw std::runtime_error("cannot write the trace to \"" + path + "\": the events of " +
                               (w < workers.size() ? workers[w] : std::to_string(w)) +
                               " are not a JSON array");
    for (const auto& e : doc)
      zero = std::min(zero, e.value("ts", int64_t{0}));
    parsed.push_back(std::move(doc));
  }
  if (zero == std::numeric_limits<int64_t>::max())
    zero = 0;
  auto out = nlohmann::json::array();
  std::map<std::string, std::vector<nlohmann::json>> flows; // flow -> its events' places
  for (size_t w = 0; w < parsed.size(); ++w) {
    const int pid = static_cast<int>(w); // the worker's place in the job's trace
    out.push_back({{"name", "process_name"},
                   {"ph", "M"},
                   {"pid", pid},
                   {"args", {{"name", w < workers.size() ? workers[w] : std::to_string(w)}}}});
    std::set<int> tids;
    for (const auto& e : parsed[w]) {
      const int tid = e.value("tid", 0);
      const int64_t ts = e.value("ts", int64_t{0}) - zero;
      const int64_t dur = e.value("dur", int64_t{1});
      out.push_back({{"name", e.value("name", std::string{})},
                     {"ph", "X"},
                     {"pid", pid},
                     {"tid", tid},
                     {"ts", ts},
                     {"dur", dur}});
      tids.insert(tid);
      if (auto flow = e.value("flow", std::string{}); !flow.empty())
        flows[flow].push_back({{"pid", pid}, {"tid", tid}, {"ts", ts}, {"dur", dur}});
    }
    for (int tid : tids) {
      std::string name = tid < 0      ? "steps"
                         : tid >= 100 ? "replica " + std::to_string(tid - 100) + " compute"
                                      : "replica " + std::to_string(tid);
      out.push_back({{"name", "thread_name"},
                     {"ph", "M"},
                     {"pid", pid},
                     {"tid", tid},
                     {"args", {{"name", name}}}});
    }
  }
  // A collective's events on the workers: an arrow from the first worker's to each other one's.
  int id = 0;
  for (const auto& [flow, places] : flows) {
    if (places.size() < 2)
      continue;
    ++id;
    const auto& from = places.front();
    for (size_t k = 1; k < places.size(); ++k) {
      if (places[k]["pid"] == from["pid"])
        continue; // the same worker's other replicas: no arrow across workers
      out.push_back({{"name", flow},
                     {"cat", "collective"},
                     {"ph", "s"},
                     {"id", id},
                     {"pid", from["pid"]},
                     {"tid", from["tid"]},
                     {"ts", from["ts"]}});
      out.push_back({{"name", flow},
                     {"cat", "collective"},
                     {"ph", "f"},
                     {"bp", "e"},
                     {"id", id},
                     {"pid", places[k]["pid"]},
                     {"tid", places[k]["tid"]},
                     {"ts", places[k]["ts"]}});
    }
  }
  std::ofstream file(path);
  if (!file)
    throw std::runtime_error("cannot write the trace to \"" + path + "\"");
  file << nlohmann::json{{"traceEvents", std::move(out)}}.dump() << "\n";
  if (!file.flush())
    throw std::runtime_error("writing the trace to \"" + path + "\" failed");
}

size_t tracer::size() const {
  std::lock_guard<std::mutex> guard{mtx_};
  return events_.size();
}

// -- training ------------------------------------------------------------------------------------

namespace {

/// The progress of a backward pass running on a helper thread, which writes the gradients into
/// the replica's buckets: the replica's thread waits here until a bucket's gradients exist.
class gradient_channel {
public:
  /// One more layer's two gradients (weight and bias) are written.
  void push_layer() {
    std::lock_guard<std::mutex> guard{mtx_};
    ready_ += 2;
    cv_.notify_one();
  }

  void finish(std::exception_ptr error) {
    std::lock_guard<std::mutex> guard{mtx_};
    done_ = true;
    error_ = std::move(error);
    cv_.notify_one();
  }

  /// Waits until `count` gradients are written (or, `count` 0, until the pass is done). The
  /// helper never blocks, so this wait ends with the pass; rethrows its error.
  void wait(size_t count) {
    std::unique_lock<std::mutex> lock{mtx_};
    cv_.wait(lock, [&] { return done_ || (count > 0 && ready_ >= count); });
    if (error_)
      std::rethrow_exception(error_);
  }

private:
  std::mutex mtx_;
  std::condition_variable cv_;
  size_t ready_ = 0;
  bool done_ = false;
  std::exception_ptr error_;
};

/// Joins a thread when the scope ends, also when it ends with an exception.
struct joining {
  std::thread& thread;
  ~joining() {
    if (thread.joinable())
      thread.join();
  }
};

/// The keys of the gradients in the order the backward pass produces them: w{L+1}, b{L+1}, ...,
/// w1, b1.
std::vector<std::string> production_order(int layers) {
  std::vector<std::string> keys;
  for (int l = layers + 1; l >= 1; --l) {
    keys.push_back(weight_key(l));
    keys.push_back(bias_key(l));
  }
  return keys;
}

void check(const train_options& o) {
  if (o.steps < 1 || o.global_batch < 1 || o.hidden < 1 || o.layers < 1 || o.examples < 1 ||
      !(o.learning_rate > 0) || !(o.target_loss >= 0) || o.start_step < 0 ||
      o.start_step > o.steps || o.checkpoint_every < 0)
    throw_error(errc::invalid_argument,
                "train_on: expected steps, global_batch, hidden, layers and examples >= 1, "
                "learning_rate > 0, target_loss >= 0, 0 <= start_step <= steps and "
                "checkpoint_every >= 0; got steps " +
                    std::to_string(o.steps) + ", global_batch " + std::to_string(o.global_batch) +
                    ", hidden " + std::to_string(o.hidden) + ", layers " +
                    std::to_string(o.layers) + ", examples " + std::to_string(o.examples) +
                    ", learning_rate " + std::to_string(o.learning_rate) + ", target_loss " +
                    std::to_string(o.target_loss) + ", start_step " + std::to_string(o.start_step) +
                    ", checkpoint_every " + std::to_string(o.checkpoint_every));
}

} // namespace

int classes_of(const train_options& o, const dataset_tensors& data) {
  const auto* labels = data.y.data<int32_t>();
  const int64_t n = data.y.num_elements();
  const int largest = n == 0 ? 0 : *std::max_element(labels, labels + n);
  if (o.classes > 0 && largest >= o.classes)
    throw_error(errc::invalid_argument, "train_on: a label is " + std::to_string(largest) +
                                            " and options.classes is " + std::to_string(o.classes));
  return o.classes > 0 ? o.classes : 1 + largest;
}

namespace {

/// True when every replica of this worker is a GPU, false when every one is a CPU.
/// @throws error(invalid_argument) for a mix: each form keeps the parameters in one place.
bool gpu_replicas(const strategy& strategy) {
  size_t gpus = 0;
  for (const auto& device : strategy.worker_devices())
    gpus += parse_device(device).kind == device_kind::gpu ? 1 : 0;
  if (gpus != 0 && gpus != strategy.worker_devices().size()) {
    std::string list;
    for (const auto& device : strategy.worker_devices())
      list += (list.empty() ? "" : ", ") + device;
    throw_error(errc::invalid_argument,
                "train_on: the replicas must be all CPUs or all GPUs (the model keeps its "
                "parameters on the host for CPU replicas and on each GPU for GPU replicas); got " +
                    list);
  }
  return gpus != 0;
}

} // namespace

nest model_state::params_on_host() const {
  nest::dict_type out;
  for (const auto& v : params) {
    tensor t = v.value();
    out.emplace(v.name(), t.on_gpu() ? t.to("CPU:0") : std::move(t));
  }
  return nest::dict(std::move(out));
}

model_state model_on(strategy& strategy, const mlp_shape& shape, const nest& initial) {
  std::map<std::string, variable> existing;
  for (const auto& v : strategy.variables())
    existing.emplace(v.name(), v);
  // Finds the variable `name` of `value`'s shape and dtype, or creates it from `value`.
  auto found_or_made = [&](const std::string& name, const tensor& value, variable_options options) {
    auto it = existing.find(name);
    if (it == existing.end())
      return strategy.create_variable(name, value, options);
    if (it->second.shape() != value.shape() || it->second.dtype() != value.dtype())
      throw_error(errc::invalid_argument,
                  "train_on: this strategy holds the model's variable \"" + name + "\" as " +
                      to_string(it->second.dtype()) + to_string(it->second.shape()) +
                      ", and this model needs " + to_string(value.dtype()) +
                      to_string(value.shape()) +
                      "; train a model of another shape on a strategy of its own");
    variable v = it->second;
    v.assign(value);
    return v;
  };
  model_state model;
  for (const auto& key : production_order(shape.layers))
    model.params.push_back(found_or_made(key, initial[key].as_tensor(), {}));
  const variable_options metric{variable_synchronization::on_read, variable_aggregation::sum};
  model.totals = found_or_made("metrics/totals", tensor::zeros(dtype::float32, {3}), metric);
  return model;
}

outcome train_on(strategy& strategy, const train_options& o, const dataset_tensors& data,
                 tracer& trace, int worker, const progress_fn& progress) {
  check(o);
  mlp_shape shape{static_cast<int>(data.x.shape()[1]), o.hidden, classes_of(o, data), o.layers};
  const bool on_gpus = gpu_replicas(strategy);
  outcome result;
  const model_state model = model_on(
      strategy, shape, o.initial_params.is_dict() ? o.initial_params : init_params(shape, o.seed));
  result.steps = o.start_step;
  auto ds =
      dataset::from_tensor_slices(nest::dict({{"x", data.x}, {"y", data.y}})).batch(o.global_batch);
  auto dist = strategy.distribute_dataset(ds);
  // The rows of global batch `b` (every worker holds the same data): what the GPU form divides the
  // learning rate by before the step's totals reach the host, checked against them after it.
  const int64_t examples = data.x.shape()[0];
  auto rows_of_batch = [&](int64_t b) {
    return std::min<int64_t>(o.global_batch, examples - b * o.global_batch);
  };
  const auto keys = production_order(o.layers);
  // The gradients in the order they are produced, then the step's totals (loss sum, correct
  // predictions, rows, replicas asked to stop), which travel in the last bucket.
  std::vector<size_t> sizes;
  std::vector<shape_t> shapes;
  for (const auto& v : model.params) {
    sizes.push_back(static_cast<size_t>(num_elements(v.shape())) * sizeof(float));
    shapes.push_back(v.shape());
  }
  sizes.push_back(4 * sizeof(float));
  shapes.push_back({4});
  const auto buckets = plan_gradient_buckets(sizes, o.bucket_bytes);
  // Where each tensor lives: its bucket and its offset (in floats) in the bucket's flat buffer.
  // The backward pass writes each gradient there (gradient_slots_fn), so a bucket needs no copy
  // before its all-reduce, and the results are views of the reduced buffer. Each tensor starts
  // on a 64-byte boundary, as a tensor of its own does: Eigen's vectorized GEMMs and sums take
  // another path for unaligned output, which changes the last bit of some gradients, and then
  // the bucket size would change the trained weights. The padding is zero and costs at most 60
  // bytes a tensor.
  constexpr int64_t align_floats = 64 / sizeof(float);
  std::vector<size_t> bucket_of(sizes.size());
  std::vector<int64_t> offset_of(sizes.size());
  std::vector<int64_t> bucket_elements;
  for (size_t b = 0; b < buckets.size(); ++b) {
    int64_t elements = 0;
    for (size_t k = buckets[b].first; k < buckets[b].second; ++k) {
      elements = (elements + align_floats - 1) / align_floats * align_floats;
      bucket_of[k] = b;
      offset_of[k] = elements;
      elements += static_cast<int64_t>(sizes[k] / sizeof(float));
    }
    bucket_elements.push_back(elements);
  }
  // Each replica's bucket buffers, kept from step to step so that the allocator does not hand
  // out (and the kernel fault in) fresh pages every step. A buffer still shared when the next
  // step writes it is copied first (tensor's copy-on-write), so reuse never changes a result.
  std::vector<std::vector<tensor>> replica_buckets(
      static_cast<size_t>(std::max(strategy.num_replicas_in_sync(), 1)));
  // With one bucket there is nothing to overlap: the backward pass runs on the replica's thread,
  // without the cost of the helper thread's start and join, which shows on a small model
  // (bench/README.md, "The small model: where buckets matter").
  const bool overlap = o.overlap && buckets.size() > 1;
  // The parameters on the host (the primary copies of the variables; for GPU replicas a copy
  // each, after the steps' GPU work, which every step waits for at its end).
  auto host_params = [&] {
    return model.params_on_host();
  };
  // This replica's copy of every parameter (its own device's), by key.
  auto own_params = [&](replica_context& ctx) {
    nest::dict_type mine;
    for (const auto& v : model.params)
      mine.emplace(v.name(), ctx.read(v));
    return nest::dict(std::move(mine));
  };
  // Applies the all-reduced gradient sums (every replica holds the same) to this replica's copy
  // of every parameter, in place, with the learning rate divided by the global batch's rows.
  auto apply = [&](replica_context& ctx, const std::vector<tensor>& reduced, double global_rows) {
    if (global_rows <= 0)
      return;
    std::vector<std::pair<tensor, variable>> pairs;
    pairs.reserve(keys.size());
    for (size_t k = 0; k < keys.size(); ++k)
      pairs.emplace_back(reduced[k], model.params[k]);
    sgd({.learning_rate = o.learning_rate / global_rows, .bucket_bytes = o.bucket_bytes})
        .apply_gradients(ctx, pairs, {.skip_gradients_aggregation = true});
  };
  std::mutex collective_mtx;
  double collective_s = 0;
  // One step of a GPU replica (docs/train.md, "On GPUs"): the forward and backward kernels, the
  // replica's totals into its copies of the metrics, the bucket all-reduces (NCCL) and the update
  // of its copies of the variables are all queued on the replica's stream, in that order; the
  // host waits once, for the totals at the end. The stream's order is what the CPU form's helper
  // thread gives it: each all-reduce starts as soon as the kernels that write its bucket are done.
  int64_t current_step = o.start_step; // the step the loop below runs, for gpu_step's trace
  auto gpu_step = [&](replica_context& ctx, const nest& part, std::vector<tensor>& flats,
                      const std::function<float*(size_t)>& slot_of, steady::time_point begin,
                      int64_t global_rows) {
    const int replica = ctx.replica_id_in_sync_group();
    // The step lets go of its handles on the copies once the kernels are queued, so that the
    // update writes them in place (the kernels read them first, in stream order).
    forward_backward_gpu(own_params(ctx), part["x"].as_tensor(), part["y"].as_tensor(),
                         slot_of(keys.size()), [&](int layer) {
                           // keys: w{L+1}, b{L+1}, ..., w1, b1.
                           auto k = static_cast<size_t>(2 * (o.layers + 1 - layer));
                           return gradient_slot{slot_of(k), slot_of(k + 1)};
                         });
    // This replica's totals (loss sum, correct, rows: written by the loss kernel into the last
    // bucket) added to its copy of the metrics before the bucket is all-reduced.
    const int64_t at = offset_of[keys.size()];
    ctx.assign_add(model.totals, flats.back().slice(at, at + 3));
    std::vector<tensor> reduced(sizes.size());
    auto reduce_begin = steady::now();
    for (size_t b = 0; b < buckets.size(); ++b) {
      auto [i, j] = buckets[b];
      auto flat_reduced = ctx.all_reduce("SUM", flats[b]);
      for (size_t k = i; k < j; ++k)
        reduced[k] =
            flat_reduced
                .slice(offset_of[k], offset_of[k] + static_cast<int64_t>(sizes[k] / sizeof(float)))
                .reshape(shapes[k]);
    }
    auto reduce_end = steady::now();
    trace.add("all_reduce(queued)", worker, replica, reduce_begin, reduce_end,
              "step " + std::to_string(current_step) + " all_reduce");
    apply(ctx, reduced, static_cast<double>(global_rows));
    // Waits for the step's GPU work (the step's end would), and keeps no view of the buckets.
    tensor totals = reduced.back().to("CPU:0");
    {
      std::lock_guard<std::mutex> guard{collective_mtx};
      collective_s += std::chrono::duration<double>(reduce_end - reduce_begin).count();
    }
    trace.add("step", worker, replica, begin, steady::now());
    return nest::dict({{"totals", totals}});
  };
  // The epoch's loss and accuracy from the sync-on-read metrics (a collective: every worker
  // reads them after the same steps), then a fresh start for the next epoch.
  const tensor zeros = tensor::zeros(dtype::float32, {3});
  variable metrics = model.totals;
  int64_t epoch_steps = 0;
  auto close_epoch = [&](int64_t last_step) {
    if (epoch_steps == 0)
      return;
    const auto sums = metrics.value().to_vector<float>();
    const double rows = std::max<double>(sums[2], 1.0);
    result.curve.epoch_loss.push_back(sums[0] / rows);
    result.curve.epoch_accuracy.push_back(sums[1] / rows);
    result.curve.epoch_first.push_back(last_step - epoch_steps + 1);
    result.curve.epoch_end.push_back(last_step);
    metrics.assign(zeros);
    epoch_steps = 0;
  };
  metrics.assign(zeros);
  int64_t seen = 0;
  auto start = steady::now();
  for (int64_t step = o.start_step; step < o.steps; ++step) {
    current_step = step;
    const int64_t global_rows_expected = rows_of_batch(step % dist.cardinality());
    auto batch = dist.get(step % dist.cardinality());
    auto step_begin = steady::now();
    auto outputs = strategy.run(
        [&](replica_context& ctx, const nest& part) {
          const int replica = ctx.replica_id_in_sync_group();
          const int compute_track = 100 + replica;
          const tensor& x = part["x"].as_tensor();
          const tensor& y = part["y"].as_tensor();
          auto begin = steady::now();
          // Only this replica's thread touches its own buffers.
          auto& flats = replica_buckets.at(static_cast<size_t>(replica));
          if (flats.empty())
            for (int64_t elements : bucket_elements)
              flats.push_back(tensor::zeros(dtype::float32, {elements},
                                            on_gpus ? ctx.device() : std::string{"CPU:0"}));
          std::vector<float*> bases;
          for (auto& flat : flats)
            bases.push_back(flat.mutable_data<float>());
          auto slot_of = [&](size_t k) {
            return bases[bucket_of[k]] + offset_of[k];
          };
          if (on_gpus)
            return gpu_step(ctx, part, flats, slot_of, begin, global_rows_expected);
          nest params = own_params(ctx);
          loss_and_grads lg;
          gradient_channel channel;
          std::thread helper;
          joining join{helper};
          auto compute = [&] {
            auto layer_begin = steady::now();
            lg = forward_backward(
                params, x, y,
                [&](int layer, const tensor&, const tensor&) {
                  auto now = steady::now();
                  trace.add("backward " + weight_key(layer), worker, compute_track, layer_begin,
                            now);
                  layer_begin = now;
                  if (overlap)
                    channel.push_layer();
                },
                [&](int layer) {
                  // keys: w{L+1}, b{L+1}, ..., w1, b1.
                  auto k = static_cast<size_t>(2 * (o.layers + 1 - layer));
                  return gradient_slot{slot_of(k), slot_of(k + 1)};
                });
          };
          if (overlap)
            helper = std::thread([&] {
              try {
                compute();
                channel.finish(nullptr);
              } catch (...) {
                channel.finish(std::current_exception());
              }
            });
          else
            compute();
          std::vector<tensor> reduced(sizes.size());
          double in_collectives = 0;
          for (size_t b = 0; b < buckets.size(); ++b) {
            auto [i, j] = buckets[b];
            const bool last = j == sizes.size();
            // The bucket's gradients: waited for (overlap) or already there.
            if (overlap) {
              channel.wait(last ? 0 : j);
              if (last)
                helper.join();
            }
            if (last) {
              float* totals = slot_of(keys.size());
              totals[0] = lg.loss_sum.item<float>();
              totals[1] = lg.correct.item<float>();
              totals[2] = static_cast<float>(y.num_elements());
              totals[3] = o.stop_requested && o.stop_requested() ? 1.0f : 0.0f;
            }
            auto reduce_begin = steady::now();
            auto flat_reduced = ctx.all_reduce("SUM", flats[b]);
            auto reduce_end = steady::now();
            in_collectives += std::chrono::duration<double>(reduce_end - reduce_begin).count();
            trace.add("all_reduce(" + std::to_string(j - i) + " tensors)", worker, replica,
                      reduce_begin, reduce_end,
                      "step " + std::to_string(step) + " bucket " + std::to_string(b));
            for (size_t k = i; k < j; ++k)
              reduced[k] = flat_reduced
                               .slice(offset_of[k],
                                      offset_of[k] + static_cast<int64_t>(sizes[k] / sizeof(float)))
                               .reshape(shapes[k]);
          }
          {
            std::lock_guard<std::mutex> guard{collective_mtx};
            collective_s += in_collectives;
          }
          // The update. The gradients are sums over the global batch's rows (every replica holds
          // the same), so the learning rate is divided by their number. The step lets go of its
          // copy first, so that the update is in place.
          params = nest{};
          apply(ctx, reduced, reduced.back().data<float>()[2]);
          // This replica's share of the metrics, kept in its own copies until they are read.
          ctx.assign_add(model.totals,
                         tensor::from<float>({lg.loss_sum.item<float>(), lg.correct.item<float>(),
                                              static_cast<float>(y.num_elements())},
                                             {3}));
          trace.add("step", worker, replica, begin, steady::now());
          return nest::dict({{"totals", reduced.back()}});
        },
        batch);
    // Every replica holds the same reduced totals; take the first.
    auto totals = outputs[0]["totals"].as_tensor().to_vector<float>();
    auto global_rows = static_cast<int64_t>(totals[2]);
    if (global_rows != global_rows_expected)
      throw_error(errc::collective_mismatch,
                  "train_on: step " + std::to_string(step) + " ran on " +
                      std::to_string(global_rows) +
                      " rows across the replicas, and its global "
                      "batch has " +
                      std::to_string(global_rows_expected) +
                      " (a worker with other data, or a dataset split that lost rows)");
    ++epoch_steps;
    if (step + 1 == o.snapshot_step)
      result.snapshot = host_params();
    // The mean loss over every example of the global batch, as tf.distribute reports it.
    double rows = std::max<double>(totals[2], 1.0);
    double loss = totals[0] / rows;
    double accuracy = totals[1] / rows;
    result.curve.loss.push_back(loss);
    result.curve.accuracy.push_back(accuracy);
    seen += global_rows;
    result.steps = step + 1;
    trace.add("step " + std::to_string(step), worker, -1, step_begin, steady::now());
    auto elapsed = std::chrono::duration<double>(steady::now() - start).count();
    if (progress)
      progress(step + 1, loss, accuracy, static_cast<double>(seen) / std::max(elapsed, 1e-9));
    if ((step + 1) % dist.cardinality() == 0)
      close_epoch(step + 1);
    // Every worker sees the same all-reduced totals, so all of them stop at the same step.
    const bool reached = o.target_loss > 0 && loss <= o.target_loss;
    const bool one_worker =
        static_cast<size_t>(strategy.num_replicas_in_sync()) == strategy.num_local_replicas();
    const bool stop =
        totals[3] > 0 || (on_gpus && one_worker && o.stop_requested && o.stop_requested());
    // GPU parameters come to the host through a strategy.run, which every worker must make
    // alike: the workers that do not save (on_checkpoint empty) fetch them too.
    const bool checkpointing = o.on_checkpoint || o.checkpoint_every > 0;
    if (checkpointing && (stop || reached || step + 1 == o.steps ||
                          (o.checkpoint_every > 0 && (step + 1) % o.checkpoint_every == 0))) {
      const nest host = host_params();
      if (o.on_checkpoint)
        o.on_checkpoint(step + 1, host);
    }
    if (o.on_commit && o.commit_every > 0 && (step + 1) % o.commit_every == 0)
      o.on_commit(step + 1, host_params());
    if (o.on_step)
      o.on_step(step + 1, host_params());
    if (reached) {
      result.reached_target = true;
      result.time_to_target_s = elapsed;
      break;
    }
    if (stop) {
      result.stopped = true;
      break;
    }
  }
  result.elapsed_s = std::chrono::duration<double>(steady::now() - start).count();
  close_epoch(result.steps);
  result.params = host_params();
  result.examples_per_s = static_cast<double>(seen) / std::max(result.elapsed_s, 1e-9);
  result.collective_s = collective_s;
  result.collectives_per_step = static_cast<int64_t>(buckets.size());
  return result;
}

difference largest_difference(const nest& a, const nest& b) {
  auto la = flatten(a);
  auto lb = flatten(b);
  if (la.size() != lb.size())
    throw std::invalid_argument("max_relative_difference: the parameter sets have " +
                                std::to_string(la.size()) + " and " + std::to_string(lb.size()) +
                                " tensors");
  difference worst;
  for (size_t i = 0; i < la.size(); ++i) {
    auto va = la[i].to_vector<float>();
    auto vb = lb[i].to_vector<float>();
    if (va.size() != vb.size())
      throw std::invalid_argument("max_relative_difference: tensor " + std::to_string(i) + " has " +
                                  std::to_string(va.size()) + " and " + std::to_string(vb.size()) +
                                  " elements");
    double squared_difference = 0, squared_a = 0, squared_b = 0;
    for (size_t k = 0; k < va.size(); ++k) {
      const double x = va[k], y = vb[k];
      double scale = std::max({std::fabs(x), std::fabs(y), 1e-3});
      double relative = std::fabs(x - y) / scale;
      if (relative > worst.relative || (k == 0 && i == 0)) {
        worst.relative = relative;
        worst.tensor = i;
        worst.element = k;
        worst.a = va[k];
        worst.b = vb[k];
      }
      squared_difference += (x - y) * (x - y);
      squared_a += x * x;
      squared_b += y * y;
    }
    const double norm = std::sqrt(std::max(squared_a, squared_b));
    const double normwise = norm > 0 ? std::sqrt(squared_difference) / norm : 0;
    if (normwise > worst.normwise) {
      worst.normwise = normwise;
      worst.normwise_tensor = i;
    }
  }
  return worst;
}

evaluation evaluate(const nest& params, const dataset_tensors& data) {
  const nest host = map_structure(params, [](const tensor& t) { return t.to("CPU:0"); });
  const tensor x = data.x.to("CPU:0");
  const tensor y = data.y.to("CPU:0");
  evaluation out;
  out.rows = y.num_elements();
  const int64_t features = x.shape()[1];
  constexpr int64_t chunk = 4096;
  double loss = 0;
  double correct = 0;
  for (int64_t begin = 0; begin < out.rows; begin += chunk) {
    const int64_t n = std::min(chunk, out.rows - begin);
    const float* xs = x.data<float>() + begin * features;
    const int32_t* ys = y.data<int32_t>() + begin;
    auto part = forward_backward(host, tensor::from<float>({xs, xs + n * features}, {n, features}),
                                 tensor::from<int32_t>({ys, ys + n}, {n}));
    loss += part.loss_sum.item<float>();
    correct += part.correct.item<float>();
  }
  if (out.rows > 0) {
    out.loss = loss / static_cast<double>(out.rows);
    out.accuracy = correct / static_cast<double>(out.rows);
  }
  return out;
}

double max_relative_difference(const nest& a, const nest& b) {
  return largest_difference(a, b).relative;
}

void write_plot(const std::string& path, const history& h) {
  const double w = 640, ht = 360, pad = 40;
  auto poly = [&](const std::vector<double>& ys, double lo, double hi) {
    std::ostringstream p;
    for (size_t i = 0; i < ys.size(); ++i) {
      double x = pad + (w - 2 * pad) * (ys.size() > 1 ? double(i) / double(ys.size() - 1) : 0);
      double y = ht - pad - (ht - 2 * pad) * (ys[i] - lo) / std::max(hi - lo, 1e-12);
      p << (i ? " " : "") << std::fixed << std::setprecision(1) << x << ',' << y;
    }
    return p.str();
  };
  double lmax = h.loss.empty() ? 1 : *std::max_element(h.loss.begin(), h.loss.end());
  std::ofstream out(path);
  if (!out)
    throw std::runtime_error("cannot write the plot to \"" + path + "\"");
  out << R"(<svg xmlns="http://www.w3.org/2000/svg" width="640" height="360" font-family="sans-serif" font-size="12">)"
      << "\n<rect width=\"640\" height=\"360\" fill=\"white\"/>\n"
      << "<line x1=\"40\" y1=\"320\" x2=\"600\" y2=\"320\" stroke=\"black\"/>\n"
      << "<line x1=\"40\" y1=\"40\" x2=\"40\" y2=\"320\" stroke=\"black\"/>\n"
      << "<polyline fill=\"none\" stroke=\"#d62728\" stroke-width=\"1.5\" points=\""
      << poly(h.loss, 0, lmax) << "\"/>\n"
      << "<polyline fill=\"none\" stroke=\"#1f77b4\" stroke-width=\"1.5\" points=\""
      << poly(h.accuracy, 0, 1) << "\"/>\n"
      << "<text x=\"50\" y=\"30\" fill=\"#d62728\">loss (0.." << std::setprecision(3) << lmax
      << ")</text>\n<text x=\"200\" y=\"30\" fill=\"#1f77b4\">accuracy (0..1)</text>\n"
      << "<text x=\"560\" y=\"340\">step " << h.loss.size() << "</text>\n</svg>\n";
  if (!out.flush())
    throw std::runtime_error("writing the plot to \"" + path + "\" failed");
}

} // namespace consort::train
