#include "fake_env.hpp"

#include <consort/cluster.hpp>

#include <gtest/gtest.h>

#include <sstream>
#include <string>
#include <vector>

using consort::cluster_spec;
using consort::errc;
using consort::task_id;
using consort::test::fails_with;

TEST(ClusterSpecTest, DefaultConstructedSpecIsEmpty) {
  cluster_spec spec;
  EXPECT_TRUE(spec.empty());
  EXPECT_TRUE(spec.jobs().empty());
  EXPECT_EQ(spec.to_json(), "{}");
}

TEST(ClusterSpecTest, DenseJobsNumberTheirTasksFromZero) {
  auto spec = cluster_spec::dense({{"worker", {"w0:2222", "w1:2222", "w2:2222"}}, {"ps", {"p:1"}}});
  EXPECT_FALSE(spec.empty());
  EXPECT_EQ(spec.num_tasks("worker"), 3);
  EXPECT_EQ(spec.task_indices("worker"), (std::vector<int>{0, 1, 2}));
  EXPECT_EQ(spec.task_address("worker", 0), "w0:2222");
  EXPECT_EQ(spec.task_address("worker", 2), "w2:2222");
  EXPECT_EQ(spec.task_address("ps", 0), "p:1");
  EXPECT_TRUE(spec.is_dense("worker"));
}

TEST(ClusterSpecTest, JobsAreListedInNameOrder) {
  auto spec = cluster_spec::dense({{"worker", {"w"}}, {"chief", {"c"}}, {"ps", {"p"}}});
  EXPECT_EQ(spec.jobs(), (std::vector<std::string>{"chief", "ps", "worker"}));
  EXPECT_TRUE(spec.has_job("ps"));
  EXPECT_FALSE(spec.has_job("evaluator"));
}

TEST(ClusterSpecTest, SparseJobKeepsOnlyItsListedIndices) {
  cluster_spec spec({{"worker", {{0, "a:1"}, {2, "c:1"}}}});
  EXPECT_EQ(spec.num_tasks("worker"), 2);
  EXPECT_EQ(spec.task_indices("worker"), (std::vector<int>{0, 2}));
  EXPECT_EQ(spec.task_address("worker", 2), "c:1");
  EXPECT_FALSE(spec.is_dense("worker"));
  // TF's job_tasks has None in the gap; we have "".
  EXPECT_EQ(spec.job_tasks("worker"), (std::vector<std::string>{"a:1", "", "c:1"}));
}

TEST(ClusterSpecTest, FromJsonReadsListsAsDenseAndObjectsAsSparseJobs) {
  auto spec =
      cluster_spec::from_json(R"({"worker": ["a:1", "b:1"], "ps": {"0": "p:1", "3": "q:1"}})");
  EXPECT_EQ(spec,
            cluster_spec({{"worker", {{0, "a:1"}, {1, "b:1"}}}, {"ps", {{0, "p:1"}, {3, "q:1"}}}}));
  EXPECT_TRUE(spec.is_dense("worker"));
  EXPECT_FALSE(spec.is_dense("ps"));
}

TEST(ClusterSpecTest, ToJsonWritesDenseJobsAsListsAndSparseJobsAsObjects) {
  cluster_spec spec({{"worker", {{0, "a:1"}, {1, "b:1"}}}, {"ps", {{0, "p:1"}, {3, "q:1"}}}});
  EXPECT_EQ(spec.to_json(), R"({"ps":{"0":"p:1","3":"q:1"},"worker":["a:1","b:1"]})");
  EXPECT_EQ(cluster_spec::from_json(spec.to_json()), spec);
}

TEST(ClusterSpecTest, AJobWithNoTasksIsStillAJob) {
  auto spec = cluster_spec::from_json(R"({"worker": []})");
  EXPECT_FALSE(spec.empty());
  EXPECT_EQ(spec.num_tasks("worker"), 0);
  EXPECT_TRUE(spec.task_indices("worker").empty());
  EXPECT_TRUE(spec.job_tasks("worker").empty());
  EXPECT_EQ(spec.to_json(), R"({"worker":[]})");
}

TEST(ClusterSpecTest, DenseAndSparseFormsOfTheSameTasksAreEqual) {
  EXPECT_EQ(cluster_spec::from_json(R"({"worker": ["a:1", "b:1"]})"),
            cluster_spec::from_json(R"({"worker": {"1": "b:1", "0": "a:1"}})"));
}

TEST(ClusterSpecTest, SpecsWithDifferentTasksAreNotEqual) {
  auto base = cluster_spec::dense({{"worker", {"a:1", "b:1"}}});
  EXPECT_NE(base, cluster_spec::dense({{"worker", {"a:1", "c:1"}}}));
  EXPECT_NE(base, cluster_spec::dense({{"worker", {"a:1"}}}));
  EXPECT_NE(base, cluster_spec::dense({{"chief", {"a:1", "b:1"}}}));
  EXPECT_NE(base, cluster_spec());
}

TEST(ClusterSpecTest, AsDictReturnsEveryJobAndTask) {
  cluster_spec::job_map jobs{{"chief", {{0, "c:1"}}}, {"worker", {{0, "a:1"}, {5, "f:1"}}}};
  EXPECT_EQ(cluster_spec(jobs).as_dict(), jobs);
}

