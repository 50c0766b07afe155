// consort-serve: serves a model trained by consort-train over HTTP, in TF Serving's REST API.
//
// It loads the newest good checkpoint of `--model-dir` (what `consort-train --checkpoint-dir`
// writes), rebuilds the MLP from the tensors' names and shapes (w1..w{L+1}, b1..b{L+1}: the layer
// count, hidden size, inputs and classes all come from the file; optional `input_mean` and
// `input_scale` tensors standardize the features first, as in training), and answers:
//   POST /v1/models/NAME:predict  {"instances": [[f1, ..., fN], ...]}
//                                 -> {"predictions": [[p1, ..., pK], ...]}, softmax probabilities
//   GET  /v1/models/NAME          the model's status, in TF Serving's shape (version = step)
//   GET  /healthz                 {"status": "ok"}
//   GET  /metrics                 Prometheus text: requests, errors, batch sizes, latencies
//
// Concurrent requests are queued and batched (up to --max-batch rows, or until the oldest has
// waited --batch-timeout-us); each batch is split over the replicas of a mirrored_strategy of
// --replicas CPU replicas with `run_async`, and its future's continuation hands the rows back to
// the HTTP thread, so no thread waits on a step. Bad input gets 400 and {"error": "..."}; a queue
// holding --max-queue rows answers 503. SIGTERM or SIGINT stops accepting connections, answers the
// requests already read, and exits 0. docs/serve.md has the details.
//
// Usage:
//   ./build/examples/train/consort-train --checkpoint-dir /tmp/ckpt --steps 200
//   ./build/examples/serve/consort-serve --model-dir /tmp/ckpt --model-name mlp --port 8501
//   curl -d '{"instances": [[0.1, ...16 numbers...]]}' localhost:8501/v1/models/mlp:predict
//
//   ./build/examples/serve/consort-serve --model-dir /tmp/ckpt --predict-rows rows.csv
//     computes the forward pass of every row of a CSV file directly (no server, no batching) and
//     prints {"version", "predictions", "classes"} as JSON, "classes" from the training demo's own
//     `predict`: what the tests compare the served answers with.

#include <utility> // before Asio: Boost 1.74's Asio needs it with C++20

#include "mlp.hpp"

#include <consort/checkpoint.hpp>
#include <consort/consort.hpp>

#include <Eigen/Core>
#include <boost/asio/ip/tcp.hpp>
#include <boost/asio/post.hpp>
#include <boost/asio/signal_set.hpp>
#include <boost/asio/steady_timer.hpp>
#include <boost/asio/write.hpp>
#include <boost/beast/core.hpp>
#include <boost/beast/http.hpp>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <array>
#include <charconv>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <deque>
#include <exception>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iostream>
#include <limits>
#include <map>
#include <memory>
#include <optional>
#include <sstream>
#include <string>
#include <unordered_map>
#include <vector>

using namespace consort;
namespace asio = boost::asio;
namespace beast = boost::beast;
namespace http = beast::http;
using tcp = asio::ip::tcp;
using steady = std::chrono::steady_clock;
using json = nlohmann::json;

namespace {

// -- options --------------------------------------------------------------------------------------

struct options {
  std::string model_dir;
  std::string model_name = "mlp";
  std::string host = "127.0.0.1";
  int port = 8501; // TF Serving's REST port
  int replicas = 2;
  int64_t max_batch = 64;
  int64_t batch_timeout_us =
      0; // 0: a batch runs as soon as a slot is free; it fills while others run
  int64_t max_queue = 4096;
  int64_t max_body_bytes = 4 << 20;
  int64_t drain_timeout_s = 30;
  int64_t idle_timeout_s = 60;
  std::string predict_rows;
};

[[noreturn]] void usage(const std::string& problem) {
  std::cerr << "consort-serve: " << problem << "\n"
            << "usage: consort-serve --model-dir DIR [--model-name NAME] [--host ADDR] [--port N]\n"
            << "                     [--replicas N] [--max-batch ROWS] [--batch-timeout-us N]\n"
            << "                     [--max-queue ROWS] [--max-body-bytes N]\n"
            << "                     [--drain-timeout-s N] [--idle-timeout-s N]\n"
            << "       consort-serve --model-dir DIR --predict-rows FILE.csv\n";
  std::exit(2);
}

options parse(int argc, char** argv) {
  options o;
  auto text = [&](int& i, const std::string& name) {
    if (i + 1 >= argc || argv[i + 1][0] == '\0')
      usage(name + " needs a value");
    return std::string{argv[++i]};
  };
  auto integer = [&](int& i, const std::string& name, int64_t least, int64_t most) {
    std::string v = text(i, name);
    int64_t out = 0;
    auto [end, ec] = std::from_chars(v.data(), v.data() + v.size(), out);
    if (ec != std::errc{} || end != v.data() + v.size() || out < least || out > most)
      usage(name + " needs a whole number from " + std::to_string(least) + " to " +
            std::to_string(most) + "; got \"" + v + "\"");
    return out;
  };
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    if (a == "--model-dir")
      o.model_dir = text(i, a);
    else if (a == "--model-name")
      o.model_name = text(i, a);
    else if (a == "--host")
      o.host = text(i, a);
    else if (a == "--port")
      o.port = static_cast<int>(integer(i, a, 0, 65535));
    else if (a == "--replicas")
      o.replicas = static_cast<int>(integer(i, a, 1, 64));
    else if (a == "--max-batch")
      o.max_batch = integer(i, a, 1, 1 << 20);
    else if (a == "--batch-timeout-us")
      o.batch_timeout_us = integer(i, a, 0, 60'000'000);
    else if (a == "--max-queue")
      o.max_queue = integer(i, a, 1, int64_t{1} << 30);
    else if (a == "--max-body-bytes")
      o.max_body_bytes = integer(i, a, 1, int64_t{1} << 32);
    else if (a == "--drain-timeout-s")
      o.drain_timeout_s = integer(i, a, 1, 3600);
    else if (a == "--idle-timeout-s")
      o.idle_timeout_s = integer(i, a, 1, 3600);
    else if (a == "--predict-rows")
      o.predict_rows = text(i, a);
    else if (a == "--help" || a == "-h")
      usage("serves a consort-train checkpoint over HTTP");
    else
      usage("unknown argument \"" + a + "\"");
  }
  if (o.model_dir.empty())
    usage("--model-dir is required: the directory consort-train --checkpoint-dir wrote");
  if (o.model_name.find_first_of("/: ") != std::string::npos)
    usage("--model-name must not contain '/', ':' or spaces; got \"" + o.model_name + "\"");
  return o;
}

