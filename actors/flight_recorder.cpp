// The flight recorder (actors/flight_recorder.hpp): the ring, its diagnosis, its JSON dump and
// the SIGUSR1 dump of every live recorder.

#include "actors/flight_recorder.hpp"

#include "actors/call_checks.hpp"
#include "actors/stderr_line.hpp"
#include "transport/algorithms/group_call.hpp"

#include <consort/caf_error.hpp>

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cerrno>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fcntl.h>
#include <fstream>
#include <limits>
#include <sstream>
#include <thread>
#include <type_traits>
#include <unistd.h>

namespace consort::detail {

namespace {

enum class entry_type : uint8_t { collective, step_start, step_end, note };

constexpr size_t note_bytes = 96;
constexpr size_t max_entries = 10'000'000;

} // namespace

struct flight_recorder::entry {
  entry_type type = entry_type::note;
  flight_state state = flight_state::queued;
  errc error = errc::none;
  int32_t replica = -1;
  uint64_t number = 0;
  uint64_t step = 0;
  uint32_t seq = 0;
  flight_signature sig;
  int64_t enqueue_ns = -1;
  int64_t start_ns = -1;
  int64_t end_ns = -1;
  /// Workers whose part arrived (bit w); set by the descriptor exchange without the lock.
  std::atomic<uint64_t> arrived{0};
  /// Who entered the call last, and by how much; set by the descriptor exchange.
  transport::call_lateness late;
  std::array<char, note_bytes> text{};
};

// -- signatures -----------------------------------------------------------------------------------

std::string flight_signature::op_text() const {
  std::ostringstream out;
  out << to_string(kind);
  switch (kind) {
  case collective_kind::all_reduce:
    out << '(' << to_string(op) << ')';
    break;
  case collective_kind::all_gather:
    out << "(axis=" << axis << ')';
    break;
  case collective_kind::broadcast:
    out << "(root=" << root << ')';
    break;
  }
  return out.str();
}

std::string flight_signature::text() const {
  if (leaves == 0)
    return "no tensors";
  std::ostringstream out;
  out << to_string(type) << '[';
  for (uint8_t d = 0; d < rank; ++d) {
    if (d > 0)
      out << ',';
    if (d < dims.size())
      out << dims[d];
    else {
      out << "...";
      break;
    }
  }
  out << ']';
  if (leaves > 1)
    out << " and " << (leaves - 1) << " more leaves (" << bytes << " B)";
  return out.str();
}

flight_signature flight_signature_of(const call_signature& sig) {
  flight_signature f;
  f.kind = sig.kind;
  f.op = sig.op;
  f.axis = sig.axis;
  f.root = sig.root;
  f.leaves = static_cast<uint32_t>(sig.dtypes.size());
  if (!sig.dtypes.empty()) {
    f.type = sig.dtypes.front();
    const auto& shape = sig.shapes.front();
    f.rank = static_cast<uint8_t>(std::min<size_t>(shape.size(), 255));
    for (size_t d = 0; d < shape.size() && d < f.dims.size(); ++d)
      f.dims[d] = shape[d];
  }
  for (size_t i = 0; i < sig.dtypes.size() && i < sig.shapes.size(); ++i) {
    uint64_t n = 1;
    for (auto e : sig.shapes[i])
      n *= static_cast<uint64_t>(std::max<int64_t>(e, 0));
    f.bytes += n * size_of(sig.dtypes[i]);
  }
  return f;
}

const char* state_name(flight_state s) noexcept {
  switch (s) {
  case flight_state::queued:
    return "queued";
  case flight_state::waiting:
    return "waiting";
  case flight_state::done:
    return "done";
  case flight_state::failed:
    return "failed";
  }
  return "?";
}

// -- the registry of live recorders and SIGUSR1 -------------------------------------------------

namespace {

struct registry {
  std::mutex mu;
  std::vector<flight_recorder*> live; // guarded by mu
};

registry& recorders() {
  static auto* r = new registry; // never destroyed: the signal thread may outlive main
  return *r;
}

int signal_pipe[2] = {-1, -1};

extern "C" void on_sigusr1(int) {
  // Only a write to the pipe here: the dump runs on the thread that reads it.
  const int saved = errno;
  const char byte = 1;
  [[maybe_unused]] auto n = ::write(signal_pipe[1], &byte, 1);
  errno = saved;
}

/// Installs the SIGUSR1 handler once per process, unless CONSORT_FLIGHT_RECORDER_SIGNAL is "0" or
/// the program handles SIGUSR1 itself (its handler is kept).
void install_signal_once() {
  static std::once_flag once;
  std::call_once(once, [] {
    const char* env = std::getenv("CONSORT_FLIGHT_RECORDER_SIGNAL");
    if (env != nullptr && std::string{env} == "0")
      return;
    struct sigaction current {};
    if (::sigaction(SIGUSR1, nullptr, &current) != 0 || current.sa_handler != SIG_DFL)
      return;
    if (::pipe(signal_pipe) != 0)
      return;
    for (int fd : signal_pipe)
      ::fcntl(fd, F_SETFD, FD_CLOEXEC);
    ::fcntl(signal_pipe[1], F_SETFL, O_NONBLOCK);
    // Detached: it blocks in read() for the life of the process and touches only the registry,
    // which is never destroyed.
    std::thread([] {
      for (;;) {
        char byte = 0;
        auto n = ::read(signal_pipe[0], &byte, 1);
        if (n == 1)
          flight_recorder::dump_all("SIGUSR1");
        else if (n < 0 && errno != EINTR)
          return;
      }
    }).detach();
    struct sigaction action {};
    action.sa_handler = on_sigusr1;
    sigemptyset(&action.sa_mask);
    action.sa_flags = SA_RESTART;
    ::sigaction(SIGUSR1, &action, nullptr);
  });
}

std::string host_name() {
  std::array<char, 256> buf{};
  if (::gethostname(buf.data(), buf.size() - 1) != 0)
    return {};
  return std::string(buf.data());
}

/// The kernel's id of this boot ("" when unreadable): two steady clocks compare only within one.
std::string boot_id() {
  std::ifstream in("/proc/sys/kernel/random/boot_id");
  std::string id;
  std::getline(in, id);
  return id;
}

int64_t unix_ns_now() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::system_clock::now().time_since_epoch())
      .count();
}

} // namespace

