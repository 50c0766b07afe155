#include "trainer.hpp"

#include <algorithm>
#include <cmath>
#include <condition_variable>
#include <exception>
#include <fstream>
#include <iomanip>
#include <sstream>
#include <stdexcept>
#include <thread>

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

std::vector<tensor> all_reduce_bucket(replica_context& ctx, const std::vector<tensor>& leaves) {
  if (leaves.size() == 1)
    return {ctx.all_reduce("SUM", leaves[0])};
  std::vector<tensor> flat;
  flat.reserve(leaves.size());
  for (const auto& t : leaves)
    flat.push_back(t.reshape({t.num_elements()}));
  auto reduced = ctx.all_reduce("SUM", concat(flat, 0));
  std::vector<tensor> out;
  out.reserve(leaves.size());
  int64_t offset = 0;
  for (const auto& t : leaves) {
    out.push_back(reduced.slice(offset, offset + t.num_elements()).reshape(t.shape()));
    offset += t.num_elements();
  }
  return out;
}

std::vector<tensor> bucketed_all_reduce(replica_context& ctx, const std::vector<tensor>& leaves,
                                        size_t bucket_bytes, tracer& trace, int worker) {
  std::vector<size_t> sizes;
  for (const auto& t : leaves)
    sizes.push_back(t.num_bytes());
  std::vector<tensor> out;
  out.reserve(leaves.size());
  for (auto [i, j] : plan_buckets(sizes, bucket_bytes)) {
    auto begin = steady::now();
    auto part = all_reduce_bucket(
        ctx, std::vector<tensor>(leaves.begin() + static_cast<std::ptrdiff_t>(i),
                                 leaves.begin() + static_cast<std::ptrdiff_t>(j)));
    out.insert(out.end(), part.begin(), part.end());
    trace.add("all_reduce(" + std::to_string(j - i) + " tensors)", worker,
              ctx.replica_id_in_sync_group(), begin, steady::now());
  }
  return out;
}

// -- training ------------------------------------------------------------------------------------

namespace {

/// The gradients of a backward pass running on a helper thread, handed to the replica's thread
/// as each layer is done.
class gradient_channel {
public:
  void push(const tensor& w_grad, const tensor& b_grad) {
    std::lock_guard<std::mutex> guard{mtx_};
    ready_.push_back(w_grad);
    ready_.push_back(b_grad);
    cv_.notify_one();
  }

  void finish(std::exception_ptr error) {
    std::lock_guard<std::mutex> guard{mtx_};
    done_ = true;
    error_ = std::move(error);
    cv_.notify_one();
  }

  /// Waits until `count` gradients are ready (or, `count` 0, until the pass is done) and returns
  /// them. The helper never blocks, so this wait ends with the pass; rethrows its error.
  std::vector<tensor> wait(size_t count) {
    std::unique_lock<std::mutex> lock{mtx_};
    cv_.wait(lock, [&] { return done_ || (count > 0 && ready_.size() >= count); });
    if (error_)
      std::rethrow_exception(error_);
    return ready_;
  }

private:
  std::mutex mtx_;
  std::condition_variable cv_;
  std::vector<tensor> ready_;
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
      !(o.learning_rate > 0) || !(o.target_loss >= 0))
    throw_error(errc::invalid_argument,
                "train_on: expected steps, global_batch, hidden, layers and examples >= 1, "
                "learning_rate > 0 and target_loss >= 0; got steps " +
                    std::to_string(o.steps) + ", global_batch " + std::to_string(o.global_batch) +
                    ", hidden " + std::to_string(o.hidden) + ", layers " +
                    std::to_string(o.layers) + ", examples " + std::to_string(o.examples) +
                    ", learning_rate " + std::to_string(o.learning_rate) + ", target_loss " +
                    std::to_string(o.target_loss));
}

} // namespace

