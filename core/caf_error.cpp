// The conversions between caf::error and consort::error (include/consort/caf_error.hpp).

#include <consort/caf_error.hpp>

#include <caf/atom.hpp>
#include <caf/make_message.hpp>
#include <caf/message.hpp>
#include <caf/sec.hpp>

CAF_ERROR_CODE_ENUM(consort::errc, "consort")

namespace consort {

caf::error make_caf_error(errc code, std::string message) {
  return caf::make_error(code, std::move(message));
}

namespace {

std::string context_text(const caf::error& err) {
  const auto& ctx = err.context();
  if (ctx.size() == 1 && ctx.match_element<std::string>(0))
    return ctx.get_as<std::string>(0);
  return ctx.empty() ? std::string{} : caf::to_string(ctx);
}

} // namespace

error to_consort_error(const caf::error& err, const std::string& what) {
  auto prefix = what.empty() ? std::string{} : what + ": ";
  if (err.category() == caf::atom("consort")) {
    auto code = static_cast<errc>(err.code());
    auto text = context_text(err);
    return error(code, text.empty() ? prefix + to_string(code) : text);
  }
  if (err.category() == caf::atom("system")) {
    switch (static_cast<caf::sec>(err.code())) {
    case caf::sec::request_timeout:
      return error(errc::collective_timeout,
                   prefix + "no answer from the runtime before the deadline");
    case caf::sec::request_receiver_down:
    case caf::sec::invalid_argument:
      break;
    default:
      return error(errc::shutdown, prefix + "the runtime failed: " + caf::to_string(err));
    }
    return error(errc::shutdown, prefix + "the runtime shut down before answering");
  }
  return error(errc::shutdown, prefix + "the runtime failed: " + caf::to_string(err));
}

} // namespace consort