std::pair<std::chrono::steady_clock::time_point, int64_t>
clock_pair(std::chrono::steady_clock::time_point (*steady)(), int64_t (*wall)()) {
  auto best_width = std::chrono::steady_clock::duration::max();
  std::pair<std::chrono::steady_clock::time_point, int64_t> best;
  for (int i = 0; i < 8 && best_width > std::chrono::microseconds(1); ++i) {
    const auto before = steady();
    const auto at = wall();
    const auto after = steady();
    if (after - before < best_width) {
      best_width = after - before;
      best = {before + (after - before) / 2, at};
    }
  }
  return best;
}

// -- the ring -------------------------------------------------------------------------------------

size_t flight_recorder::entries_for(int64_t option) {
  if (option >= 0) {
    if (static_cast<uint64_t>(option) > max_entries)
      throw_error(errc::invalid_argument, "strategy_options::flight_recorder_entries is " +
                                              std::to_string(option) +
                                              "; expected 0 (off) to 10000000");
    return static_cast<size_t>(option);
  }
  const char* env = std::getenv("CONSORT_FLIGHT_RECORDER_ENTRIES");
  if (env == nullptr || *env == '\0')
    return static_cast<size_t>(default_entries);
  char* end = nullptr;
  errno = 0;
  auto n = std::strtoll(env, &end, 10);
  if (end == env || *end != '\0' || errno != 0 || n < 0 || static_cast<uint64_t>(n) > max_entries)
    throw_error(errc::invalid_argument, std::string{"CONSORT_FLIGHT_RECORDER_ENTRIES is \""} + env +
                                            "\"; expected the number of collectives to keep, "
                                            "0 (off) to 10000000");
  return static_cast<size_t>(n);
}

flight_recorder::flight_recorder(size_t entries, int rank, std::vector<std::string> names)
    : flight_recorder(entries, rank, std::move(names),
                      clock_pair(&std::chrono::steady_clock::now, &unix_ns_now)) {}

flight_recorder::flight_recorder(size_t entries, int rank, std::vector<std::string> names,
                                 std::pair<clock::time_point, int64_t> epoch)
    : capacity_(entries), rank_(rank),
      names_(names.empty() ? std::vector<std::string>{"worker:0"} : std::move(names)),
      epoch_(epoch.first), epoch_unix_ns_(epoch.second) {
  if (capacity_ == 0)
    return;
  ring_ = std::make_unique<entry[]>(capacity_);
  install_signal_once();
  std::lock_guard<std::mutex> guard{recorders().mu};
  recorders().live.push_back(this);
}

