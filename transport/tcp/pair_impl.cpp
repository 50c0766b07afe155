// A TCP pair: operations, the receive and send pumps, matching and the stash (see pair_impl.hpp).

#include "transport/tcp/pair_impl.hpp"

#include "device/host_memory.hpp"
#include "transport/op_pool.hpp"

#include <boost/asio/post.hpp>
#include <boost/asio/socket_base.hpp>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <system_error>

#include <sys/epoll.h>
#include <sys/socket.h>
#include <sys/uio.h>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

namespace consort::transport::tcp {

namespace {

/// Reads of headers and small payloads land here first (one syscall for many small frames).
constexpr std::size_t stage_bytes = 64 * 1024;

/// The most buffers one sendmsg gathers (the kernel allows IOV_MAX = 1024).
constexpr int max_iov = 64;

void cpu_relax() noexcept {
#if defined(__x86_64__) || defined(__i386__)
  _mm_pause();
#endif
}

std::string errno_text(int err) {
  return std::error_code(err, std::system_category()).message();
}

std::string n_bytes(uint64_t n) {
  return std::to_string(n) + (n == 1 ? " byte" : " bytes");
}

/// Removes and returns the oldest entry of `pending` (posted receives or early messages, each with
/// its tag) with `tag`, or null.
template <class Ptr>
Ptr take_oldest(std::vector<std::pair<uint64_t, Ptr>>& pending, uint64_t tag) {
  auto it = std::find_if(pending.begin(), pending.end(),
                         [tag](const auto& entry) { return entry.first == tag; });
  if (it == pending.end())
    return nullptr;
  Ptr found = std::move(it->second);
  pending.erase(it);
  return found;
}

} // namespace

// -- pair_env ------------------------------------------------------------------------------------

void pair_env::log_line(const std::string& line) const {
  auto text = "consort tcp rank " + std::to_string(rank) + ": " + line;
  if (log) {
    log(text);
    return;
  }
  text += '\n';
  std::fwrite(text.data(), 1, text.size(), stderr); // one write: lines of threads do not mix
}

// -- operations ----------------------------------------------------------------------------------

caf::error op_base::wait(deadline until) {
  if (!done()) {
    const auto& env = pair_->env();
    auto spin_until = env.busy_poll ? until : std::min(until, clock::now() + env.spin);
    // Spin while driving the socket ourselves: when the peer is already on its way this returns
    // without any thread wake-up. A busy poll spins the same way to the deadline
    // (sched_yield in the loop was tried: it did not help, and can give the core away for a time
    // slice).
    spinning(true);
    for (;;) {
      drive();
      if (done() || clock::now() >= spin_until)
        break;
      cpu_relax();
    }
    spinning(false);
    if (!done()) {
      blocking(true);
      {
        std::unique_lock lock(mu_);
        ++waiters_;
        cv_.wait_until(lock, until, [this] { return done_.load(std::memory_order_acquire); });
        --waiters_;
      }
      blocking(false);
    }
    if (!done())
      return timeout_error();
  }
  std::lock_guard lock(mu_);
  return result_;
}

void op_base::complete(caf::error err) {
  std::lock_guard lock(mu_);
  if (done_.load(std::memory_order_relaxed))
    return;
  result_ = std::move(err);
  done_.store(true, std::memory_order_release);
  // Notified under the lock: a waiter that returns may destroy the operation at once.
  if (waiters_ > 0)
    cv_.notify_all();
}

void recv_op::drive() {
  pair_->pump_rx();
}

void recv_op::spinning(bool on) {
  pair_->spinning_on_rx(on);
}

void recv_op::blocking(bool on) {
  pair_->blocked_on_rx(on);
}

caf::error recv_op::timeout_error() const {
  auto got = received.load(std::memory_order_relaxed);
  return make_caf_error(
      errc::collective_timeout,
      "recv of tag " + std::to_string(tag_) + " (" + n_bytes(into_.size()) + ") from " +
          pair_->describe() + " did not complete before its deadline: " +
          (got == 0 ? std::string{"no byte of it has arrived"}
                    : std::to_string(got) + " of " + n_bytes(into_.size()) + " received"));
}

void recv_op::fail(const std::string& why, errc code) {
  complete(make_caf_error(code, "recv of tag " + std::to_string(tag_) + " (" +
                                    n_bytes(into_.size()) + ") from " + pair_->describe() +
                                    " failed after " + std::to_string(received.load()) + " of " +
                                    n_bytes(into_.size()) + ": " + why));
}

send_op::send_op(std::shared_ptr<pair_impl> pair, uint64_t tag, send_parts parts,
                 uint64_t payload_bytes, wire::frame_kind kind)
    : op_base(std::move(pair)), tag_(tag), payload_bytes_(payload_bytes), parts_(std::move(parts)) {
  wire::header h;
  h.sender_rank = static_cast<uint32_t>(pair_->env().rank);
  h.tag = tag;
  h.payload_bytes = payload_bytes;
  h.kind = kind;
  head_len_ = wire::encode_header(h, head_);
}

std::shared_ptr<send_op> send_op::control(std::shared_ptr<pair_impl> pair, wire::frame_kind kind,
                                          std::string payload) {
  payload.resize(std::min(payload.size(), wire::max_control_bytes));
  auto bytes = payload.size();
  auto op = std::make_shared<send_op>(std::move(pair), 0, send_parts{}, bytes, kind);
  op->owned_ = std::move(payload);
  // Pointed at after the move: a short string's bytes live inside the string object.
  op->parts_.push_back({reinterpret_cast<const std::byte*>(op->owned_.data()), bytes});
  return op;
}

void send_op::drive() {
  pair_->pump_tx();
}

caf::error send_op::timeout_error() const {
  return make_caf_error(
      errc::collective_timeout,
      "send of tag " + std::to_string(tag_) + " (" + n_bytes(payload_bytes_) + ") to " +
          pair_->describe() +
          " did not complete before its deadline: " + std::to_string(written_.load()) + " of " +
          n_bytes(total_bytes()) + " (header included) written");
}

void send_op::fail(const std::string& why, errc code) {
  complete(make_caf_error(
      code, "send of tag " + std::to_string(tag_) + " (" + n_bytes(payload_bytes_) + ") to " +
                pair_->describe() + " failed after " + std::to_string(written_.load()) + " of " +
                n_bytes(total_bytes()) + " (header included) were written: " + why));
}

// -- the stash -----------------------------------------------------------------------------------

/// A message that arrived before its receive. Its bytes were reserved in `pair_env::stash_bytes`
/// before it was allocated and are released with it.
struct pair_impl::stash_entry {
  stash_entry(std::shared_ptr<pair_env> env, uint64_t size)
      : env(std::move(env)), size(size),
        data(size > 0 ? consort::detail::host_block(size) : consort::detail::host_block{}) {}
  ~stash_entry() { env->stash_bytes.fetch_sub(size, std::memory_order_relaxed); }