/// A start-up failure: main prints it and exits with status 2.
struct startup_error : std::runtime_error {
  using std::runtime_error::runtime_error;
};

// -- the model ------------------------------------------------------------------------------------

using matrix = Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
using const_map = Eigen::Map<const matrix>;

/// The names of the optional input statistics in a checkpoint: float32 [inputs] each. When a
/// checkpoint has them, each feature is standardized as in training, x' = (x - mean) * scale,
/// before the first layer (consort-train standardizes the features of `--data` files).
constexpr const char* input_mean_key = "input_mean";
constexpr const char* input_scale_key = "input_scale";

/// The served model: the checkpoint's parameters and where they came from. Immutable once loaded,
/// so every replica reads it without a lock.
struct model {
  nest params;
  train::mlp_shape shape;
  /// The input's standardization, or invalid tensors when the checkpoint has none.
  tensor input_mean;
  tensor input_scale;
  int64_t version = 0;
  std::string path;
};

/// The newest good checkpoint of `dir` as an MLP, its shape taken from the tensors.
model load_model(const std::string& dir) {
  std::error_code ec;
  if (!std::filesystem::is_directory(dir, ec))
    throw startup_error("--model-dir " + dir + ": no such directory");
  checkpoint_manager_options copts;
  copts.on_warning = [](const std::string& line) {
    std::fprintf(stderr, "consort-serve: warning: %s\n", line.c_str());
  };
  checkpoint_manager manager(dir, copts);
  auto last = manager.restore_latest();
  if (!last)
    throw startup_error("--model-dir " + dir +
                        ": no good checkpoint there (consort-train --checkpoint-dir writes "
                        "ckpt-<step>.safetensors files)");
  // The layers are w1.., b1..; any other tensor is not the MLP's (but the input statistics).
  nest::dict_type leaves;
  for (const auto& t : last->data.tensors) {
    const bool layer = t.name.size() > 1 && (t.name[0] == 'w' || t.name[0] == 'b') &&
                       t.name.find_first_not_of("0123456789", 1) == std::string::npos;
    if (layer)
      leaves.emplace(t.name, t.value);
  }
  model m;
  m.params = nest::dict(std::move(leaves));
  try {
    m.shape = train::shape_of(m.params);
  } catch (const error& e) {
    throw startup_error(last->path + " is not a checkpoint of consort-train's MLP: " + e.what());
  }
  const tensor* mean = last->data.find(input_mean_key);
  const tensor* scale = last->data.find(input_scale_key);
  if ((mean == nullptr) != (scale == nullptr))
    throw startup_error(last->path + " has " + (mean ? input_mean_key : input_scale_key) +
                        " without " + (mean ? input_scale_key : input_mean_key) +
                        "; the input's standardization needs both");
  if (mean != nullptr) {
    for (const auto& [t, name] :
         {std::pair{mean, input_mean_key}, std::pair{scale, input_scale_key}})
      if (t->dtype() != dtype::float32 || t->shape() != shape_t{m.shape.inputs})
        throw startup_error(last->path + ": " + name + " must be float32 [" +
                            std::to_string(m.shape.inputs) + "], one per input feature");
    m.input_mean = *mean;
    m.input_scale = *scale;
  }
  m.version = last->data.metadata.step;
  m.path = last->path;
  return m;
}

/// Softmax probabilities of every row of `x` (float32 [rows, inputs]): float32 [rows, classes].
/// The layers are the training demo's (ReLU hidden layers, a linear output layer) on float32
/// GEMMs; the softmax is computed in float64 per row.
tensor forward(const model& m, const tensor& x) {
  const int64_t rows = x.shape()[0];
  const int layers = m.shape.layers;
  matrix h = const_map(x.data<float>(), rows, x.shape()[1]);
  if (m.input_mean.valid()) {
    const_map mean(m.input_mean.data<float>(), 1, m.shape.inputs);
    const_map scale(m.input_scale.data<float>(), 1, m.shape.inputs);
    h.rowwise() -= mean.row(0);
    h.array().rowwise() *= scale.row(0).array();
  }
  for (int l = 1; l <= layers + 1; ++l) {
    const tensor& w = m.params[train::weight_key(l)].as_tensor();
    const tensor& b = m.params[train::bias_key(l)].as_tensor();
    const_map wm(w.data<float>(), w.shape()[0], w.shape()[1]);
    const_map bm(b.data<float>(), 1, b.shape()[0]);
    matrix out(rows, wm.cols());
    out.noalias() = h * wm;
    out.rowwise() += bm.row(0);
    if (l <= layers)
      out = out.cwiseMax(0.0f);
    h = std::move(out);
  }
  tensor probs = tensor::empty(dtype::float32, {rows, static_cast<int64_t>(h.cols())});
  float* p = probs.mutable_data<float>();
  for (int64_t r = 0; r < rows; ++r) {
    double top = h(r, 0);
    for (Eigen::Index k = 1; k < h.cols(); ++k)
      top = std::max(top, static_cast<double>(h(r, k)));
    double total = 0;
    for (Eigen::Index k = 0; k < h.cols(); ++k)
      total += std::exp(static_cast<double>(h(r, k)) - top);
    for (Eigen::Index k = 0; k < h.cols(); ++k)
      p[r * h.cols() + k] =
          static_cast<float>(std::exp(static_cast<double>(h(r, k)) - top) / total);
  }
  return probs;
}