flight_recorder::~flight_recorder() {
  if (capacity_ == 0)
    return;
  // CONSORT_FLIGHT_RECORDER_DUMP_AT_END=1: the ring of a job that ended well, for the job's
  // trace and its stragglers (tools/consort-diagnose --trace, --stragglers).
  if (const char* env = std::getenv("CONSORT_FLIGHT_RECORDER_DUMP_AT_END");
      env != nullptr && std::string{env} == "1") {
    try {
      auto path = dump("", "end");
      detail::write_stderr_line(name() + ": flight recorder written to " + path);
    } catch (const std::exception& e) {
      detail::write_stderr_line(e.what());
    }
  }
  std::lock_guard<std::mutex> guard{recorders().mu};
  std::erase(recorders().live, this);
}

int64_t flight_recorder::since_epoch(clock::time_point t) const noexcept {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(t - epoch_).count();
}

flight_recorder::entry& flight_recorder::claim(clock::time_point now) {
  auto& e = ring_[next_slot_];
  ++written_;
  if (++next_slot_ == capacity_) // (no division on the call's way)
    next_slot_ = 0;
  e.type = entry_type::note;
  e.state = flight_state::done;
  e.error = errc::none;
  e.replica = -1;
  e.number = 0;
  e.step = 0;
  e.seq = 0;
  e.sig = {};
  e.enqueue_ns = since_epoch(now);
  e.start_ns = -1;
  e.end_ns = -1;
  e.arrived.store(0, std::memory_order_relaxed);
  e.late.last.store(-1, std::memory_order_relaxed);
  e.late.margin_ns.store(0, std::memory_order_relaxed);
  e.text[0] = '\0';
  return e;
}

flight_recorder::handle flight_recorder::collective(uint64_t step, uint32_t seq, int replica,
                                                    const flight_signature& sig, flight_state state,
                                                    clock::time_point enqueued,
                                                    clock::time_point started) {
  if (capacity_ == 0)
    return {};
  const auto now = started != clock::time_point{} ? started : clock::now();
  std::lock_guard<spin_mutex> guard{mu_};
  const auto slot = static_cast<uint32_t>(next_slot_);
  auto& e = claim(enqueued == clock::time_point{} ? now : enqueued);
  e.type = entry_type::collective;
  e.state = state;
  e.replica = replica;
  e.number = next_number_++;
  e.step = step;
  e.seq = seq;
  e.sig = sig;
  if (state == flight_state::waiting)
    e.start_ns = since_epoch(now);
  e.arrived.store(uint64_t{1} << (rank_ & 63), std::memory_order_relaxed);
  return {e.number, slot};
}

void flight_recorder::started(handle h) {
  if (!h)
    return;
  const auto now = clock::now();
  std::lock_guard<spin_mutex> guard{mu_};
  auto& e = ring_[h.slot];
  if (e.number != h.number || e.type != entry_type::collective)
    return;
  e.state = flight_state::waiting;
  e.start_ns = since_epoch(now);
}

std::atomic<uint64_t>* flight_recorder::arrivals(handle h) noexcept {
  return h ? &ring_[h.slot].arrived : nullptr;
}

transport::call_lateness* flight_recorder::lateness(handle h) noexcept {
  return h ? &ring_[h.slot].late : nullptr;
}

void flight_recorder::ended(handle h, errc code) {
  if (!h)
    return;
  const auto now = clock::now();
  std::lock_guard<spin_mutex> guard{mu_};
  auto& e = ring_[h.slot];
  if (e.number != h.number || e.type != entry_type::collective)
    return;
  if (const int last = e.late.last.load(std::memory_order_relaxed);
      code == errc::none && last >= 0 && static_cast<size_t>(last) < names_.size()) {
    if (current_ == nullptr || current_step_ != e.step) { // one lookup a step, not a call
      current_ = &open_steps_[e.step];
      current_step_ = e.step;
      current_->late_ns.resize(names_.size());
    }
    current_->late_ns[static_cast<size_t>(last)] +=
        e.late.margin_ns.load(std::memory_order_relaxed);
  }
  e.state = code == errc::none ? flight_state::done : flight_state::failed;
  e.error = code;
  if (code != errc::none)
    ++failures_;
  if (e.start_ns < 0)
    e.start_ns = since_epoch(now);
  e.end_ns = since_epoch(now);
  if (code == errc::none)
    e.arrived.store(names_.size() >= 64 ? ~uint64_t{0} : (uint64_t{1} << names_.size()) - 1,
                    std::memory_order_relaxed);
}

