// The simulated network of consort::testing (see sim_transport.hpp).

#include "testing/sim_transport.hpp"

#include <consort/caf_error.hpp>

#include <algorithm>
#include <array>
#include <cstring>
#include <functional>
#include <optional>
#include <sstream>

namespace consort::testing::detail {

namespace {

using std::chrono::nanoseconds;

std::string n_bytes(std::size_t n) {
  return std::to_string(n) + (n == 1 ? " byte" : " bytes");
}

std::string ms_text(nanoseconds d) {
  return std::to_string(std::chrono::duration_cast<std::chrono::milliseconds>(d).count()) + " ms";
}

} // namespace

// -- the world's lock ----------------------------------------------------------------------------

namespace {

thread_local const sim_world* locked_world = nullptr;

} // namespace

world_lock::world_lock(const sim_world& w) : lock_(w.mu_), previous_(locked_world) {
  locked_world = &w;
}

world_lock::~world_lock() {
  locked_world = previous_;
}

bool world_lock::held(const sim_world& w) noexcept {
  return locked_world == &w;
}

// -- operations ----------------------------------------------------------------------------------

class sim_op : public transport::operation {
public:
  sim_op(std::shared_ptr<sim_world> world, bool send, uint64_t tag, int me, int peer,
         transport::mutable_bytes into, bool at_most, std::size_t bytes)
      : world_(std::move(world)), send_(send), tag_(tag), me_(me), peer_(peer), into_(into),
        at_most_(at_most), bytes_(bytes) {}

  caf::error wait(transport::deadline until) override { return world_->wait(*this, until); }

  bool done() const noexcept override {
    world_lock lock(*world_);
    return done_;
  }

  std::size_t message_bytes() const noexcept override {
    world_lock lock(*world_);
    return bytes_;
  }

  /// "recv of tag 7 (16 bytes) from rank 2": the prefix of every error of this operation.
  std::string describe() const {
    return std::string{send_ ? "send" : "recv"} + " of tag " + std::to_string(tag_) + " (" +
           n_bytes(send_ ? bytes_ : into_.size()) + ") " + (send_ ? "to" : "from") + " rank " +
           std::to_string(peer_);
  }

  // mu_ held from here on.
  void complete(caf::error err = {}) {
    if (done_)
      return;
    done_ = true;
    err_ = std::move(err);
  }
  void fail(errc code, const std::string& why) {
    complete(make_caf_error(code, describe() + ": " + why));
  }
  bool fits(std::size_t size) const {
    return at_most_ ? size <= into_.size() : size == into_.size();
  }

  /// Copies a matched message in, or fails when it does not fit (the message is dropped).
  void take(const std::vector<std::byte>& data) {
    if (!fits(data.size())) {
      fail(errc::invalid_argument,
           std::string{at_most_ ? "the buffer holds at most " : "the buffer has "} +
               n_bytes(into_.size()) + " but the message has " + n_bytes(data.size()) +
               "; the message was dropped");
      return;
    }
    if (!data.empty())
      std::memcpy(into_.data(), data.data(), data.size());
    bytes_ = data.size();
    complete();
  }

  bool done_locked() const { return done_; }
  const caf::error& error_locked() const { return err_; }
  uint64_t tag() const { return tag_; }
  int me() const { return me_; }

private:
  std::shared_ptr<sim_world> world_;
  const bool send_;
  const uint64_t tag_;
  const int me_;
  const int peer_;
  const transport::mutable_bytes into_;
  const bool at_most_;
  std::size_t bytes_; // guarded by world_->mu_
  bool done_ = false; // guarded by world_->mu_
  caf::error err_;    // guarded by world_->mu_
};

// -- contexts ------------------------------------------------------------------------------------

class sim_context : public transport::context, public std::enable_shared_from_this<sim_context> {
public:
  /// Rank `rank` of the group `group` (an epoch) whose ranks are the workers `members`.
  sim_context(std::shared_ptr<sim_world> world, uint64_t group, std::vector<int> members, int rank)
      : world_(std::move(world)), group_(group), members_(std::move(members)), rank_(rank),
        size_(static_cast<int>(members_.size())), links_(members_.size()) {
    for (int p = 0; p < size_; ++p)
      pairs_.push_back(std::make_unique<pair_to>(*this, p));
    if (world_->lockstep() && size_ <= lockstep_max_ranks)
      for (int c = 0; c < 2; ++c)
        mailboxes_[static_cast<std::size_t>(c)] = std::make_unique<sim_mailbox>(*this, c);
  }

  /// The worker of rank `r` of this group, and the rank of worker `w` (-1: not a member).
  int worker_of(int r) const noexcept { return members_[static_cast<std::size_t>(r)]; }
  int worker() const noexcept { return worker_of(rank_); }
  int rank_of(int w) const noexcept {
    auto it = std::find(members_.begin(), members_.end(), w);
    return it == members_.end() ? -1 : static_cast<int>(it - members_.begin());
  }

  ~sim_context() override {
    // A temporary taken under the world's lock may hold the last reference: then the lock is
    // this thread's already.
    std::optional<world_lock> lock;
    if (!world_lock::held(*world_))
      lock.emplace(*world_);
    abort_locked("the context was destroyed", errc::peer_lost, false);
    world_->cv_.notify_all();
  }

