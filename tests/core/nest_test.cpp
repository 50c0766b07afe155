#include "support/expect_error.hpp"

#include <consort/nest.hpp>

#include <gtest/gtest.h>

#include <string>
#include <vector>

using consort::errc;
using consort::nest;
using consort::tensor;
using consort::test::fails_with;

namespace {

tensor f32(std::vector<float> values) {
  return tensor::from<float>(values);
}

tensor i32(int32_t value) {
  return tensor::scalar<int32_t>(value);
}

} // namespace

TEST(NestTest, DefaultIsAnEmptyList) {
  nest n;
  EXPECT_TRUE(n.is_list());
  EXPECT_EQ(n.size(), 0u);
  EXPECT_EQ(n.num_leaves(), 0u);
  EXPECT_EQ(n.to_string(), "[]");
}

TEST(NestTest, ObserversTellTheKind) {
  nest leaf = f32({1});
  auto list = nest::list({f32({1}), f32({2})});
  auto dict = nest::dict({{"a", f32({1})}});
  EXPECT_TRUE(leaf.is_tensor());
  EXPECT_FALSE(leaf.is_list());
  EXPECT_TRUE(list.is_list());
  EXPECT_TRUE(dict.is_dict());
  EXPECT_EQ(leaf.size(), 1u);
  EXPECT_EQ(list.size(), 2u);
  EXPECT_EQ(dict.size(), 1u);
  EXPECT_EQ(leaf.as_tensor(), f32({1}));
  EXPECT_EQ(list.as_list().size(), 2u);
  EXPECT_EQ(dict.as_dict().count("a"), 1u);
}

TEST(NestTest, AccessorsOfTheWrongKindSayWhatTheNestIs) {
  auto list = nest::list({f32({1}), f32({2})});
  EXPECT_TRUE(fails_with([&] { list.as_tensor(); }, errc::structure_mismatch,
                         {"expected a tensor, got a list of 2 items"}));
  EXPECT_TRUE(fails_with([&] { list.as_dict(); }, errc::structure_mismatch,
                         {"expected a dict, got a list of 2 items"}));
  nest leaf = f32({1});
  EXPECT_TRUE(fails_with([&] { leaf.as_list(); }, errc::structure_mismatch,
                         {"expected a list, got a tensor"}));
  auto dict = nest::dict({{"x", leaf}});
  EXPECT_TRUE(fails_with([&] { dict.as_tensor(); }, errc::structure_mismatch,
                         {"got a dict with keys [\"x\"]"}));
}

TEST(NestTest, IndexingChecksKindAndRange) {
  auto list = nest::list({f32({1}), f32({2})});
  EXPECT_EQ(list[1].as_tensor(), f32({2}));
  EXPECT_TRUE(fails_with([&] { list[2]; }, errc::out_of_range, {"index 2", "list of 2 items"}));
  EXPECT_TRUE(fails_with([&] { list["a"]; }, errc::structure_mismatch, {"[\"a\"]", "dict"}));
  auto dict = nest::dict({{"a", f32({1})}});
  EXPECT_EQ(dict["a"].as_tensor(), f32({1}));
  EXPECT_EQ(dict[std::string{"a"}].as_tensor(), f32({1}));
  EXPECT_TRUE(fails_with([&] { dict["b"]; }, errc::out_of_range, {"\"b\"", "[\"a\"]"}));
  EXPECT_TRUE(fails_with([&] { dict[size_t{0}]; }, errc::structure_mismatch, {"[0]", "list"}));
}

TEST(NestTest, FlattenFollowsTfNestOrder) {
  // Dicts by sorted key, lists in order, depth first.
  auto n = nest::dict({{"b", i32(3)}, {"a", nest::list({i32(1), nest::dict({{"z", i32(2)}})})}});
  auto leaves = flatten(n);
  ASSERT_EQ(leaves.size(), 3u);
  EXPECT_EQ(leaves[0].item<int32_t>(), 1);
  EXPECT_EQ(leaves[1].item<int32_t>(), 2);
  EXPECT_EQ(leaves[2].item<int32_t>(), 3);
  EXPECT_EQ(n.num_leaves(), 3u);
  EXPECT_EQ(flatten(nest{i32(4)}).size(), 1u);
}

TEST(NestTest, FlattenSharesTensorStorage) {
  auto t = f32({1, 2});
  auto leaves = flatten(nest::list({t}));
  EXPECT_TRUE(leaves[0].shares_storage_with(t));
}

