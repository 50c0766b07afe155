// The checks and the arithmetic of one collective call (actors/call_checks.hpp), without an actor
// system: what the collective actor and the cross-worker paths decide, call by call.

#include "actors/call_checks.hpp"

#include <consort/error.hpp>

#include <gtest/gtest.h>

#include <cstdint>
#include <string>
#include <vector>

namespace consort::detail {
namespace {

collective_call call_of(int replica, collective_kind kind, nest value) {
  collective_call call;
  call.step = 4;
  call.seq = 2;
  call.replica = replica;
  call.request.kind = kind;
  call.request.value = std::move(value);
  return call;
}

bool contains(const std::string& text, const std::string& part) {
  return text.find(part) != std::string::npos;
}

TEST(CallChecksTest, ASignatureDescribesTheCallAndItsSlot) {
  auto call = call_of(0, collective_kind::all_gather, tensor::from<float>({1, 2}, {2}));
  call.request.axis = -1;
  auto leaves = flatten(call.request.value);
  auto sig = signature_from(call, leaves);
  EXPECT_EQ(describe_slot(sig, 4, 2), "all_gather(axis=-1) #2 of step 4");
  ASSERT_EQ(sig.dtypes.size(), 1u);
  EXPECT_EQ(sig.dtypes[0], dtype::float32);
  EXPECT_EQ(sig.shapes[0], (shape_t{2}));
  EXPECT_EQ(join_ids({0, 2}), "[0, 2]");
  EXPECT_EQ(join_ids({}), "[]");
}

TEST(CallChecksTest, EveryFieldOfTheSignatureIsCheckedAgainstTheFirstArrival) {
  auto first = call_of(0, collective_kind::all_reduce, tensor::from<float>({1, 2}, {2}));
  auto sig = signature_from(first, flatten(first.request.value));
  auto against = [&](collective_call c) {
    return check_against(sig, c, 0, flatten(c.request.value));
  };
  EXPECT_EQ(against(call_of(1, collective_kind::all_reduce, tensor::from<float>({3, 4}, {2}))), "");
  auto kind = against(call_of(1, collective_kind::broadcast, tensor::from<float>({3, 4}, {2})));
  EXPECT_TRUE(contains(kind, "replica 1 called broadcast(root=0) but replica 0 called "
                             "all_reduce(SUM)"))
      << kind;
  auto op_call = call_of(1, collective_kind::all_reduce, tensor::from<float>({3, 4}, {2}));
  op_call.request.op = reduce_op::max;
  EXPECT_TRUE(contains(against(op_call), "all_reduce(MAX)")) << against(op_call);
  auto dt = against(call_of(1, collective_kind::all_reduce, tensor::from<double>({3, 4}, {2})));
  EXPECT_TRUE(contains(dt, "leaf 0: replica 1 passed float64 but replica 0 passed float32")) << dt;
  auto shape = against(call_of(1, collective_kind::all_reduce, tensor::from<float>({3}, {1})));
  EXPECT_TRUE(contains(shape, "shape [1] but replica 0 passed [2]")) << shape;
  auto structure = against(
      call_of(1, collective_kind::all_reduce,
              nest::list({tensor::from<float>({3, 4}, {2}), tensor::from<float>({3, 4}, {2})})));
  EXPECT_TRUE(contains(structure, "replica 1 passed structure")) << structure;
}

TEST(CallChecksTest, AnAllGatherMayDifferAlongItsAxisOnly) {
  auto first = call_of(0, collective_kind::all_gather, tensor::zeros(dtype::float32, {2, 3}));
  auto sig = signature_from(first, flatten(first.request.value));
  sig.axis = 0;
  auto ragged = call_of(1, collective_kind::all_gather, tensor::zeros(dtype::float32, {5, 3}));
  EXPECT_EQ(check_against(sig, ragged, 0, flatten(ragged.request.value)), "");
  auto wrong = call_of(1, collective_kind::all_gather, tensor::zeros(dtype::float32, {2, 4}));
  auto text = check_against(sig, wrong, 0, flatten(wrong.request.value));
  EXPECT_TRUE(contains(text, "needs the same rank and the same extents on every other axis"))
      << text;
}

TEST(CallChecksTest, TheArgumentsOfACallAreCheckedOnTheirOwn) {
  int64_t axis = 0;
  auto bcast = call_of(0, collective_kind::broadcast, tensor::scalar<float>(1));
  bcast.request.root = 3;
  auto text = check_arguments(bcast, flatten(bcast.request.value), 3, &axis);
  EXPECT_TRUE(contains(text, "root replica 3 is out of range; expected 0 <= root < 3")) << text;
  bcast.request.root = 2;
  EXPECT_EQ(check_arguments(bcast, flatten(bcast.request.value), 3, &axis), "");

  auto scalar = call_of(0, collective_kind::all_gather, tensor::scalar<float>(1));
  text = check_arguments(scalar, flatten(scalar.request.value), 2, &axis);
  EXPECT_TRUE(contains(text, "is a scalar (rank 0)")) << text;

  auto gather = call_of(0, collective_kind::all_gather, tensor::zeros(dtype::float32, {2, 3}));
  gather.request.axis = -1;
  EXPECT_EQ(check_arguments(gather, flatten(gather.request.value), 2, &axis), "");
  EXPECT_EQ(axis, 1);
  gather.request.axis = 2;
  text = check_arguments(gather, flatten(gather.request.value), 2, &axis);
  EXPECT_TRUE(contains(text, "axis 2 is out of range for leaf 0 of rank 2")) << text;
}

TEST(CallChecksTest, ComputeReducesGathersAndBroadcastsInReplicaOrder) {
  call_signature sig;
  std::vector<std::vector<tensor>> leaves{{tensor::from<float>({1, 2}, {2})},
                                          {tensor::from<float>({10, 20}, {2})}};
  nest structure = leaves[0][0];
  sig.kind = collective_kind::all_reduce;
  EXPECT_EQ(compute(sig, leaves, structure).as_tensor().to_vector<float>(),
            (std::vector<float>{11, 22}));
  sig.kind = collective_kind::all_gather;
  sig.axis = 0;
  EXPECT_EQ(compute(sig, leaves, structure).as_tensor().to_vector<float>(),
            (std::vector<float>{1, 2, 10, 20}));
  sig.kind = collective_kind::broadcast;
  sig.root = 1;
  EXPECT_EQ(compute(sig, leaves, structure).as_tensor().to_vector<float>(),
            (std::vector<float>{10, 20}));
}

TEST(CallChecksTest, TheCrossWorkerSignatureHidesTheGatherAxisExtent) {
  auto a = call_of(0, collective_kind::all_gather, tensor::zeros(dtype::float32, {2, 3}));
  auto b = call_of(0, collective_kind::all_gather, tensor::zeros(dtype::float32, {5, 3}));
  auto sa = signature_from(a, flatten(a.request.value));
  auto sb = signature_from(b, flatten(b.request.value));
  EXPECT_EQ(signature_of(sa), signature_of(sb));
  auto c = call_of(0, collective_kind::all_reduce, tensor::zeros(dtype::float32, {2, 3}));
  auto d = call_of(0, collective_kind::all_reduce, tensor::zeros(dtype::float32, {5, 3}));
  EXPECT_NE(signature_of(signature_from(c, flatten(c.request.value))),
            signature_of(signature_from(d, flatten(d.request.value))));
}

TEST(CallChecksTest, TheSignatureTextOfEveryFieldIsExactAlsoAfterTheLastOneIsReused) {
  // signature_of keeps the calling thread's last text; each call below differs from the one
  // before it in one field, and the first comes back at the end.
  auto base = call_of(0, collective_kind::all_reduce, tensor::zeros(dtype::float32, {2, 3}));
  auto sig = [](const collective_call& c) {
    return signature_from(c, flatten(c.request.value));
  };
  const auto first = signature_of(sig(base));
  EXPECT_EQ(first, "all_reduce(SUM) of T with float32[2, 3]");
  EXPECT_EQ(signature_of(sig(base)), first);
  auto op = base;
  op.request.op = reduce_op::max;
  EXPECT_EQ(signature_of(sig(op)), "all_reduce(MAX) of T with float32[2, 3]");
  auto type = call_of(0, collective_kind::all_reduce, tensor::zeros(dtype::int32, {2, 3}));
  EXPECT_EQ(signature_of(sig(type)), "all_reduce(SUM) of T with int32[2, 3]");
  auto shape = call_of(0, collective_kind::all_reduce, tensor::zeros(dtype::float32, {3, 2}));
  EXPECT_EQ(signature_of(sig(shape)), "all_reduce(SUM) of T with float32[3, 2]");
  auto kind = call_of(0, collective_kind::broadcast, tensor::zeros(dtype::float32, {2, 3}));
  kind.request.root = 1;
  EXPECT_EQ(signature_of(sig(kind)), "broadcast(root=1) of T with float32[2, 3]");
  auto structure =
      call_of(0, collective_kind::all_reduce, nest::list({tensor::zeros(dtype::float32, {2, 3})}));
  EXPECT_NE(signature_of(sig(structure)), first);
  EXPECT_EQ(signature_of(sig(base)), first);
}

TEST(CallChecksTest, TheSignatureHashIsTheTextsFnv1aAlsoAfterTheLastOneIsReused) {
  // signature_hash keeps the calling thread's last signature and hash: signatures that alternate,
  // each differing from the one before it in one field, each hash to FNV-1a of their own text.
  auto fnv1a = [](const std::string& text) {
    uint64_t h = 1469598103934665603ull;
    for (unsigned char c : text) {
      h ^= c;
      h *= 1099511628211ull;
    }
    return h;
  };
  auto sig = [](const collective_call& c) {
    return signature_from(c, flatten(c.request.value));
  };
  auto base = call_of(0, collective_kind::all_reduce, tensor::zeros(dtype::float32, {2, 3}));
  auto op = base;
  op.request.op = reduce_op::max;
  auto shape = call_of(0, collective_kind::all_reduce, tensor::zeros(dtype::float32, {3, 2}));
  auto kind = call_of(0, collective_kind::broadcast, tensor::zeros(dtype::float32, {2, 3}));
  kind.request.root = 1;
  auto structure =
      call_of(0, collective_kind::all_reduce, nest::list({tensor::zeros(dtype::float32, {2, 3})}));
  std::vector<uint64_t> seen;
  for (const auto* c : {&base, &base, &op, &shape, &kind, &structure, &base, &op}) {
    const auto s = sig(*c);
    EXPECT_EQ(signature_hash(s), fnv1a(signature_of(s))) << signature_of(s);
    seen.push_back(signature_hash(s));
  }
  EXPECT_EQ(seen[0], seen[6]);
  EXPECT_NE(seen[0], seen[2]);
  EXPECT_NE(seen[2], seen[3]);
  EXPECT_NE(seen[3], seen[4]);
  EXPECT_NE(seen[4], seen[5]);
}

TEST(CallChecksTest, AMeanTravelsAsASumOfFloatsOrAFloat64SumOfIntegers) {
  auto f = mean_partial({tensor::from<float>({1, 2}, {2}), tensor::from<float>({3, 4}, {2})});
  EXPECT_EQ(f.dtype(), dtype::float32);
  EXPECT_EQ(f.to_vector<float>(), (std::vector<float>{4, 6}));
  auto i = mean_partial({tensor::from<int32_t>({1, 2}, {2}), tensor::from<int32_t>({3, 4}, {2})});
  EXPECT_EQ(i.dtype(), dtype::float64);
  EXPECT_EQ(i.to_vector<double>(), (std::vector<double>{4, 6}));
}

TEST(CallChecksTest, ErrorOfKeepsAConsortCodeAndCallsAnythingElseABadArgument) {
  auto mine = error_of(error(errc::collective_timeout, "late"));
  EXPECT_EQ(to_consort_error(mine, "").code(), errc::collective_timeout);
  auto other = error_of(std::runtime_error("odd"));
  EXPECT_EQ(to_consort_error(other, "").code(), errc::invalid_argument);
  EXPECT_TRUE(contains(to_consort_error(other, "").what(), "odd"));
}

} // namespace
} // namespace consort::detail