TEST(ClusterSpecTest, TaskAddressOfAnUnknownJobFailsListingTheJobs) {
  auto spec = cluster_spec::dense({{"worker", {"a:1"}}, {"chief", {"c:1"}}});
  EXPECT_TRUE(fails_with([&] { spec.task_address("ps", 0); }, errc::invalid_argument,
                         {"\"ps\"", "chief, worker"}));
  EXPECT_TRUE(fails_with([&] { spec.num_tasks("ps"); }, errc::invalid_argument, {"\"ps\""}));
  EXPECT_TRUE(fails_with([&] { spec.task_indices("ps"); }, errc::invalid_argument, {"\"ps\""}));
  EXPECT_TRUE(fails_with([&] { spec.job_tasks("ps"); }, errc::invalid_argument, {"\"ps\""}));
  EXPECT_TRUE(fails_with([&] { cluster_spec().num_tasks("worker"); }, errc::invalid_argument,
                         {"\"worker\"", "empty"}));
}

TEST(ClusterSpecTest, TaskAddressOfAMissingIndexFailsListingTheJobsIndices) {
  cluster_spec spec({{"worker", {{0, "a:1"}, {2, "c:1"}}}});
  EXPECT_TRUE(fails_with([&] { spec.task_address("worker", 1); }, errc::out_of_range,
                         {"index 1", "\"worker\"", "0, 2"}));
  EXPECT_TRUE(
      fails_with([&] { spec.task_address("worker", -1); }, errc::out_of_range, {"index -1"}));
}

TEST(ClusterSpecTest, ConstructorRejectsANegativeIndexAndAnEmptyJobName) {
  EXPECT_TRUE(fails_with(
      [] {
        cluster_spec({{"worker", {{-1, "a:1"}}}});
      },
      errc::invalid_argument, {"\"worker\"", "-1", ">= 0"}));
  EXPECT_TRUE(fails_with(
      [] {
        cluster_spec({{"", {{0, "a:1"}}}});
      },
      errc::invalid_argument, {"empty name"}));
}

TEST(ClusterSpecTest, FromJsonRejectsMalformedJsonQuotingTheParserPosition) {
  EXPECT_TRUE(fails_with([] { cluster_spec::from_json(R"({"worker": ["a:1",]})"); },
                         errc::invalid_argument,
                         {"not valid JSON", "line 1, column 19", "byte 19", "expected"}));
}

TEST(ClusterSpecTest, FromJsonRejectsAValueThatIsNotAnObject) {
  EXPECT_TRUE(fails_with([] { cluster_spec::from_json(R"(["a:1"])"); }, errc::invalid_argument,
                         {"must be an object", "array"}));
}

TEST(ClusterSpecTest, FromJsonRejectsAJobThatIsNeitherAListNorAnObject) {
  EXPECT_TRUE(fails_with([] { cluster_spec::from_json(R"({"worker": "a:1"})"); },
                         errc::invalid_argument,
                         {"job \"worker\"", "list of addresses or an object", "string \"a:1\""}));
  EXPECT_TRUE(fails_with([] { cluster_spec::from_json(R"({"worker": 3})"); },
                         errc::invalid_argument, {"job \"worker\"", "number 3"}));
}

TEST(ClusterSpecTest, FromJsonRejectsAnAddressThatIsNotAString) {
  EXPECT_TRUE(fails_with([] { cluster_spec::from_json(R"({"worker": ["a:1", 7]})"); },
                         errc::invalid_argument, {"worker:1", "must be a string", "number 7"}));
  EXPECT_TRUE(fails_with([] { cluster_spec::from_json(R"({"ps": {"4": null}})"); },
                         errc::invalid_argument, {"ps:4", "must be a string", "null"}));
}

TEST(ClusterSpecTest, FromJsonRejectsASparseKeyThatIsNotADecimalIndex) {
  for (std::string key : {"x", "1.5", " 1", "", "99999999999"}) {
    SCOPED_TRACE(key);
    EXPECT_TRUE(
        fails_with([&] { cluster_spec::from_json(R"({"worker": {")" + key + R"(": "a:1"}})"); },
                   errc::invalid_argument, {"\"" + key + "\"", "decimal task index"}));
  }
}

TEST(ClusterSpecTest, FromJsonRejectsANegativeSparseIndex) {
  EXPECT_TRUE(fails_with([] { cluster_spec::from_json(R"({"worker": {"-1": "a:1"}})"); },
                         errc::invalid_argument, {"negative task index -1", ">= 0"}));
}

TEST(ClusterSpecTest, FromJsonRejectsTheSameSparseIndexTwice) {
  EXPECT_TRUE(
      fails_with([] { cluster_spec::from_json(R"({"worker": {"0": "a:1", "00": "b:1"}})"); },
                 errc::invalid_argument, {"index 0 twice"}));
}

TEST(TaskIdTest, PrintsAsTypeColonIndex) {
  EXPECT_EQ(to_string(task_id{"worker", 1}), "worker:1");
  std::ostringstream out;
  out << task_id{"chief", 0};
  EXPECT_EQ(out.str(), "chief:0");
  EXPECT_EQ((task_id{"worker", 1}), (task_id{"worker", 1}));
  EXPECT_NE((task_id{"worker", 1}), (task_id{"worker", 2}));
  EXPECT_NE((task_id{"worker", 0}), (task_id{"chief", 0}));
}