uint64_t flight_recorder::last_number() const {
  std::lock_guard<spin_mutex> guard{mu_};
  return next_number_ - 1;
}

void flight_recorder::step_started(uint64_t step, clock::time_point at) {
  if (capacity_ == 0)
    return;
  std::lock_guard<spin_mutex> guard{mu_};
  auto& e = claim(at);
  e.type = entry_type::step_start;
  e.step = step;
  if (names_.size() > 1) {
    open_steps_[step].start_ns = since_epoch(at);
    // A step that never ends (its worker failed) does not pile up.
    while (open_steps_.size() > 64) {
      open_steps_.erase(open_steps_.begin());
      current_ = nullptr;
    }
  }
}

void flight_recorder::step_ended(uint64_t step, bool ok) {
  if (capacity_ == 0)
    return;
  const auto now = clock::now();
  std::lock_guard<spin_mutex> guard{mu_};
  auto& e = claim(now);
  e.type = entry_type::step_end;
  e.step = step;
  e.state = ok ? flight_state::done : flight_state::failed;
  if (ok)
    judge_step(step, since_epoch(now));
  else
    open_steps_.erase(step);
  current_ = nullptr;
}

// -- stragglers -----------------------------------------------------------------------------------

void flight_recorder::judge_step(uint64_t step, int64_t end_ns) {
  auto it = open_steps_.find(step);
  if (it == open_steps_.end())
    return;
  auto s = std::move(it->second);
  open_steps_.erase(it);
  if (s.start_ns == std::numeric_limits<int64_t>::min() || s.late_ns.empty())
    return; // no collective between workers in it
  step_verdict v;
  v.length_ns = end_ns - s.start_ns;
  const auto most = std::max_element(s.late_ns.begin(), s.late_ns.end());
  if (v.length_ns > 0 && static_cast<double>(*most) > rule_.share * v.length_ns) {
    v.who = static_cast<int>(most - s.late_ns.begin());
    v.late_ns = *most;
  }
  verdicts_.push_back(v);
  while (verdicts_.size() > static_cast<size_t>(rule_.steps))
    verdicts_.pop_front();
  if (v.who < 0 ||
      (named_.size() > static_cast<size_t>(v.who) && named_[static_cast<size_t>(v.who)]))
    return;
  int count = 0;
  double late = 0, share = 0;
  for (const auto& o : verdicts_)
    if (o.who == v.who) {
      ++count;
      late += static_cast<double>(o.late_ns);
      share += static_cast<double>(o.late_ns) / static_cast<double>(o.length_ns);
    }
  if (count <= rule_.steps / 2)
    return;
  named_.resize(names_.size());
  named_at_.resize(names_.size());
  named_[static_cast<size_t>(v.who)] = true;
  named_at_[static_cast<size_t>(v.who)] = step;
  if (!straggler_log_)
    return;
  char text[256];
  std::snprintf(text, sizeof text,
                "straggler: %s entered the collectives last in %d of the last %zu steps (through "
                "step %llu), %.2f ms (%.0f %% of a step) after the worker before it, on average",
                names_[static_cast<size_t>(v.who)].c_str(), count, verdicts_.size(),
                static_cast<unsigned long long>(step), late / count / 1e6, share / count * 100);
  straggler_log_(text);
}

namespace {

// The option unless it is -1, else the variable when set, else `fallback`; `valid` says whether
// a value is in range, `expected` what would be.
template <class T>
T rule_value(T option, const char* option_name, const char* variable, T fallback, bool (*valid)(T),
             const std::string& expected) {
  if (option != T{-1}) {
    if (!valid(option)) {
      std::ostringstream text;
      text << "strategy_options::" << option_name << " is " << option << "; expected " << expected
           << ", or -1 for " << variable << " or the default";
      throw_error(errc::invalid_argument, text.str());
    }
    return option;
  }
  const char* env = std::getenv(variable);
  if (env == nullptr || *env == '\0')
    return fallback;
  char* end = nullptr;
  errno = 0;
  T value{};
  if constexpr (std::is_floating_point_v<T>)
    value = std::strtod(env, &end);
  else {
    const long long n = std::strtoll(env, &end, 10);
    value = n < std::numeric_limits<T>::min() || n > std::numeric_limits<T>::max()
                ? T{-1}
                : static_cast<T>(n);
  }
  if (end == env || *end != '\0' || errno != 0 || !valid(value))
    throw_error(errc::invalid_argument,
                std::string{variable} + " is \"" + env + "\"; expected " + expected);
  return value;
}

} // namespace

