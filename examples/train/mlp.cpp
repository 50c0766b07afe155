#include "mlp.hpp"

#include <consort/error.hpp>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <string>
#include <vector>

namespace consort::train {

namespace {

// -- deterministic arithmetic ---------------------------------------------------------------------

constexpr double pi = 3.14159265358979323846;

/// splitmix64 (Steele, Lea, Flood 2014): tiny, fast, and fully specified, so every standard
/// library produces the same stream (unlike `<random>` distributions).
class splitmix64 {
public:
  explicit splitmix64(uint64_t seed) : state_(seed) {}

  uint64_t next() {
    uint64_t z = (state_ += 0x9e3779b97f4a7c15ULL);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
    return z ^ (z >> 31);
  }

  /// Uniform in [0, 1) with 53 random bits.
  double uniform() { return static_cast<double>(next() >> 11) * 0x1.0p-53; }

  /// Uniform in [-limit, limit).
  double uniform(double limit) { return (2.0 * uniform() - 1.0) * limit; }

  /// Approximately standard normal: the Irwin-Hall sum of four uniforms, centred and scaled to
  /// unit variance. Needs no `log`/`cos`, whose last bit may differ between libm versions.
  double normal() {
    double sum = uniform() + uniform() + uniform() + uniform();
    return (sum - 2.0) * 1.7320508075688772; // sqrt(3): Var(sum) = 4/12.
  }

private:
  uint64_t state_;
};

/// sin(x) from +, *, / and floor only, which IEEE 754 rounds the same everywhere (libm's `sin`
/// need not). Reduces to [-pi/2, pi/2] and sums the Taylor series to degree 23 (error < 1e-16
/// there); ample for generating data.
double portable_sin(double x) {
  x -= 2.0 * pi * std::floor(x / (2.0 * pi) + 0.5); // now in [-pi, pi]
  if (x > pi / 2)
    x = pi - x;
  else if (x < -pi / 2)
    x = -pi - x;
  const double x2 = x * x;
  double term = x;
  double sum = x;
  for (int n = 1; n <= 11; ++n) {
    term *= -x2 / static_cast<double>((2 * n) * (2 * n + 1));
    sum += term;
  }
  return sum;
}

double portable_cos(double x) {
  return portable_sin(x + pi / 2);
}

// -- validation -----------------------------------------------------------------------------------

const tensor& param(const nest& params, const char* key, const char* what) {
  const auto& leaf = params.as_dict().at(key);
  if (!leaf.is_tensor() || !leaf.as_tensor().valid())
    throw_error(errc::structure_mismatch, std::string{what} + ": parameter \"" + key +
                                              "\" must be a tensor; got " +
                                              leaf.structure_string());
  const tensor& t = leaf.as_tensor();
  if (t.dtype() != dtype::float32)
    throw_error(errc::dtype_mismatch, std::string{what} + ": parameter \"" + key +
                                          "\" must be float32; got " + to_string(t.dtype()));
  return t;
}

/// `shape_of` with `what` naming the caller in messages.
mlp_shape checked_shape(const nest& params, const char* what) {
  static const char* const keys[] = {"b1", "b2", "w1", "w2"};
  bool keys_match = params.is_dict() && params.size() == 4;
  for (const char* key : keys)
    keys_match = keys_match && params.as_dict().count(key) == 1;
  if (!keys_match)
    throw_error(errc::structure_mismatch,
                std::string{what} +
                    ": parameters must be a dict with exactly the keys "
                    "\"b1\", \"b2\", \"w1\", \"w2\" (see init_params); got " +
                    params.structure_string());
  const tensor& w1 = param(params, "w1", what);
  const tensor& b1 = param(params, "b1", what);
  const tensor& w2 = param(params, "w2", what);
  const tensor& b2 = param(params, "b2", what);
  if (w1.rank() != 2 || w2.rank() != 2)
    throw_error(errc::shape_mismatch, std::string{what} + ": w1 and w2 must have rank 2; got w1 " +
                                          to_string(w1.shape()) + ", w2 " + to_string(w2.shape()));
  const int64_t inputs = w1.shape()[0];
  const int64_t hidden = w1.shape()[1];
  const int64_t classes = w2.shape()[1];
  if (w2.shape()[0] != hidden || b1.shape() != shape_t{hidden} || b2.shape() != shape_t{classes})
    throw_error(errc::shape_mismatch,
                std::string{what} + ": parameter shapes do not agree; expected w1 [inputs, " +
                    "hidden], b1 [hidden], w2 [hidden, classes], b2 [classes]; got w1 " +
                    to_string(w1.shape()) + ", b1 " + to_string(b1.shape()) + ", w2 " +
                    to_string(w2.shape()) + ", b2 " + to_string(b2.shape()));
  if (inputs < 1 || hidden < 1 || classes < 1)
    throw_error(errc::shape_mismatch, std::string{what} +
                                          ": every layer needs at least one unit; got w1 " +
                                          to_string(w1.shape()) + ", w2 " + to_string(w2.shape()));
  return {static_cast<int>(inputs), static_cast<int>(hidden), static_cast<int>(classes)};
}

void check_features(const tensor& x, const mlp_shape& shape, const char* what) {
  if (!x.valid())
    throw_error(errc::invalid_argument, std::string{what} + ": x is a default-constructed tensor");
  if (x.dtype() != dtype::float32)
    throw_error(errc::dtype_mismatch,
                std::string{what} + ": x must be float32; got " + to_string(x.dtype()));
  if (x.rank() != 2 || x.shape()[1] != shape.inputs)
    throw_error(errc::shape_mismatch, std::string{what} + ": x must have shape [N, " +
                                          std::to_string(shape.inputs) + "] to match w1; got " +
                                          to_string(x.shape()));
}

/// The forward pass of one row, in float64: fills `pre` (hidden pre-activations), `hidden`
/// (after ReLU) and `logits`.
struct forward_row {
  std::vector<double> pre, hidden, logits;