/// `v` in the shortest form that reads back as the same float.
void append_float(std::string& out, float v) {
  char buf[32];
  auto [end, ec] = std::to_chars(buf, buf + sizeof buf, v);
  out.append(buf, ec == std::errc{} ? end : buf);
}

/// `rows` rows of `cols` floats as a JSON list of lists.
void append_rows(std::string& out, const float* data, int64_t rows, int64_t cols) {
  out += '[';
  for (int64_t r = 0; r < rows; ++r) {
    out += r == 0 ? "[" : ",[";
    for (int64_t k = 0; k < cols; ++k) {
      if (k != 0)
        out += ',';
      append_float(out, data[r * cols + k]);
    }
    out += ']';
  }
  out += ']';
}

// -- --predict-rows -------------------------------------------------------------------------------

/// The forward pass of every row of a CSV file, printed as JSON; no server.
int predict_rows(const model& m, const std::string& file) {
  std::ifstream in(file);
  if (!in)
    throw startup_error("--predict-rows " + file + ": cannot open: " + std::strerror(errno));
  std::vector<float> values;
  int64_t rows = 0;
  std::string line;
  for (int number = 1; std::getline(in, line); ++number) {
    if (line.find_first_not_of(" \t\r") == std::string::npos)
      continue;
    std::stringstream cells(line);
    std::string cell;
    int column = 0;
    while (std::getline(cells, cell, ',')) {
      ++column;
      char* end = nullptr;
      double v = std::strtod(cell.c_str(), &end);
      if (end == cell.c_str() ||
          std::string_view(end).find_first_not_of(" \t\r") != std::string_view::npos)
        throw startup_error(file + ":" + std::to_string(number) + ": column " +
                            std::to_string(column) + " is not a number: \"" + cell + "\"");
      values.push_back(static_cast<float>(v));
    }
    if (column != m.shape.inputs)
      throw startup_error(file + ":" + std::to_string(number) + ": " + std::to_string(column) +
                          " columns; the model takes " + std::to_string(m.shape.inputs));
    ++rows;
  }
  tensor x = tensor::from(values, {rows, static_cast<int64_t>(m.shape.inputs)});
  tensor probs = forward(m, x);
  // The demo's own forward pass, on the features as it saw them in training.
  tensor seen = x;
  if (m.input_mean.valid()) {
    float* v = seen.mutable_data<float>();
    for (int64_t r = 0; r < rows; ++r)
      for (int f = 0; f < m.shape.inputs; ++f)
        v[r * m.shape.inputs + f] = (v[r * m.shape.inputs + f] - m.input_mean.data<float>()[f]) *
                                    m.input_scale.data<float>()[f];
  }
  tensor classes = train::predict(m.params, seen);
  std::string out = "{\"version\":" + std::to_string(m.version) + ",\"predictions\":";
  append_rows(out, probs.data<float>(), rows, m.shape.classes);
  out += ",\"classes\":[";
  for (int64_t r = 0; r < rows; ++r)
    out += (r == 0 ? "" : ",") + std::to_string(classes.data<int32_t>()[r]);
  out += "]}";
  std::printf("%s\n", out.c_str());
  return 0;
}

// -- metrics --------------------------------------------------------------------------------------

/// A Prometheus histogram. Thread safety: not thread-safe; the HTTP thread owns it.
class histogram {
public:
  explicit histogram(std::vector<double> bounds)
      : bounds_(std::move(bounds)), counts_(bounds_.size() + 1, 0) {}
  void observe(double v) {
    size_t i = std::lower_bound(bounds_.begin(), bounds_.end(), v) - bounds_.begin();
    ++counts_[i];
    sum_ += v;
    ++count_;
  }
  void render(std::string& out, const std::string& name, const std::string& help) const {
    out += "# HELP " + name + " " + help + "\n# TYPE " + name + " histogram\n";
    uint64_t cumulative = 0;
    char buf[64];
    for (size_t i = 0; i < bounds_.size(); ++i) {
      cumulative += counts_[i];
      std::snprintf(buf, sizeof buf, "%g", bounds_[i]);
      out += name + "_bucket{le=\"" + buf + "\"} " + std::to_string(cumulative) + "\n";
    }
    out += name + "_bucket{le=\"+Inf\"} " + std::to_string(count_) + "\n";
    std::snprintf(buf, sizeof buf, "%.9g", sum_);
    out += name + "_sum " + buf + "\n" + name + "_count " + std::to_string(count_) + "\n";
  }

private:
  std::vector<double> bounds_;
  std::vector<uint64_t> counts_;
  double sum_ = 0;
  uint64_t count_ = 0;
};

std::vector<double> latency_bounds() {
  return {25e-6, 50e-6, 100e-6, 200e-6, 500e-6, 1e-3, 2e-3, 5e-3, 10e-3,
          25e-3, 50e-3, 100e-3, 250e-3, 500e-3, 1,    2.5,  5,    10};
}

std::vector<double> batch_bounds(int64_t max_batch) {
  std::vector<double> out;
  for (int64_t b = 1; b < max_batch; b *= 2)
    out.push_back(static_cast<double>(b));
  out.push_back(static_cast<double>(max_batch));
  return out;
}

