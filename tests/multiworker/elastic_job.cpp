// An elastic training job for the integration tests (docs/multi_worker.md, "Elastic training"):
// run as N processes, it trains one mirrored variable for STEPS steps, committing every
// COMMIT_EVERY steps, and goes on when workers are lost or join. Every step adds the MEAN over
// every replica of ones, so whatever the group's size the variable ends at exactly STEPS in every
// element, and only if every re-formation rolled every worker back to the same commit: a step
// applied twice, or lost, shows.
//
//   elastic_job STEPS COMMIT_EVERY MIN_WORKERS [--die TASK:STEP] [--die-in-setup TASK]
//               [--stop TASK:STEP:MS] [--regrow WORKERS:STEP] ...
//
//   --die TASK:STEP       worker TASK kills itself (SIGKILL) inside step STEP, while the others
//                         are in its all-reduce; not in a restarted process (CONSORT_RESTART_COUNT
//                         or ELASTIC_JOB_RESTARTED set and not 0); may be given once per task
//   --die-in-setup TASK   every worker makes a variable before `w`; worker TASK kills itself
//                         once it has made it, while the others are in the creation broadcast of
//                         `w`, before any commit (not in a restarted process)
//   --stop TASK:STEP:MS   worker TASK stops (SIGSTOP, every thread, as a debugger or a frozen
//                         host would) inside step STEP for MS ms, then goes on; not in a
//                         restarted process. Longer than the peer timeout, the others leave it
//                         out; its call fails with membership_changed, and its reform joins them
//                         again in this process. Shorter, nothing changes.
//   --regrow N:STEP       at step STEP, while the group has fewer than N workers, every worker
//                         waits in `reform` for the group to grow (a restarted worker joining)
//   --late-reform TASK:MS worker TASK waits MS ms after its first membership change before it
//                         calls reform (a loop slow to react): past reform_timeout, the chief
//                         leaves it out of the epoch, and its reform joins the group again
//   --reform-timeout MS   multi_worker_options::reform_timeout (default: the library's, 10 s)
//   --wait-for STEP:PATH  at step STEP, every worker says so and waits (at most 60 s) until PATH
//                         exists, then goes on: a test does something to the idle group meanwhile
//   --cut TASK:STEP       worker TASK (in a network namespace) takes its link down inside step
//                         STEP and goes on: a partition, which nobody sees close; only silence
//   --commits N:STEP      at step STEP, while the group has fewer than N workers, every worker
//                         commits again and again without stepping: a joining worker comes in at
//                         one of these step boundaries (elastic_state::commit), with nothing to
//                         roll back
//
// After each change, every worker that was in the group prints where it goes on from:
//   went on from the commit of step C at step S (R steps redone)
// Every membership change prints, on every worker that was in the group:
//   membership: 3 -> 2 workers at step S; training resumed T ms after the loss
// and at the end: "final step STEPS: w = STEPS (ok)", exit 0; a wrong value exits 1.

#include <consort/consort.hpp>

#include <algorithm>
#include <chrono>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <iostream>
#include <optional>
#include <stdexcept>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include <fcntl.h>
#include <poll.h>
#include <sys/inotify.h>
#include <sys/wait.h>
#include <unistd.h>

using namespace consort;
using clock_type = std::chrono::steady_clock;

namespace {

/// Prints `line` and, when ELASTIC_JOB_LOG names a file, appends it there (one write a line, so
/// that the lines of the workers do not mix): the test reads what every worker said.
void say(const std::string& line) {
  std::cout << line << std::endl;
  if (const char* path = std::getenv("ELASTIC_JOB_LOG"); path && *path) {
    if (FILE* f = std::fopen(path, "a")) {
      std::fputs((line + "\n").c_str(), f);
      std::fclose(f);
    }
  }
}

/// The monotonic clock in ns (the same clock in every process of the machine), for the
/// benchmark's times across processes (bench/elastic_bench.sh).
long long now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(clock_type::now().time_since_epoch())
      .count();
}

bool restarted() {
  for (const char* name : {"CONSORT_RESTART_COUNT", "ELASTIC_JOB_RESTARTED"}) {
    const char* v = std::getenv(name);
    if (v && *v && std::string{v} != "0")
      return true;
  }
  return false;
}

