// The strategy actor: numbers steps, fans each out to every replica, and joins the replies.

#include <consort/actors/protocol.hpp>

#include <caf/all.hpp>

#include <sstream>

namespace consort {

struct strategy_state {
  std::vector<replica_actor> replicas;
  std::chrono::milliseconds step_timeout{0};
  step_id next_step = 0;
  static inline const char* name = "consort.strategy";
};

namespace {

using self_ptr = strategy_actor::stateful_pointer<strategy_state>;

/// The replies of one step, filled in as they come.
struct step_join {
  step_id step = 0;
  std::vector<nest> values;
  std::vector<caf::error> errors;
  size_t pending = 0;
  caf::typed_response_promise<step_results> promise;
};

/// How likely an error is the root cause of a failed step, lower first: a replica's own failure,
/// then replicas that never finished, then collective disagreements, then their echoes.
int rank_of(const caf::error& err) {
  if (err.category() != caf::atom("consort"))
    return 1;
  switch (static_cast<errc>(err.code())) {
  case errc::step_timeout:
    return 1;
  case errc::collective_mismatch:
  case errc::collective_timeout:
    return 2;
  case errc::collective_aborted:
    return 3;
  default:
    return 0;
  }
}

void finish(const std::shared_ptr<step_join>& join, std::chrono::milliseconds step_timeout) {
  std::vector<size_t> timed_out;
  const caf::error* best = nullptr;
  for (size_t i = 0; i < join->errors.size(); ++i) {
    const auto& err = join->errors[i];
    if (!err)
      continue;
    if (err == caf::sec::request_timeout) {
      timed_out.push_back(i);
      continue;
    }
    if (!best || rank_of(err) < rank_of(*best))
      best = &err;
  }
  if (!timed_out.empty() && (!best || rank_of(*best) > 1)) {
    std::ostringstream out;
    out << "step " << join->step << " did not finish within the step deadline of "
        << step_timeout.count() << " ms on local replica(s) ";
    for (size_t k = 0; k < timed_out.size(); ++k)
      out << (k ? ", " : "") << timed_out[k];
    out << "; a step function that blocks or loops forever holds its replica";
    join->promise.deliver(make_caf_error(errc::step_timeout, out.str()));
    return;
  }
  if (best) {
    join->promise.deliver(*best);
    return;
  }
  join->promise.deliver(step_results{std::move(join->values)});
}

caf::result<step_results> run(self_ptr self, step_function_ptr& fn) {
  auto& st = self->state;
  auto join = std::make_shared<step_join>();
  join->step = st.next_step++;
  auto n = st.replicas.size();
  join->values.resize(n);
  join->errors.resize(n);
  join->pending = n;
  join->promise = self->make_response_promise<step_results>();
  auto timeout = st.step_timeout;
  for (size_t i = 0; i < n; ++i) {
    self->request(st.replicas[i], timeout, step_atom_v, step_message{join->step, fn})
        .then(
            [join, i, timeout](nest& value) {
              join->values[i] = std::move(value);
              if (--join->pending == 0)
                finish(join, timeout);
            },
            [join, i, timeout](caf::error& err) {
              join->errors[i] = std::move(err);
              if (--join->pending == 0)
                finish(join, timeout);
            });
  }
  return join->promise;
}

} // namespace

strategy_actor spawn_strategy(caf::actor_system& sys, std::vector<replica_actor> replicas,
                              std::chrono::milliseconds step_timeout) {
  return sys.spawn([replicas = std::move(replicas),
                    step_timeout](self_ptr self) -> strategy_actor::behavior_type {
    self->state.replicas = replicas;
    self->state.step_timeout = step_timeout;
    return {
        [self](run_atom, step_function_ptr& fn) -> caf::result<step_results> {
          return run(self, fn);
        },
    };
  });
}

} // namespace consort