outcome train_on(strategy& strategy, const train_options& o, const dataset_tensors& data,
                 tracer& trace, int worker, const progress_fn& progress) {
  check(o);
  const auto* labels = data.y.data<int32_t>();
  mlp_shape shape{static_cast<int>(data.x.shape()[1]), o.hidden,
                  static_cast<int>(1 + *std::max_element(labels, labels + data.y.num_elements())),
                  o.layers};
  outcome result;
  result.params = init_params(shape, o.seed);
  auto ds =
      dataset::from_tensor_slices(nest::dict({{"x", data.x}, {"y", data.y}})).batch(o.global_batch);
  auto dist = strategy.distribute_dataset(ds);
  const auto keys = production_order(o.layers);
  // The gradients in the order they are produced, then the step's totals (loss sum, correct
  // predictions, rows), which travel in the last bucket.
  std::vector<size_t> sizes;
  for (const auto& key : keys)
    sizes.push_back(result.params[key].as_tensor().num_bytes());
  sizes.push_back(3 * sizeof(float));
  const auto buckets = plan_buckets(sizes, o.bucket_bytes);
  // With one bucket there is nothing to overlap: the backward pass runs on the replica's thread,
  // without the helper thread's start and join (about 80 us a step on a small model).
  const bool overlap = o.overlap && buckets.size() > 1;
  std::mutex collective_mtx;
  double collective_s = 0;
  int64_t seen = 0;
  auto start = steady::now();
  for (int64_t step = 0; step < o.steps; ++step) {
    auto batch = dist.get(step % dist.cardinality());
    auto step_begin = steady::now();
    // The step reads result.params by reference: run returns only after every replica's step has
    // ended, and nothing else holds the tensors, so sgd_update updates them in place (a copy
    // captured here would make every update copy the whole model first).
    auto outputs = strategy.run(
        [&](replica_context& ctx, const nest& part) {
          const int replica = ctx.replica_id_in_sync_group();
          const int compute_track = 100 + replica;
          const tensor& x = part["x"].as_tensor();
          const tensor& y = part["y"].as_tensor();
          auto begin = steady::now();
          loss_and_grads lg;
          gradient_channel channel;
          std::thread helper;
          joining join{helper};
          auto compute = [&] {
            auto layer_begin = steady::now();
            lg = forward_backward(result.params, x, y,
                                  [&](int layer, const tensor& gw, const tensor& gb) {
                                    auto now = steady::now();
                                    trace.add("backward " + weight_key(layer), worker,
                                              compute_track, layer_begin, now);
                                    layer_begin = now;
                                    if (overlap)
                                      channel.push(gw, gb);
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
          std::vector<tensor> reduced;
          reduced.reserve(sizes.size());
          double in_collectives = 0;
          for (auto [i, j] : buckets) {
            // The bucket's gradients: waited for (overlap) or already there.
            std::vector<tensor> leaves;
            const bool last = j == sizes.size();
            if (overlap) {
              auto ready = channel.wait(last ? 0 : j);
              if (last)
                helper.join();
              leaves.assign(ready.begin() + static_cast<std::ptrdiff_t>(i),
                            ready.begin() + static_cast<std::ptrdiff_t>(std::min(j, keys.size())));
            } else {
              for (size_t k = i; k < std::min(j, keys.size()); ++k)
                leaves.push_back(lg.grads[keys[k]].as_tensor());
            }
            if (last)
              leaves.push_back(
                  tensor::from<float>({lg.loss_sum.item<float>(), lg.correct.item<float>(),
                                       static_cast<float>(y.num_elements())},
                                      {3}));
            auto reduce_begin = steady::now();
            auto part_reduced = all_reduce_bucket(ctx, leaves);
            auto reduce_end = steady::now();
            in_collectives += std::chrono::duration<double>(reduce_end - reduce_begin).count();
            trace.add("all_reduce(" + std::to_string(j - i) + " tensors)", worker, replica,
                      reduce_begin, reduce_end);
            reduced.insert(reduced.end(), part_reduced.begin(), part_reduced.end());
          }
          {
            std::lock_guard<std::mutex> guard{collective_mtx};
            collective_s += in_collectives;
          }
          trace.add("step", worker, replica, begin, steady::now());
          nest::dict_type grads;
          for (size_t k = 0; k < keys.size(); ++k)
            grads[keys[k]] = reduced[k];
          return nest::dict({{"grads", nest::dict(std::move(grads))}, {"totals", reduced.back()}});
        },
        batch);
    // Every replica holds the same reduced gradients; take the first.
    auto totals = outputs[0]["totals"].as_tensor().to_vector<float>();
    auto global_rows = static_cast<int64_t>(totals[2]);
    if (global_rows > 0)
      sgd_update(result.params, outputs[0]["grads"], o.learning_rate, global_rows);
    if (step + 1 == o.snapshot_step)
      result.snapshot = result.params;
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
    if (o.target_loss > 0 && loss <= o.target_loss) {
      // Every worker sees the same all-reduced totals, so all of them stop at this step.
      result.reached_target = true;
      result.time_to_target_s = elapsed;
      break;
    }
  }
  result.elapsed_s = std::chrono::duration<double>(steady::now() - start).count();
  result.examples_per_s = static_cast<double>(seen) / std::max(result.elapsed_s, 1e-9);
  result.collective_s = collective_s;
  result.collectives_per_step = static_cast<int64_t>(buckets.size());
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
