// A socket carrying length-prefixed frames (see framed_connection.hpp).

#include "transport/framed_connection.hpp"

#include <boost/asio/read.hpp>
#include <boost/asio/write.hpp>

#include <string_view>

namespace consort::transport {

namespace asio = boost::asio;
using error_code = boost::system::error_code;

std::string reason_of(const error_code& ec) {
  if (ec == asio::error::eof)
    return "end of file";
  return ec.message();
}

framed_connection::framed_connection(asio::io_context& io, owner& o) : owner_(o), socket_(io) {}

void framed_connection::read_frames() {
  auto self = shared_from_this();
  asio::async_read(socket_, asio::buffer(prefix_),
                   [this, self](const error_code& ec, std::size_t n) {
                     if (owner_.stopped() || closed_)
                       return;
                     if (ec)
                       return read_failed(ec, n, prefix_bytes, "length prefix");
                     uint32_t length = 0;
                     if (auto why = owner_.frame_length(prefix_, length); !why.empty())
                       return owner_.on_failure(self, "malformed frame: " + why);
                     body_.resize(length); // bounded by frame_length
                     asio::async_read(socket_, asio::buffer(body_),
                                      [this, self](const error_code& ec, std::size_t n) {
                                        if (owner_.stopped() || closed_)
                                          return;
                                        if (ec)
                                          return read_failed(ec, n, body_.size(), "message");
                                        // Moved out: frames are rare, so no connection keeps a
                                        // body's buffer between them.
                                        owner_.on_frame(self, std::move(body_));
                                        if (!closed_)
                                          read_frames();
                                      });
                   });
}

void framed_connection::read_failed(const error_code& ec, std::size_t got, std::size_t want,
                                    const char* part) {
  auto mid_frame = got > 0 || std::string_view(part) != "length prefix";
  if (ec == asio::error::eof && mid_frame)
    return owner_.on_failure(shared_from_this(),
                             "truncated frame: the connection ended after " + std::to_string(got) +
                                 " of " + std::to_string(want) + " bytes of its " + part);
  owner_.on_read_error(shared_from_this(), ec);
}

void framed_connection::send(std::vector<std::byte> frame) {
  if (closed_ || send_shut_)
    return;
  queue_.push_back(std::move(frame));
  start_write();
}

void framed_connection::start_write() {
  if (closed_ || writing_)
    return;
  if (queue_.empty()) {
    if (graceful_ && !send_shut_) {
      send_shut_ = true;
      error_code ignored;
      socket_.shutdown(asio::ip::tcp::socket::shutdown_send, ignored);
    }
    return;
  }
  writing_ = true;
  write_started_ = owner_.now();
  asio::async_write(socket_, asio::buffer(queue_.front()),
                    [this, self = shared_from_this()](const error_code& ec, std::size_t n) {
                      writing_ = false;
                      if (owner_.stopped() || closed_)
                        return;
                      if (ec)
                        return owner_.on_failure(self, "write failed after " + std::to_string(n) +
                                                           " of " +
                                                           std::to_string(queue_.front().size()) +
                                                           " bytes (" + reason_of(ec) + ")");
                      queue_.pop_front();
                      start_write();
                    });
}

void framed_connection::close_gracefully(std::chrono::milliseconds linger) {
  if (closed_ || graceful_)
    return;
  graceful_ = true;
  linger_until_ = owner_.now() + linger;
  start_write(); // shuts the sending side down at once when nothing is queued
}

bool framed_connection::close() {
  if (closed_)
    return false;
  closed_ = true;
  error_code ignored;
  socket_.close(ignored); // pending operations complete with operation_aborted
  queue_.clear();
  return true;
}

} // namespace consort::transport
