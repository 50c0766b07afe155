#include "trainer.hpp"

#include <algorithm>
#include <cmath>
#include <fstream>
#include <iomanip>
#include <sstream>
#include <stdexcept>

namespace consort::train {

using steady = std::chrono::steady_clock;

// -- tracing -------------------------------------------------------------------------------------

tracer::tracer(bool on) : on_(on), start_(steady::now()) {}

void tracer::add(const std::string& name, int pid, int tid, steady::time_point begin,
                 steady::time_point end) {
  if (!on_)
    return;
  auto us = [&](steady::time_point t) {
    return std::chrono::duration_cast<std::chrono::microseconds>(t - start_).count();
  };
  std::ostringstream e;
  e << R"({"name":")" << name << R"(","ph":"X","pid":)" << pid << R"(,"tid":)" << tid << R"(,"ts":)"
    << us(begin) << R"(,"dur":)" << std::max<int64_t>(us(end) - us(begin), 1) << '}';
  std::lock_guard<std::mutex> guard{mtx_};
  events_.push_back(e.str());
}

void tracer::write(const std::string& path) const {
  std::ofstream out(path);
  if (!out)
    throw std::runtime_error("cannot write the trace to \"" + path + "\"");
  std::lock_guard<std::mutex> guard{mtx_};
  out << "{\"traceEvents\":[\n";
  for (size_t i = 0; i < events_.size(); ++i)
    out << events_[i] << (i + 1 < events_.size() ? ",\n" : "\n");
  out << "]}\n";
  if (!out.flush())
    throw std::runtime_error("writing the trace to \"" + path + "\" failed");
}

size_t tracer::size() const {
  std::lock_guard<std::mutex> guard{mtx_};
  return events_.size();
}

// -- bucketed all-reduce -------------------------------------------------------------------------

std::vector<std::pair<size_t, size_t>> plan_buckets(const std::vector<size_t>& sizes,
                                                    size_t bucket_bytes) {
  std::vector<std::pair<size_t, size_t>> buckets;
  size_t i = 0;
  while (i < sizes.size()) {
    size_t j = i;
    size_t bytes = 0;
    do {
      bytes += sizes[j];
      ++j;
    } while (j < sizes.size() && bucket_bytes > 0 && bytes + sizes[j] <= bucket_bytes);
    buckets.emplace_back(i, j);
    i = j;
  }
  return buckets;
}

std::vector<tensor> bucketed_all_reduce(replica_context& ctx, const std::vector<tensor>& leaves,
                                        size_t bucket_bytes, tracer& trace, int worker) {
  std::vector<size_t> sizes;
  for (const auto& t : leaves)
    sizes.push_back(t.num_bytes());
  std::vector<tensor> out(leaves.size());
  for (auto [i, j] : plan_buckets(sizes, bucket_bytes)) {
    auto begin = steady::now();
    if (j == i + 1) {
      out[i] = ctx.all_reduce("SUM", leaves[i]);
    } else {
      std::vector<tensor> flat;
      for (size_t k = i; k < j; ++k)
        flat.push_back(leaves[k].reshape({leaves[k].num_elements()}));
      auto reduced = ctx.all_reduce("SUM", concat(flat, 0));
      int64_t offset = 0;
      for (size_t k = i; k < j; ++k) {
        auto n = leaves[k].num_elements();
        out[k] = reduced.slice(offset, offset + n).reshape(leaves[k].shape());
        offset += n;
      }
    }
    trace.add("all_reduce(" + std::to_string(j - i) + " tensors)", worker,
              ctx.replica_id_in_sync_group(), begin, steady::now());
  }
  return out;
}

// -- training ------------------------------------------------------------------------------------

namespace {

/// Rounds every leaf of a float64 nest to float32, once.
nest to_float32(const nest& values) {
  std::vector<tensor> out;
  for (const auto& t : flatten(values)) {
    auto v = t.to_vector<double>();
    std::vector<float> f(v.begin(), v.end());
    out.push_back(tensor::from<float>(f, t.shape()));
  }
  return pack_as(values, out);
}

} // namespace

outcome train_on(strategy& strategy, const train_options& o, const dataset_tensors& data,
                 tracer& trace, int worker, const progress_fn& progress) {
  mlp_shape shape{
      static_cast<int>(data.x.shape()[1]), o.hidden,
      static_cast<int>(1 + *std::max_element(data.y.data<int32_t>(),
                                             data.y.data<int32_t>() + data.y.num_elements()))};
  outcome result;
  result.params = init_params(shape, o.seed);
  auto ds =
      dataset::from_tensor_slices(nest::dict({{"x", data.x}, {"y", data.y}})).batch(o.global_batch);
  auto dist = strategy.distribute_dataset(ds);
  auto start = steady::now();
  int64_t seen = 0;
  std::mutex collective_mtx;
  double collective_s = 0;
  // The gradients have the parameters' shapes, in float64, plus the 3 totals.
  std::vector<size_t> sizes;
  for (const auto& t : flatten(result.params))
    sizes.push_back(static_cast<size_t>(t.num_elements()) * sizeof(double));
  sizes.push_back(3 * sizeof(double));
  const auto calls = static_cast<int64_t>(plan_buckets(sizes, o.bucket_bytes).size());
  for (int64_t step = 0; step < o.steps; ++step) {
    auto batch = dist.get(step % dist.cardinality());
    auto step_begin = steady::now();
    auto outputs = strategy.run(
        [&, params = result.params](replica_context& ctx, const nest& part) {
          auto begin = steady::now();
          auto lg = forward_backward(params, part["x"].as_tensor(), part["y"].as_tensor());
          // float64 gradient sums: how the batch is split changes them only at float64 rounding.
          auto leaves = flatten(lg.grads64);
          auto rows = static_cast<double>(part["y"].as_tensor().num_elements());
          // The counts travel with the gradients in the last bucket.
          leaves.push_back(tensor::from<double>(
              {lg.loss_sum.item<float>(), lg.correct.item<float>(), rows}, {3}));
          auto reduce_begin = steady::now();
          auto reduced = bucketed_all_reduce(ctx, leaves, o.bucket_bytes, trace, worker);
          auto reduce_end = steady::now();
          {
            std::lock_guard<std::mutex> guard{collective_mtx};
            collective_s += std::chrono::duration<double>(reduce_end - reduce_begin).count();
          }
          trace.add("step", worker, ctx.replica_id_in_sync_group(), begin, reduce_end);
          auto totals = reduced.back();
          reduced.pop_back();
          return nest::dict({{"grads", pack_as(lg.grads64, reduced)},
                             {"totals", totals},
                             {"loss", lg.per_example_loss}});
        },
        batch);
    // Every replica holds the same reduced gradients; take the first.
    auto totals = outputs[0]["totals"].as_tensor().to_vector<double>();
    auto global_rows = static_cast<int64_t>(totals[2]);
    if (global_rows > 0)
      sgd_update(result.params, to_float32(outputs[0]["grads"]), o.learning_rate, global_rows);
    // The loss as tf.distribute reports it: MEAN over every example of the global batch.
    std::vector<nest> losses;
    for (auto& out : outputs)
      losses.push_back(out["loss"]);
    auto loss = strategy.reduce("MEAN", per_replica<nest>(losses), 0).as_tensor().item<float>();
    auto accuracy = totals[1] / std::max(totals[2], 1.0);
    result.curve.loss.push_back(loss);
    result.curve.accuracy.push_back(accuracy);
    seen += global_rows;
    trace.add("step " + std::to_string(step), worker, -1, step_begin, steady::now());
    if (progress) {
      auto elapsed = std::chrono::duration<double>(steady::now() - start).count();
      progress(step + 1, loss, accuracy, static_cast<double>(seen) / std::max(elapsed, 1e-9));
    }
  }
  result.elapsed_s = std::chrono::duration<double>(steady::now() - start).count();
  result.examples_per_s = static_cast<double>(seen) / std::max(result.elapsed_s, 1e-9);
  result.collective_s = collective_s;
  result.collectives_per_step = calls;
  return result;
}

double max_relative_difference(const nest& a, const nest& b) {
  auto la = flatten(a);
  auto lb = flatten(b);
  if (la.size() != lb.size())
    throw std::invalid_argument("max_relative_difference: the parameter sets have " +
                                std::to_string(la.size()) + " and " + std::to_string(lb.size()) +
                                " tensors");
  double worst = 0;
  for (size_t i = 0; i < la.size(); ++i) {
    auto va = la[i].to_vector<float>();
    auto vb = lb[i].to_vector<float>();
    if (va.size() != vb.size())
      throw std::invalid_argument("max_relative_difference: tensor " + std::to_string(i) + " has " +
                                  std::to_string(va.size()) + " and " + std::to_string(vb.size()) +
                                  " elements");
    for (size_t k = 0; k < va.size(); ++k) {
      double scale = std::max({std::fabs(double(va[k])), std::fabs(double(vb[k])), 1e-3});
      worst = std::max(worst, std::fabs(double(va[k]) - double(vb[k])) / scale);
    }
  }
  return worst;
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
