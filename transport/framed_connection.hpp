#pragma once

// A TCP socket that carries length-prefixed frames: a write queue with one write in flight, frame
// reading, and a graceful close with a linger. It lives in transport/ rather than
// transport/membership/ because none of it is membership's: the frame format (how the 4-byte
// prefix gives a length, what a body means) and every policy (what a failure means, when to
// close) stay with the owner, so another transport component (transport/tcp) can use it as well.
// Used by the membership service (transport/membership). Internal to the library.
//
// Closing. A clean close (`close_gracefully`) lets the queued frames, the last message among
// them, be written, then shuts down the sending side and keeps reading until the peer closes too
// or the owner's deadline (`linger_expired`) passes: the last message is never lost to a reset.
// Nothing here waits: the owner enforces the linger, and a write that does not complete
// (`writing`, `write_started`), with its own timer.

#include <utility> // Boost 1.74's Asio needs <utility> before it on C++20

#include <boost/asio/io_context.hpp>
#include <boost/asio/ip/tcp.hpp>

#include <array>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <memory>
#include <span>
#include <string>
#include <vector>

namespace consort::transport {

/// Asio's message, except for end of file, which reads better in a sentence.
std::string reason_of(const boost::system::error_code& ec);

/// One connection carrying frames of a u32 length prefix and a body (see the file comment).
/// Derive from it to keep a protocol's state per connection; create it with `std::make_shared`.
///
/// Thread safety: not thread-safe; it belongs to the thread that runs its io_context, which also
/// runs every call of its owner.
class framed_connection : public std::enable_shared_from_this<framed_connection> {
public:
  using clock = std::chrono::steady_clock;

  /// Bytes of the length prefix.
  static constexpr std::size_t prefix_bytes = 4;

  /// What a connection asks and tells its owner; called on the I/O thread. The owner must
  /// outlive the completion handlers of its connections (own the io_context, or stop it first).
  class owner {
  public:
    virtual ~owner() = default;

    /// Whether the owner stopped its io_context (set from another thread): handlers that still
    /// complete afterwards do nothing.
    virtual bool stopped() const noexcept = 0;

    /// The time on the owner's clock, which the connection's times (`write_started`, the end of
    /// a linger) are taken on.
    virtual clock::time_point now() const { return clock::now(); }

    /// Reads a frame's length from its prefix; returns why the length is unacceptable (the frame
    /// format's bounds, checked before anything is allocated), or "" and sets `length`.
    virtual std::string frame_length(std::span<const std::byte, prefix_bytes> prefix,
                                     uint32_t& length) = 0;

    /// A frame's body arrived, also while closing gracefully (the owner decides whether to look
    /// at it). The next frame is read after this returns, unless the connection was closed.
    virtual void on_frame(const std::shared_ptr<framed_connection>& c,
                          std::vector<std::byte> body) = 0;

    /// Reading stopped other than inside a frame's bytes: end of file between frames, a reset,
    /// any other error. The connection is still open; the owner decides.
    virtual void on_read_error(const std::shared_ptr<framed_connection>& c,
                               const boost::system::error_code& ec) = 0;

    /// The connection broke: a malformed length ("malformed frame: …"), a truncated frame, a
    /// failed write; `what` says how. The connection is still open; the owner decides.
    virtual void on_failure(const std::shared_ptr<framed_connection>& c,
                            const std::string& what) = 0;
  };

  framed_connection(boost::asio::io_context& io, owner& o);
  virtual ~framed_connection() = default;

  framed_connection(const framed_connection&) = delete;
  framed_connection& operator=(const framed_connection&) = delete;

  // -- properties --------------------------------------------------------------------------------

  /// The socket, for accepting, connecting and options.
  boost::asio::ip::tcp::socket& socket() noexcept { return socket_; }

  /// "host:port" of the other end (or what this side was trying to reach), for logs and errors.
  const std::string& remote() const noexcept { return remote_; }
  void remote(std::string text) { remote_ = std::move(text); }

  /// Closed: nothing is read or written any more.
  bool closed() const noexcept { return closed_; }

  /// Closing gracefully (see `close_gracefully`).
  bool graceful() const noexcept { return graceful_; }

  /// The sending side is shut down: frames queued from now on are dropped.
  bool send_shut() const noexcept { return send_shut_; }

  /// Whether the linger of a graceful close is over at `now`.
  bool linger_expired(clock::time_point now) const noexcept {
    return graceful_ && now >= linger_until_;
  }

  /// A write is in flight; since `write_started`, of `front_bytes` bytes.
  bool writing() const noexcept { return writing_; }
  clock::time_point write_started() const noexcept { return write_started_; }
  std::size_t front_bytes() const noexcept { return queue_.empty() ? 0 : queue_.front().size(); }

  // -- operations --------------------------------------------------------------------------------

  /// Reads frames until the connection is closed, reporting each to the owner.
  void read_frames();

  /// Queues `frame` (its prefix included) and writes it after those queued before. Dropped when
  /// closed or when the sending side is shut down.
  void send(std::vector<std::byte> frame);

  /// Writes what is queued, then shuts down the sending side and keeps reading until the peer
  /// closes or the owner closes it once `linger_expired`. Once only.
  void close_gracefully(std::chrono::milliseconds linger);

  /// Closes the socket at once and drops the queue; pending operations complete with
  /// operation_aborted and report nothing. Returns false when it was closed already.
  bool close();

private:
  void start_write();
  void read_failed(const boost::system::error_code& ec, std::size_t got, std::size_t want,
                   const char* part);

  owner& owner_;
  boost::asio::ip::tcp::socket socket_;
  std::string remote_;
  std::array<std::byte, prefix_bytes> prefix_{};
  std::vector<std::byte> body_;
  std::deque<std::vector<std::byte>> queue_; // frames to write, the front one in flight
  bool writing_ = false;
  clock::time_point write_started_{};
  bool graceful_ = false; // shut down the sending side once the queue is written
  bool send_shut_ = false;
  clock::time_point linger_until_{};
  bool closed_ = false;
};

} // namespace consort::transport