/// Stops this process (every thread) for `ms` ms: a child waits until it is stopped, then
/// continues it `ms` later. The child is a fork of a threaded process, so it calls only
/// async-signal-safe functions.
void stop_for(int ms) {
  const pid_t parent = getpid();
  const pid_t child = fork();
  if (child < 0) {
    std::perror("elastic_job: fork");
    std::_Exit(3);
  }
  if (child == 0) {
    char path[64];
    std::snprintf(path, sizeof path, "/proc/%d/stat", static_cast<int>(parent));
    const timespec poll{0, 1'000'000};
    for (int i = 0; i < 60'000; ++i) { // until the parent is stopped, at most 60 s
      char buf[512];
      const int fd = open(path, O_RDONLY);
      const ssize_t n = fd < 0 ? -1 : read(fd, buf, sizeof buf - 1);
      if (fd >= 0)
        close(fd);
      if (n <= 0)
        _exit(1); // the parent is gone
      buf[n] = '\0';
      const char* state = std::strrchr(buf, ')'); // "pid (comm) S ...": comm may hold spaces
      if (state && state[1] == ' ' && state[2] == 'T')
        break;
      nanosleep(&poll, nullptr);
    }
    const timespec pause{ms / 1000, static_cast<long>(ms % 1000) * 1'000'000};
    nanosleep(&pause, nullptr);
    kill(parent, SIGCONT);
    _exit(0);
  }
  std::raise(SIGSTOP);
  waitpid(child, nullptr, 0);
}

/// Waits until `path` exists, at most `limit`: on the creation events of its directory
/// (inotify), not by polling. False when it did not appear in time (or cannot be watched).
bool wait_for_file(const std::string& path, std::chrono::milliseconds limit) {
  const auto slash = path.rfind('/');
  const std::string dir = slash == std::string::npos ? "." : path.substr(0, slash + 1);
  const int fd = inotify_init1(IN_CLOEXEC);
  if (fd < 0)
    return access(path.c_str(), F_OK) == 0;
  const bool watched = inotify_add_watch(fd, dir.c_str(), IN_CREATE | IN_MOVED_TO) >= 0;
  const auto until = clock_type::now() + limit;
  bool there = access(path.c_str(), F_OK) == 0; // after the watch: no creation is missed
  while (watched && !there && clock_type::now() < until) {
    pollfd p{fd, POLLIN, 0};
    const auto left =
        std::chrono::duration_cast<std::chrono::milliseconds>(until - clock_type::now());
    if (poll(&p, 1, static_cast<int>(std::max<long long>(left.count(), 1))) > 0) {
      char events[4096];
      (void)read(fd, events, sizeof events);
    }
    there = access(path.c_str(), F_OK) == 0;
  }
  close(fd);
  return there;
}

std::pair<int, int> pair_of(const std::string& text) {
  auto colon = text.find(':');
  if (colon == std::string::npos)
    throw std::invalid_argument("expected A:B, got \"" + text + "\"");
  return {std::stoi(text.substr(0, colon)), std::stoi(text.substr(colon + 1))};
}

int64_t step_of(const nest& extra) {
  return extra["step"].as_tensor().item<int64_t>();
}

} // namespace