  explicit forward_row(const mlp_shape& s)
      : pre(static_cast<size_t>(s.hidden)), hidden(static_cast<size_t>(s.hidden)),
        logits(static_cast<size_t>(s.classes)) {}

  void run(const mlp_shape& s, const float* x, const float* w1, const float* b1, const float* w2,
           const float* b2) {
    for (int j = 0; j < s.hidden; ++j)
      pre[j] = b1[j];
    for (int i = 0; i < s.inputs; ++i)
      for (int j = 0; j < s.hidden; ++j)
        pre[j] += static_cast<double>(x[i]) * w1[static_cast<size_t>(i) * s.hidden + j];
    for (int j = 0; j < s.hidden; ++j)
      hidden[j] = std::max(pre[j], 0.0);
    for (int k = 0; k < s.classes; ++k)
      logits[k] = b2[k];
    for (int j = 0; j < s.hidden; ++j)
      for (int k = 0; k < s.classes; ++k)
        logits[k] += hidden[j] * w2[static_cast<size_t>(j) * s.classes + k];
  }

  /// Index of the highest logit, the first one on ties.
  int argmax() const {
    return static_cast<int>(std::max_element(logits.begin(), logits.end()) - logits.begin());
  }
};

tensor to_float32(const std::vector<double>& values, shape_t shape) {
  tensor out = tensor::empty(dtype::float32, std::move(shape));
  float* data = out.mutable_data<float>();
  for (size_t i = 0; i < values.size(); ++i)
    data[i] = static_cast<float>(values[i]);
  return out;
}

} // namespace

// -- synthetic data -------------------------------------------------------------------------------

dataset_tensors make_dataset(const synthetic_options& options) {
  if (options.examples < 0 || options.features < 2 || options.classes < 2)
    throw_error(errc::invalid_argument,
                "make_dataset: expected examples >= 0, features >= 2 and classes >= 2; got "
                "examples " +
                    std::to_string(options.examples) + ", features " +
                    std::to_string(options.features) + ", classes " +
                    std::to_string(options.classes));
  const auto rows = options.examples;
  const auto features = static_cast<size_t>(options.features);
  const auto classes = static_cast<uint64_t>(options.classes);
  splitmix64 rng(options.seed);

  // The embedding: feature f is a random direction (a[f][0], a[f][1]) of the warped latent plane.
  std::vector<double> embed(2 * features);
  for (auto& a : embed)
    a = rng.uniform(1.0);

  std::vector<float> x(static_cast<size_t>(rows) * features);
  std::vector<int32_t> y(static_cast<size_t>(rows));
  for (size_t n = 0; n < y.size(); ++n) {
    // Modulo bias is < classes / 2^64: irrelevant here.
    const auto label = static_cast<int32_t>(rng.next() % classes);
    // Position along the arm: radius grows from 0.3 to 1.3 while the angle turns by pi.
    const double t = rng.uniform();
    const double radius = 0.3 + t;
    const double angle = 2.0 * pi * label / static_cast<double>(classes) + pi * t;
    const double z0 = radius * portable_cos(angle) + 0.05 * rng.normal();
    const double z1 = radius * portable_sin(angle) + 0.05 * rng.normal();
    // A smooth nonlinear warp of the plane, so the class boundaries are not even spirals.
    const double w0 = z0 + 0.25 * portable_sin(2.0 * z1);
    const double w1 = z1 + 0.25 * portable_sin(2.0 * z0);
    for (size_t f = 0; f < features; ++f)
      x[n * features + f] =
          static_cast<float>(embed[2 * f] * w0 + embed[2 * f + 1] * w1 + 0.1 * rng.normal());
    y[n] = label;
  }
  return {tensor::from<float>(x, {rows, options.features}), tensor::from<int32_t>(y, {rows})};
}

// -- the model ------------------------------------------------------------------------------------

nest init_params(const mlp_shape& shape, uint64_t seed) {
  if (shape.inputs < 1 || shape.hidden < 1 || shape.classes < 1)
    throw_error(errc::invalid_argument,
                "init_params: every layer needs at least one unit; got inputs " +
                    std::to_string(shape.inputs) + ", hidden " + std::to_string(shape.hidden) +
                    ", classes " + std::to_string(shape.classes));
  splitmix64 rng(seed);
  auto uniform = [&](int64_t rows, int64_t cols, double limit) {
    std::vector<double> values(static_cast<size_t>(rows * cols));
    for (auto& v : values)
      v = rng.uniform(limit);
    return to_float32(values, {rows, cols});
  };
  // He-uniform suits w1 (a ReLU follows it); Glorot-uniform suits w2 (softmax follows it).
  tensor w1 = uniform(shape.inputs, shape.hidden, std::sqrt(6.0 / shape.inputs));
  tensor w2 = uniform(shape.hidden, shape.classes, std::sqrt(6.0 / (shape.hidden + shape.classes)));
  return nest::dict({{"w1", w1},
                     {"b1", tensor::zeros(dtype::float32, {shape.hidden})},
                     {"w2", w2},
                     {"b2", tensor::zeros(dtype::float32, {shape.classes})}});
}

mlp_shape shape_of(const nest& params) {
  return checked_shape(params, "shape_of");
}

loss_and_grads forward_backward(const nest& params, const tensor& x, const tensor& y) {
  const char* what = "forward_backward";
  const mlp_shape s = checked_shape(params, what);
  check_features(x, s, what);
  if (!y.valid())
    throw_error(errc::invalid_argument, std::string{what} + ": y is a default-constructed tensor");
  if (y.dtype() != dtype::int32)
    throw_error(errc::dtype_mismatch,
                std::string{what} + ": y must be int32; got " + to_string(y.dtype()));
  const int64_t rows = x.shape()[0];
  if (y.shape() != shape_t{rows})
    throw_error(errc::shape_mismatch, std::string{what} + ": y must have shape [" +
                                          std::to_string(rows) + "] to match x " +
                                          to_string(x.shape()) + "; got " + to_string(y.shape()));

  const float* w1 = params["w1"].as_tensor().data<float>();
  const float* b1 = params["b1"].as_tensor().data<float>();
  const float* w2 = params["w2"].as_tensor().data<float>();
  const float* b2 = params["b2"].as_tensor().data<float>();
  const float* xs = x.data<float>();
  const int32_t* labels = y.data<int32_t>();

  const auto inputs = static_cast<size_t>(s.inputs);
  const auto hidden = static_cast<size_t>(s.hidden);
  const auto classes = static_cast<size_t>(s.classes);
  std::vector<double> gw1(inputs * hidden), gb1(hidden), gw2(hidden * classes), gb2(classes);
  std::vector<double> dlogits(classes), dpre(hidden);
  forward_row row(s);
  double loss_sum = 0.0;
  double correct = 0.0;
  std::vector<double> losses(static_cast<size_t>(rows));

  for (int64_t n = 0; n < rows; ++n) {
    const int32_t label = labels[n];
    if (label < 0 || label >= s.classes)
      throw_error(errc::invalid_argument, std::string{what} + ": label " + std::to_string(label) +
                                              " of row " + std::to_string(n) + " is outside [0, " +
                                              std::to_string(s.classes) + ")");
    const float* xn = xs + static_cast<size_t>(n) * inputs;
    row.run(s, xn, w1, b1, w2, b2);
    if (row.argmax() == label)
      correct += 1.0;

    // Stable log-sum-exp: shifting by the largest logit keeps every exp() in (0, 1].
    const double top = row.logits[static_cast<size_t>(row.argmax())];
    double exp_sum = 0.0;
    for (size_t k = 0; k < classes; ++k)
      exp_sum += std::exp(row.logits[k] - top);
    const double log_sum_exp = top + std::log(exp_sum);
    losses[static_cast<size_t>(n)] = log_sum_exp - row.logits[static_cast<size_t>(label)];
    loss_sum += losses[static_cast<size_t>(n)];

    // d loss / d logits = softmax(logits) - one_hot(label).
    for (size_t k = 0; k < classes; ++k)
      dlogits[k] = std::exp(row.logits[k] - log_sum_exp);
    dlogits[static_cast<size_t>(label)] -= 1.0;

    // Output layer, then back through w2 and the ReLU (gradient 0 where pre <= 0).
    for (size_t k = 0; k < classes; ++k)
      gb2[k] += dlogits[k];
    for (size_t j = 0; j < hidden; ++j) {
      double dh = 0.0;
      for (size_t k = 0; k < classes; ++k) {
        gw2[j * classes + k] += row.hidden[j] * dlogits[k];
        dh += static_cast<double>(w2[j * classes + k]) * dlogits[k];
      }
      dpre[j] = row.pre[j] > 0.0 ? dh : 0.0;
      gb1[j] += dpre[j];
    }
    for (size_t i = 0; i < inputs; ++i)
      for (size_t j = 0; j < hidden; ++j)
        gw1[i * hidden + j] += static_cast<double>(xn[i]) * dpre[j];
  }

  loss_and_grads out;
  out.loss_sum = tensor::scalar(static_cast<float>(loss_sum));
  out.correct = tensor::scalar(static_cast<float>(correct));
  out.per_example_loss = to_float32(losses, {rows});
  auto f64 = [](const std::vector<double>& v, shape_t shape) {
    return tensor::from<double>(v, std::move(shape));
  };
  out.grads64 = nest::dict({{"w1", f64(gw1, {s.inputs, s.hidden})},
                            {"b1", f64(gb1, {s.hidden})},
                            {"w2", f64(gw2, {s.hidden, s.classes})},
                            {"b2", f64(gb2, {s.classes})}});
  out.grads = nest::dict({{"w1", to_float32(gw1, {s.inputs, s.hidden})},
                          {"b1", to_float32(gb1, {s.hidden})},
                          {"w2", to_float32(gw2, {s.hidden, s.classes})},
                          {"b2", to_float32(gb2, {s.classes})}});
  return out;
}

tensor predict(const nest& params, const tensor& x) {
  const char* what = "predict";
  const mlp_shape s = checked_shape(params, what);
  check_features(x, s, what);
  const int64_t rows = x.shape()[0];
  const float* xs = x.data<float>();
  const float* w1 = params["w1"].as_tensor().data<float>();
  const float* b1 = params["b1"].as_tensor().data<float>();
  const float* w2 = params["w2"].as_tensor().data<float>();
  const float* b2 = params["b2"].as_tensor().data<float>();
  tensor out = tensor::zeros(dtype::int32, {rows});
  int32_t* predictions = out.mutable_data<int32_t>();
  forward_row row(s);
  for (int64_t n = 0; n < rows; ++n) {
    row.run(s, xs + static_cast<size_t>(n) * static_cast<size_t>(s.inputs), w1, b1, w2, b2);
    predictions[n] = row.argmax();
  }
  return out;
}

void sgd_update(nest& params, const nest& grad_sums, double learning_rate, int64_t global_batch) {
  if (global_batch < 1)
    throw_error(errc::invalid_argument,
                "sgd_update: global_batch must be >= 1 (the number of examples the gradient sums "
                "cover); got " +
                    std::to_string(global_batch));
  assert_same_structure(params, grad_sums);
  auto leaves = flatten(params);
  const auto grads = flatten(grad_sums);
  const double scale = learning_rate / static_cast<double>(global_batch);
  for (size_t i = 0; i < leaves.size(); ++i) {
    tensor& p = leaves[i];
    const tensor& g = grads[i];
    if (!p.valid() || !g.valid())
      throw_error(errc::invalid_argument,
                  "sgd_update: leaf " + std::to_string(i) + " is a default-constructed tensor");
    if (p.dtype() != dtype::float32 || g.dtype() != dtype::float32)
      throw_error(errc::dtype_mismatch, "sgd_update: leaf " + std::to_string(i) +
                                            " must be float32 in both nests; got parameter " +
                                            to_string(p.dtype()) + ", gradient " +
                                            to_string(g.dtype()));
    if (p.shape() != g.shape())
      throw_error(errc::shape_mismatch, "sgd_update: leaf " + std::to_string(i) +
                                            " has parameter shape " + to_string(p.shape()) +
                                            " but gradient shape " + to_string(g.shape()));
    const float* gd = g.data<float>();
    float* pd = p.mutable_data<float>(); // copies first when the storage is shared
    for (int64_t e = 0; e < p.num_elements(); ++e)
      pd[e] = static_cast<float>(pd[e] - scale * gd[e]);
  }
  params = pack_as(params, leaves);
}

} // namespace consort::train