  int rank() const noexcept override { return rank_; }
  int size() const noexcept override { return size_; }

  transport::mailbox* mailbox(int channel) noexcept override {
    return channel == 0 || channel == 1 ? mailboxes_[static_cast<std::size_t>(channel)].get()
                                        : nullptr;
  }

  transport::pair& to(int peer) override {
    if (peer < 0 || peer >= size_ || peer == rank_)
      throw_error(errc::invalid_argument, "sim rank " + std::to_string(rank_) +
                                              ": no pair to rank " + std::to_string(peer) +
                                              " in a group of " + std::to_string(size_));
    return *pairs_[static_cast<std::size_t>(peer)];
  }

  void abort(const std::string& why, errc code) override {
    world_lock lock(*world_);
    abort_locked(why, code, true);
    world_->cv_.notify_all();
  }

  caf::error close(const std::string& reason, transport::deadline) override {
    world_lock lock(*world_);
    if (closing_ || aborted_)
      return {};
    closing_ = true;
    for (auto& link : links_)
      fail_posted(link, errc::shutdown,
                  "this rank left the group (" + reason + ") before the message arrived");
    // Every send of this rank is complete (a send is copied when posted): say goodbye.
    for (int p = 0; p < size_; ++p) {
      if (p == rank_ || links_[static_cast<std::size_t>(p)].failed)
        continue;
      world_->notice(group_, worker(), worker_of(p), "goodbye", reason,
                     [&](sim_context& peer) { peer.on_goodbye(rank_, reason); });
    }
    world_->cv_.notify_all();
    return {};
  }

  transport::operation_ptr send(int peer, uint64_t tag, const transport::send_parts& parts) {
    std::size_t total = 0;
    for (const auto& p : parts)
      total += p.size();
    auto op = std::make_shared<sim_op>(world_, true, tag, worker(), peer,
                                       transport::mutable_bytes{}, false, total);
    world_lock lock(*world_);
    auto& link = links_[static_cast<std::size_t>(peer)];
    if (refused(*op, link))
      return op;
    if (link.left) {
      op->fail(errc::peer_left, left_text(peer, link));
      return op;
    }
    std::vector<std::byte> data;
    data.reserve(total);
    for (const auto& p : parts)
      data.insert(data.end(), p.begin(), p.end());
    op->complete();
    world_->post(group_, worker(), worker_of(peer), tag, std::move(data));
    world_->cv_.notify_all();
    return op;
  }

  transport::operation_ptr recv(int peer, uint64_t tag, transport::mutable_bytes into,
                                bool at_most) {
    auto op = std::make_shared<sim_op>(world_, false, tag, worker(), peer, into, at_most, 0);
    world_lock lock(*world_);
    auto& link = links_[static_cast<std::size_t>(peer)];
    if (auto it = link.stash.find(tag); it != link.stash.end() && !aborted_ && !closing_) {
      op->take(it->second.front());
      it->second.pop_front();
      if (it->second.empty())
        link.stash.erase(it);
    } else if (!refused(*op, link)) {
      if (link.left)
        op->fail(errc::peer_left, left_text(peer, link));
      else
        link.posted[tag].push_back(op);
    }
    world_->cv_.notify_all();
    return op;
  }

  // -- mu_ held from here on -------------------------------------------------------------------

  /// A message from `from` arrives.
  void on_arrive(int from, uint64_t tag, std::vector<std::byte> data) {
    auto& link = links_[static_cast<std::size_t>(from)];
    if (aborted_ || closing_ || link.failed)
      return; // dropped, as by a closed socket
    if (auto it = link.posted.find(tag); it != link.posted.end()) {
      auto op = std::move(it->second.front());
      it->second.pop_front();
      if (it->second.empty())
        link.posted.erase(it);
      op->take(data);
      return;
    }
    link.stash[tag].push_back(std::move(data));
  }

  /// `peer` said goodbye: what it has not sent it never will.
  void on_goodbye(int peer, const std::string& reason) {
    auto& link = links_[static_cast<std::size_t>(peer)];
    if (link.failed || link.left)
      return;
    link.left = true;
    link.left_reason = reason;
    fail_posted(link, errc::peer_left, left_text(peer, link));
  }

  /// The link to `peer` is down (the peer died, aborted, or a frame was malformed).
  void fail_link(int peer, errc code, const std::string& why) {
    auto& link = links_[static_cast<std::size_t>(peer)];
    if (link.failed)
      return;
    link.failed = true;
    link.code = link.left ? errc::peer_left : code;
    link.why = link.left ? left_text(peer, link) : why;
    fail_posted(link, link.code, link.why);
    // A lockstep message that arrived stays to be taken, as in its shared-memory slot (a take
    // sees the peer's failure after the messages it put before it).
    std::erase_if(link.stash, [](const auto& kept) { return !is_lockstep_tag(kept.first); });
  }

