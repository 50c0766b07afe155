// The collective algorithms over the in-memory transport: one thread per rank, swept over ranks
// 1..8, element counts 0, 1, 7, 1001 and 2^20 + 3, every dtype and reduce op, against a
// sequential reference; ragged all-gather; broadcast from every root; concurrent tags; a silent
// rank; an aborted rank. The all-reduce, all-gather and broadcast sweeps also run over the
// shared-memory transport (the Shm* instantiations, on fewer rank counts), with rings of 64 KiB
// that the large messages stream through. Nothing sleeps: every wait is an operation with a
// deadline.

#include <consort/caf_error.hpp>

#include "support/time_scale.hpp"
#include <consort/error.hpp>
#include <consort/transport/algorithms.hpp>
#include <consort/transport/local.hpp>
#include <consort/transport/shm.hpp>

#include <caf/error.hpp>

#include <gtest/gtest.h>

#include <algorithm>
#include <cctype>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <functional>
#include <memory>
#include <ostream>
#include <random>
#include <sstream>
#include <string>
#include <thread>
#include <tuple>
#include <type_traits>
#include <vector>

namespace consort::transport {
namespace {

using namespace std::chrono_literals;

// -- helpers --------------------------------------------------------------------------------------

errc code_of(const caf::error& err) {
  if (!err)
    return errc::none;
  return err.category() == caf::atom("consort") ? static_cast<errc>(err.code())
                                                : errc::invalid_argument;
}

std::string text_of(const caf::error& err) {
  return err ? std::string{to_consort_error(err, "").what()} : std::string{"(no error)"};
}

bool mentions(const caf::error& err, const std::string& fragment) {
  return text_of(err).find(fragment) != std::string::npos;
}

/// The transport that a sweep runs its group over.
enum class transport_kind { local, shm };

/// A group of `n` ranks (threads of this process) over `kind`. Shared memory gets rings of
/// 64 KiB, so that the large messages of the sweeps stream through a ring many times.
std::vector<context_ptr> make_group_over(transport_kind kind, int n) {
  if (kind == transport_kind::local)
    return local::make_group(n);
  shm::options opts;
  opts.ring_bytes = size_t{64} << 10;
  return shm::make_group(n, opts);
}

/// Why this machine cannot run a group over `kind` (a test then skips); empty when it can.
std::string unavailable(transport_kind kind) {
  return kind == transport_kind::shm ? shm::unavailable_reason() : std::string{};
}

/// Runs `fn(rank)` on one thread per rank of `group`; returns each rank's error.
std::vector<caf::error> on_ranks(const std::vector<context_ptr>& group,
                                 const std::function<caf::error(int)>& fn) {
  std::vector<caf::error> errors(group.size());
  std::vector<std::thread> threads;
  for (int r = 0; r < static_cast<int>(group.size()); ++r)
    threads.emplace_back([&, r] { errors[static_cast<size_t>(r)] = fn(r); });
  for (auto& t : threads)
    t.join();
  return errors;
}

/// Aborts every context, so that nothing posted by a failed run touches buffers any more.
void abort_all(const std::vector<context_ptr>& group) {
  for (const auto& ctx : group)
    ctx->abort("test cleanup");
}

/// Whether T is one of the 16-bit floats, which the algorithms combine in float.
template <class T>
constexpr bool is_half_v = std::is_same_v<T, float16_t> || std::is_same_v<T, bfloat16_t>;

/// An element as something GoogleTest prints as a number.
template <class T>
auto printable(T x) {
  if constexpr (std::is_same_v<T, std::byte>)
    return static_cast<int>(x);
  else if constexpr (is_half_v<T>)
    return static_cast<float>(x);
  else
    return +x;
}

/// Where two byte ranges first differ, as a message for a failed expectation.
template <class T>
::testing::AssertionResult same_bytes(const std::vector<T>& actual,
                                      const std::vector<T>& expected) {
  if (actual.size() != expected.size())
    return ::testing::AssertionFailure()
           << "size " << actual.size() << " instead of " << expected.size();
  if (actual.empty() || std::memcmp(actual.data(), expected.data(), actual.size() * sizeof(T)) == 0)
    return ::testing::AssertionSuccess();
  for (size_t i = 0; i < actual.size(); ++i)
    if (std::memcmp(&actual[i], &expected[i], sizeof(T)) != 0)
      return ::testing::AssertionFailure() << "element " << i << " is " << printable(actual[i])
                                           << ", expected " << printable(expected[i]);
  return ::testing::AssertionFailure() << "bytes differ";
}

// -- all-reduce ---------------------------------------------------------------------------------

enum class algo { ring, direct, doubling, dispatcher, ring_out_of_place };

const char* to_string(algo a) {
  switch (a) {
  case algo::ring:
    return "Ring";
  case algo::direct:
    return "Direct";
  case algo::doubling:
    return "RecursiveDoubling";
  case algo::dispatcher:
    return "Dispatcher";
  case algo::ring_out_of_place:
    return "RingOutOfPlace";
  }
  return "?";
}

void PrintTo(algo value, std::ostream* out) {
  *out << to_string(value);
}

caf::error run_all_reduce(algo a, const context_ptr& ctx, void* data, size_t count, dtype type,
                          reduce_op op, const algorithm_options& opts) {
  switch (a) {
  case algo::ring:
    return ring_all_reduce{ctx, data, count, type, op, opts}.run();
  case algo::direct:
    return direct_all_reduce{ctx, data, count, type, op, opts}.run();
  case algo::doubling:
    return recursive_doubling_all_reduce{ctx, data, count, type, op, opts}.run();
  case algo::dispatcher:
    return all_reduce(ctx, data, count, type, op, opts);
  case algo::ring_out_of_place: {
    // The input in a buffer of its own, the output poisoned first: the result must not depend on
    // what `data` held, and the input must come back unchanged.
    const size_t bytes = count * size_of(type);
    std::vector<std::byte> in(static_cast<std::byte*>(data), static_cast<std::byte*>(data) + bytes);
    const auto before = in;
    if (bytes > 0)
      std::memset(data, 0xcd, bytes);
    auto err = ring_all_reduce{ctx, in.data(), data, count, type, op, opts}.run();
    if (!err && in != before)
      return make_caf_error(errc::invalid_argument, "the out-of-place ring wrote to its input");
    return err;
  }
  }
  return {};
}

/// Inputs whose reductions are exact in every dtype and order (small integers; products of
/// +-1 and +-2), so results can be compared bit for bit whatever order an algorithm folds in.
template <class T>
T input_value(reduce_op op, int rank, size_t i) {
  long v = 0;
  switch (op) {
  case reduce_op::prod: {
    static constexpr long factors[] = {1, -1, 2, 1, -2, 1, 1};
    v = factors[(i + 3 * static_cast<size_t>(rank)) % 7];
    break;
  }
  case reduce_op::min:
  case reduce_op::max:
    v = static_cast<long>((i * 31 + static_cast<size_t>(rank) * 17) % 201) - 100;
    break;
  default:
    v = static_cast<long>((i * 7 + static_cast<size_t>(rank) * 13) % 11) - 5;
  }
  return static_cast<T>(v); // uint8 wraps, as intended
}

/// The reference fold, as tf.distribute defines it (integers wrap; the 16-bit floats combine in
/// float and round once).
template <class T>
T apply(reduce_op op, T a, T b);

template <class T>
T apply_in(reduce_op op, T a, T b) {
  if constexpr (is_half_v<T>)
    return T(apply<float>(op, static_cast<float>(a), static_cast<float>(b)));
  else
    return apply<T>(op, a, b);
}

template <class T>
T apply(reduce_op op, T a, T b) {
  using W = typename std::conditional_t<std::is_integral_v<T>, std::make_unsigned<T>,
                                        std::type_identity<T>>::type;
  switch (op) {
  case reduce_op::sum:
  case reduce_op::mean:
    return static_cast<T>(static_cast<W>(a) + static_cast<W>(b));
  case reduce_op::prod:
    return static_cast<T>(static_cast<W>(a) * static_cast<W>(b));
  case reduce_op::min:
    return b < a ? b : a;
  case reduce_op::max:
    return a < b ? b : a;
  }
  return a;
}

/// Sequential reduction in rank order; MEAN multiplies the sum by 1/n, as the kernels do.
template <class T>
std::vector<T> reference(reduce_op op, const std::vector<std::vector<T>>& inputs) {
  std::vector<T> out = inputs.front();
  for (size_t r = 1; r < inputs.size(); ++r)
    for (size_t i = 0; i < out.size(); ++i)
      out[i] = apply_in(op, out[i], inputs[r][i]);
  if constexpr (is_half_v<T>) {
    if (op == reduce_op::mean) {
      const float s = 1.0f / static_cast<float>(inputs.size());
      for (auto& x : out)
        x = T(static_cast<float>(x) * s);
    }
  } else if constexpr (std::is_floating_point_v<T>) {
    if (op == reduce_op::mean) {
      const T s = T(1) / static_cast<T>(inputs.size());
      for (auto& x : out)
        x *= s;
    }
  }
  return out;
}

template <class T>
void expect_all_reduce(transport_kind kind, algo a, int n, size_t count, reduce_op op,
                       const algorithm_options& opts) {
  SCOPED_TRACE(std::string{to_string(dtype_of<T>)} + " " + consort::to_string(op));
  std::vector<std::vector<T>> data(static_cast<size_t>(n), std::vector<T>(count));
  for (int r = 0; r < n; ++r)
    for (size_t i = 0; i < count; ++i)
      data[static_cast<size_t>(r)][i] = input_value<T>(op, r, i);
  const bool rejected = op == reduce_op::mean && !is_floating(dtype_of<T>);
  const auto expected = rejected ? std::vector<T>{} : reference(op, data);
  auto group = make_group_over(kind, n);
  auto errors = on_ranks(group, [&](int r) {
    return run_all_reduce(a, group[static_cast<size_t>(r)], data[static_cast<size_t>(r)].data(),
                          count, dtype_of<T>, op, opts);
  });
  for (int r = 0; r < n; ++r) {
    const auto& err = errors[static_cast<size_t>(r)];
    if (rejected) {
      EXPECT_EQ(code_of(err), errc::dtype_mismatch) << "rank " << r << ": " << text_of(err);
      EXPECT_TRUE(mentions(err, "float64")) << text_of(err);
      continue;
    }
    ASSERT_FALSE(err) << "rank " << r << ": " << text_of(err);
    EXPECT_TRUE(same_bytes(data[static_cast<size_t>(r)], expected)) << "rank " << r;
  }
}

void expect_all_reduce(transport_kind kind, algo a, int n, size_t count, dtype type, reduce_op op,
                       const algorithm_options& opts) {
  switch (type) {
  case dtype::float32:
    return expect_all_reduce<float>(kind, a, n, count, op, opts);
  case dtype::float64:
    return expect_all_reduce<double>(kind, a, n, count, op, opts);
  case dtype::int32:
    return expect_all_reduce<int32_t>(kind, a, n, count, op, opts);
  case dtype::int64:
    return expect_all_reduce<int64_t>(kind, a, n, count, op, opts);
  case dtype::uint8:
    return expect_all_reduce<uint8_t>(kind, a, n, count, op, opts);
  case dtype::float16:
    return expect_all_reduce<float16_t>(kind, a, n, count, op, opts);
  case dtype::bfloat16:
    return expect_all_reduce<bfloat16_t>(kind, a, n, count, op, opts);
  case dtype::boolean:
    break;
  }
}

constexpr dtype all_dtypes[] = {dtype::float32, dtype::float64, dtype::int32,   dtype::int64,
                                dtype::uint8,   dtype::float16, dtype::bfloat16};
constexpr reduce_op all_ops[] = {reduce_op::sum, reduce_op::mean, reduce_op::min, reduce_op::max,
                                 reduce_op::prod};
constexpr size_t large_count = (size_t{1} << 20) + 3;

class AllReduceSweepTest
    : public ::testing::TestWithParam<std::tuple<transport_kind, algo, int, size_t>> {};

TEST_P(AllReduceSweepTest, MatchesASequentialReductionForEveryDtypeAndOp) {
  const auto [kind, a, n, count] = GetParam();
  if (auto why = unavailable(kind); !why.empty())
    GTEST_SKIP() << why;
  algorithm_options opts;
  opts.tag = 42;
  // Small chunks below the large size, so that even 1001 elements go through many pipelined
  // chunks per segment (24 bytes: 3 to 24 elements, not a divisor of the segments).
  if (count < large_count)
    opts.chunk_bytes = 24;
  // A small window, so that the ring's first step is paced by its receives (3 chunks here; the
  // smallest window, 2 chunks, at the large count).
  opts.window_bytes = count < large_count ? 3 * 24 : size_t{512} << 10;
  // The dispatcher picks recursive doubling above 4 ranks, the direct exchange up to 4, and the
  // ring for the large count.
  opts.direct_max_ranks = 4;
  // Over shared memory, the large count reduces with SUM only, in every dtype (1 to 8 MiB per
  // rank through the rings): the transport moves bytes whatever the op, and the other ops at that
  // count are the local sweep's (each op there costs as much CPU as the whole transport check).
  const bool every_op = kind == transport_kind::local || count < large_count;
  for (auto type : all_dtypes)
    for (auto op : all_ops)
      if (every_op || op == reduce_op::sum)
        expect_all_reduce(kind, a, n, count, type, op, opts);
}

/// The transport is in the instantiation's name (Shm...), not in the test's.
std::string
sweep_name(const ::testing::TestParamInfo<std::tuple<transport_kind, algo, int, size_t>>& info) {
  return std::string{to_string(std::get<1>(info.param))} + std::to_string(std::get<2>(info.param)) +
         "Ranks" + std::to_string(std::get<3>(info.param)) + "Elements";
}

constexpr auto over_local = transport_kind::local;

INSTANTIATE_TEST_SUITE_P(
    RanksAndCounts, AllReduceSweepTest,
    ::testing::Combine(::testing::Values(over_local),
                       ::testing::Values(algo::ring, algo::doubling, algo::dispatcher),
                       ::testing::Range(1, 9), ::testing::Values(0, 1, 7, 1001, large_count)),
    sweep_name);
// The direct exchange sends every rank's whole vector to every other rank, O(ranks^2) bytes: the
// dispatcher uses it for small messages on few ranks only. Its 1 Mi-element sweep runs up to 4
// ranks (at 5-8 ranks it cost much of the suite's CPU time, docs/sanitizers.md "Cost", and tests
// no other code: 1001 elements in 24-byte chunks already cover its chunking at every rank count).
INSTANTIATE_TEST_SUITE_P(DirectRanksAndCounts, AllReduceSweepTest,
                         ::testing::Combine(::testing::Values(over_local),
                                            ::testing::Values(algo::direct), ::testing::Range(1, 9),
                                            ::testing::Values(0, 1, 7, 1001)),
                         sweep_name);
// The ring out of place (input only read, output poisoned first): the same sweep on fewer ranks.
INSTANTIATE_TEST_SUITE_P(OutOfPlace, AllReduceSweepTest,
                         ::testing::Combine(::testing::Values(over_local),
                                            ::testing::Values(algo::ring_out_of_place),
                                            ::testing::Values(1, 2, 3, 5),
                                            ::testing::Values(0, 1, 7, 1001)),
                         sweep_name);
INSTANTIATE_TEST_SUITE_P(OutOfPlaceLarge, AllReduceSweepTest,
                         ::testing::Combine(::testing::Values(over_local),
                                            ::testing::Values(algo::ring_out_of_place),
                                            ::testing::Values(2, 3),
                                            ::testing::Values(large_count)),
                         sweep_name);
INSTANTIATE_TEST_SUITE_P(DirectLarge, AllReduceSweepTest,
                         ::testing::Combine(::testing::Values(over_local),
                                            ::testing::Values(algo::direct), ::testing::Range(1, 5),
                                            ::testing::Values(large_count)),
                         sweep_name);
// Over shared memory: on 2, 3, 5 and 8 ranks at 0 elements (empty messages), 7 (fewer elements
// than ranks: empty segments) and 1001 (in 24-byte chunks: hundreds of small messages per run);
// the direct exchange through the dispatcher, which picks it up to 4 ranks. The large count, which
// streams through the 64 KiB rings, on 2 and 5 ranks.
INSTANTIATE_TEST_SUITE_P(
    ShmRanksAndCounts, AllReduceSweepTest,
    ::testing::Combine(::testing::Values(transport_kind::shm),
                       ::testing::Values(algo::ring, algo::doubling, algo::dispatcher),
                       ::testing::Values(2, 3, 5, 8), ::testing::Values(0, 7, 1001)),
    sweep_name);
INSTANTIATE_TEST_SUITE_P(ShmLarge, AllReduceSweepTest,
                         ::testing::Combine(::testing::Values(transport_kind::shm),
                                            ::testing::Values(algo::ring, algo::doubling),
                                            ::testing::Values(2, 5),
                                            ::testing::Values(large_count)),
                         sweep_name);

class AllReduceOrderTest : public ::testing::TestWithParam<std::tuple<algo, int>> {};

TEST_P(AllReduceOrderTest, RandomFloatsGiveBitwiseIdenticalResultsOnEveryRankCloseToTheReference) {
  const auto [a, n] = GetParam();
  constexpr size_t count = 100003;
  for (auto op : {reduce_op::sum, reduce_op::mean}) {
    std::mt19937 gen(7);
    std::uniform_real_distribution<float> dist(-1.0f, 1.0f);
    std::vector<std::vector<float>> data(static_cast<size_t>(n), std::vector<float>(count));
    for (auto& v : data)
      for (auto& x : v)
        x = dist(gen);
    const auto expected = reference(op, data);
    auto group = local::make_group(n);
    algorithm_options opts;
    opts.chunk_bytes = 4000;
    auto errors = on_ranks(group, [&](int r) {
      return run_all_reduce(a, group[static_cast<size_t>(r)], data[static_cast<size_t>(r)].data(),
                            count, dtype::float32, op, opts);
    });
    for (int r = 0; r < n; ++r) {
      ASSERT_FALSE(errors[static_cast<size_t>(r)]) << text_of(errors[static_cast<size_t>(r)]);
      EXPECT_TRUE(same_bytes(data[static_cast<size_t>(r)], data[0])) << "rank " << r;
    }
    double worst = 0;
    for (size_t i = 0; i < count; ++i)
      worst = std::max(worst, std::abs(double(data[0][i]) - double(expected[i])));
    EXPECT_LT(worst, 1e-5 * n) << consort::to_string(op);
  }
}

INSTANTIATE_TEST_SUITE_P(Ranks, AllReduceOrderTest,
                         ::testing::Combine(::testing::Values(algo::ring, algo::direct,
                                                              algo::doubling),
                                            ::testing::Values(2, 3, 5, 8)),
                         [](const auto& info) {
                           return std::string{to_string(std::get<0>(info.param))} +
                                  std::to_string(std::get<1>(info.param)) + "Ranks";
                         });

TEST(AllReduceTest, DirectExchangeEqualsTheSequentialReductionBitForBit) {
  // The direct exchange folds in rank order on every rank: exactly the sequential reference,
  // even for inexact floating sums.
  constexpr int n = 5;
  constexpr size_t count = 1001;
  std::mt19937 gen(3);
  std::uniform_real_distribution<double> dist(-1e3, 1e3);
  std::vector<std::vector<double>> data(n, std::vector<double>(count));
  for (auto& v : data)
    for (auto& x : v)
      x = dist(gen);
  const auto expected = reference(reduce_op::sum, data);
  auto group = local::make_group(n);
  auto errors = on_ranks(group, [&](int r) {
    return direct_all_reduce{group[static_cast<size_t>(r)], data[static_cast<size_t>(r)].data(),
                             count, dtype::float64, reduce_op::sum}
        .run();
  });
  for (int r = 0; r < n; ++r) {
    ASSERT_FALSE(errors[static_cast<size_t>(r)]);
    EXPECT_TRUE(same_bytes(data[static_cast<size_t>(r)], expected)) << "rank " << r;
  }
}

TEST(AllReduceTest, IntegerMeanIsDoneByTheCallerInFloat64) {
  // The algorithms reduce in the input dtype, so integer MEAN (which yields float64) is
  // rejected; the caller converts to float64 and reduces that with MEAN.
  constexpr int n = 3;
  std::vector<std::vector<int32_t>> ints = {{1, 2, 7}, {2, 2, 8}, {4, 3, 8}};
  auto group = local::make_group(n);
  auto rejected = on_ranks(group, [&](int r) {
    return all_reduce(group[static_cast<size_t>(r)], ints[static_cast<size_t>(r)].data(), 3,
                      dtype::int32, reduce_op::mean);
  });
  for (const auto& err : rejected) {
    EXPECT_EQ(code_of(err), errc::dtype_mismatch) << text_of(err);
    EXPECT_TRUE(mentions(err, "convert them to float64")) << text_of(err);
  }
  std::vector<std::vector<double>> doubles(n);
  for (int r = 0; r < n; ++r)
    for (auto x : ints[static_cast<size_t>(r)])
      doubles[static_cast<size_t>(r)].push_back(static_cast<double>(x));
  auto errors = on_ranks(group, [&](int r) {
    return all_reduce(group[static_cast<size_t>(r)], doubles[static_cast<size_t>(r)].data(), 3,
                      dtype::float64, reduce_op::mean);
  });
  for (int r = 0; r < n; ++r) {
    ASSERT_FALSE(errors[static_cast<size_t>(r)]);
    EXPECT_DOUBLE_EQ(doubles[static_cast<size_t>(r)][0], 7.0 / 3);
    EXPECT_DOUBLE_EQ(doubles[static_cast<size_t>(r)][1], 7.0 / 3);
    EXPECT_DOUBLE_EQ(doubles[static_cast<size_t>(r)][2], 23.0 / 3);
  }
}

TEST(AllReduceTest, BoolAndBadOptionsAreRejectedBeforeAnythingIsSent) {
  auto group = local::make_group(2);
  std::vector<uint8_t> flags(4, 1);
  algorithm_options big_tag;
  big_tag.tag = max_tag;
  for (auto a : {algo::ring, algo::direct, algo::doubling}) {
    // One rank alone: an error that needed a message would time out instead.
    auto err =
        run_all_reduce(a, group[0], flags.data(), flags.size(), dtype::boolean, reduce_op::sum, {});
    EXPECT_EQ(code_of(err), errc::dtype_mismatch) << text_of(err);
    EXPECT_TRUE(mentions(err, "cast to int32")) << text_of(err);
    err = run_all_reduce(a, group[0], flags.data(), flags.size(), dtype::uint8, reduce_op::sum,
                         big_tag);
    EXPECT_EQ(code_of(err), errc::invalid_argument) << text_of(err);
    EXPECT_TRUE(mentions(err, "2^40")) << text_of(err);
  }
}

TEST(AllReduceTest, RanksThatDisagreeOnTheCountFailWithInvalidArgument) {
  auto group = local::make_group(2);
  std::vector<std::vector<float>> data = {std::vector<float>(3), std::vector<float>(4)};
  auto errors = on_ranks(group, [&](int r) {
    auto& v = data[static_cast<size_t>(r)];
    return direct_all_reduce{group[static_cast<size_t>(r)], v.data(), v.size(), dtype::float32,
                             reduce_op::sum}
        .run();
  });
  for (int r = 0; r < 2; ++r) {
    const auto& err = errors[static_cast<size_t>(r)];
    EXPECT_EQ(code_of(err), errc::invalid_argument) << text_of(err);
    EXPECT_TRUE(mentions(err, "direct_all_reduce (rank " + std::to_string(r))) << text_of(err);
  }
}

double gbps(size_t bytes, double seconds) {
  return static_cast<double>(bytes) / seconds / 1e9;
}

TEST(AllReduceTest, RingAllReduceOf64MiBOfFloat32IsExact) {
  constexpr size_t count = size_t{16} << 20; // 64 MiB of float32
  constexpr size_t bytes = count * sizeof(float);
  // memcpy bandwidth of this machine, in the same program, for comparison.
  double memcpy_s = 1e9;
  {
    std::vector<std::byte> src(bytes, std::byte{1});
    std::vector<std::byte> dst(bytes, std::byte{0});
    for (int i = 0; i < 3; ++i) {
      const auto start = clock::now();
      std::memcpy(dst.data(), src.data(), bytes);
      memcpy_s = std::min(memcpy_s, std::chrono::duration<double>(clock::now() - start).count());
    }
    ASSERT_EQ(dst[bytes - 1], std::byte{1});
  }
  std::printf("[ figure   ] memcpy of 64 MiB: %.2f ms (%.2f GB/s)\n", memcpy_s * 1e3,
              gbps(bytes, memcpy_s));
  for (int n : {2, 4}) {
    std::vector<std::vector<float>> data(static_cast<size_t>(n), std::vector<float>(count));
    auto group = local::make_group(n);
    double best = 1e9;
    for (int iteration = 0; iteration < 3; ++iteration) {
      for (int r = 0; r < n; ++r)
        for (size_t i = 0; i < count; ++i)
          data[static_cast<size_t>(r)][i] = input_value<float>(reduce_op::sum, r, i);
      const auto start = clock::now();
      auto errors = on_ranks(group, [&](int r) {
        return ring_all_reduce{group[static_cast<size_t>(r)], data[static_cast<size_t>(r)].data(),
                               count, dtype::float32, reduce_op::sum}
            .run();
      });
      best = std::min(best, std::chrono::duration<double>(clock::now() - start).count());
      for (int r = 0; r < n; ++r)
        ASSERT_FALSE(errors[static_cast<size_t>(r)]) << text_of(errors[static_cast<size_t>(r)]);
    }
    // Spot checks against the exact sum (the full comparison is in the sweep above).
    for (size_t i : {size_t{0}, size_t{1}, count / 3, count / 2 + 1, count - 1}) {
      float expected = 0;
      for (int r = 0; r < n; ++r)
        expected += input_value<float>(reduce_op::sum, r, i);
      for (int r = 0; r < n; ++r)
        EXPECT_EQ(data[static_cast<size_t>(r)][i], expected) << "rank " << r << " element " << i;
    }
    std::printf("[ figure   ] ring all-reduce of 64 MiB float32 SUM, %d ranks (threads) over the "
                "local transport: %.2f ms (best of 3, thread start included); algbw %.2f GB/s, "
                "busbw %.2f GB/s\n",
                n, best * 1e3, gbps(bytes, best), gbps(bytes, best) * 2.0 * (n - 1) / n);
  }
}

// -- all-gather ---------------------------------------------------------------------------------

enum class sizes_kind { equal, ragged, zeros, large };

std::vector<size_t> sizes_for(sizes_kind kind, int n) {
  std::vector<size_t> sizes(static_cast<size_t>(n));
  for (int r = 0; r < n; ++r) {
    const auto ur = static_cast<size_t>(r);
    switch (kind) {
    case sizes_kind::equal:
      sizes[ur] = 7;
      break;
    case sizes_kind::ragged:
      sizes[ur] = (ur * 37 + 5) % 4 * 333 + ur % 2; // includes zero-size contributions
      break;
    case sizes_kind::zeros:
      sizes[ur] = 0;
      break;
    case sizes_kind::large:
      sizes[ur] = ur == 0 ? large_count : ur * 1001;
      break;
    }
  }
  return sizes;
}

const char* to_string(sizes_kind kind) {
  switch (kind) {
  case sizes_kind::equal:
    return "Equal";
  case sizes_kind::ragged:
    return "Ragged";
  case sizes_kind::zeros:
    return "AllEmpty";
  case sizes_kind::large:
    return "Large";
  }
  return "?";
}

void PrintTo(sizes_kind value, std::ostream* out) {
  *out << to_string(value);
}

std::vector<std::byte> contribution(int rank, size_t size) {
  std::vector<std::byte> out(size);
  for (size_t i = 0; i < size; ++i)
    out[i] = static_cast<std::byte>((i * 13 + static_cast<size_t>(rank) * 101) % 251);
  return out;
}

class AllGatherSweepTest
    : public ::testing::TestWithParam<std::tuple<transport_kind, int, sizes_kind>> {};

TEST_P(AllGatherSweepTest, ConcatenatesEveryContributionInRankOrder) {
  const auto [over, n, kind] = GetParam();
  if (auto why = unavailable(over); !why.empty())
    GTEST_SKIP() << why;
  const auto sizes = sizes_for(kind, n);
  std::vector<std::vector<std::byte>> inputs;
  std::vector<std::byte> expected;
  for (int r = 0; r < n; ++r) {
    inputs.push_back(contribution(r, sizes[static_cast<size_t>(r)]));
    expected.insert(expected.end(), inputs.back().begin(), inputs.back().end());
  }
  algorithm_options opts;
  opts.tag = 5;
  if (kind != sizes_kind::large)
    opts.chunk_bytes = 100;
  auto group = make_group_over(over, n);
  // Sizes exchanged by the helper.
  std::vector<std::vector<std::byte>> outputs(static_cast<size_t>(n));
  std::vector<std::vector<size_t>> seen(static_cast<size_t>(n));
  auto errors = on_ranks(group, [&](int r) {
    const auto ur = static_cast<size_t>(r);
    return all_gather(group[ur], inputs[ur], outputs[ur], &seen[ur], opts);
  });
  for (int r = 0; r < n; ++r) {
    const auto ur = static_cast<size_t>(r);
    ASSERT_FALSE(errors[ur]) << "rank " << r << ": " << text_of(errors[ur]);
    EXPECT_EQ(seen[ur], sizes) << "rank " << r;
    EXPECT_TRUE(same_bytes(outputs[ur], expected)) << "rank " << r;
  }
  // Sizes given, gathered in place (each rank's input already at its offset in the output).
  std::vector<std::vector<std::byte>> in_place(static_cast<size_t>(n),
                                               std::vector<std::byte>(expected.size()));
  errors = on_ranks(group, [&](int r) {
    const auto ur = static_cast<size_t>(r);
    size_t offset = 0;
    for (size_t i = 0; i < ur; ++i)
      offset += sizes[i];
    auto& out = in_place[ur];
    std::copy(inputs[ur].begin(), inputs[ur].end(), out.begin() + static_cast<long>(offset));
    return ring_all_gather{group[ur], const_bytes{out.data() + offset, sizes[ur]}, out, sizes, opts}
        .run();
  });
  for (int r = 0; r < n; ++r) {
    const auto ur = static_cast<size_t>(r);
    ASSERT_FALSE(errors[ur]) << "rank " << r << ": " << text_of(errors[ur]);
    EXPECT_TRUE(same_bytes(in_place[ur], expected)) << "rank " << r << " (in place)";
  }
}

std::string
gather_name(const ::testing::TestParamInfo<std::tuple<transport_kind, int, sizes_kind>>& info) {
  return std::to_string(std::get<1>(info.param)) + "Ranks" + to_string(std::get<2>(info.param));
}

INSTANTIATE_TEST_SUITE_P(RanksAndSizes, AllGatherSweepTest,
                         ::testing::Combine(::testing::Values(over_local), ::testing::Range(1, 9),
                                            ::testing::Values(sizes_kind::equal, sizes_kind::ragged,
                                                              sizes_kind::zeros,
                                                              sizes_kind::large)),
                         gather_name);
// Over shared memory on fewer rank counts (a group of one sends nothing).
INSTANTIATE_TEST_SUITE_P(ShmRanksAndSizes, AllGatherSweepTest,
                         ::testing::Combine(::testing::Values(transport_kind::shm),
                                            ::testing::Values(2, 3, 5, 8),
                                            ::testing::Values(sizes_kind::equal, sizes_kind::ragged,
                                                              sizes_kind::zeros,
                                                              sizes_kind::large)),
                         gather_name);

TEST(AllGatherTest, MismatchedArgumentsAreRejected) {
  auto group = local::make_group(2);
  std::vector<std::byte> in(3);
  std::vector<std::byte> out(5);
  auto err = ring_all_gather{group[0], in, out, {3}}.run();
  EXPECT_EQ(code_of(err), errc::invalid_argument) << text_of(err);
  EXPECT_TRUE(mentions(err, "1 sizes for 2 ranks")) << text_of(err);
  err = ring_all_gather{group[0], in, out, {2, 2}}.run();
  EXPECT_TRUE(mentions(err, "the input has 3 bytes")) << text_of(err);
  err = ring_all_gather{group[0], in, out, {3, 3}}.run();
  EXPECT_TRUE(mentions(err, "the sizes add up to 6")) << text_of(err);
  err = ring_all_gather{group[1], const_bytes{out.data(), 3}, out, {2, 3}}.run();
  EXPECT_TRUE(mentions(err, "overlaps")) << text_of(err);
}

// -- broadcast ----------------------------------------------------------------------------------

enum class cast { tree, chain, dispatcher };

const char* to_string(cast c) {
  switch (c) {
  case cast::tree:
    return "Binomial";
  case cast::chain:
    return "Chain";
  case cast::dispatcher:
    return "Dispatcher";
  }
  return "?";
}

void PrintTo(cast value, std::ostream* out) {
  *out << to_string(value);
}

caf::error run_broadcast(cast c, const context_ptr& ctx, mutable_bytes data, int root,
                         const algorithm_options& opts) {
  switch (c) {
  case cast::tree:
    return binomial_broadcast{ctx, data, root, opts}.run();
  case cast::chain:
    return chain_broadcast{ctx, data, root, opts}.run();
  case cast::dispatcher:
    return broadcast(ctx, data, root, opts);
  }
  return {};
}

class BroadcastSweepTest
    : public ::testing::TestWithParam<std::tuple<transport_kind, cast, int, size_t>> {};

TEST_P(BroadcastSweepTest, EveryRankGetsTheRootsBytesFromEveryRoot) {
  const auto [kind, c, n, size] = GetParam();
  if (auto why = unavailable(kind); !why.empty())
    GTEST_SKIP() << why;
  algorithm_options opts;
  opts.tag = 9;
  opts.chunk_bytes = size < large_count ? 100 : size_t{256} << 10;
  opts.tree_max_bytes = 1001; // the dispatcher: tree up to 1001 bytes, chain above
  auto group = make_group_over(kind, n);
  for (int root = 0; root < n; ++root) {
    SCOPED_TRACE("root " + std::to_string(root));
    std::vector<std::vector<std::byte>> data(static_cast<size_t>(n));
    for (int r = 0; r < n; ++r)
      data[static_cast<size_t>(r)] =
          r == root ? contribution(root, size) : std::vector<std::byte>(size, std::byte{0xee});
    const auto expected = data[static_cast<size_t>(root)];
    auto errors = on_ranks(group, [&](int r) {
      return run_broadcast(c, group[static_cast<size_t>(r)], data[static_cast<size_t>(r)], root,
                           opts);
    });
    for (int r = 0; r < n; ++r) {
      ASSERT_FALSE(errors[static_cast<size_t>(r)])
          << "rank " << r << ": " << text_of(errors[static_cast<size_t>(r)]);
      EXPECT_TRUE(same_bytes(data[static_cast<size_t>(r)], expected)) << "rank " << r;
    }
  }
}

std::string broadcast_name(
    const ::testing::TestParamInfo<std::tuple<transport_kind, cast, int, size_t>>& info) {
  return std::string{to_string(std::get<1>(info.param))} + std::to_string(std::get<2>(info.param)) +
         "Ranks" + std::to_string(std::get<3>(info.param)) + "Bytes";
}

INSTANTIATE_TEST_SUITE_P(
    RanksAndSizes, BroadcastSweepTest,
    ::testing::Combine(::testing::Values(over_local),
                       ::testing::Values(cast::tree, cast::chain, cast::dispatcher),
                       ::testing::Range(1, 9), ::testing::Values(0, 1, 7, 1001, large_count)),
    broadcast_name);
// Over shared memory on fewer rank counts and sizes: empty, small, chunked (1001 bytes in 100-byte
// chunks) and large (256 KiB chunks through 64 KiB rings).
INSTANTIATE_TEST_SUITE_P(
    ShmRanksAndSizes, BroadcastSweepTest,
    ::testing::Combine(::testing::Values(transport_kind::shm),
                       ::testing::Values(cast::tree, cast::chain, cast::dispatcher),
                       ::testing::Values(2, 3, 5, 8), ::testing::Values(0, 7, 1001, large_count)),
    broadcast_name);

TEST(BroadcastTest, ARootOutOfRangeIsRejected) {
  auto group = local::make_group(3);
  std::vector<std::byte> data(4);
  for (int root : {-1, 3}) {
    auto err = binomial_broadcast{group[0], data, root}.run();
    EXPECT_EQ(code_of(err), errc::invalid_argument) << text_of(err);
    EXPECT_TRUE(mentions(err, "root " + std::to_string(root) + " is out of range"));
    err = chain_broadcast{group[0], data, root}.run();
    EXPECT_EQ(code_of(err), errc::invalid_argument) << text_of(err);
  }
}

// -- concurrency and failures -------------------------------------------------------------------

TEST(CollectiveConcurrencyTest, OperationsWithDistinctTagsRunConcurrentlyOnOneGroup) {
  constexpr int n = 4;
  constexpr size_t count = 20011;
  auto group = local::make_group(n);
  for (int iteration = 0; iteration < 5; ++iteration) {
    // Four collectives per rank at once, each on its own thread and tag.
    std::vector<std::vector<int32_t>> ring(n, std::vector<int32_t>(count));
    std::vector<std::vector<double>> direct(n, std::vector<double>(3));
    std::vector<std::vector<std::byte>> gathered(n);
    std::vector<std::vector<std::byte>> cast_data(n, std::vector<std::byte>(5000));
    for (int r = 0; r < n; ++r) {
      const auto ur = static_cast<size_t>(r);
      for (size_t i = 0; i < count; ++i)
        ring[ur][i] = static_cast<int32_t>(i) * (r + 1);
      direct[ur] = {1.0 * r, 2.0 * r, 3.0 * r};
      if (r == 2)
        cast_data[ur] = contribution(2, 5000);
    }
    std::vector<std::vector<std::byte>> inputs;
    for (int r = 0; r < n; ++r)
      inputs.push_back(contribution(r, static_cast<size_t>(r) * 50));
    auto errors = on_ranks(group, [&](int r) {
      const auto ur = static_cast<size_t>(r);
      const auto& ctx = group[ur];
      caf::error e[4];
      algorithm_options o1;
      o1.tag = 1;
      o1.chunk_bytes = 512;
      algorithm_options o2;
      o2.tag = 2;
      algorithm_options o3;
      o3.tag = 3;
      o3.chunk_bytes = 64;
      algorithm_options o4;
      o4.tag = 4;
      o4.chunk_bytes = 700;
      std::thread t1([&] {
        e[0] = ring_all_reduce{ctx, ring[ur].data(), count, dtype::int32, reduce_op::sum, o1}.run();
      });
      std::thread t2([&] {
        e[1] =
            direct_all_reduce{ctx, direct[ur].data(), 3, dtype::float64, reduce_op::max, o2}.run();
      });
      std::thread t3([&] { e[2] = all_gather(ctx, inputs[ur], gathered[ur], nullptr, o3); });
      e[3] = chain_broadcast{ctx, cast_data[ur], 2, o4}.run();
      t1.join();
      t2.join();
      t3.join();
      for (auto& err : e)
        if (err)
          return err;
      return caf::error{};
    });
    std::vector<std::byte> all_inputs;
    for (auto& in : inputs)
      all_inputs.insert(all_inputs.end(), in.begin(), in.end());
    for (int r = 0; r < n; ++r) {
      const auto ur = static_cast<size_t>(r);
      ASSERT_FALSE(errors[ur]) << text_of(errors[ur]);
      for (size_t i = 0; i < count; i += 997)
        ASSERT_EQ(ring[ur][i], static_cast<int32_t>(i) * (1 + 2 + 3 + 4));
      EXPECT_EQ(direct[ur], (std::vector<double>{3.0, 6.0, 9.0}));
      EXPECT_TRUE(same_bytes(gathered[ur], all_inputs));
      EXPECT_TRUE(same_bytes(cast_data[ur], contribution(2, 5000)));
    }
  }
}

/// The collectives that the failure tests run, by name.
enum class which { ring, direct, doubling, gather, chain, tree };

const char* to_string(which w) {
  switch (w) {
  case which::ring:
    return "ring_all_reduce";
  case which::direct:
    return "direct_all_reduce";
  case which::doubling:
    return "recursive_doubling_all_reduce";
  case which::gather:
    return "ring_all_gather";
  case which::chain:
    return "chain_broadcast";
  case which::tree:
    return "binomial_broadcast";
  }
  return "?";
}

void PrintTo(which value, std::ostream* out) {
  *out << to_string(value);
}

/// One rank's part in a failure test: its buffers and its algorithm object, built up front so
/// that they outlive the run (the contexts are aborted before they are released).
struct participant {
  std::vector<float> values = std::vector<float>(4099, 1.0f);
  std::vector<std::byte> gathered;
  std::function<caf::error()> run;
};

std::unique_ptr<participant> make_participant(which w, const context_ptr& ctx,
                                              const algorithm_options& opts) {
  auto p = std::make_unique<participant>();
  auto* values = p->values.data();
  const size_t count = p->values.size();
  switch (w) {
  case which::ring:
    p->run = [alg = std::make_shared<ring_all_reduce>(ctx, values, count, dtype::float32,
                                                      reduce_op::sum, opts)] {
      return alg->run();
    };
    break;
  case which::direct:
    p->run = [alg = std::make_shared<direct_all_reduce>(ctx, values, count, dtype::float32,
                                                        reduce_op::sum, opts)] {
      return alg->run();
    };
    break;
  case which::doubling:
    p->run = [alg = std::make_shared<recursive_doubling_all_reduce>(
                  ctx, values, count, dtype::float32, reduce_op::sum, opts)] {
      return alg->run();
    };
    break;
  case which::gather: {
    const size_t bytes = count * sizeof(float);
    p->gathered.resize(bytes * static_cast<size_t>(ctx->size()));
    p->run = [alg = std::make_shared<ring_all_gather>(
                  ctx, const_bytes{reinterpret_cast<const std::byte*>(values), bytes}, p->gathered,
                  std::vector<size_t>(static_cast<size_t>(ctx->size()), bytes), opts)] {
      return alg->run();
    };
    break;
  }
  case which::chain:
  case which::tree: {
    auto data = mutable_bytes{reinterpret_cast<std::byte*>(values), count * sizeof(float)};
    if (w == which::chain)
      p->run = [alg = std::make_shared<chain_broadcast>(ctx, data, 0, opts)] {
        return alg->run();
      };
    else
      p->run = [alg = std::make_shared<binomial_broadcast>(ctx, data, 0, opts)] {
        return alg->run();
      };
    break;
  }
  }
  return p;
}

class CollectiveFailureTest : public ::testing::TestWithParam<which> {};

TEST_P(CollectiveFailureTest, ASilentRankMakesTheOthersTimeOutNamingTheStepAndThePeer) {
  const which w = GetParam();
  constexpr int n = 4;
  constexpr int silent = 2;
  constexpr auto timeout = 300ms;
  auto group = local::make_group(n);
  algorithm_options opts;
  opts.timeout = timeout;
  opts.tag = 77;
  // Each rank reports its own failure (no abort cascading to the peers).
  opts.abort_on_failure = false;
  std::vector<std::unique_ptr<participant>> parts;
  for (int r = 0; r < n; ++r)
    parts.push_back(make_participant(w, group[static_cast<size_t>(r)], opts));
  std::vector<clock::duration> took(n);
  auto errors = on_ranks(group, [&](int r) {
    if (r == silent)
      return caf::error{};
    const auto start = clock::now();
    auto err = parts[static_cast<size_t>(r)]->run();
    took[static_cast<size_t>(r)] = clock::now() - start;
    return err;
  });
  abort_all(group); // before the buffers and algorithm objects go
  int waited_on_silent = 0;
  for (int r = 0; r < n; ++r) {
    if (r == silent)
      continue;
    const auto& err = errors[static_cast<size_t>(r)];
    if ((w == which::tree || w == which::chain) && !err)
      continue; // ranks that do not depend on the silent rank finish
    EXPECT_EQ(code_of(err), errc::collective_timeout) << "rank " << r << ": " << text_of(err);
    EXPECT_GE(took[static_cast<size_t>(r)], timeout) << "rank " << r;
    EXPECT_LT(took[static_cast<size_t>(r)], timeout + consort::test::scaled(3s)) << "rank " << r;
    EXPECT_TRUE(
        mentions(err, std::string{to_string(w)} + " (rank " + std::to_string(r) + " of 4, tag 77)"))
        << text_of(err);
    EXPECT_TRUE(mentions(err, " rank ")) << text_of(err);
    EXPECT_TRUE(mentions(err, "did not complete before its deadline")) << text_of(err);
    if (mentions(err, "from rank 2 failed"))
      ++waited_on_silent;
  }
  EXPECT_GE(waited_on_silent, 1) << "no rank named the silent rank";
  if (w == which::ring) {
    // Rank 3 receives from rank 2 in reduce-scatter step 1; the others wait for their left
    // neighbours, which are stuck.
    EXPECT_TRUE(mentions(errors[3], "reduce-scatter step 1 of 3, chunk 1 of 1: receive from "
                                    "rank 2 failed"))
        << text_of(errors[3]);
  }
}

TEST_P(CollectiveFailureTest, ASilentRankFailsEveryOtherRankByTheDeadlineWhenAbortingOnFailure) {
  const which w = GetParam();
  constexpr int n = 4;
  constexpr int silent = 2;
  constexpr auto timeout = 300ms;
  auto group = local::make_group(n);
  algorithm_options opts;
  opts.timeout = timeout;
  std::vector<std::unique_ptr<participant>> parts;
  for (int r = 0; r < n; ++r)
    parts.push_back(make_participant(w, group[static_cast<size_t>(r)], opts));
  std::vector<clock::duration> took(n);
  auto errors = on_ranks(group, [&](int r) {
    if (r == silent)
      return caf::error{};
    const auto start = clock::now();
    auto err = parts[static_cast<size_t>(r)]->run();
    took[static_cast<size_t>(r)] = clock::now() - start;
    return err;
  });
  for (int r = 0; r < n; ++r) {
    if (r == silent)
      continue;
    const auto& err = errors[static_cast<size_t>(r)];
    if ((w == which::tree || w == which::chain) && !err)
      continue;
    const auto code = code_of(err);
    EXPECT_TRUE(code == errc::collective_timeout || code == errc::peer_lost)
        << "rank " << r << ": " << text_of(err);
    EXPECT_LT(took[static_cast<size_t>(r)], timeout + consort::test::scaled(3s)) << "rank " << r;
  }
  abort_all(group);
}

TEST_P(CollectiveFailureTest, AnAbortedRankFailsTheOthersWithPeerLostPromptly) {
  const which w = GetParam();
  constexpr int n = 4;
  constexpr int lost = 1;
  auto group = local::make_group(n);
  algorithm_options opts;
  opts.timeout = 30s;
  std::vector<std::unique_ptr<participant>> parts;
  for (int r = 0; r < n; ++r)
    parts.push_back(make_participant(w, group[static_cast<size_t>(r)], opts));
  std::vector<clock::duration> took(n);
  auto errors = on_ranks(group, [&](int r) {
    const auto& ctx = group[static_cast<size_t>(r)];
    // A first collective brings every rank to the same point, then rank 1 dies.
    float one = 1;
    algorithm_options sync;
    sync.tag = 1000;
    if (auto err = all_reduce(ctx, &one, 1, dtype::float32, reduce_op::sum, sync))
      return err;
    if (r == lost) {
      ctx->abort("worker 1 was killed");
      return caf::error{};
    }
    const auto start = clock::now();
    auto err = parts[static_cast<size_t>(r)]->run();
    took[static_cast<size_t>(r)] = clock::now() - start;
    return err;
  });
  for (int r = 0; r < n; ++r) {
    if (r == lost)
      continue;
    const auto& err = errors[static_cast<size_t>(r)];
    // A tree broadcast from rank 0 completes where rank 1's subtree is not involved.
    if (w == which::tree && !err)
      continue;
    EXPECT_EQ(code_of(err), errc::peer_lost) << "rank " << r << ": " << text_of(err);
    EXPECT_TRUE(mentions(err, "worker 1 was killed")) << text_of(err);
    EXPECT_TRUE(mentions(err, to_string(w))) << text_of(err);
    EXPECT_LT(took[static_cast<size_t>(r)], consort::test::scaled(5s)) << "rank " << r;
  }
  abort_all(group);
}

INSTANTIATE_TEST_SUITE_P(Collectives, CollectiveFailureTest,
                         ::testing::Values(which::ring, which::direct, which::doubling,
                                           which::gather, which::chain, which::tree),
                         [](const auto& info) {
                           std::string name = to_string(info.param);
                           std::string out;
                           bool upper = true;
                           for (char ch : name) {
                             if (ch == '_') {
                               upper = true;
                               continue;
                             }
                             out += upper ? static_cast<char>(std::toupper(ch)) : ch;
                             upper = false;
                           }
                           return out;
                         });

} // namespace
} // namespace consort::transport