flight_recorder::straggler_rule flight_recorder::straggler_rule_for(double share, int steps) {
  straggler_rule rule;
  rule.share = rule_value<double>(
      share, "straggler_share", "CONSORT_STRAGGLER_SHARE", rule.share,
      [](double v) { return v > 0 && v <= 1; },
      "a share of the step above 0 and at most 1 (0.05: 5 %)");
  rule.steps = rule_value<int>(
      steps, "straggler_steps", "CONSORT_STRAGGLER_STEPS", rule.steps,
      [](int v) { return v >= 1 && v <= max_straggler_steps; },
      "a window of 1 to " + std::to_string(max_straggler_steps) + " steps");
  return rule;
}

void flight_recorder::set_straggler_rule(straggler_rule rule) {
  std::lock_guard<spin_mutex> guard{mu_};
  rule_ = rule;
}

flight_recorder::straggler_rule flight_recorder::rule() const {
  std::lock_guard<spin_mutex> guard{mu_};
  return rule_;
}

void flight_recorder::set_straggler_log(std::function<void(const std::string&)> log) {
  std::lock_guard<spin_mutex> guard{mu_};
  straggler_log_ = std::move(log);
}

std::vector<consort::straggler_stat> flight_recorder::stragglers() const {
  std::lock_guard<spin_mutex> guard{mu_};
  std::vector<consort::straggler_stat> out(names_.size());
  for (size_t w = 0; w < names_.size(); ++w) {
    out[w].worker = names_[w];
    out[w].steps = static_cast<int>(verdicts_.size());
    out[w].named = w < named_.size() && named_[w];
  }
  for (const auto& v : verdicts_) {
    if (v.who < 0)
      continue;
    auto& o = out[static_cast<size_t>(v.who)];
    ++o.last_steps;
    o.late_ms += static_cast<double>(v.late_ns) / 1e6;
    o.share += static_cast<double>(v.late_ns) / static_cast<double>(v.length_ns);
  }
  for (auto& o : out)
    if (o.last_steps > 0) {
      o.late_ms /= o.last_steps;
      o.share /= o.last_steps;
    }
  return out;
}

void flight_recorder::note(const std::string& text) {
  if (capacity_ == 0)
    return;
  const auto now = clock::now();
  std::lock_guard<spin_mutex> guard{mu_};
  auto& e = claim(now);
  e.type = entry_type::note;
  ++failures_;
  auto n = std::min(text.size(), note_bytes - 1);
  std::memcpy(e.text.data(), text.data(), n);
  e.text[n] = '\0';
}

// -- the diagnosis --------------------------------------------------------------------------------