  /// Fails everything of this context; `tell` sends the abort's notice to every peer it can
  /// reach (a dying process tells no one).
  void abort_locked(const std::string& why, errc code, bool tell) {
    if (aborted_)
      return;
    aborted_ = true;
    abort_why_ = why;
    abort_code_ = code;
    for (auto& link : links_) {
      fail_posted(link, code, why);
      link.stash.clear();
    }
    if (!tell || closing_)
      return;
    for (int p = 0; p < size_; ++p) {
      if (p == rank_ || links_[static_cast<std::size_t>(p)].failed)
        continue;
      world_->notice(group_, worker(), worker_of(p), "abort", why, [&](sim_context& peer) {
        peer.fail_link(rank_, code, "rank " + std::to_string(rank_) + " aborted the group: " + why);
      });
    }
  }

private:
  struct link_state {
    std::map<uint64_t, std::deque<std::vector<std::byte>>> stash;
    std::map<uint64_t, std::deque<std::shared_ptr<sim_op>>> posted;
    bool failed = false;
    errc code = errc::peer_lost;
    std::string why;
    bool left = false;
    std::string left_reason;
  };

  class pair_to : public transport::pair {
  public:
    pair_to(sim_context& ctx, int peer) : ctx_(ctx), peer_(peer) {}
    int peer_rank() const noexcept override { return peer_; }
    transport::operation_ptr send(uint64_t tag, transport::send_parts parts) override {
      return ctx_.send(peer_, tag, parts);
    }
    transport::operation_ptr recv(uint64_t tag, transport::mutable_bytes into) override {
      return ctx_.recv(peer_, tag, into, false);
    }
    transport::operation_ptr recv_at_most(uint64_t tag, transport::mutable_bytes into) override {
      return ctx_.recv(peer_, tag, into, true);
    }

  private:
    sim_context& ctx_;
    const int peer_;
  };

  /// A lockstep channel over the simulated links (transport::mailbox's contract, as shared
  /// memory has it for groups of up to 8 ranks): a message is a send with the channel's own tag,
  /// its tag in front of its bytes, so the harness's faults, filters and log see it as any
  /// other; a take receives it into the slot of its number (two per peer, as shared memory's),
  /// where it is read until the next put to that peer.
  class sim_mailbox final : public transport::mailbox {
  public:
    /// As shared memory's slot: 8 KiB less its header.
    static constexpr std::size_t slot_bytes = 8168;

    sim_mailbox(sim_context& ctx, int channel)
        : ctx_(ctx), wire_tag_(lockstep_tag_base | static_cast<uint64_t>(channel)),
          channel_(channel), puts_(static_cast<std::size_t>(ctx.size_), 0),
          takes_(static_cast<std::size_t>(ctx.size_), 0),
          slots_(static_cast<std::size_t>(ctx.size_)) {}

    std::size_t capacity() const noexcept override { return slot_bytes; }

    caf::error put(int peer, uint64_t tag, const transport::send_parts& parts) override {
      if (auto err = check_peer(peer, "put"))
        return err;
      auto& puts = puts_[static_cast<std::size_t>(peer)];
      const uint64_t seq = puts + 1;
      errc code{};
      if (auto why = ctx_.refusal(code); !why.empty()) // said first, as shared memory does
        return make_caf_error(code, describe(peer, seq, "to") + ": " + why);
      if (puts > takes_[static_cast<std::size_t>(peer)])
        return make_caf_error(errc::invalid_argument,
                              describe(peer, seq, "to") + ": message " + std::to_string(puts) +
                                  " of rank " + std::to_string(peer) +
                                  " was not taken yet; take each of a peer's messages before "
                                  "putting the next one to it");
      std::size_t total = 0;
      for (const auto& part : parts)
        total += part.size();
      if (total > capacity())
        return make_caf_error(errc::invalid_argument, describe(peer, seq, "to") + " has " +
                                                          std::to_string(total) +
                                                          " bytes; a message may have at most " +
                                                          std::to_string(capacity()));
      transport::send_parts framed;
      framed.push_back({reinterpret_cast<const std::byte*>(&tag), sizeof tag});
      for (const auto& part : parts)
        framed.push_back(part);
      auto op = ctx_.send(peer, wire_tag_, framed);
      if (auto err = op->wait(transport::clock::now())) // a send is done when posted
        return make_caf_error(to_consort_error(err, "").code(),
                              describe(peer, seq, "to") + ": " + to_consort_error(err, "").what());
      puts = seq;
      return {};
    }

    caf::expected<transport::const_bytes> take(int peer, uint64_t tag,
                                               transport::deadline until) override {
      if (auto err = check_peer(peer, "take"))
        return err;
      auto& takes = takes_[static_cast<std::size_t>(peer)];
      const uint64_t seq = takes + 1;
      auto& slot = slots_[static_cast<std::size_t>(peer)][seq & 1];
      slot.resize(sizeof(uint64_t) + slot_bytes);
      auto op = ctx_.recv(peer, wire_tag_, {slot.data(), slot.size()}, true);
      if (auto err = op->wait(until)) {
        // The message may still come, and stays for a later look (arrived), as in its slot.
        ctx_.withdraw(peer, wire_tag_, op.get());
        return make_caf_error(to_consort_error(err, "").code(),
                              describe(peer, seq, "from") + ": " +
                                  to_consort_error(err, "").what());
      }
      takes = seq;
      const auto bytes = op->message_bytes();
      uint64_t got = 0;
      if (bytes < sizeof got)
        return make_caf_error(errc::peer_lost, describe(peer, seq, "from") + " has " +
                                                   std::to_string(bytes) +
                                                   " bytes, less than its tag: a malformed slot");
      std::memcpy(&got, slot.data(), sizeof got);
      if (got != tag) {
        std::ostringstream out;
        out << describe(peer, seq, "from") << " carries tag 0x" << std::hex << got
            << " where tag 0x" << tag
            << " was expected: the ranks' exchanges on the channel are out of step";
        return make_caf_error(errc::invalid_argument, out.str());
      }
      return transport::const_bytes{slot.data() + sizeof got, bytes - sizeof got};
    }