/// What /metrics reports. Thread safety: not thread-safe; only the HTTP thread touches it.
struct metrics {
  explicit metrics(int64_t max_batch)
      : batch_size(batch_bounds(max_batch)), request_latency(latency_bounds()),
        batch_latency(latency_bounds()) {}
  std::map<int, uint64_t> requests_by_code;
  std::map<std::string, uint64_t> errors_by_reason;
  uint64_t predict_rows = 0;
  histogram batch_size;
  histogram request_latency;
  histogram batch_latency;

  std::string render(int64_t queued_rows, int inflight_batches, int64_t version) const {
    std::string out;
    out += "# HELP consort_serve_requests_total HTTP requests answered, by status code.\n"
           "# TYPE consort_serve_requests_total counter\n";
    for (const auto& [code, n] : requests_by_code)
      out += "consort_serve_requests_total{code=\"" + std::to_string(code) + "\"} " +
             std::to_string(n) + "\n";
    out += "# HELP consort_serve_errors_total Requests answered with an error, by reason.\n"
           "# TYPE consort_serve_errors_total counter\n";
    for (const auto& [reason, n] : errors_by_reason)
      out += "consort_serve_errors_total{reason=\"" + reason + "\"} " + std::to_string(n) + "\n";
    out += "# HELP consort_serve_predict_rows_total Instances predicted.\n"
           "# TYPE consort_serve_predict_rows_total counter\n"
           "consort_serve_predict_rows_total " +
           std::to_string(predict_rows) + "\n";
    batch_size.render(out, "consort_serve_batch_size", "Rows per batch run on the replicas.");
    request_latency.render(out, "consort_serve_request_latency_seconds",
                           "Predict requests, from the request read to the response ready.");
    batch_latency.render(out, "consort_serve_batch_latency_seconds",
                         "Batches, from their run_async to their results on the HTTP thread.");
    out += "# HELP consort_serve_queue_rows Rows waiting for a batch.\n"
           "# TYPE consort_serve_queue_rows gauge\nconsort_serve_queue_rows " +
           std::to_string(queued_rows) +
           "\n# HELP consort_serve_batches_in_flight Batches running on the replicas.\n"
           "# TYPE consort_serve_batches_in_flight gauge\nconsort_serve_batches_in_flight " +
           std::to_string(inflight_batches) +
           "\n# HELP consort_serve_model_version The served checkpoint's step.\n"
           "# TYPE consort_serve_model_version gauge\nconsort_serve_model_version " +
           std::to_string(version) + "\n";
    return out;
  }
};

// -- dynamic batching -----------------------------------------------------------------------------

/// One predict request waiting for its rows' results.
struct pending {
  std::vector<float> rows; // n x inputs
  int64_t n = 0;
  steady::time_point arrived;
  /// Called on the HTTP thread: the rows' probabilities (n x classes), or an error message.
  std::function<void(const float* probs, const std::string& error)> done;
};

/// Queues requests and runs them in batches over the strategy's replicas.
///
/// A batch closes when the queue holds `max_batch` rows or its oldest request has waited
/// `batch_timeout`; at most `max_inflight` batches run at once (one computing while the next
/// forms). Each batch is split over the replicas (the first ones get a row more when it does not
/// divide) and run with `run_async`; the future's continuation, on the engine thread that
/// completes it, only posts the results back to the HTTP thread.
///
/// Thread safety: not thread-safe; every call is made on the HTTP thread (the io_context's only
/// thread), which is why it needs no lock.
class batcher {
public:
  static constexpr int max_inflight = 2;

  batcher(asio::io_context& io, strategy& s, const model& m, const options& o, metrics& met)
      : io_(&io), strategy_(&s), model_(&m), max_batch_(o.max_batch),
        timeout_(std::chrono::microseconds(o.batch_timeout_us)), max_queue_(o.max_queue),
        metrics_(&met), timer_(io) {}

  /// Queues `p`; false (and nothing queued) when the queue cannot take its rows.
  bool submit(pending p) {
    if (queued_rows_ + p.n > max_queue_)
      return false;
    queued_rows_ += p.n;
    queue_.push_back(std::move(p));
    maybe_dispatch();
    return true;
  }

  int64_t queued_rows() const noexcept { return queued_rows_; }
  int inflight() const noexcept { return inflight_; }
  void stop() { timer_.cancel(); }
  /// From now on every queued request runs at once, without waiting for its batch to fill (the
  /// drain at SIGTERM: nothing more will join it).
  void flush() {
    flushing_ = true;
    maybe_dispatch();
  }

private:
  void maybe_dispatch() {
    while (inflight_ < max_inflight && !queue_.empty()) {
      const auto due = queue_.front().arrived + timeout_;
      if (flushing_ || queued_rows_ >= max_batch_ || steady::now() >= due) {
        dispatch();
        continue;
      }
      // The front is the oldest request, so a timer armed earlier is due no later than this one:
      // when it fires it comes back here and re-arms for whatever is then the front.
      if (!timer_armed_) {
        timer_armed_ = true;
        timer_.expires_at(due);
        timer_.async_wait([this](const boost::system::error_code& ec) {
          timer_armed_ = false;
          if (!ec)
            maybe_dispatch();
        });
      }
      break;
    }
  }