int main(int argc, char** argv) {
  if (argc < 4) {
    std::cerr << "usage: elastic_job STEPS COMMIT_EVERY MIN_WORKERS [--die TASK:STEP] "
                 "[--die-in-setup TASK] [--stop TASK:STEP:MS] [--cut TASK:STEP] "
                 "[--regrow WORKERS:STEP] [--commits WORKERS:STEP]\n";
    return 2;
  }
  const int64_t steps = std::stoll(argv[1]);
  const int64_t commit_every = std::stoll(argv[2]);
  multi_worker_options mw;
  mw.elastic_min_workers = std::stoi(argv[3]);
  // The library's peer_timeout and heartbeats (800 ms, 100 ms): the tests hold it to them.
  int die_step = -1, regrow_workers = 0, regrow_step = -1, stop_step = -1, stop_ms = 0;
  int commits_workers = 0, commits_step = -1;
  int setup_victim = -1;
  int64_t wait_step = -1;
  std::string wait_path;
  std::vector<std::pair<int, int>> deaths;       // (task, step)
  std::vector<std::tuple<int, int, int>> stops;  // (task, step, ms)
  std::vector<std::pair<int, int>> cuts;         // (task, step)
  std::vector<std::pair<int, int>> late_reforms; // (task, ms)
  for (int i = 4; i + 1 < argc; i += 2) {
    std::string flag = argv[i];
    if (flag == "--die") {
      deaths.push_back(pair_of(argv[i + 1]));
    } else if (flag == "--die-in-setup") {
      setup_victim = std::stoi(argv[i + 1]);
    } else if (flag == "--cut") {
      cuts.push_back(pair_of(argv[i + 1]));
    } else if (flag == "--stop") {
      std::string text = argv[i + 1];
      auto last = text.rfind(':');
      if (last == std::string::npos)
        throw std::invalid_argument("expected TASK:STEP:MS, got \"" + text + "\"");
      auto [t, at] = pair_of(text.substr(0, last));
      stops.emplace_back(t, at, std::stoi(text.substr(last + 1)));
    } else if (flag == "--regrow")
      std::tie(regrow_workers, regrow_step) = pair_of(argv[i + 1]);
    else if (flag == "--commits")
      std::tie(commits_workers, commits_step) = pair_of(argv[i + 1]);
    else if (flag == "--late-reform")
      late_reforms.push_back(pair_of(argv[i + 1]));
    else if (flag == "--wait-for") {
      std::string text = argv[i + 1];
      auto colon = text.find(':');
      if (colon == std::string::npos)
        throw std::invalid_argument("expected STEP:PATH, got \"" + text + "\"");
      wait_step = std::stoll(text.substr(0, colon));
      wait_path = text.substr(colon + 1);
    } else if (flag == "--reform-timeout")
      mw.reform_timeout = std::chrono::milliseconds{std::stoi(argv[i + 1])};
    else {
      std::cerr << "elastic_job: unknown option " << flag << "\n";
      return 2;
    }
  }
  if (argc > 4 && (argc - 4) % 2 != 0) {
    std::cerr << "elastic_job: option " << argv[argc - 1] << " has no value\n";
    return 2;
  }
  const long long started_ns = now_ns();
  multi_worker_mirrored_strategy s({}, mw);
  const auto task = s.cluster_resolver().task().index;
  const std::string me = "worker:" + std::to_string(task);
  for (auto [t, at] : deaths)
    if (t == task && !restarted())
      die_step = at;
  for (auto [t, at, ms] : stops)
    if (t == task && !restarted())
      std::tie(stop_step, stop_ms) = std::tuple{at, ms};
  int64_t cut_step = -1;
  for (auto [t, at] : cuts)
    if (t == task)
      cut_step = at;
  int late_reform_ms = 0;
  for (auto [t, ms] : late_reforms)
    if (t == task)
      late_reform_ms = ms;
  std::cout << me << ": epoch " << s.membership_epoch() << ", rank " << s.worker_rank() << " of "
            << s.num_workers() << std::endl;

  if (setup_victim >= 0) {
    // A variable first, whose creation broadcast every worker completes; the victim dies then,
    // and the others meet the change in the broadcast of `w`: they make it from their own
    // initial value, and the loop's first sync fails, re-forms and gives them the group's.
    (void)s.create_variable("before_w", tensor::zeros(dtype::float32, {2}));
    if (setup_victim == task && !restarted()) {
      say(me + ": killed in the set-up at " + std::to_string(now_ns()));
      std::raise(SIGKILL);
    }
  }
  auto w = s.create_variable("w", tensor::zeros(dtype::float32, {4}),
                             {variable_synchronization::on_write, variable_aggregation::mean});
  elastic_state state{s};
  state.commit(nest::dict({{"step", tensor::scalar<int64_t>(0)}}));
  int64_t step = 0;
  bool synced = false; // a worker that joined takes the group's step and weights
  std::optional<clock_type::time_point> lost_at;
  bool first_step = true;
  std::string pending_line;
  int64_t changed_at = -1; // the step at which the group last changed, until the sync after it

  auto changed = [&](const multi_worker_mirrored_strategy::membership_change& c, int64_t at) {
    if (!pending_line.empty()) // the previous change: no step completed in between
      say(me + ": " + pending_line + "; changed again before a step completed");
    pending_line = "membership: " + std::to_string(c.workers_before) + " -> " +
                   std::to_string(c.workers) + " workers at step " + std::to_string(at);
  };

  while (step < steps || !synced) {
    try {
      if (!synced) {
        const int64_t at = step;
        step = step_of(state.sync()); // worker 0's commit; a change meanwhile re-forms again
        synced = true;
        if (changed_at >= 0)
          say(me + ": went on from the commit of step " + std::to_string(step) + " at step " +
              std::to_string(at) +
              (at >= step ? " (" + std::to_string(at - step) + " steps redone)"
                          : " (joined the group " + std::to_string(step - at) + " steps ahead)"));
        changed_at = -1;
        continue;
      }
      if (step == commits_step && s.num_workers() < commits_workers) {
        state.commit(nest::dict({{"step", tensor::scalar<int64_t>(step)}}));
        continue; // a step boundary, again and again, until a join comes in at one
      }
      if (step == regrow_step && s.num_workers() < regrow_workers) {
        lost_at = clock_type::now();
        auto c = s.reform(); // waits for the group to grow
        changed(c, step);
        changed_at = step;
        synced = false;
        continue;
      }
      if (step == wait_step && !wait_path.empty()) {
        say(me + ": waiting for " + wait_path + " at step " + std::to_string(step));
        if (!wait_for_file(wait_path, std::chrono::seconds(60)))
          say(me + ": " + wait_path + " did not appear within 60 s; going on");
        wait_path.clear(); // once
      }
      const bool dies_now = step == die_step;
      const int stop_now_ms = step == stop_step ? stop_ms : 0;
      const bool cut_now = step == cut_step;
      s.run([&w, dies_now, stop_now_ms, cut_now, task](replica_context& ctx) {
        if (cut_now && ctx.local_replica_index() == 0) {
          say("worker:" + std::to_string(task) + ": cutting its network link");
          if (std::system("ip link set dev eth0 down") != 0)
            throw std::runtime_error("could not take eth0 down");
        }
        if (dies_now && ctx.local_replica_index() == 0) {
          say("worker:" + std::to_string(task) + ": killed at " + std::to_string(now_ns()));
          std::raise(SIGKILL); // inside the step: the others wait in its all-reduce
        }
        if (stop_now_ms > 0 && ctx.local_replica_index() == 0) {
          say("worker:" + std::to_string(task) + ": stopped at " + std::to_string(now_ns()) +
              " for " + std::to_string(stop_now_ms) + " ms");
          stop_for(stop_now_ms); // inside the step: the others wait in its all-reduce
          say("worker:" + std::to_string(task) + ": continued");
        }
        ctx.assign_add(w, tensor::from<float>({1, 1, 1, 1}, {4}));
        return nest{};
      });
      ++step;
      if (first_step) {
        first_step = false;
        if (s.membership_epoch() > 1 && restarted())
          say(me + ": started at " + std::to_string(started_ns) + ", first step in the group at " +
              std::to_string(now_ns()));
      }
      if (!pending_line.empty()) {
        auto ms =
            std::chrono::duration_cast<std::chrono::milliseconds>(clock_type::now() - *lost_at);
        say(me + ": " + pending_line + "; training resumed " + std::to_string(ms.count()) +
            " ms after the loss (at " + std::to_string(now_ns()) + ")");
        pending_line.clear();
      }
      if (step % commit_every == 0)
        state.commit(nest::dict({{"step", tensor::scalar<int64_t>(step)}}));
    } catch (const error& e) {
      auto failed = [&](const error& why) {
        say(me + ": step " + std::to_string(step) + " failed (" + to_string(why.code()) +
            "): " + why.what());
        return 1;
      };
      if (e.code() != errc::membership_changed)
        return failed(e);
      lost_at = clock_type::now();
      std::cout << me << ": step " << step << ": " << e.what() << std::endl;
      if (late_reform_ms > 0) { // the fault: a loop slow to react, once
        say(me + ": reforms " + std::to_string(late_reform_ms) + " ms late");
        std::this_thread::sleep_for(std::chrono::milliseconds{late_reform_ms});
        late_reform_ms = 0;
      }
      try {
        auto c = s.reform(); // peer_lost when too few remain; a worker left out joins again
        changed(c, step);
        changed_at = step;
      } catch (const error& e2) {
        return failed(e2);
      }
      synced = false;
    }
  }
  auto value = w.value();
  const bool ok =
      value == tensor::from<float>(std::vector<float>(4, static_cast<float>(steps)), {4});
  say(me + ": final step " + std::to_string(step) + ": w = " + value.to_string(8) + " (" +
      (ok ? "ok" : "WRONG, expected every element " + std::to_string(steps)) + ")");
  return ok ? 0 : 1;
}
