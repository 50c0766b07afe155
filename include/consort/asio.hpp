#pragma once

// Asio completion tokens for consort futures. Kept apart from future.hpp so that code that does
// not use Asio does not pay for its headers.

#include <utility> // Boost 1.74's Asio needs <utility> before it on C++20

#include <boost/asio/associated_executor.hpp>
#include <boost/asio/async_result.hpp>
#include <boost/asio/post.hpp>
#include <boost/asio/system_executor.hpp>

#include <consort/future.hpp>

namespace consort {

/// Completes `token` with `(std::exception_ptr, T)` when `f` is ready, following Asio's
/// completion-token model:
/// - a callback `void(std::exception_ptr, T)`,
/// - `boost::asio::use_future` (gives `std::future<T>` that rethrows consort::error),
/// - `boost::asio::use_awaitable` (`T v = co_await async_get(f, use_awaitable);` throws on error).
/// The handler runs on its associated executor (the coroutine's, for `use_awaitable`), or on
/// Asio's system executor when it has none, never on an engine thread.
template <class T, class Token>
auto async_get(future<T> f, Token&& token) {
  return boost::asio::async_initiate<Token, void(std::exception_ptr, T)>(
      [](auto handler, future<T> fut) {
        fut.on_complete([h = std::move(handler)](std::exception_ptr ep, T value) mutable {
          auto ex = boost::asio::get_associated_executor(h, boost::asio::system_executor{});
          boost::asio::post(ex, [h = std::move(h), ep, v = std::move(value)]() mutable {
            std::move(h)(ep, std::move(v));
          });
        });
      },
      token, std::move(f));
}

} // namespace consort
