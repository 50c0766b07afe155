// elastic_state (include/consort/elastic.hpp): a training loop's commit, and worker 0's commit
// made everyone's by one broadcast step.

#include <consort/elastic.hpp>
#include <consort/error.hpp>

#include <cstdint>
#include <limits>

namespace consort {

namespace {

/// What a worker offers in the sync's choice when its commit is not the group's state.
constexpr int32_t no_state = std::numeric_limits<int32_t>::max();

} // namespace

void elastic_state::commit(nest extra) {
  if (committed_) {
    variables_ = strategy_->variable_values();
  } else {
    // The first commit reads the local copies, with no collective: on a worker that joins a
    // running group, a read of sync-on-read variables across workers would meet the others'
    // sync instead. The sync that follows it replaces them anyway.
    variables_.clear();
    for (const auto& v : strategy_->variables())
      variables_.push_back({v.name(), v.local_values().front()});
    fresh_ = strategy_->joined_running_group();
  }
  extra_ = std::move(extra);
  const bool first = !committed_;
  committed_ = true;
  // A task waiting to join comes in here, where nothing is lost. Not at the first commit: a
  // worker that joined commits before its first sync, while the others are in theirs.
  if (!first)
    strategy_->step_boundary();
}

nest elastic_state::sync() {
  if (!committed_)
    throw_error(errc::invalid_argument,
                "elastic_state::sync before any commit; commit the state first (a joining worker "
                "commits its freshly created variables, which the sync then replaces)");
  nest::dict_type values;
  for (const auto& v : variables_)
    values.emplace(v.name, nest{v.value});
  auto packed = nest::dict({{"variables", nest::dict(std::move(values))}, {"extra", extra_}});
  if (strategy_->num_workers() > 1) {
    const int per_worker = strategy_->num_replicas_in_sync() / strategy_->num_workers();
    const int32_t offered = fresh_ ? no_state : strategy_->worker_rank();
    auto out = strategy_->run(
        [offered, per_worker](replica_context& ctx, const nest& mine) {
          // The first worker whose commit is the group's state; worker 0 when none is.
          const auto first = ctx.all_reduce("MIN", tensor::scalar<int32_t>(offered));
          const int32_t root = first.item<int32_t>() == no_state ? 0 : first.item<int32_t>();
          return ctx.broadcast(mine, root * per_worker);
        },
        packed);
    packed = out.values().front();
  }
  std::vector<named_tensor> synced;
  for (const auto& [name, value] : packed["variables"].as_dict())
    synced.push_back({name, value.as_tensor()});
  strategy_->assign_variables(synced);
  variables_ = std::move(synced);
  extra_ = packed["extra"];
  fresh_ = false;
  return extra_;
}

} // namespace consort