    bool arrived(int peer) const noexcept override {
      if (peer < 0 || peer >= ctx_.size_ || peer == ctx_.rank_)
        return false;
      world_lock lock(*ctx_.world_);
      const auto& link = ctx_.links_[static_cast<std::size_t>(peer)];
      return link.stash.count(wire_tag_) > 0 && !ctx_.aborted_ && !ctx_.closing_;
    }

  private:
    caf::error check_peer(int peer, const char* action) const {
      if (peer >= 0 && peer < ctx_.size_ && peer != ctx_.rank_)
        return {};
      return make_caf_error(errc::invalid_argument,
                            "sim rank " + std::to_string(ctx_.rank_) + ": cannot " + action +
                                " a lockstep message of rank " + std::to_string(peer) +
                                "; expected another rank of the group of " +
                                std::to_string(ctx_.size_));
    }
    std::string describe(int peer, uint64_t seq, const char* from) const {
      return "sim rank " + std::to_string(ctx_.rank_) + ": message " + std::to_string(seq) +
             " of lockstep channel " + std::to_string(channel_) + " " + from + " rank " +
             std::to_string(peer);
    }

    sim_context& ctx_;
    const uint64_t wire_tag_;
    const int channel_;
    std::vector<uint64_t> puts_;
    std::vector<uint64_t> takes_;
    std::vector<std::array<std::vector<std::byte>, 2>> slots_;
  };

  /// The tags of the lockstep channels' messages on the links: above every algorithm's
  /// (transport::max_tag << 24), so they never meet one.
  static constexpr uint64_t lockstep_tag_base = 0xFFFF'FF00'0000'0000ull;
  static constexpr bool is_lockstep_tag(uint64_t tag) noexcept {
    return (tag & ~uint64_t{1}) == lockstep_tag_base;
  }
  /// Groups of up to this many ranks have lockstep channels (as shared memory's).
  static constexpr int lockstep_max_ranks = 8;

  /// Takes back receive `op` from `peer` with `tag` if it is still posted (its wait failed): a
  /// message that comes later is stashed, not delivered into it.
  void withdraw(int peer, uint64_t tag, const transport::operation* op) {
    world_lock lock(*world_);
    auto& posted = links_[static_cast<std::size_t>(peer)].posted;
    auto it = posted.find(tag);
    if (it == posted.end())
      return;
    auto& ops = it->second;
    ops.erase(std::remove_if(ops.begin(), ops.end(),
                             [op](const std::shared_ptr<sim_op>& p) { return p.get() == op; }),
              ops.end());
    if (ops.empty())
      posted.erase(it);
  }

  /// Why this context takes no new operation (it aborted or is leaving), with its code in
  /// `code`; empty when it takes them.
  std::string refusal(errc& code) const {
    world_lock lock(*world_);
    if (aborted_) {
      code = abort_code_;
      return "this rank aborted: " + abort_why_;
    }
    code = errc::shutdown;
    return closing_ ? "this rank is leaving the group" : "";
  }

  /// Fails `op` at once when this context or the link can take no new operation.
  bool refused(sim_op& op, const link_state& link) {
    if (aborted_) {
      op.fail(abort_code_, abort_why_);
    } else if (closing_) {
      op.fail(errc::shutdown, "this rank is leaving the group");
    } else if (link.failed) {
      op.fail(link.code, link.why);
    } else {
      return false;
    }
    return true;
  }

  std::string left_text(int peer, const link_state& link) const {
    return "rank " + std::to_string(peer) + " left the group (" + link.left_reason + ")";
  }

  void fail_posted(link_state& link, errc code, const std::string& why) {
    for (auto& [tag, ops] : link.posted)
      for (auto& op : ops)
        op->fail(code, why);
    link.posted.clear();
  }