  void dispatch() {
    auto batch = std::make_shared<std::vector<pending>>();
    int64_t rows = 0;
    while (!queue_.empty() && (batch->empty() || rows + queue_.front().n <= max_batch_)) {
      rows += queue_.front().n;
      batch->push_back(std::move(queue_.front()));
      queue_.pop_front();
    }
    queued_rows_ -= rows;
    const int64_t inputs = model_->shape.inputs;
    const auto replicas = static_cast<int64_t>(strategy_->num_local_replicas());
    std::vector<tensor> parts;
    size_t request = 0;
    int64_t row_in_request = 0;
    for (int64_t r = 0; r < replicas; ++r) {
      const int64_t share = rows / replicas + (r < rows % replicas ? 1 : 0);
      tensor part = tensor::empty(dtype::float32, {share, inputs});
      float* out = part.mutable_data<float>();
      for (int64_t filled = 0; filled < share;) {
        const pending& p = (*batch)[request];
        const int64_t take = std::min(share - filled, p.n - row_in_request);
        std::memcpy(out + filled * inputs, p.rows.data() + row_in_request * inputs,
                    static_cast<size_t>(take * inputs) * sizeof(float));
        filled += take;
        row_in_request += take;
        if (row_in_request == p.n) {
          ++request;
          row_in_request = 0;
        }
      }
      parts.push_back(std::move(part));
    }
    metrics_->batch_size.observe(static_cast<double>(rows));
    ++inflight_;
    const auto started = steady::now();
    const model* m = model_;
    auto result =
        strategy_->run_async([m](replica_context&, const tensor& x) { return forward(*m, x); },
                             per_replica<tensor>(std::move(parts)));
    // On the engine thread that completes the step: hand the results to the HTTP thread.
    result.on_complete([this, batch, started](std::exception_ptr ep, per_replica<tensor> out) {
      asio::post(*io_, [this, batch, started, ep, out = std::move(out)] {
        finish(*batch, started, ep, out);
      });
    });
  }

  void finish(std::vector<pending>& batch, steady::time_point started, std::exception_ptr ep,
              const per_replica<tensor>& out) {
    --inflight_;
    metrics_->batch_latency.observe(std::chrono::duration<double>(steady::now() - started).count());
    std::string failure;
    if (ep) {
      try {
        std::rethrow_exception(ep);
      } catch (const std::exception& e) {
        failure = std::string{"the batch failed on the replicas: "} + e.what();
      }
    }
    const int64_t classes = model_->shape.classes;
    if (failure.empty()) {
      // The replicas' rows, in order, are the batch's rows: one contiguous buffer to slice.
      std::vector<float> all;
      for (const auto& part : out.values())
        all.insert(all.end(), part.data<float>(), part.data<float>() + part.num_elements());
      int64_t row = 0;
      for (auto& p : batch) {
        p.done(all.data() + row * classes, "");
        row += p.n;
      }
    } else {
      for (auto& p : batch)
        p.done(nullptr, failure);
    }
    maybe_dispatch();
  }

  asio::io_context* io_;
  strategy* strategy_;
  const model* model_;
  int64_t max_batch_;
  std::chrono::microseconds timeout_;
  int64_t max_queue_;
  metrics* metrics_;
  asio::steady_timer timer_;
  bool timer_armed_ = false;
  bool flushing_ = false;
  std::deque<pending> queue_;
  int64_t queued_rows_ = 0;
  int inflight_ = 0;
};

// -- parsing a predict request
// ---------------------------------------------------------------------

/// The rows of a predict body, or the reason it is refused.
struct parsed_instances {
  std::vector<float> rows;
  int64_t n = 0;
  std::string error;
  std::string reason; // a metrics label
};

const char* json_type(const json& v) {
  return v.type_name();
}

parsed_instances parse_instances(const std::string& body, int inputs, int64_t max_rows) {
  parsed_instances out;
  auto refuse = [&](std::string reason, std::string message) {
    out.reason = std::move(reason);
    out.error = std::move(message);
    return out;
  };
  json doc;
  try {
    doc = json::parse(body);
  } catch (const json::exception& e) {
    return refuse("malformed_json", std::string{"malformed JSON: "} + e.what());
  }
  if (!doc.is_object())
    return refuse("bad_instances", std::string{"the body must be a JSON object with \"instances\", "
                                               "a list of rows; got a "} +
                                       json_type(doc));
  auto it = doc.find("instances");
  if (it == doc.end())
    return refuse("bad_instances",
                  doc.contains("inputs")
                      ? "only TF Serving's row format is served: give \"instances\", a list of "
                        "rows, not \"inputs\""
                      : "the body has no \"instances\": give a list of rows of " +
                            std::to_string(inputs) + " numbers");
  if (!it->is_array())
    return refuse("bad_instances",
                  std::string{"\"instances\" must be a list of rows; got a "} + json_type(*it));
  if (it->empty())
    return refuse("bad_instances", "\"instances\" is empty: give at least one row");
  if (static_cast<int64_t>(it->size()) > max_rows)
    return refuse("bad_instances", "\"instances\" has " + std::to_string(it->size()) +
                                       " rows; this server takes at most " +
                                       std::to_string(max_rows) + " per request (--max-queue)");
  out.rows.reserve(it->size() * static_cast<size_t>(inputs));
  for (size_t r = 0; r < it->size(); ++r) {
    const json& row = (*it)[r];
    const std::string where = "instances[" + std::to_string(r) + "]";
    if (!row.is_array())
      return refuse("bad_instances", where + " must be a list of " + std::to_string(inputs) +
                                         " numbers; got a " + json_type(row));
    if (static_cast<int>(row.size()) != inputs)
      return refuse("bad_instances", where + " has " + std::to_string(row.size()) +
                                         " features; the model expects " + std::to_string(inputs));
    for (size_t k = 0; k < row.size(); ++k) {
      const json& v = row[k];
      if (!v.is_number())
        return refuse("bad_instances", where + "[" + std::to_string(k) + "] is not a number: " +
                                           v.dump() + " (a " + json_type(v) + ")");
      const double d = v.get<double>();
      if (!(std::fabs(d) <= std::numeric_limits<float>::max()))
        return refuse("bad_instances", where + "[" + std::to_string(k) + "] = " + v.dump() +
                                           " is out of float32's range");
      out.rows.push_back(static_cast<float>(d));
    }
  }
  out.n = static_cast<int64_t>(it->size());
  return out;
}

