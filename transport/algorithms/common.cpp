// Tags, error reports and argument checks shared by the collective algorithms.

#include "transport/algorithms/common.hpp"

#include "device/host_memory.hpp"

#include <sstream>

namespace consort::transport::detail {

std::string who(const char* algorithm, const context& ctx, uint64_t tag) {
  std::ostringstream out;
  out << algorithm << " (rank " << ctx.rank() << " of " << ctx.size() << ", tag " << tag << ")";
  return out.str();
}

caf::error step_failed(context& ctx, const algorithm_options& opts, const char* algorithm,
                       const std::string& step, const char* action, int peer,
                       const caf::error& cause) {
  auto code = errc::peer_lost;
  std::string detail;
  if (cause.category() == caf::atom("consort")) {
    code = static_cast<errc>(cause.code());
    detail = to_consort_error(cause, "").what();
  } else {
    detail = to_consort_error(cause, "transport").what();
  }
  std::ostringstream out;
  out << who(algorithm, ctx, opts.tag) << ": " << step << ": " << action << " rank " << peer
      << " failed: " << detail;
  auto text = out.str();
  if (opts.abort_on_failure)
    ctx.abort(text, code);
  return make_caf_error(code, std::move(text));
}

caf::error argument_error(errc code, const char* algorithm, const context& ctx, uint64_t tag,
                          const std::string& what) {
  return make_caf_error(code, who(algorithm, ctx, tag) + ": " + what);
}

caf::error check_options(const char* algorithm, const context& ctx, const algorithm_options& opts) {
  if (opts.tag >= max_tag)
    return argument_error(errc::invalid_argument, algorithm, ctx, opts.tag,
                          "the tag must be below 2^40 (the low 24 bits of a message tag number "
                          "the step)");
  if (opts.timeout.count() < 0)
    return argument_error(errc::invalid_argument, algorithm, ctx, opts.tag,
                          "the timeout is negative (" + std::to_string(opts.timeout.count()) +
                              " ms)");
  if (opts.chunk_bytes == 0)
    return argument_error(errc::invalid_argument, algorithm, ctx, opts.tag,
                          "chunk_bytes must be positive");
  return {};
}

caf::error check_reduction(const char* algorithm, const context& ctx, const algorithm_options& opts,
                           dtype type, reduce_op op) {
  if (type == dtype::boolean)
    return argument_error(errc::dtype_mismatch, algorithm, ctx, opts.tag,
                          std::string{"cannot reduce bool elements with "} + to_string(op) +
                              "; cast to int32 first");
  if (op == reduce_op::mean && !is_floating(type))
    return argument_error(errc::dtype_mismatch, algorithm, ctx, opts.tag,
                          std::string{"MEAN of "} + to_string(type) +
                              " elements is float64: convert them to float64 and reduce those "
                              "with MEAN (the algorithms reduce in the input dtype)");
  return {};
}

std::shared_ptr<std::byte> scratch(size_t bytes) {
  if (bytes == 0)
    return nullptr;
  auto block = std::make_shared<consort::detail::host_block>(bytes);
  auto* data = block->data();
  return {std::move(block), data};
}

} // namespace consort::transport::detail