  std::shared_ptr<sim_world> world_;
  const uint64_t group_;
  const std::vector<int> members_;
  const int rank_;
  const int size_;
  std::vector<std::unique_ptr<pair_to>> pairs_;
  std::vector<link_state> links_; // guarded by world_->mu_, indexed by peer
  bool aborted_ = false;          // guarded by world_->mu_
  std::string abort_why_;
  errc abort_code_ = errc::peer_lost;
  bool closing_ = false; // guarded by world_->mu_
  std::array<std::unique_ptr<sim_mailbox>, 2> mailboxes_;
};

// -- the world -----------------------------------------------------------------------------------

sim_world::sim_world(int size, std::chrono::milliseconds peer_timeout, bool lockstep)
    : size_(size), peer_timeout_(peer_timeout), lockstep_(lockstep),
      epoch_(transport::clock::now()), dead_(static_cast<std::size_t>(size), false),
      alive_from_(static_cast<std::size_t>(size), 0), waiting_(static_cast<std::size_t>(size)),
      waits_begun_(static_cast<std::size_t>(size), 0) {
  ticker_ = std::thread([this] { ticker(); });
}

sim_world::~sim_world() {
  stop_ticker();
}

void sim_world::stop_ticker() {
  {
    world_lock lock(*this);
    stopping_ = true;
  }
  cv_.notify_all();
  if (ticker_.joinable())
    ticker_.join();
}

std::vector<transport::context_ptr> sim_world::make_contexts() {
  std::vector<int> everyone(static_cast<std::size_t>(size_));
  for (int w = 0; w < size_; ++w)
    everyone[static_cast<std::size_t>(w)] = w;
  return make_group(1, everyone);
}

std::vector<transport::context_ptr> sim_world::make_group(uint64_t group,
                                                          const std::vector<int>& members) {
  std::vector<transport::context_ptr> out;
  world_lock lock(*this);
  auto& slots = groups_[group];
  slots.resize(static_cast<std::size_t>(size_));
  for (int r = 0; r < static_cast<int>(members.size()); ++r) {
    auto ctx = std::make_shared<sim_context>(shared_from_this(), group, members, r);
    slots[static_cast<std::size_t>(members[static_cast<std::size_t>(r)])] = ctx;
    out.push_back(std::move(ctx));
  }
  return out;
}

nanoseconds sim_world::now_locked() const {
  return std::chrono::duration_cast<nanoseconds>(transport::clock::now() - epoch_) + advanced_;
}

nanoseconds sim_world::now() const {
  world_lock lock(*this);
  return now_locked();
}

caf::error sim_world::wait(sim_op& op, transport::deadline until) {
  world_lock lock(*this);
  // The budget left in real time now, spent in simulated time from here on.
  const auto sim_deadline = now_locked() + (until - transport::clock::now());
  auto& waiting = waiting_[static_cast<std::size_t>(op.me())];
  waiting.push_back(&op);
  ++waits_begun_[static_cast<std::size_t>(op.me())];
  // advance() stops at this deadline and lets this wait end before time moves on.
  auto registered = deadlines_.emplace(sim_deadline, op.me());
  cv_.notify_all(); // wait_blocked
  caf::error result;
  for (;;) {
    if (op.done_locked()) {
      result = op.error_locked();
      break;
    }
    auto left = sim_deadline - now_locked();
    if (left <= nanoseconds::zero()) {
      result = make_caf_error(errc::collective_timeout,
                              op.describe() + " did not complete before its deadline (simulated " +
                                  "time " + ms_text(now_locked()) + ")");
      break;
    }
    cv_.wait_for(lock.get(), left);
  }
  waiting.erase(std::find(waiting.begin(), waiting.end(), &op));
  deadlines_.erase(registered);
  cv_.notify_all(); // advance waits for the waits whose deadline came to end
  return result;
}

bool sim_world::blocked(int rank) const {
  const auto& ops = waiting_[static_cast<std::size_t>(rank)];
  return std::any_of(ops.begin(), ops.end(), [](const sim_op* op) { return !op->done_locked(); });
}

bool sim_world::partitioned(int a, int b) const {
  return !side_.empty() && (side_.count(a) > 0) != (side_.count(b) > 0);
}

bool sim_world::cut(int a, int b) const {
  return partitioned(a, b) || (a != b && (hung_.count(a) > 0 || hung_.count(b) > 0));
}

bool sim_world::dead_in(uint64_t group, int worker) const {
  return dead_[static_cast<std::size_t>(worker)] ||
         group < alive_from_[static_cast<std::size_t>(worker)];
}

std::shared_ptr<sim_context> sim_world::context_of(uint64_t group, int worker) const {
  if (dead_in(group, worker))
    return nullptr;
  auto it = groups_.find(group);
  if (it == groups_.end())
    return nullptr;
  return it->second[static_cast<std::size_t>(worker)].lock();
}

void sim_world::notice(uint64_t group, int from, int to, const char* kind,
                       const std::string& reason,
                       const std::function<void(sim_context&)>& deliver_to) {
  message m;
  m.time = now_locked();
  m.epoch = group;
  m.from = from;
  m.to = to;
  m.kind = kind;
  m.bytes = reason.size();
  auto peer = context_of(group, to);
  if (!peer || dead_in(group, from)) {
    m.what = fate::refused;
  } else if (cut(from, to)) {
    m.what = fate::dropped;
  } else {
    // Control messages follow the data of their link (FIFO): deliver what is delayed first.
    flush_link(from, to);
    deliver_to(*peer);
  }
  log_.push_back(std::move(m));
}

void sim_world::post(uint64_t group, int from, int to, uint64_t tag, std::vector<std::byte> data) {
  message m;
  m.time = now_locked();
  m.epoch = group;
  m.from = from;
  m.to = to;
  m.kind = "data";
  m.tag = tag;
  m.link_seq = link_seq_[{from, to}]++;
  m.bytes = data.size();
  auto peer = context_of(group, to);
  verdict v;
  if (!peer) {
    m.what = fate::refused;
  } else if (muted_.count(from) > 0) {
    m.what = fate::dropped; // its process died; its connections have not closed yet
  } else if (cut(from, to)) {
    m.what = fate::dropped;
  } else if (filter_) {
    v = filter_(m);
  }
  if (m.what == fate::delivered && v.what == verdict::action::partition) {
    // The cut begins with this message, which it swallows when it crosses it.
    if (auto why = invalid_side(v.side); !why.empty()) {
      if (filter_error_.empty())
        filter_error_ = "consort::testing: the filter's verdict::partition for the message " +
                        std::to_string(m.link_seq) + " from worker " + std::to_string(from) +
                        " to worker " + std::to_string(to) + " was refused: " + why;
    } else {
      partition_locked(std::set<int>(v.side.begin(), v.side.end()));
      if (cut(from, to))
        m.what = fate::dropped;
    }
    v = verdict::deliver();
  }
  if (m.what == fate::delivered && v.what == verdict::action::restart_sender) {
    // The sender dies here and a new process of its task takes its place, when the membership
    // can have it so; else the message is delivered and the test hears why.
    std::string why = hooks_.on_crash
                          ? hooks_.on_crash(from, true)
                          : std::string{"the cluster is not elastic (cluster_options::"
                                        "elastic_min_workers is 0): there is no running group "
                                        "for a new process to join"};
    if (why.empty()) {
      m.what = fate::dropped;
      mute_locked(from); // the membership closes its connections (close_when_quiet)
    } else if (filter_error_.empty()) {
      filter_error_ = "consort::testing: the filter's verdict::restart_sender for the message " +
                      std::to_string(m.link_seq) + " from worker " + std::to_string(from) +
                      " to worker " + std::to_string(to) + " was refused: " + why;
    }
    v = verdict::deliver();
  }
  if (m.what == fate::delivered) {
    switch (v.what) {
    case verdict::action::partition: // handled above
      break;
    case verdict::action::drop:
      m.what = fate::dropped;
      break;
    case verdict::action::restart_sender: // handled above
      break;
    case verdict::action::crash_sender:
      m.what = fate::dropped;
      if (hooks_.on_crash) {
        // Elastic: it sends nothing more, and its connections close once the others are
        // blocked (close_when_quiet), so that which of them finished the step does not depend on
        // their threads' timing.
        mute_locked(from);
        (void)hooks_.on_crash(from, false);
      } else {
        kill_locked(from);
      }
      break;
    case verdict::action::corrupt: {
      m.what = fate::corrupted;
      const int from_rank = peer->rank_of(from);
      peer->fail_link(from_rank, errc::peer_lost,
                      "malformed frame from rank " + std::to_string(from_rank) +
                          " (corrupted by the test harness); the connection was closed");
      if (auto self = context_of(group, from)) {
        const int to_rank = self->rank_of(to);
        self->fail_link(to_rank, errc::peer_lost,
                        "rank " + std::to_string(to_rank) +
                            " closed the connection (it received a malformed frame)");
      }
      break;
    }
    case verdict::action::deliver: {
      m.delay = std::max(v.delay, nanoseconds::zero());
      auto& queue = links_[{from, to}];
      if (m.delay > nanoseconds::zero() || !queue.empty()) {
        auto due = m.time + m.delay;
        if (!queue.empty())
          due = std::max(due, queue.back().due);
        queue.push_back({due, group, from, to, tag, std::move(data)});
      } else {
        peer->on_arrive(peer->rank_of(from), tag, std::move(data));
      }
      break;
    }
    }
  }
  log_.push_back(std::move(m));
}

void sim_world::flush_link(int from, int to) {
  auto it = links_.find({from, to});
  if (it == links_.end())
    return;
  auto queue = std::move(it->second);
  links_.erase(it);
  for (auto& m : queue)
    if (auto peer = context_of(m.group, to); peer && !cut(from, to))
      peer->on_arrive(peer->rank_of(from), m.tag, std::move(m.data));
}

void sim_world::fire_due() {
  const auto t = now_locked();
  for (auto it = links_.begin(); it != links_.end();) {
    auto& queue = it->second;
    while (!queue.empty() && queue.front().due <= t) {
      auto m = std::move(queue.front());
      queue.pop_front();
      if (auto peer = context_of(m.group, m.to); peer && !cut(m.from, m.to))
        peer->on_arrive(peer->rank_of(m.from), m.tag, std::move(m.data));
    }
    it = queue.empty() ? links_.erase(it) : std::next(it);
  }
  if (!side_.empty() && !cut_reported_ && t >= cut_at_ + peer_timeout_ && hooks_.on_split) {
    cut_reported_ = true;
    hooks_.on_split(side_); // an elastic membership keeps the side with its quorum
  }
  if (!side_.empty() && !cut_reported_ && t >= cut_at_ + peer_timeout_) {
    cut_reported_ = true;
    // Each side's membership finds the other silent: every live worker aborts its group naming
    // the first worker it lost, as the service's on_lost does in production.
    for (const auto& [group, slots] : groups_)
      for (int a = 0; a < size_; ++a)
        for (int b = 0; b < size_; ++b)
          if (partitioned(a, b))
            if (auto ctx = context_of(group, a); ctx && ctx->rank_of(b) >= 0)
              ctx->abort_locked("lost worker:" + std::to_string(b) + " (rank " +
                                    std::to_string(ctx->rank_of(b)) + "): no heartbeat for " +
                                    ms_text(peer_timeout_) + " (partitioned by the test harness)",
                                errc::peer_lost, true);
  }
  for (auto& [w, h] : hung_) {
    if (h.reported || t < h.since + peer_timeout_)
      continue;
    h.reported = true;
    if (hooks_.on_silent) { // an elastic membership leaves it out
      hooks_.on_silent(w);
      continue;
    }
    // Every other worker's membership finds it silent and aborts its group naming it; its own
    // finds that the chief gave it up.
    const auto why = "no heartbeat for " + ms_text(peer_timeout_) + " (hung by the test harness)";
    for (const auto& [group, slots] : groups_)
      for (int a = 0; a < size_; ++a)
        if (auto ctx = context_of(group, a); ctx && ctx->rank_of(w) >= 0)
          ctx->abort_locked(a == w ? "the others lost this worker: " + why
                                   : "lost worker:" + std::to_string(w) + " (rank " +
                                         std::to_string(ctx->rank_of(w)) + "): " + why,
                            errc::peer_lost, true);
  }
}

std::optional<nanoseconds> sim_world::next_silence() const {
  std::optional<nanoseconds> next;
  if (!side_.empty() && !cut_reported_)
    next = cut_at_ + peer_timeout_;
  for (const auto& [w, h] : hung_)
    if (!h.reported)
      next = next ? std::min(*next, h.since + peer_timeout_) : h.since + peer_timeout_;
  return next;
}

void sim_world::hang(int worker) {
  world_lock lock(*this);
  hung_.emplace(worker, hang_state{now_locked(), false});
  cv_.notify_all();
}

void sim_world::resume(int worker) {
  world_lock lock(*this);
  hung_.erase(worker);
  cv_.notify_all();
}

bool sim_world::hung(int worker) const {
  world_lock lock(*this);
  return hung_.count(worker) > 0;
}

void sim_world::ticker() {
  world_lock lock(*this);
  while (!stopping_) {
    fire_due();
    cv_.notify_all();
    // Sleep until the next due event in simulated time (real time runs at the same pace).
    std::optional<nanoseconds> next;
    for (const auto& [key, queue] : links_)
      if (!queue.empty())
        next = next ? std::min(*next, queue.front().due) : queue.front().due;
    if (auto silence = next_silence())
      next = next ? std::min(*next, *silence) : *silence;
    if (next)
      cv_.wait_for(lock.get(),
                   std::max(*next - now_locked(), nanoseconds{0}) + std::chrono::microseconds{50});
    else
      cv_.wait(lock.get());
  }
}

void sim_world::kill(int rank) {
  world_lock lock(*this);
  kill_locked(rank);
}

void sim_world::mute_locked(int worker) {
  // Dead at once: its own calls fail, and nothing it sends arrives; its connections stay open
  // until close_when_quiet.
  muted_.insert(worker);
  for (const auto& [group, slots] : groups_)
    if (auto self = slots[static_cast<std::size_t>(worker)].lock())
      self->abort_locked("this worker was killed by the test harness", errc::peer_lost, false);
  cv_.notify_all();
}

void sim_world::close_when_quiet(int worker, const std::vector<int>& others, nanoseconds bound) {
  world_lock lock(*this);
  cv_.wait_for(lock.get(), bound, [&] {
    return std::all_of(others.begin(), others.end(),
                       [this](int w) { return dead_[static_cast<std::size_t>(w)] || blocked(w); });
  });
  kill_locked(worker);
}

void sim_world::kill_locked(int worker) {
  muted_.erase(worker);
  if (dead_[static_cast<std::size_t>(worker)])
    return;
  // What was in flight to or from it is lost with it.
  for (auto it = links_.begin(); it != links_.end();)
    it = it->first.first == worker || it->first.second == worker ? links_.erase(it) : std::next(it);
  dead_[static_cast<std::size_t>(worker)] = true; // notices to it are refused from here on
  for (const auto& [group, slots] : groups_) {
    auto victim = slots[static_cast<std::size_t>(worker)].lock();
    if (!victim)
      continue;
    victim->abort_locked("this worker was killed by the test harness", errc::peer_lost, false);
    // Its connections close: every survivor's link to it fails, and its membership connection
    // too, so every survivor's group is aborted naming it.
    const int rank = victim->rank();
    const auto cause = "lost worker:" + std::to_string(worker) + " (rank " + std::to_string(rank) +
                       "): connection closed without leave (killed by the test harness)";
    for (int w = 0; w < size_; ++w)
      if (auto ctx = w == worker ? nullptr : slots[static_cast<std::size_t>(w)].lock()) {
        ctx->fail_link(rank, errc::peer_lost,
                       "rank " + std::to_string(rank) + " closed the connection (worker:" +
                           std::to_string(worker) + " was killed by the test harness)");
        ctx->abort_locked(cause, errc::peer_lost, true);
      }
  }
  cv_.notify_all();
}

void sim_world::partition(const std::set<int>& side) {
  world_lock lock(*this);
  partition_locked(side);
}

void sim_world::partition_locked(const std::set<int>& side) {
  side_ = side;
  cut_at_ = now_locked();
  cut_reported_ = false;
  cv_.notify_all();
}

std::string sim_world::invalid_side(const std::vector<int>& side) const {
  std::set<int> members;
  for (int w : side) {
    if (w < 0 || w >= size_)
      return "worker " + std::to_string(w) + " does not exist (expected 0 to " +
             std::to_string(size_ - 1) + ")";
    members.insert(w);
  }
  if (members.empty() || static_cast<int>(members.size()) == size_)
    return "the side has " + std::to_string(members.size()) + " of " + std::to_string(size_) +
           " workers; expected some but not all";
  return {};
}

void sim_world::check_filter() {
  std::string why;
  {
    world_lock lock(*this);
    why.swap(filter_error_);
  }
  if (!why.empty())
    throw_error(errc::invalid_argument, why);
}

void sim_world::heal() {
  world_lock lock(*this);
  side_.clear();
  cv_.notify_all();
}

void sim_world::revive(int worker, uint64_t group) {
  world_lock lock(*this);
  dead_[static_cast<std::size_t>(worker)] = false;
  alive_from_[static_cast<std::size_t>(worker)] = group;
  cv_.notify_all();
}

bool sim_world::alive(int rank) const {
  world_lock lock(*this);
  return !dead_[static_cast<std::size_t>(rank)] && muted_.count(rank) == 0;
}

void sim_world::set_filter(message_filter filter) {
  world_lock lock(*this);
  filter_ = std::move(filter);
}

void sim_world::set_worker_hooks(worker_hooks hooks) {
  world_lock lock(*this);
  hooks_ = std::move(hooks);
}

void sim_world::advance(nanoseconds by) {
  // From event to event, in time order: a delayed message, the failure detector, a wait's
  // deadline, a step's deadline (kept by the actors). At each one, what is due happens, and a
  // worker whose wait timed out is given the (real) time to act on it (its step fails, or it
  // waits on the network again) before time moves on. So a message due after a deadline arrives
  // after that wait timed out, and a step fails with the collective's timeout, not with the step
  // deadline that came later, as in real time.
  worker_hooks hooks;
  nanoseconds target;
  {
    world_lock lock(*this);
    target = now_locked() + by;
    hooks = hooks_;
  }
  using step_info = std::optional<std::pair<uint64_t, nanoseconds>>;
  auto steps = [&] {
    std::vector<step_info> out(static_cast<std::size_t>(size_));
    if (hooks.oldest_step)
      for (int r = 0; r < size_; ++r)
        out[static_cast<std::size_t>(r)] = hooks.oldest_step(r);
    return out;
  };
  for (;;) {
    // Outside the lock: the hooks take the actors' locks, whose holders may wait for this one.
    const auto before = steps();
    std::vector<int> timed_out;
    std::vector<uint64_t> begun;
    nanoseconds step{0};
    {
      world_lock lock(*this);
      const auto now = now_locked();
      if (now >= target)
        break;
      // Only events strictly ahead count: what is due now is fired below.
      auto next = target;
      auto consider = [&](nanoseconds t) {
        if (t > now)
          next = std::min(next, t);
      };
      for (const auto& [key, queue] : links_)
        if (!queue.empty())
          consider(queue.front().due);
      if (auto silence = next_silence())
        consider(*silence);
      if (auto it = deadlines_.upper_bound(now); it != deadlines_.end())
        consider(it->first);
      for (const auto& s : before)
        if (s)
          consider(now + s->second);
      step = next - now;
      advanced_ += step;
      fire_due();
      const auto reached = now_locked();
      for (auto it = deadlines_.begin(); it != deadlines_.end() && it->first <= reached; ++it)
        if (std::find(timed_out.begin(), timed_out.end(), it->second) == timed_out.end())
          timed_out.push_back(it->second);
      begun = waits_begun_;
      cv_.notify_all();
    }
    if (hooks.on_advanced)
      hooks.on_advanced(step);
    // Each worker whose wait timed out settles: its oldest step ends, or it waits on the network
    // again. Bounded, so that a worker that cannot run (descheduled, or a step busy elsewhere)
    // does not stop the clock.
    const auto give_up = transport::clock::now() + std::chrono::seconds(1);
    for (int r : timed_out) {
      const auto i = static_cast<std::size_t>(r);
      for (;;) {
        auto now_step = hooks.oldest_step ? hooks.oldest_step(r) : step_info{};
        const bool step_moved = !now_step || !before[i] || now_step->first != before[i]->first;
        world_lock lock(*this);
        const bool waits_again = waits_begun_[i] > begun[i] && blocked(r);
        if (step_moved || waits_again || transport::clock::now() >= give_up)
          break;
        cv_.wait_for(lock.get(), std::chrono::milliseconds(1));
      }
    }
  }
}

bool sim_world::wait_blocked(int rank, nanoseconds within) {
  world_lock lock(*this);
  return cv_.wait_for(lock.get(), within, [&] { return blocked(rank); });
}

std::vector<message> sim_world::messages() const {
  world_lock lock(*this);
  return log_;
}

} // namespace consort::testing::detail