// -- the HTTP server ------------------------------------------------------------------------------

class server;

/// One connection: reads requests one after the other (keep-alive), answers each.
/// Thread safety: not thread-safe; lives on the HTTP thread.
class session : public std::enable_shared_from_this<session> {
public:
  session(tcp::socket socket, server& srv) : stream_(std::move(socket)), server_(&srv) {}
  ~session();
  void start();
  /// Closes the connection unless a request is being answered (the drain at SIGTERM).
  void close_if_idle() {
    if (!busy_)
      close();
  }

private:
  void read();
  void on_header(const boost::system::error_code& ec);
  void on_read(const boost::system::error_code& ec);
  void route(http::request<http::string_body>& req);
  void predict(const std::string& body);
  void send(http::status status, std::string body, const char* content_type = "application/json");
  void send_error(http::status status, const std::string& reason, const std::string& message);
  void close() {
    boost::system::error_code ignored;
    stream_.socket().shutdown(tcp::socket::shutdown_both, ignored);
    stream_.socket().close(ignored);
  }
  /// Closes after an answer sent before the request was read to its end (a body over the limit,
  /// a malformed request): closing with unread bytes would make the kernel reset the connection,
  /// and the client could lose the answer. So this side's half is shut, and what the client
  /// still sends is read and dropped until it closes its half, for at most 2 s.
  void linger_close() {
    boost::system::error_code ignored;
    stream_.socket().shutdown(tcp::socket::shutdown_send, ignored);
    stream_.expires_after(std::chrono::seconds(2));
    discard();
  }
  void discard() {
    stream_.async_read_some(
        asio::buffer(discard_buffer_),
        [self = shared_from_this()](const boost::system::error_code& ec, size_t) {
          if (ec)
            self->close();
          else
            self->discard();
        });
  }

  beast::tcp_stream stream_;
  beast::flat_buffer buffer_;
  std::optional<http::request_parser<http::string_body>> parser_;
  std::shared_ptr<http::response<http::string_body>> response_;
  server* server_;
  bool busy_ = false;
  bool keep_alive_ = true;
  bool unread_ = false; // the request was not read to its end
  std::array<char, 16384> discard_buffer_{};
  unsigned version_ = 11;
  steady::time_point read_at_;
};

/// The listener, the routes' shared state and the drain at SIGTERM.
/// Thread safety: not thread-safe; lives on the HTTP thread.
class server {
public:
  server(asio::io_context& io, const options& o, const model& m, strategy& s)
      : io_(&io), options_(o), model_(&m), metrics_(o.max_batch), batcher_(io, s, m, o, metrics_),
        acceptor_(io), signals_(io, SIGTERM, SIGINT), drain_timer_(io) {}

  /// Binds and listens; returns the address actually bound.
  tcp::endpoint listen() {
    boost::system::error_code ec;
    auto address = asio::ip::make_address(options_.host, ec);
    if (ec)
      throw startup_error("--host " + options_.host + ": not an IP address (" + ec.message() + ")");
    tcp::endpoint at(address, static_cast<unsigned short>(options_.port));
    acceptor_.open(at.protocol(), ec);
    if (!ec)
      acceptor_.set_option(asio::socket_base::reuse_address(true), ec);
    if (!ec)
      acceptor_.bind(at, ec);
    if (!ec)
      acceptor_.listen(asio::socket_base::max_listen_connections, ec);
    if (ec)
      throw startup_error("cannot listen on " + options_.host + ":" +
                          std::to_string(options_.port) + ": " + ec.message());
    signals_.async_wait([this](const boost::system::error_code& e, int signo) {
      if (!e)
        drain(signo);
    });
    accept();
    return acceptor_.local_endpoint();
  }

  bool clean_exit() const noexcept { return clean_; }

  const options& opts() const noexcept { return options_; }
  const model& served() const noexcept { return *model_; }
  metrics& stats() noexcept { return metrics_; }
  batcher& batches() noexcept { return batcher_; }
  bool draining() const noexcept { return draining_; }

  void add(session* s, std::weak_ptr<session> w) { sessions_.emplace(s, std::move(w)); }
  void remove(session* s) {
    sessions_.erase(s);
    if (draining_ && sessions_.empty())
      finish(true);
  }

private:
  void accept() {
    acceptor_.async_accept([this](const boost::system::error_code& ec, tcp::socket socket) {
      if (ec == asio::error::operation_aborted || !acceptor_.is_open())
        return;
      if (!ec) {
        socket.set_option(tcp::no_delay(true));
        std::make_shared<session>(std::move(socket), *this)->start();
      }
      accept();
    });
  }

  void drain(int signo) {
    draining_ = true;
    boost::system::error_code ignored;
    acceptor_.close(ignored);
    std::printf("consort-serve: %s: not accepting connections; answering the requests in flight "
                "(%zu connection(s) open)\n",
                signo == SIGINT ? "SIGINT" : "SIGTERM", sessions_.size());
    std::fflush(stdout);
    if (sessions_.empty()) {
      finish(true);
      return;
    }
    // Copy first: closing a session may destroy it, which erases it from sessions_.
    std::vector<std::shared_ptr<session>> open;
    for (auto& [ptr, weak] : sessions_)
      if (auto s = weak.lock())
        open.push_back(std::move(s));
    for (auto& s : open)
      s->close_if_idle();
    open.clear();
    batcher_.flush();
    if (finished_)
      return;
    drain_timer_.expires_after(std::chrono::seconds(options_.drain_timeout_s));
    drain_timer_.async_wait([this](const boost::system::error_code& ec) {
      if (ec)
        return;
      std::fprintf(stderr,
                   "consort-serve: %zu connection(s) still open after --drain-timeout-s %lld; "
                   "closing them\n",
                   sessions_.size(), static_cast<long long>(options_.drain_timeout_s));
      finish(false);
    });
  }