  std::shared_ptr<pair_env> env;
  uint64_t size;
  consort::detail::host_block data; // from the host block cache: no fresh pages per message
  bool complete = false;            // guarded by match_mu_
  std::shared_ptr<recv_op> waiter;  // guarded by match_mu_: claimed it while it was being read
};

// -- construction --------------------------------------------------------------------------------

pair_impl::pair_impl(std::shared_ptr<pair_env> env, boost::asio::io_context& io, int peer_rank)
    : env_(std::move(env)), io_(&io), peer_(peer_rank),
      stage_(std::make_unique_for_overwrite<std::byte[]>(stage_bytes)) {}

pair_impl::~pair_impl() = default;

std::string pair_impl::describe() const {
  std::lock_guard lock(address_mu_);
  auto out = "rank " + std::to_string(peer_);
  if (!address_.empty())
    out += " (" + address_ + ")";
  return out;
}

std::pair<std::string, errc> pair_impl::failure() const {
  std::lock_guard lock(match_mu_);
  return {failure_, failure_code_};
}

caf::error pair_impl::left_error(const std::string& what) const {
  std::string reason;
  {
    std::lock_guard lock(match_mu_);
    reason = left_reason_;
  }
  return make_caf_error(errc::peer_left,
                        what + " failed: rank " + std::to_string(peer_) + " left the group (" +
                            reason + ") and sent nothing more; it never started this operation");
}

// -- transport::pair -----------------------------------------------------------------------------

operation_ptr pair_impl::send(uint64_t tag, send_parts parts) {
  uint64_t total = 0;
  for (const auto& part : parts)
    total += part.size();
  auto op = std::allocate_shared<send_op>(detail::op_allocator<send_op>{}, shared_from_this(), tag,
                                          std::move(parts), total);
  if (total > env_->max_payload_bytes) {
    op->complete(make_caf_error(errc::invalid_argument,
                                "send of tag " + std::to_string(tag) + " to " + describe() + ": " +
                                    n_bytes(total) + " exceed max_payload_bytes (" +
                                    std::to_string(env_->max_payload_bytes) + ")"));
    return op;
  }
  if (closing_.load(std::memory_order_acquire)) {
    op->fail("this rank is leaving the group", errc::shutdown);
    return op;
  }
  if (peer_left_.load(std::memory_order_acquire)) {
    op->complete(left_error("send of tag " + std::to_string(tag) + " (" + n_bytes(total) + ") to " +
                            describe()));
    return op;
  }
  if (failed_.load(std::memory_order_acquire)) {
    std::string why;
    errc code;
    {
      std::lock_guard lock(match_mu_);
      why = failure_;
      code = failure_code_;
    }
    op->fail(why, code);
    return op;
  }
  {
    std::lock_guard lock(txq_mu_);
    txq_.push_back(op);
  }
  // Written from the caller's thread when the socket takes it: no hop for small messages. A pair
  // that failed meanwhile fails the queued operation in this pump.
  pump_tx();
  return op;
}

operation_ptr pair_impl::recv(uint64_t tag, mutable_bytes into) {
  return post_recv(std::allocate_shared<recv_op>(detail::op_allocator<recv_op>{},
                                                 shared_from_this(), tag, into, false));
}

operation_ptr pair_impl::recv_at_most(uint64_t tag, mutable_bytes into) {
  return post_recv(std::allocate_shared<recv_op>(detail::op_allocator<recv_op>{},
                                                 shared_from_this(), tag, into, true));
}

operation_ptr pair_impl::post_recv(std::shared_ptr<recv_op> op) {
  const auto tag = op->tag();
  const auto into = op->into();
  std::shared_ptr<stash_entry> early;
  bool failed = false;
  bool left = false;
  bool ready = false; // `early` is complete: copy it here (else the reader hands it over)
  std::string why;
  errc code = errc::peer_lost;
  {
    std::lock_guard lock(match_mu_);
    if (closing_.load(std::memory_order_relaxed)) {
      failed = true;
      why = "this rank is leaving the group";
      code = errc::shutdown;
    } else if (failed_.load(std::memory_order_relaxed)) {
      failed = true;
      why = failure_;
      code = failure_code_;
    } else if (auto found = take_oldest(stash_, tag)) {
      early = std::move(found);
      // A message still being read is handed to this receive when it is complete (the reader
      // holds the other reference); one of the wrong size is dropped when it is complete.
      ready = early->complete;
      if (!ready && op->fits(early->size))
        early->waiter = op;
    } else if (peer_left_.load(std::memory_order_relaxed)) {
      left = true; // the peer sent everything it will send before its goodbye: no match comes
    } else {
      posted_.emplace_back(tag, op);
    }
  }
  if (failed) {
    op->fail(why, code);
  } else if (left) {
    op->complete(left_error("recv of tag " + std::to_string(tag) + " (" + n_bytes(into.size()) +
                            ") from " + describe()));
  } else if (early && !op->fits(early->size)) {
    op->complete(make_caf_error(errc::invalid_argument,
                                "recv of tag " + std::to_string(tag) + " from " + describe() +
                                    ": " + op->buffer_words() + n_bytes(into.size()) +
                                    " but the message has " + n_bytes(early->size) +
                                    "; the message was dropped"));
  } else if (ready) {
    if (early->size > 0)
      std::memcpy(into.data(), early->data.data(), early->size);
    op->received.store(early->size, std::memory_order_relaxed);
    op->complete();
  }
  return op;
}

// -- life cycle ----------------------------------------------------------------------------------

void pair_impl::open(boost::asio::ip::tcp::socket socket, std::string address) {
  {
    std::lock_guard lock(address_mu_);
    address_ = std::move(address);
  }
  // Out of Asio's reactor, which would wake its thread for every message (poller.hpp): the
  // descriptor is ours from here, closed by teardown.
  boost::system::error_code ec;
  const int fd = socket.release(ec);
  if (ec || fd < 0) {
    fail("taking the connection over from Asio failed: " + ec.message(), log_mode::always);
    return;
  }
  {
    std::scoped_lock lock(rx_mu_, tx_mu_);
    fd_.store(fd, std::memory_order_release);
  }
  if (failed_.load(std::memory_order_acquire)) {
    // Aborted (or the mesh deadline passed) before the handshake finished.
    ::shutdown(fd, SHUT_RDWR);
    return;
  }
  {
    std::lock_guard lock(arm_mu_);
    if (auto why = env_->poller->add(fd, this, 0); !why.empty()) {
      // Without readiness, nothing would read what the peer sends while no thread waits.
      ::shutdown(fd, SHUT_RDWR);
      fail("cannot watch the connection for readiness: " + why, log_mode::always);
      return;
    }
    registered_ = true;
  }
  pump_rx(); // what came with the handshake
  arm();
  pump_tx();
}

void pair_impl::fail(const std::string& why_in, log_mode log, errc code) {
  std::vector<std::shared_ptr<recv_op>> posted;
  std::string why = why_in;
  {
    std::lock_guard lock(match_mu_);
    if (failed_.load(std::memory_order_relaxed))
      return;
    if (peer_left_.load(std::memory_order_relaxed)) {
      // After a goodbye nothing more was due from the peer: whatever ends the pair now, what
      // still waits on it waits because the peer left.
      why = "rank " + std::to_string(peer_) + " left the group: " + left_reason_;
      code = errc::peer_left;
      log = log_mode::never;
    } else if (aborting_) {
      // This rank's abort, whichever thread got here first (the reader sees the peer close its
      // end once the abort frame reached it).
      why = abort_reason_;
      code = abort_code_;
      log = log_mode::never;
    }
    failure_ = why;
    failure_code_ = code;
    failed_.store(true, std::memory_order_release);
    if (log == log_mode::if_busy) {
      bool busy = !posted_.empty();
      std::lock_guard queue_lock(txq_mu_);
      busy = busy || !txq_.empty();
      log = busy ? log_mode::always : log_mode::never;
    }
    for (auto& [tag, op] : posted_)
      posted.push_back(std::move(op));
    posted_.clear();
    // Complete early messages are released here; one being read is the reader's to abandon.
    stash_.clear();
  }
  if (log == log_mode::always)
    env_->log_line("closing the connection to " + describe() + ": " + why);
  if (auto fd = fd_.load(std::memory_order_acquire); fd >= 0)
    ::shutdown(fd, SHUT_RDWR); // the peer learns at once; the descriptor stays ours until teardown
  for (auto& op : posted)
    op->fail(why, code);
  { std::lock_guard lock(end_mu_); }
  end_cv_.notify_all();
  // The receive being read into and the queued sends are failed by the next pump of their
  // direction; the caller may hold one of them, so make sure the I/O thread runs both.
  rx_kick_.store(true);
  tx_kick_.store(true);
  if (!torn_down_.load() && io_ != nullptr)
    boost::asio::post(*io_, [self = shared_from_this()] {
      self->pump_rx();
      self->pump_tx();
    });
}

void pair_impl::teardown(const std::string& why) {
  fail(why, log_mode::never);
  std::scoped_lock lock(rx_mu_, tx_mu_);
  torn_down_.store(true);
  abandon_incoming();
  pump_tx_locked(); // fails what is queued
  const int fd = fd_.load(std::memory_order_acquire);
  {
    // Out of the poller's set before the number can be reused by another descriptor; from here
    // no thread arms it (arm_locked reads fd_ only while registered_).
    std::lock_guard arming(arm_mu_);
    if (registered_) {
      env_->poller->remove(fd);
      env_->poller->undefer(this);
    }
    registered_ = false;
  }
  fd_.store(-1, std::memory_order_release);
  if (fd >= 0)
    ::close(fd);
  io_ = nullptr;
}

// -- receive -------------------------------------------------------------------------------------

void pair_impl::spinning_on_rx(bool on) {
  if (on) {
    std::lock_guard lock(arm_mu_);
    if (rx_spinners_.fetch_add(1) == 0)
      arm_locked(); // the first spinner: no read readiness while it reads itself
    return;
  }
  stop_reading(false); // the last spinner: the poller reads again
}

void pair_impl::reading_here(bool on) {
  if (on) {
    spinning_on_rx(true);
    return;
  }
  stop_reading(true); // the last one: reading stays disarmed for the poller's grace
}

void pair_impl::stop_reading(bool lazy) {
  // Pairs with on_ready's store-then-load: either it saw no spinner and pumped itself, or this
  // sees its flag and pumps what it left. Pumped before the socket is re-armed, so that the
  // poller is not woken for bytes read here.
  if (rx_skipped_.exchange(false))
    pump_rx();
  std::lock_guard lock(arm_mu_);
  if (rx_spinners_.fetch_sub(1) != 1)
    return;
  lazy_ = lazy && registered_;
  arm_locked();
  // Under arm_mu_ (a leaf but for the poller's own lock, which it never holds while calling a
  // target back): once teardown has unregistered the pair, nothing reaches the poller.
  if (lazy_)
    env_->poller->defer(this);
}

void pair_impl::on_deferred() {
  std::lock_guard lock(arm_mu_);
  lazy_ = false;
  arm_locked();
}

void pair_impl::blocked_on_rx(bool on) {
  std::lock_guard lock(arm_mu_);
  rx_blocked_.fetch_add(on ? 1 : -1);
  arm_locked();
}

namespace {

/// Set while this thread runs the reading pump of some pair (which may call pump_tx).
thread_local bool in_rx_pump = false;

} // namespace

void pair_impl::pump_rx() {
  // Whoever finds the pump busy leaves a kick; the thread inside runs again before it leaves.
  rx_kick_.store(true);
  while (rx_kick_.load() && rx_mu_.try_lock()) {
    rx_kick_.store(false);
    const bool outer = in_rx_pump;
    in_rx_pump = true;
    pump_rx_locked();
    in_rx_pump = outer;
    rx_mu_.unlock();
  }
}

void pair_impl::pump_rx_now() {
  if (in_rx_pump) {
    pump_rx();
    return;
  }
  // The other pump reads without blocking, so the wait is short.
  {
    std::lock_guard lock(rx_mu_);
    rx_kick_.store(false);
    in_rx_pump = true;
    pump_rx_locked();
    in_rx_pump = false;
  }
  // A thread that found the pump busy meanwhile left a kick: run for it, as pump_rx would.
  pump_rx();
}

void pair_impl::pump_rx_locked() {
  for (;;) {
    if (failed_.load(std::memory_order_acquire)) {
      abandon_incoming();
      return;
    }
    if (rx_eof_.load(std::memory_order_acquire))
      return;
    int fd = fd_.load(std::memory_order_acquire);
    if (fd < 0)
      return;
    if (!consume_staged())
      continue; // the pair failed
    // consume_staged needs more bytes. While a payload with a destination is being read the
    // stage is empty: the payload goes straight to its destination, what follows it to the stage.
    iovec iov[2];
    int n_iov = 1;
    bool direct = phase_ == rx_phase::payload && in_sink_ != sink::drop;
    if (direct) {
      stage_begin_ = stage_end_ = 0;
      iov[0] = {in_dst_ + in_got_, static_cast<std::size_t>(in_.payload_bytes - in_got_)};
      iov[1] = {stage_.get(), stage_bytes};
      n_iov = 2;
    } else {
      if (stage_begin_ == stage_end_) {
        stage_begin_ = stage_end_ = 0;
      } else if (stage_begin_ > 0) {
        std::memmove(stage_.get(), stage_.get() + stage_begin_, stage_end_ - stage_begin_);
        stage_end_ -= stage_begin_;
        stage_begin_ = 0;
      }
      iov[0] = {stage_.get() + stage_end_, stage_bytes - stage_end_};
    }
    msghdr msg{};
    msg.msg_iov = iov;
    msg.msg_iovlen = n_iov;
    if (env_->before_read)
      env_->before_read(peer_);
    auto n = ::recvmsg(fd, &msg, MSG_DONTWAIT);
    if (n > 0) {
      auto got = static_cast<std::size_t>(n);
      if (direct) {
        auto to_payload = std::min(got, iov[0].iov_len);
        in_got_ += to_payload;
        stage_end_ = got - to_payload;
        if (in_op_)
          in_op_->received.store(in_got_, std::memory_order_relaxed);
        if (in_got_ == in_.payload_bytes)
          finish_message();
      } else {
        stage_end_ += got;
      }
      continue;
    }
    if (n == 0) {
      if (peer_left_.load(std::memory_order_acquire) || closing_.load(std::memory_order_acquire)) {
        // The end of a clean close (either side's): nothing more is due on this connection.
        peer_closed();
        return;
      }
      auto buffered = stage_end_ - stage_begin_;
      std::string why;
      if (phase_ == rx_phase::prefix && buffered == 0) {
        fail("the peer closed the connection (read: end of file)", log_mode::if_busy);
        continue;
      }
      if (phase_ == rx_phase::payload) {
        why = "truncated frame: the connection ended after " + std::to_string(in_got_) + " of " +
              n_bytes(in_.payload_bytes) + " of the payload of tag " + std::to_string(in_.tag) +
              " (read: end of file)";
      } else {
        why = "truncated frame: the connection ended after " + n_bytes(buffered) + " of a " +
              (phase_ == rx_phase::prefix ? "4-byte length prefix"
                                          : std::to_string(head_len_) + "-byte header") +
              " (read: end of file)";
      }
      fail(why, log_mode::always);
      continue;
    }
    int err = errno;
    if (err == EINTR)
      continue;
    if (err == EAGAIN || err == EWOULDBLOCK)
      return;
    fail("read failed (recvmsg): " + errno_text(err) +
             (phase_ == rx_phase::payload
                  ? "; " + std::to_string(in_got_) + " of " + n_bytes(in_.payload_bytes) +
                        " of the payload of tag " + std::to_string(in_.tag) + " received"
                  : std::string{}),
         log_mode::always);
  }
}

bool pair_impl::consume_staged() {
  for (;;) {
    auto avail = stage_end_ - stage_begin_;
    auto* at = stage_.get() + stage_begin_;
    switch (phase_) {
    case rx_phase::prefix: {
      if (avail < wire::prefix_bytes)
        return true;
      auto why =
          wire::decode_length(std::span<const std::byte, wire::prefix_bytes>(at, 4), head_len_);
      if (!why.empty()) {
        malformed(why);
        return false;
      }
      stage_begin_ += wire::prefix_bytes;
      phase_ = rx_phase::header;
      break;
    }
    case rx_phase::header: {
      if (avail < head_len_)
        return true;
      wire::header h;
      auto why = wire::decode_header({at, head_len_}, h);
      if (why.empty() && h.version != wire::protocol_version)
        why = "protocol version " + std::to_string(h.version) + ", expected " +
              std::to_string(wire::protocol_version);
      if (why.empty() && h.sender_rank != static_cast<uint32_t>(peer_))
        why = "a frame of sender rank " + std::to_string(h.sender_rank) +
              " on the connection of rank " + std::to_string(peer_);
      if (why.empty() && h.payload_bytes > env_->max_payload_bytes)
        why = "a payload of " + n_bytes(h.payload_bytes) + " exceeds max_payload_bytes (" +
              std::to_string(env_->max_payload_bytes) + ")";
      if (why.empty() && peer_left_.load(std::memory_order_relaxed))
        why = "a frame after the peer's goodbye";
      if (!why.empty()) {
        malformed(why);
        return false;
      }
      stage_begin_ += head_len_;
      if (!begin_message(h))
        return false;
      if (h.payload_bytes == 0)
        finish_message();
      else
        phase_ = rx_phase::payload;
      break;
    }
    case rx_phase::payload: {
      if (avail == 0)
        return true;
      auto n = static_cast<std::size_t>(std::min<uint64_t>(avail, in_.payload_bytes - in_got_));
      if (in_sink_ != sink::drop)
        std::memcpy(in_dst_ + in_got_, at, n);
      in_got_ += n;
      stage_begin_ += n;
      if (in_op_)
        in_op_->received.store(in_got_, std::memory_order_relaxed);
      if (in_got_ == in_.payload_bytes)
        finish_message();
      break;
    }
    }
  }
}

bool pair_impl::begin_message(const wire::header& h) {
  in_ = h;
  in_got_ = 0;
  in_sink_ = sink::drop;
  in_dst_ = nullptr;
  if (h.kind != wire::frame_kind::data) {
    // Bounded by decode_header (max_control_bytes).
    in_sink_ = sink::control;
    in_dst_ = control_.data();
    return true;
  }
  if (closing_.load(std::memory_order_acquire))
    return true; // this rank is leaving: the message is read and dropped
  std::shared_ptr<recv_op> mismatched;
  std::size_t held = 0;
  bool over = false;
  {
    std::lock_guard lock(match_mu_);
    if (failed_.load(std::memory_order_relaxed))
      return false;
    if (auto op = take_oldest(posted_, h.tag)) {
      if (op->fits(h.payload_bytes)) {
        in_sink_ = sink::op;
        in_dst_ = op->into().data();
        in_op_ = std::move(op);
      } else {
        mismatched = std::move(op); // the message is read and dropped
      }
    } else {
      // No receive yet: reserve the bytes in the context's stash before allocating them.
      held = env_->stash_bytes.fetch_add(h.payload_bytes, std::memory_order_relaxed);
      if (held + h.payload_bytes > env_->max_stash_bytes) {
        env_->stash_bytes.fetch_sub(h.payload_bytes, std::memory_order_relaxed);
        over = true;
      } else {
        auto entry = std::make_shared<stash_entry>(env_, h.payload_bytes);
        stash_.emplace_back(h.tag, entry);
        in_sink_ = sink::stash;
        in_dst_ = entry->data.data();
        in_stash_ = std::move(entry);
      }
    }
  }
  if (mismatched)
    mismatched->complete(make_caf_error(
        errc::invalid_argument, "recv of tag " + std::to_string(h.tag) + " from " + describe() +
                                    ": " + mismatched->buffer_words() +
                                    n_bytes(mismatched->into().size()) + " but the message has " +
                                    n_bytes(h.payload_bytes) + "; the message was dropped"));
  if (over) {
    fail("the stash is full: a message of tag " + std::to_string(h.tag) + " with " +
             n_bytes(h.payload_bytes) +
             " arrived before its receive was posted, and this context already holds " +
             n_bytes(held) + " of early messages (max_stash_bytes " +
             std::to_string(env_->max_stash_bytes) + ")",
         log_mode::always);
    return false;
  }
  return true;
}

void pair_impl::finish_message() {
  phase_ = rx_phase::prefix;
  auto kind = in_sink_;
  in_sink_ = sink::drop;
  in_dst_ = nullptr;
  if (kind == sink::control) {
    std::string payload(reinterpret_cast<const char*>(control_.data()),
                        static_cast<std::size_t>(in_.payload_bytes));
    if (in_.kind == wire::frame_kind::goodbye)
      on_goodbye(payload);
    else
      on_abort(payload);
    return;
  }
  if (kind == sink::op) {
    auto op = std::move(in_op_);
    op->received.store(in_.payload_bytes, std::memory_order_relaxed);
    op->complete();
  } else if (kind == sink::stash) {
    auto entry = std::move(in_stash_);
    std::shared_ptr<recv_op> waiter;
    {
      std::lock_guard lock(match_mu_);
      entry->complete = true;
      waiter = std::move(entry->waiter);
    }
    if (waiter) {
      if (entry->size > 0)
        std::memcpy(waiter->into().data(), entry->data.data(), entry->size);
      waiter->received.store(entry->size, std::memory_order_relaxed);
      waiter->complete();
    }
  }
}

void pair_impl::abandon_incoming() {
  if (!in_op_ && !in_stash_)
    return;
  auto [why, code] = failure();
  if (in_op_) {
    in_op_->fail(why, code);
    in_op_.reset();
  }
  if (in_stash_) {
    std::shared_ptr<recv_op> waiter;
    {
      std::lock_guard lock(match_mu_);
      waiter = std::move(in_stash_->waiter);
    }
    if (waiter)
      waiter->fail(why, code);
    in_stash_.reset();
  }
  in_sink_ = sink::drop;
  in_dst_ = nullptr;
}

void pair_impl::malformed(const std::string& what) {
  fail("malformed frame: " + what, log_mode::always);
}

void pair_impl::on_goodbye(const std::string& reason) {
  std::vector<std::shared_ptr<recv_op>> posted;
  {
    std::lock_guard lock(match_mu_);
    if (failed_.load(std::memory_order_relaxed))
      return;
    left_reason_ = reason.empty() ? std::string{"no reason given"} : reason;
    peer_left_.store(true, std::memory_order_release);
    // Every message the peer sent came before its goodbye: a receive still posted has none.
    // Early messages stay in the stash for the receives that will claim them.
    for (auto& [tag, op] : posted_)
      posted.push_back(std::move(op));
    posted_.clear();
  }
  if (!posted.empty())
    env_->log_line(describe() + " left the group (" + reason + ") while " +
                   std::to_string(posted.size()) + " receive(s) from it were pending");
  for (auto& op : posted)
    op->complete(left_error("recv of tag " + std::to_string(op->tag()) + " (" +
                            n_bytes(op->into().size()) + ") from " + describe()));
  // Fail what is queued for the peer and half-close our side (on this thread if the writing
  // pump is free, else by its holder before it leaves).
  pump_tx();
}

void pair_impl::on_abort(const std::string& payload) {
  auto code = errc::peer_lost;
  std::string reason = payload;
  if (!payload.empty()) {
    auto carried = static_cast<uint8_t>(payload[0]);
    // Only the codes that describe a broken group travel; anything else reads as a loss.
    for (auto known : {errc::peer_lost, errc::peer_left, errc::collective_timeout,
                       errc::collective_aborted, errc::collective_mismatch, errc::shutdown})
      if (carried == static_cast<uint8_t>(known))
        code = known;
    reason = payload.substr(1);
  }
  fail("rank " + std::to_string(peer_) + " aborted the group: " + reason, log_mode::if_busy, code);
}

void pair_impl::peer_closed() {
  {
    std::lock_guard lock(end_mu_);
    rx_eof_.store(true, std::memory_order_release);
  }
  end_cv_.notify_all();
}

void pair_impl::abort(const std::string& why, errc code) {
  {
    std::lock_guard lock(match_mu_);
    if (!failed_.load(std::memory_order_relaxed) && !aborting_) {
      aborting_ = true;
      abort_reason_ = why;
      abort_code_ = code;
    }
  }
  if (!failed_.load(std::memory_order_acquire) && !closing_.load(std::memory_order_acquire) &&
      !peer_left_.load(std::memory_order_acquire)) {
    // Between frames only: nothing queued, or the front message not begun (it fails anyway).
    std::lock_guard tx_lock(tx_mu_);
    int fd = fd_.load(std::memory_order_acquire);
    bool boundary;
    {
      std::lock_guard lock(txq_mu_);
      boundary = txq_.empty() || txq_.front()->written_.load(std::memory_order_relaxed) == 0;
    }
    if (fd >= 0 && boundary && !write_shut_) {
      std::string payload(1, static_cast<char>(code));
      payload += why;
      payload.resize(std::min(payload.size(), wire::max_control_bytes));
      wire::header h;
      h.sender_rank = static_cast<uint32_t>(env_->rank);
      h.payload_bytes = payload.size();
      h.kind = wire::frame_kind::abort;
      std::array<std::byte, wire::max_head_bytes> head{};
      auto head_len = wire::encode_header(h, head);
      iovec iov[2] = {{head.data(), head_len}, {payload.data(), payload.size()}};
      msghdr msg{};
      msg.msg_iov = iov;
      msg.msg_iovlen = 2;
      // Best effort, never blocking: a full socket buffer means a peer that does not read.
      (void)::sendmsg(fd, &msg, MSG_DONTWAIT | MSG_NOSIGNAL);
    }
  }
  fail(why, log_mode::never, code);
}

std::shared_ptr<send_op> pair_impl::begin_close(const std::string& why) {
  std::vector<std::shared_ptr<recv_op>> posted;
  {
    std::lock_guard lock(match_mu_);
    closing_.store(true, std::memory_order_release);
    for (auto& [tag, op] : posted_)
      posted.push_back(std::move(op));
    posted_.clear();
  }
  for (auto& op : posted)
    op->fail("this rank left the group (" + why + ") before the message arrived", errc::shutdown);
  std::lock_guard lock(txq_mu_);
  return txq_.empty() ? nullptr : txq_.back();
}

std::shared_ptr<send_op> pair_impl::send_goodbye(const std::string& reason) {
  if (failed_.load(std::memory_order_acquire) || fd_.load(std::memory_order_acquire) < 0 ||
      peer_left_.load(std::memory_order_acquire))
    return nullptr;
  auto op = send_op::control(shared_from_this(), wire::frame_kind::goodbye, reason);
  {
    std::lock_guard lock(txq_mu_);
    txq_.push_back(op);
  }
  pump_tx();
  return op;
}

void pair_impl::shut_write() {
  std::lock_guard lock(tx_mu_);
  if (write_shut_)
    return;
  write_shut_ = true;
  if (int fd = fd_.load(std::memory_order_acquire); fd >= 0)
    ::shutdown(fd, SHUT_WR);
}

bool pair_impl::wait_peer_closed(deadline until) {
  auto ended = [this] {
    return rx_eof_.load(std::memory_order_acquire) || failed_.load(std::memory_order_acquire);
  };
  // The poller reads (and drops) what still arrives, up to the peer's end of file.
  pump_rx();
  blocked_on_rx(true);
  bool seen = false;
  {
    std::unique_lock lock(end_mu_);
    seen = end_cv_.wait_until(lock, until, ended);
  }
  blocked_on_rx(false);
  return seen;
}

// -- send ----------------------------------------------------------------------------------------

void pair_impl::pump_tx() {
  tx_kick_.store(true);
  while (tx_kick_.load() && tx_mu_.try_lock()) {
    tx_kick_.store(false);
    if (pump_tx_locked())
      request_write_wait(); // under tx_mu_, so teardown cannot have begun
    std::string broken;
    broken.swap(tx_broken_);
    tx_mu_.unlock();
    if (!broken.empty())
      conclude_broken_write(broken);
  }
}

void pair_impl::conclude_broken_write(const std::string& why) {
  // The peer's end is gone: it reset the connection, or shut it and then met our bytes. What it
  // sent before that (an abort frame with the cause of its abort, or a goodbye) is still in our
  // receive queue, ahead of the reset: read it first, so that the pair fails with the peer's
  // cause and code rather than with a broken pipe. A reset socket gives its queued bytes and then
  // an error, so the read ends at once; the wait only covers another thread inside the reading
  // pump (which the kick makes read again), and is skipped inside the reading pump itself.
  if (!in_rx_pump) {
    pump_rx();
    std::unique_lock lock(end_mu_);
    end_cv_.wait_for(lock, broken_write_grace, [this] {
      return failed_.load(std::memory_order_acquire) || rx_eof_.load(std::memory_order_acquire);
    });
  }
  fail(why, log_mode::always); // no change when the read failed the pair first
}

bool pair_impl::pump_tx_locked() {
  for (;;) {
    if (failed_.load(std::memory_order_acquire)) {
      std::deque<std::shared_ptr<send_op>> queued;
      {
        std::lock_guard lock(txq_mu_);
        queued.swap(txq_);
      }
      if (!queued.empty()) {
        auto [why, code] = failure();
        for (auto& op : queued)
          op->fail(why, code);
      }
      return false;
    }
    if (peer_left_.load(std::memory_order_acquire)) {
      // The peer reads nothing more after its goodbye: what is queued was for calls it never
      // started. Fail it and end our side, so that the leaver's close sees our end of file.
      std::deque<std::shared_ptr<send_op>> queued;
      {
        std::lock_guard lock(txq_mu_);
        queued.swap(txq_);
      }
      for (auto& op : queued)
        op->complete(left_error("send of tag " + std::to_string(op->tag()) + " (" +
                                n_bytes(op->payload_bytes()) + ") to " + describe()));
      if (!write_shut_) {
        write_shut_ = true;
        if (int fd = fd_.load(std::memory_order_acquire); fd >= 0)
          ::shutdown(fd, SHUT_WR);
      }
      return false;
    }
    int fd = fd_.load(std::memory_order_acquire);
    if (fd < 0)
      return false;
    // Gather the unwritten bytes of the queued messages: heads and the callers' buffers in place.
    iovec iov[max_iov];
    int n_iov = 0;
    {
      std::lock_guard lock(txq_mu_);
      for (const auto& op : txq_) {
        uint64_t skip = op->written_.load(std::memory_order_relaxed);
        if (skip < op->head_len_) {
          iov[n_iov++] = {op->head_.data() + skip, static_cast<std::size_t>(op->head_len_ - skip)};
          skip = 0;
        } else {
          skip -= op->head_len_;
        }
        for (const auto& part : op->parts_) {
          if (n_iov == max_iov)
            break;
          if (part.size() <= skip) {
            skip -= part.size();
            continue;
          }
          iov[n_iov++] = {const_cast<std::byte*>(part.data()) + skip,
                          static_cast<std::size_t>(part.size() - skip)};
          skip = 0;
        }
        if (n_iov == max_iov)
          break;
      }
    }
    if (n_iov == 0)
      return false;
    msghdr msg{};
    msg.msg_iov = iov;
    msg.msg_iovlen = n_iov;
    auto n = ::sendmsg(fd, &msg, MSG_DONTWAIT | MSG_NOSIGNAL);
    if (n >= 0) {
      auto left = static_cast<uint64_t>(n);
      std::lock_guard lock(txq_mu_);
      while (!txq_.empty()) {
        auto& op = txq_.front();
        auto written = op->written_.load(std::memory_order_relaxed);
        auto take = std::min(left, op->total_bytes() - written);
        op->written_.store(written + take, std::memory_order_relaxed);
        left -= take;
        if (written + take < op->total_bytes())
          break;
        op->complete();
        txq_.pop_front();
      }
      continue;
    }
    int err = errno;
    if (err == EINTR)
      continue;
    if (err == EAGAIN || err == EWOULDBLOCK)
      return true;
    std::string progress;
    {
      std::lock_guard lock(txq_mu_);
      if (!txq_.empty())
        progress = "; " + std::to_string(txq_.front()->written_.load()) + " of " +
                   n_bytes(txq_.front()->total_bytes()) + " of the message of tag " +
                   std::to_string(txq_.front()->tag()) + " written";
    }
    auto why = "write failed (sendmsg): " + errno_text(err) + progress;
    if ((err == EPIPE || err == ECONNRESET) && tx_broken_.empty() &&
        !failed_.load(std::memory_order_acquire)) {
      tx_broken_ = std::move(why); // pump_tx reads what the peer sent first, then fails the pair
      return false;
    }
    fail(why, log_mode::always);
  }
}

void pair_impl::request_write_wait() {
  std::lock_guard lock(arm_mu_);
  want_write_ = true;
  arm_locked();
}

// -- readiness (the poller, poller.hpp) --------------------------------------------------------

void pair_impl::arm_locked() {
  if (!registered_)
    return;
  uint32_t events = 0;
  const bool failed = failed_.load(std::memory_order_acquire);
  if (!failed && !rx_eof_.load(std::memory_order_acquire) &&
      ((rx_spinners_.load() == 0 && !lazy_) || rx_blocked_.load() > 0))
    events |= EPOLLIN;
  if (!failed && want_write_)
    events |= EPOLLOUT;
  if (events == armed_)
    return;
  if (auto why = env_->poller->arm(fd_.load(std::memory_order_acquire), this, events);
      !why.empty()) {
    // The descriptor is ours and registered: the kernel refuses only when out of memory.
    env_->log_line("re-arming the connection to " + describe() + " failed: " + why);
    return;
  }
  armed_ = events;
}

void pair_impl::arm() {
  std::lock_guard lock(arm_mu_);
  arm_locked();
}

void pair_impl::on_ready(uint32_t events) {
  if (env_->on_readiness)
    env_->on_readiness(peer_);
  {
    std::lock_guard lock(arm_mu_);
    armed_ = 0; // one-shot: nothing is armed until arm_locked runs again
    // The pump below asks again (request_write_wait) if bytes still do not fit.
    if ((events & (EPOLLOUT | EPOLLERR | EPOLLHUP)) != 0)
      want_write_ = false;
  }
  if ((events & (EPOLLOUT | EPOLLERR | EPOLLHUP)) != 0)
    pump_tx();
  if ((events & (EPOLLIN | EPOLLRDHUP | EPOLLERR | EPOLLHUP)) != 0) {
    // To EAGAIN, unless a waiting thread is reading (see spinning_on_rx) and none is asleep.
    rx_skipped_.store(true);
    if (rx_spinners_.load() == 0 || rx_blocked_.load() > 0) {
      rx_skipped_.store(false);
      pump_rx();
    }
  }
  arm();
}

} // namespace consort::transport::tcp
