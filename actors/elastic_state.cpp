// elastic_state (include/consort/elastic.hpp): a training loop's commit, and worker 0's commit
// made everyone's by one broadcast step.

#include <consort/elastic.hpp>
#include <consort/error.hpp>

namespace consort {

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
    auto out = strategy_->run(
        [](replica_context& ctx, const nest& mine) { return ctx.broadcast(mine, 0); }, packed);
    packed = out.values().front();
  }
  std::vector<named_tensor> synced;
  for (const auto& [name, value] : packed["variables"].as_dict())
    synced.push_back({name, value.as_tensor()});
  strategy_->assign_variables(synced);
  variables_ = std::move(synced);
  extra_ = packed["extra"];
  return extra_;
}

} // namespace consort