  void finish(bool clean) {
    if (finished_)
      return;
    finished_ = true;
    clean_ = clean;
    drain_timer_.cancel();
    batcher_.stop();
    signals_.cancel();
    io_->stop();
  }

  asio::io_context* io_;
  options options_;
  const model* model_;
  metrics metrics_;
  batcher batcher_;
  tcp::acceptor acceptor_;
  asio::signal_set signals_;
  asio::steady_timer drain_timer_;
  std::unordered_map<session*, std::weak_ptr<session>> sessions_;
  bool draining_ = false;
  bool finished_ = false;
  bool clean_ = false;
};

session::~session() {
  server_->remove(this);
}

void session::start() {
  server_->add(this, weak_from_this());
  read();
}

void session::read() {
  busy_ = false;
  parser_.emplace();
  parser_->body_limit(static_cast<uint64_t>(server_->opts().max_body_bytes));
  stream_.expires_after(std::chrono::seconds(server_->opts().idle_timeout_s));
  http::async_read_header(stream_, buffer_, *parser_,
                          [self = shared_from_this()](const boost::system::error_code& ec, size_t) {
                            self->on_header(ec);
                          });
}

void session::on_header(const boost::system::error_code& ec) {
  if (ec || parser_->is_done())
    return on_read(ec);
  auto read_body = [self = shared_from_this()](const boost::system::error_code& e, size_t) {
    if (e)
      return self->on_read(e);
    http::async_read(self->stream_, self->buffer_, *self->parser_,
                     [self](const boost::system::error_code& e2, size_t) { self->on_read(e2); });
  };
  // curl sends "Expect: 100-continue" before a body over 1 KiB and waits a second for the go-ahead
  // unless it gets one. (A body over the limit has already failed above, without the go-ahead.)
  if (beast::iequals(parser_->get()[http::field::expect], "100-continue")) {
    static const char go_ahead[] = "HTTP/1.1 100 Continue\r\n\r\n";
    asio::async_write(stream_, asio::buffer(go_ahead, sizeof go_ahead - 1), std::move(read_body));
    return;
  }
  read_body({}, 0);
}

void session::on_read(const boost::system::error_code& ec) {
  if (ec == http::error::body_limit) {
    busy_ = true;
    keep_alive_ = false; // the rest of the body is still on the wire
    unread_ = true;
    send_error(http::status::bad_request, "body_too_large",
               "the request body is over the limit of " +
                   std::to_string(server_->opts().max_body_bytes) + " bytes (--max-body-bytes)");
    return;
  }
  if (ec == http::error::end_of_stream || ec == beast::error::timeout ||
      ec == asio::error::operation_aborted || ec == asio::error::connection_reset ||
      ec == asio::error::bad_descriptor || ec == asio::error::eof) {
    close();
    return;
  }
  if (ec) {
    busy_ = true;
    keep_alive_ = false;
    unread_ = true;
    send_error(http::status::bad_request, "bad_http", "malformed HTTP request: " + ec.message());
    return;
  }
  busy_ = true;
  read_at_ = steady::now();
  stream_.expires_never();
  auto req = parser_->release();
  keep_alive_ = req.keep_alive();
  version_ = req.version();
  route(req);
}

void session::route(http::request<http::string_body>& req) {
  std::string path{req.target()};
  path = path.substr(0, path.find('?'));
  const bool get = req.method() == http::verb::get;
  const bool post = req.method() == http::verb::post;
  auto method_not_allowed = [&](const char* allowed) {
    send_error(http::status::method_not_allowed, "method",
               std::string{req.method_string()} + " " + path + " is not served; use " + allowed);
  };
  if (path == "/healthz") {
    if (!get)
      return method_not_allowed("GET");
    return send(http::status::ok, R"({"status":"ok"})");
  }
  if (path == "/metrics") {
    if (!get)
      return method_not_allowed("GET");
    auto& b = server_->batches();
    return send(http::status::ok,
                server_->stats().render(b.queued_rows(), b.inflight(), server_->served().version),
                "text/plain; version=0.0.4");
  }
  const std::string prefix = "/v1/models/";
  if (path.rfind(prefix, 0) == 0) {
    std::string rest = path.substr(prefix.size());
    std::string verb;
    if (auto colon = rest.find(':'); colon != std::string::npos) {
      verb = rest.substr(colon + 1);
      rest = rest.substr(0, colon);
    }
    if (rest.empty() || rest.find('/') != std::string::npos || (!verb.empty() && verb != "predict"))
      return send_error(http::status::not_found, "not_found",
                        "no such path: " + path + "; this server answers POST /v1/models/" +
                            server_->opts().model_name + ":predict and GET /v1/models/" +
                            server_->opts().model_name);
    if (rest != server_->opts().model_name)
      // TF Serving's words for an unknown model.
      return send_error(http::status::not_found, "not_found",
                        "Servable not found for request: Latest(" + rest +
                            "); this server serves \"" + server_->opts().model_name + "\"");
    if (verb == "predict") {
      if (!post)
        return method_not_allowed("POST");
      return predict(req.body());
    }
    if (!get)
      return method_not_allowed("GET");
    json status = {{"model_version_status",
                    {{{"version", std::to_string(server_->served().version)},
                      {"state", "AVAILABLE"},
                      {"status", {{"error_code", "OK"}, {"error_message", ""}}}}}}};
    return send(http::status::ok, status.dump());
  }
  send_error(http::status::not_found, "not_found",
             "no such path: " + path + "; this server answers POST /v1/models/" +
                 server_->opts().model_name + ":predict, GET /v1/models/" +
                 server_->opts().model_name + ", GET /healthz and GET /metrics");
}