TEST(NestTest, PackAsRebuildsTheStructureWithNewLeaves) {
  auto n = nest::dict({{"b", i32(0)}, {"a", nest::list({i32(0), i32(0)})}});
  auto packed = pack_as(n, {i32(1), i32(2), i32(3)});
  EXPECT_EQ(packed["a"][0].as_tensor().item<int32_t>(), 1);
  EXPECT_EQ(packed["a"][1].as_tensor().item<int32_t>(), 2);
  EXPECT_EQ(packed["b"].as_tensor().item<int32_t>(), 3);
  EXPECT_EQ(pack_as(nest{i32(0)}, {i32(9)}).as_tensor().item<int32_t>(), 9);
}

TEST(NestTest, PackAsRejectsAWrongLeafCount) {
  auto n = nest::list({i32(0), i32(0), i32(0)});
  EXPECT_TRUE(fails_with([&] { pack_as(n, {i32(1)}); }, errc::structure_mismatch,
                         {"3 leaves", "1 tensors"}));
}

TEST(NestTest, MapStructureKeepsTheStructure) {
  auto n = nest::dict({{"a", i32(1)}, {"b", nest::list({i32(2)})}});
  auto doubled = map_structure(n, [](const tensor& t) { return i32(t.item<int32_t>() * 2); });
  EXPECT_EQ(compare_structure(n, doubled), "");
  EXPECT_EQ(doubled["b"][0].as_tensor().item<int32_t>(), 4);
}

TEST(NestTest, CompareStructureIgnoresLeafDtypesAndShapes) {
  auto a = nest::dict({{"x", f32({1, 2})}, {"y", nest::list({i32(1)})}});
  auto b = nest::dict({{"x", i32(5)}, {"y", nest::list({f32({})})}});
  EXPECT_EQ(compare_structure(a, b), "");
  EXPECT_NO_THROW(assert_same_structure(a, b));
}

TEST(NestTest, CompareStructureGivesThePathOfTheFirstDifference) {
  auto a = nest::dict({{"a", i32(0)}, {"b", nest::list({i32(0), i32(0)})}});
  auto b = nest::dict({{"a", i32(0)}, {"b", nest::list({i32(0), nest::list({i32(0), i32(0)})})}});
  EXPECT_EQ(compare_structure(a, b), "at [\"b\"][1]: expected a tensor, got a list of 2 items");
}

TEST(NestTest, CompareStructureReportsListLengthsKeysAndTopLevelKinds) {
  EXPECT_EQ(compare_structure(nest::list({i32(0)}), nest::list({i32(0), i32(1)})),
            "at the top level: expected a list of 1 item, got a list of 2 items");
  EXPECT_EQ(compare_structure(nest::dict({{"a", i32(0)}, {"b", i32(0)}}),
                              nest::dict({{"a", i32(0)}, {"c", i32(0)}})),
            "at the top level: expected a dict with keys [\"a\", \"b\"], got a dict with keys "
            "[\"a\", \"c\"] (missing \"b\"; unexpected \"c\")");
  EXPECT_EQ(compare_structure(nest{i32(0)}, nest::dict(nest::dict_type{})),
            "at the top level: expected a tensor, got a dict with keys []");
  EXPECT_EQ(compare_structure(nest::list({nest::list({i32(0)})}), nest::list({i32(0)})),
            "at [0]: expected a list of 1 item, got a tensor");
}

TEST(NestTest, AssertSameStructureThrowsTheDescription) {
  auto a = nest::list({i32(0)});
  auto b = nest::list({i32(0), i32(0)});
  EXPECT_TRUE(fails_with([&] { assert_same_structure(a, b); }, errc::structure_mismatch,
                         {"expected a list of 1 item, got a list of 2 items", "[T]", "[T, T]"}));
}

TEST(NestTest, ToStringAndStructureString) {
  auto n = nest::dict({{"a", f32({1, 2})}, {"b", nest::list({i32(1), i32(2)})}});
  EXPECT_EQ(n.to_string(), "{\"a\": float32[2], \"b\": [int32[], int32[]]}");
  EXPECT_EQ(n.structure_string(), "{\"a\": T, \"b\": [T, T]}");
  EXPECT_EQ(nest{tensor{}}.to_string(), "invalid");
}

TEST(NestTest, EqualityComparesStructureAndValues) {
  auto a = nest::dict({{"a", f32({1, 2})}, {"b", nest::list({i32(1)})}});
  EXPECT_EQ(a, (nest::dict({{"a", f32({1, 2})}, {"b", nest::list({i32(1)})}})));
  EXPECT_NE(a, (nest::dict({{"a", f32({1, 3})}, {"b", nest::list({i32(1)})}})));
  EXPECT_NE(a, (nest::dict({{"a", f32({1, 2})}, {"c", nest::list({i32(1)})}})));
  EXPECT_NE(nest::list({i32(1)}), nest{i32(1)});
}