std::string flight_recorder::explain(handle h, errc code, std::chrono::milliseconds timeout) const {
  if (!h)
    return {};
  const auto now = clock::now();
  std::lock_guard<spin_mutex> guard{mu_};
  const auto& e = ring_[h.slot];
  if (e.number != h.number || e.type != entry_type::collective)
    return {};
  std::ostringstream out;
  out << to_string(e.sig.kind) << " #" << e.number << " (" << e.sig.text() << ", "
      << e.sig.op_text() << " call #" << e.seq << " of step " << e.step << ")";
  if (code == errc::collective_timeout)
    out << " timed out after " << timeout.count() << " ms";
  else
    out << " failed (" << consort::to_string(code) << ")";
  const auto mask = e.arrived.load(std::memory_order_relaxed);
  std::vector<int> missing;
  for (int w = 0; w < workers() && w < 64; ++w)
    if (w != rank_ && (mask & (uint64_t{1} << w)) == 0)
      missing.push_back(w);
  if (code != errc::collective_timeout || missing.empty() || workers() <= 1)
    return out.str();
  if (workers() > transport::descriptor_exchange::direct_max_workers) {
    // Beyond 8 workers the descriptors go round a ring: a worker that timed out does not know
    // who else reached the call, so it blames no one.
    out << " (with more than " << transport::descriptor_exchange::direct_max_workers
        << " workers this worker cannot tell who reached it: compare the workers' dumps)";
    return out.str();
  }
  // Who never called it: the workers whose part did not arrive. For each, the last collective in
  // which this worker saw its part (done: every worker's part arrived).
  out << ": ";
  for (size_t i = 0; i < missing.size(); ++i) {
    const int w = missing[i];
    if (i > 0)
      out << "; ";
    out << names_[static_cast<size_t>(w)] << " never called it";
    const entry* last = nullptr;
    const auto held = std::min<uint64_t>(written_, capacity_);
    for (uint64_t k = 1; k <= held; ++k) {
      const auto& c = ring_[(written_ - k) % capacity_];
      if (c.type != entry_type::collective || c.number >= e.number)
        continue;
      if ((c.arrived.load(std::memory_order_relaxed) & (uint64_t{1} << w)) != 0) {
        last = &c;
        break;
      }
    }
    if (last == nullptr) {
      out << "; it took part in no collective this worker recorded before it";
      continue;
    }
    const auto at = last->end_ns >= 0 ? last->end_ns : last->start_ns;
    const auto ago = std::chrono::duration_cast<std::chrono::milliseconds>(
        std::chrono::nanoseconds{since_epoch(now) - at});
    out << "; its last collective was #" << last->number << " at step " << last->step << ", "
        << ago.count() << " ms ago";
  }
  return out.str();
}

std::string flight_recorder::diagnose() const {
  if (capacity_ == 0)
    return "the flight recorder is off (strategy_options::flight_recorder_entries or "
           "CONSORT_FLIGHT_RECORDER_ENTRIES is 0)";
  const auto now = clock::now();
  std::lock_guard<spin_mutex> guard{mu_};
  std::ostringstream out;
  out << name() << ": ";
  const entry* last_done = nullptr;
  std::vector<const entry*> open;
  const auto held = std::min<uint64_t>(written_, capacity_);
  for (uint64_t k = 1; k <= held; ++k) {
    const auto& c = ring_[(written_ - k) % capacity_];
    if (c.type != entry_type::collective)
      continue;
    if (c.state == flight_state::done) {
      if (last_done == nullptr)
        last_done = &c;
      break; // older ones are history
    }
    open.push_back(&c);
  }
  if (last_done == nullptr && open.empty()) {
    out << "no collective recorded yet";
    return out.str();
  }
  auto ago = [&](int64_t ns) {
    return std::chrono::duration_cast<std::chrono::milliseconds>(
               std::chrono::nanoseconds{since_epoch(now) - ns})
        .count();
  };
  if (last_done != nullptr)
    out << "last collective done: #" << last_done->number << " " << last_done->sig.op_text() << " ("
        << last_done->sig.text() << ") at step " << last_done->step << ", "
        << ago(last_done->end_ns) << " ms ago";
  else
    out << "no collective done yet";
  for (auto it = open.rbegin(); it != open.rend(); ++it) {
    const auto& c = **it;
    out << "; #" << c.number << " " << c.sig.op_text() << " (" << c.sig.text() << ") at step "
        << c.step << " " << state_name(c.state);
    if (c.state == flight_state::failed)
      out << " (" << consort::to_string(c.error) << ")";
    // Who is missing means something while a call waits, or when its deadline passed; a call
    // that failed otherwise (a lost peer, a mismatch) stopped waiting before everyone came.
    if ((c.state == flight_state::waiting ||
         (c.state == flight_state::failed && c.error == errc::collective_timeout)) &&
        workers() <= transport::descriptor_exchange::direct_max_workers) {
      const auto mask = c.arrived.load(std::memory_order_relaxed);
      std::vector<std::string> missing;
      for (int w = 0; w < workers() && w < 64; ++w)
        if ((mask & (uint64_t{1} << w)) == 0)
          missing.push_back(names_[static_cast<size_t>(w)]);
      if (!missing.empty() && workers() > 1) {
        out << ", without the part of ";
        for (size_t i = 0; i < missing.size(); ++i)
          out << (i > 0 ? ", " : "") << missing[i];
      }
      if (c.start_ns >= 0 && c.state == flight_state::waiting)
        out << ", for " << ago(c.start_ns) << " ms";
    }
  }
  // Who was named a straggler, and how it stands over the window now.
  for (size_t w = 0; w < named_.size(); ++w) {
    if (!named_[w])
      continue;
    int count = 0;
    double late = 0;
    for (const auto& v : verdicts_)
      if (v.who == static_cast<int>(w)) {
        ++count;
        late += static_cast<double>(v.late_ns);
      }
    char text[160];
    std::snprintf(
        text, sizeof text, "; straggler: %s, named at step %llu; last in %d of the last %zu steps",
        names_[w].c_str(), static_cast<unsigned long long>(named_at_[w]), count, verdicts_.size());
    out << text;
    if (count > 0) {
      std::snprintf(text, sizeof text, ", %.2f ms late on average", late / count / 1e6);
      out << text;
    }
  }
  return out.str();
}