void session::predict(const std::string& body) {
  const model& m = server_->served();
  auto parsed = parse_instances(body, m.shape.inputs, server_->opts().max_queue);
  if (!parsed.error.empty())
    return send_error(http::status::bad_request, parsed.reason, parsed.error);
  pending p;
  p.n = parsed.n;
  p.rows = std::move(parsed.rows);
  p.arrived = steady::now();
  const int64_t n = p.n;
  p.done = [self = shared_from_this(), n, classes = m.shape.classes](const float* probs,
                                                                     const std::string& error) {
    if (!error.empty())
      return self->send_error(http::status::internal_server_error, "internal", error);
    // Features near float32's limits overflow the layers; JSON has no NaN or infinity.
    for (int64_t i = 0; i < n * classes; ++i)
      if (!std::isfinite(probs[i]))
        return self->send_error(http::status::bad_request, "not_finite",
                                "instances[" + std::to_string(i / classes) +
                                    "]: the model's output is not finite (the features are too "
                                    "large for float32 arithmetic)");
    std::string out = "{\"predictions\":";
    append_rows(out, probs, n, classes);
    out += "}";
    self->server_->stats().predict_rows += static_cast<uint64_t>(n);
    self->server_->stats().request_latency.observe(
        std::chrono::duration<double>(steady::now() - self->read_at_).count());
    self->send(http::status::ok, std::move(out));
  };
  if (!server_->batches().submit(std::move(p)))
    send_error(http::status::service_unavailable, "queue_full",
               "the queue is full (" + std::to_string(server_->batches().queued_rows()) +
                   " rows waiting, --max-queue " + std::to_string(server_->opts().max_queue) +
                   "); retry later");
}

void session::send_error(http::status status, const std::string& reason,
                         const std::string& message) {
  ++server_->stats().errors_by_reason[reason];
  send(status, json{{"error", message}}.dump());
}

void session::send(http::status status, std::string body, const char* content_type) {
  ++server_->stats().requests_by_code[static_cast<int>(status)];
  response_ = std::make_shared<http::response<http::string_body>>(status, version_);
  // A client that stops reading does not hold the connection (or the drain) forever.
  stream_.expires_after(std::chrono::seconds(server_->opts().idle_timeout_s));
  response_->set(http::field::server, "consort-serve");
  response_->set(http::field::content_type, content_type);
  response_->body() = std::move(body);
  response_->keep_alive(keep_alive_ && !server_->draining());
  response_->prepare_payload();
  http::async_write(stream_, *response_,
                    [self = shared_from_this()](const boost::system::error_code& ec, size_t) {
                      if (!ec && self->unread_) {
                        self->linger_close();
                        return;
                      }
                      if (ec || !self->response_->keep_alive() || self->server_->draining()) {
                        self->close();
                        return;
                      }
                      self->read();
                    });
}

} // namespace

int main(int argc, char** argv) {
  const options o = parse(argc, argv);
  model m;
  try {
    m = load_model(o.model_dir);
    if (!o.predict_rows.empty())
      return predict_rows(m, o.predict_rows);
  } catch (const startup_error& e) {
    std::fprintf(stderr, "consort-serve: %s\n", e.what());
    return 2;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "consort-serve: %s: %s\n", o.model_dir.c_str(), e.what());
    return 2;
  }
  try {
    std::vector<std::string> devices;
    for (int i = 0; i < o.replicas; ++i)
      devices.push_back("CPU:" + std::to_string(i));
    asio::io_context io(1);
    mirrored_strategy strategy(devices);
    {
      server srv(io, o, m, strategy);
      tcp::endpoint at;
      try {
        at = srv.listen();
      } catch (const startup_error& e) {
        std::fprintf(stderr, "consort-serve: %s\n", e.what());
        return 2;
      }
      std::printf("consort-serve: model \"%s\" version %lld from %s: MLP %d -> %d x %d -> %d "
                  "(softmax); %d CPU replica(s), batches of up to %lld rows or %lld us, queue of "
                  "%lld rows\n",
                  o.model_name.c_str(), static_cast<long long>(m.version), m.path.c_str(),
                  m.shape.inputs, m.shape.layers, m.shape.hidden, m.shape.classes, o.replicas,
                  static_cast<long long>(o.max_batch), static_cast<long long>(o.batch_timeout_us),
                  static_cast<long long>(o.max_queue));
      if (m.input_mean.valid())
        std::printf("consort-serve: features standardized by the checkpoint's %s and %s\n",
                    input_mean_key, input_scale_key);
      std::printf("listening on %s:%u\n", at.address().to_string().c_str(),
                  static_cast<unsigned>(at.port()));
      std::fflush(stdout);
      io.run();
      if (!srv.clean_exit()) {
        // The drain deadline passed: connections and their handlers are still in the io_context,
        // and steps may still run on the replicas. Nothing more will be answered; leave now
        // rather than tear down what they still point to.
        std::printf("consort-serve: stopped at the drain deadline\n");
        std::fflush(stdout);
        std::_Exit(1);
      }
      strategy.shutdown();
    }
    std::printf("consort-serve: stopped; every request answered\n");
    std::fflush(stdout);
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "consort-serve: %s\n", e.what());
    return 1;
  }
}