// -- dumps ----------------------------------------------------------------------------------------

std::string flight_recorder::to_json(const std::string& reason) const {
  using nlohmann::json;
  json doc;
  doc["format"] = "consort-flight-recorder-1";
  doc["worker"] = name();
  doc["rank"] = rank_;
  doc["workers"] = names_;
  doc["pid"] = static_cast<int64_t>(::getpid());
  doc["reason"] = reason;
  doc["capacity"] = capacity_;
  // Times are microseconds since `epoch_unix_us` (this process's wall clock when the recorder
  // started; the entries are on its steady clock).
  doc["epoch_unix_us"] = epoch_unix_ns_ / 1000;
  // The chief's wall clock minus this one's, as the membership heartbeats last measured it (0
  // on the chief, and until a first round trip).
  doc["chief_clock_offset_us"] = chief_offset_ns() / 1000;
  // The round trip it comes from (it is within half of it), once one is known.
  if (const auto delay = chief_delay_ns_.load(std::memory_order_relaxed); delay >= 0)
    doc["chief_clock_offset_delay_us"] = delay / 1000;
  // The same instant on the steady clock (CLOCK_MONOTONIC, one clock for every process of a boot
  // of a host), with the host and boot it belongs to: tools/consort-diagnose estimates the
  // workers' clock offsets from the collectives alone, and checks the estimate against this clock
  // when every dump comes from one boot of one host.
  doc["clock"] = {
      {"steady_epoch_ns",
       std::chrono::duration_cast<std::chrono::nanoseconds>(epoch_.time_since_epoch()).count()},
      {"host", host_name()},
      {"boot_id", boot_id()}};
  json entries = json::array();
  {
    std::lock_guard<spin_mutex> guard{mu_};
    doc["dumped_us"] = since_epoch(clock::now()) / 1000;
    doc["last_number"] = next_number_ - 1;
    const auto held = std::min<uint64_t>(written_, capacity_);
    // In time order: a step's start is recorded once it is launched, maybe after its first
    // collective, with the time it was launched at.
    std::vector<const entry*> order;
    order.reserve(static_cast<size_t>(held));
    for (uint64_t k = held; k >= 1; --k)
      order.push_back(&ring_[(written_ - k) % capacity_]);
    std::stable_sort(order.begin(), order.end(),
                     [](const entry* a, const entry* b) { return a->enqueue_ns < b->enqueue_ns; });
    for (const auto* p : order) {
      const auto& e = *p;
      json j;
      auto us = [](int64_t ns) -> json {
        return ns < 0 ? json(nullptr) : json(ns / 1000);
      };
      switch (e.type) {
      case entry_type::collective: {
        j["type"] = "collective";
        j["number"] = e.number;
        j["step"] = e.step;
        j["seq"] = e.seq;
        j["replica"] = e.replica;
        j["op"] = e.sig.op_text();
        j["signature"] = e.sig.text();
        j["dtype"] = to_string(e.sig.type);
        std::vector<int64_t> dims(e.sig.dims.begin(),
                                  e.sig.dims.begin() + std::min<size_t>(e.sig.rank, 4));
        j["shape"] = dims;
        j["leaves"] = e.sig.leaves;
        j["bytes"] = e.sig.bytes;
        j["state"] = state_name(e.state);
        if (e.error != errc::none)
          j["error"] = consort::to_string(e.error);
        j["enqueue_us"] = us(e.enqueue_ns);
        j["start_us"] = us(e.start_ns);
        j["end_us"] = us(e.end_ns);
        const auto mask = e.arrived.load(std::memory_order_relaxed);
        std::vector<int> arrived;
        for (int w = 0; w < workers() && w < 64; ++w)
          if ((mask & (uint64_t{1} << w)) != 0)
            arrived.push_back(w);
        j["arrived"] = arrived;
        break;
      }
      case entry_type::step_start:
        j["type"] = "step_start";
        j["step"] = e.step;
        j["time_us"] = us(e.enqueue_ns);
        break;
      case entry_type::step_end:
        j["type"] = "step_end";
        j["step"] = e.step;
        j["ok"] = e.state == flight_state::done;
        j["time_us"] = us(e.enqueue_ns);
        break;
      case entry_type::note:
        j["type"] = "event";
        j["text"] = std::string(e.text.data());
        j["time_us"] = us(e.enqueue_ns);
        break;
      }
      entries.push_back(std::move(j));
    }
  }
  doc["entries"] = std::move(entries);
  doc["diagnosis"] = diagnose();
  return doc.dump(1);
}

std::string flight_recorder::default_path() const {
  const char* dir = std::getenv("CONSORT_DUMP_DIR");
  std::string base = dir != nullptr && *dir != '\0' ? std::string{dir} : std::string{"."};
  std::string task = name();
  std::replace(task.begin(), task.end(), ':', '-');
  std::replace(task.begin(), task.end(), '/', '-');
  return base + "/consort-flight-" + task + "-" + std::to_string(::getpid()) + ".json";
}

std::string flight_recorder::dump(const std::string& path, const std::string& reason) const {
  if (capacity_ == 0)
    throw_error(errc::invalid_argument,
                "cannot dump the flight recorder: it is off (strategy_options::"
                "flight_recorder_entries or CONSORT_FLIGHT_RECORDER_ENTRIES is 0)");
  const auto target = path.empty() ? default_path() : path;
  const auto text = to_json(reason);
  const auto temp = target + ".tmp";
  {
    std::ofstream out(temp, std::ios::trunc);
    out << text << '\n';
    out.close();
    if (!out)
      throw_error(errc::invalid_argument, "cannot write the flight recorder's dump to \"" + temp +
                                              "\": " + std::strerror(errno));
  }
  // Renamed into place, so that a reader never sees half a dump.
  if (std::rename(temp.c_str(), target.c_str()) != 0)
    throw_error(errc::invalid_argument, "cannot move the flight recorder's dump to \"" + target +
                                            "\": " + std::strerror(errno));
  return target;
}

void flight_recorder::dump_on_failure(const std::string& reason) noexcept {
  if (capacity_ == 0)
    return;
  const char* dir = std::getenv("CONSORT_DUMP_DIR");
  if (dir == nullptr || *dir == '\0')
    return;
  {
    std::lock_guard<spin_mutex> guard{mu_};
    // Only when something failed since the last dump; after the first few, at most once a second
    // (a lost peer fails every later call too, at once).
    const auto now = clock::now();
    if (failures_ == dumped_failures_ ||
        (dumps_ >= 4 && now - last_dump_ < std::chrono::seconds(1)))
      return;
    dumped_failures_ = failures_;
    ++dumps_;
    last_dump_ = now;
  }
  try {
    (void)dump("", reason);
  } catch (const std::exception& e) {
    detail::write_stderr_line(e.what());
  }
}

void flight_recorder::dump_all(const std::string& reason) noexcept {
  std::lock_guard<std::mutex> guard{recorders().mu};
  for (auto* r : recorders().live) {
    try {
      auto path = r->dump("", reason);
      detail::write_stderr_line(r->name() + ": flight recorder written to " + path);
    } catch (const std::exception& e) {
      detail::write_stderr_line(e.what());
    }
  }
}

// -- a recorded call's end ------------------------------------------------------------------------

caf::error recorded_call::finish(const caf::error& err, std::chrono::milliseconds timeout) const {
  if (recorder == nullptr || !h)
    return err;
  if (!err) {
    recorder->ended(h, errc::none);
    return err;
  }
  auto e = to_consort_error(err, "");
  recorder->ended(h, e.code());
  auto why = recorder->explain(h, e.code(), timeout);
  if (e.code() == errc::collective_timeout || e.code() == errc::peer_lost)
    recorder->dump_on_failure(why.empty() ? std::string{e.what()} : why);
  if (why.empty())
    return err;
  return make_caf_error(e.code(), why + ". " + e.what());
}

} // namespace consort::detail
