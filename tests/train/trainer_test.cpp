// The distributed training loop of the demo (examples/train/trainer.hpp): gradient buckets, the
// result's independence of bucketing and layout, and the --plot and --trace files.

#include "support/expect_error.hpp"
#include "trainer.hpp"

#include <consort/consort.hpp>
#include <consort/testing.hpp>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <unistd.h>

#include <atomic>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <future>
#include <map>
#include <regex>
#include <sstream>
#include <string>

using namespace consort;
using namespace consort::train;

namespace {

std::string slurp(const std::string& path) {
  std::ifstream in(path);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

/// A file name in the test's temporary directory, removed at the end of the test.
class temp_file {
public:
  explicit temp_file(const std::string& name)
      : path_((std::filesystem::temp_directory_path() /
               ("consort_trainer_" + std::to_string(::getpid()) + "_" + name))
                  .string()) {}
  ~temp_file() { std::filesystem::remove(path_); }
  const std::string& path() const { return path_; }

private:
  std::string path_;
};

const dataset_tensors& small_data() {
  static const dataset_tensors data = [] {
    synthetic_options o;
    o.examples = 256;
    return make_dataset(o);
  }();
  return data;
}

train_options few_steps(int64_t steps) {
  train_options o;
  o.steps = steps;
  o.global_batch = 24;
  o.examples = 256;
  o.hidden = 8;
  o.layers = 1;
  o.learning_rate = 0.2;
  o.bucket_bytes = size_t{64} << 10;
  return o;
}

} // namespace

TEST(TrainOn, BucketingDoesNotChangeTheResult) {
  mirrored_strategy strategy({"CPU:0", "CPU:1", "CPU:2"});
  auto fused = few_steps(12);
  auto per_tensor = fused;
  per_tensor.bucket_bytes = 0;
  tracer off(false);
  auto a = train_on(strategy, fused, small_data(), off, 0);
  auto b = train_on(strategy, per_tensor, small_data(), off, 0);
  EXPECT_EQ(a.collectives_per_step, 1);
  EXPECT_EQ(b.collectives_per_step, 5); // W1, b1, W2, b2 and the totals
  EXPECT_EQ(max_relative_difference(a.params, b.params), 0.0);
  EXPECT_EQ(a.curve.loss, b.curve.loss);
}

TEST(TrainOn, ThreeReplicasMatchOneReplicaAndLearn) {
  mirrored_strategy three({"CPU:0", "CPU:1", "CPU:2"});
  one_device_strategy one("CPU:0");
  auto o = few_steps(60);
  tracer off(false);
  auto a = train_on(three, o, small_data(), off, 0);
  auto b = train_on(one, o, small_data(), off, 0);
  EXPECT_LE(max_relative_difference(a.params, b.params), verify_tolerance);
  ASSERT_EQ(a.curve.loss.size(), 60u);
  EXPECT_LT(a.curve.loss.back(), a.curve.loss.front());
  EXPECT_GT(a.examples_per_s, 0);
  EXPECT_GT(a.collective_s, 0);
}

TEST(TrainOn, ADeeperModelOnTwoReplicasMatchesOneReplicaAfterItsFirstSteps) {
  mirrored_strategy two({"CPU:0", "CPU:1"});
  one_device_strategy one("CPU:0");
  auto o = few_steps(10);
  o.hidden = 48;
  o.layers = 3;
  o.global_batch = 40;
  o.snapshot_step = 6;
  tracer off(false);
  auto a = train_on(two, o, small_data(), off, 0);
  o.steps = 6;
  o.snapshot_step = 0;
  auto b = train_on(one, o, small_data(), off, 0);
  EXPECT_EQ(shape_of(a.params).layers, 3);
  EXPECT_EQ(a.collectives_per_step, 1);
  EXPECT_LE(max_relative_difference(a.snapshot, b.params), verify_tolerance);
  EXPECT_GT(max_relative_difference(a.params, b.params), 0.0); // 4 more steps
}

TEST(TrainOn, TheVerifyToleranceCatchesOneChangedExample) {
  // What --verify must catch: one replica training on one different row (a lost, doubled or
  // misrouted example) moves the weights far beyond the tolerance of reordered float32 sums.
  one_device_strategy one("CPU:0");
  auto o = few_steps(10);
  tracer off(false);
  auto changed = small_data();
  changed.x = changed.x.clone();
  changed.x.mutable_data<float>()[5] += 1.0f;
  auto a = train_on(one, o, small_data(), off, 0);
  auto b = train_on(one, o, changed, off, 0);
  EXPECT_GT(max_relative_difference(a.params, b.params), 10 * verify_tolerance);
}

TEST(TrainOn, OneReplicaIsBitwiseReproducibleAndOverlapChangesNoBit) {
  one_device_strategy one("CPU:0");
  mirrored_strategy two({"CPU:0", "CPU:1"});
  auto o = few_steps(8);
  o.layers = 2;
  o.bucket_bytes = 300; // several buckets, so that overlap has something to overlap
  tracer off(false);
  auto a = train_on(one, o, small_data(), off, 0);
  auto b = train_on(one, o, small_data(), off, 0);
  EXPECT_EQ(max_relative_difference(a.params, b.params), 0.0);
  EXPECT_EQ(a.params, b.params);
  auto overlapped = train_on(two, o, small_data(), off, 0);
  o.overlap = false;
  auto after = train_on(two, o, small_data(), off, 0);
  EXPECT_GT(overlapped.collectives_per_step, 2);
  EXPECT_EQ(overlapped.params, after.params);
  EXPECT_EQ(overlapped.curve.loss, after.curve.loss);
}

TEST(TrainOn, StopsAtTheTargetLossAndSaysWhen) {
  mirrored_strategy two({"CPU:0", "CPU:1"});
  auto o = few_steps(400);
  tracer off(false);
  auto full = train_on(two, few_steps(60), small_data(), off, 0);
  // A loss the run passes on its way: it stops at the first step at or below it.
  const double target = full.curve.loss[30];
  o.target_loss = target;
  auto r = train_on(two, o, small_data(), off, 0);
  ASSERT_TRUE(r.reached_target);
  EXPECT_LE(r.steps, 31);
  EXPECT_LE(r.curve.loss.back(), target);
  for (size_t i = 0; i + 1 < r.curve.loss.size(); ++i)
    EXPECT_GT(r.curve.loss[i], target) << "step " << i + 1;
  EXPECT_GT(r.time_to_target_s, 0);
  EXPECT_LE(r.time_to_target_s, r.elapsed_s);
  o.target_loss = 1e-9; // unreachable in 3 steps
  o.steps = 3;
  auto never = train_on(two, o, small_data(), off, 0);
  EXPECT_FALSE(never.reached_target);
  EXPECT_EQ(never.steps, 3);
}

TEST(TrainOn, AResumedRunEndsWithTheSameBytesAsAnUninterruptedOne) {
  // Checkpoints every 4 steps of a 2-replica run; a run resumed from any of them, through a
  // checkpoint file, ends with the same parameters bit for bit.
  mirrored_strategy two({"CPU:0", "CPU:1"});
  tracer off(false);
  auto o = few_steps(14);
  o.checkpoint_every = 4;
  std::map<int64_t, nest> saved;
  o.on_checkpoint = [&](int64_t step, const nest& params) {
    saved[step] = map_structure(params, [](const tensor& t) { return t.clone(); });
  };
  auto full = train_on(two, o, small_data(), off, 0);
  std::vector<int64_t> steps;
  for (const auto& [step, params] : saved)
    steps.push_back(step);
  EXPECT_EQ(steps, (std::vector<int64_t>{4, 8, 12, 14})); // every 4, and the last
  EXPECT_EQ(saved[14], full.params);
  temp_file file("resume.safetensors");
  for (int64_t from : {4, 8, 12}) {
    save_checkpoint(file.path(), named_leaves(saved[from]), checkpoint_metadata{});
    auto resumed_options = few_steps(14);
    resumed_options.start_step = from;
    resumed_options.initial_params = restore_nest(full.params, load_checkpoint(file.path()));
    auto resumed = train_on(two, resumed_options, small_data(), off, 0);
    EXPECT_EQ(resumed.steps, 14);
    EXPECT_EQ(resumed.curve.loss.size(), static_cast<size_t>(14 - from));
    EXPECT_EQ(resumed.params, full.params) << "resumed from step " << from;
  }
  // Nothing left to do: the parameters come back as given.
  auto done = few_steps(14);
  done.start_step = 14;
  done.initial_params = full.params;
  auto none = train_on(two, done, small_data(), off, 0);
  EXPECT_EQ(none.steps, 14);
  EXPECT_TRUE(none.curve.loss.empty());
  EXPECT_EQ(none.params, full.params);
}

TEST(TrainOn, AStopRequestOnOneReplicaStopsEveryReplicaAfterThatStepWithACheckpoint) {
  mirrored_strategy two({"CPU:0", "CPU:1"});
  tracer off(false);
  auto o = few_steps(50);
  // Replica threads ask; the request becomes true from the 6th question on (the 3rd step of
  // 2 replicas), so the run stops after step 3 at the latest, on every replica at once.
  std::atomic<int> asked{0};
  o.stop_requested = [&] {
    return ++asked > 5;
  };
  std::vector<int64_t> checkpoints;
  o.on_checkpoint = [&](int64_t step, const nest&) {
    checkpoints.push_back(step);
  };
  auto r = train_on(two, o, small_data(), off, 0);
  EXPECT_TRUE(r.stopped);
  EXPECT_EQ(r.steps, 3);
  EXPECT_EQ(checkpoints, (std::vector<int64_t>{3}));
  // The same 3 steps without a stop give the same parameters.
  EXPECT_EQ(train_on(two, few_steps(3), small_data(), off, 0).params, r.params);
}

TEST(TrainOn, AStepThatFailsOnTheBackwardThreadFailsTheRunWithItsError) {
  // A label outside the classes makes forward_backward throw on the overlap helper thread of the
  // replica that holds it; the run fails with that error instead of hanging or crashing.
  mirrored_strategy two({"CPU:0", "CPU:1"});
  auto bad = small_data();
  bad.y = bad.y.clone();
  bad.y.mutable_data<int32_t>()[20] = -3; // row 20: replica 1's part of the first batch of 24
  tracer off(false);
  for (bool overlap : {true, false}) {
    auto o = few_steps(2);
    o.overlap = overlap;
    EXPECT_TRUE(consort::test::fails_with([&] { train_on(two, o, bad, off, 0); },
                                          errc::invalid_argument, {"label -3", "row 8"}))
        << "overlap " << overlap;
  }
}

TEST(TrainOn, RejectsOptionsOutOfRange) {
  one_device_strategy one("CPU:0");
  tracer off(false);
  auto o = few_steps(1);
  o.layers = 0;
  EXPECT_TRUE(consort::test::fails_with([&] { train_on(one, o, small_data(), off, 0); },
                                        errc::invalid_argument, {"layers 0"}));
  o = few_steps(0);
  EXPECT_TRUE(consort::test::fails_with([&] { train_on(one, o, small_data(), off, 0); },
                                        errc::invalid_argument, {"steps 0"}));
  o = few_steps(5);
  o.start_step = 6;
  EXPECT_TRUE(consort::test::fails_with([&] { train_on(one, o, small_data(), off, 0); },
                                        errc::invalid_argument, {"start_step 6"}));
}

TEST(TrainOn, ReportsProgressEveryStep) {
  one_device_strategy one("CPU:0");
  tracer off(false);
  std::vector<int64_t> steps;
  train_on(one, few_steps(4), small_data(), off, 0,
           [&](int64_t step, double loss, double accuracy, double rate) {
             steps.push_back(step);
             EXPECT_GT(loss, 0);
             EXPECT_GE(accuracy, 0);
             EXPECT_LE(accuracy, 1);
             EXPECT_GT(rate, 0);
           });
  EXPECT_EQ(steps, (std::vector<int64_t>{1, 2, 3, 4}));
}

TEST(MaxRelativeDifference, SaysWhenTheParameterSetsDiffer) {
  auto a = nest::list({tensor::from<float>({1, 2})});
  auto b = nest::list({tensor::from<float>({1, 2}), tensor::from<float>({3})});
  auto c = nest::list({tensor::from<float>({1, 2, 3})});
  auto d = nest::list({tensor::from<float>({1, 2.5f})});
  EXPECT_THROW(max_relative_difference(a, b), std::invalid_argument);
  EXPECT_THROW(max_relative_difference(a, c), std::invalid_argument);
  EXPECT_DOUBLE_EQ(max_relative_difference(a, d), 0.5 / 2.5);
}

TEST(Trace, HoldsOneEventPerReplicaStepAndBucketAsChromeJson) {
  mirrored_strategy strategy({"CPU:0", "CPU:1"});
  auto o = few_steps(3);
  o.bucket_bytes = 0; // 5 all-reduces per replica and step
  tracer trace(true);
  train_on(strategy, o, small_data(), trace, 7);
  temp_file file("trace.json");
  trace.write(file.path());
  auto doc = nlohmann::json::parse(slurp(file.path()));
  const auto& events = doc.at("traceEvents");
  // Per step: the worker's step track, and per replica one step and 5 all-reduce events on its
  // track, and its 2 layers' backward passes on its compute track (100 + replica).
  std::map<std::string, int> names;
  std::map<int, int> per_tid;
  std::map<int, std::string> threads;
  size_t spans = 0;
  for (const auto& e : events) {
    if (e.at("ph") == "M") { // the process's and its threads' names
      if (e.at("name") == "thread_name")
        threads[e.at("tid").get<int>()] = e.at("args").at("name").get<std::string>();
      else
        EXPECT_EQ(e.at("args").at("name"), "worker:0");
      continue;
    }
    ++spans;
    EXPECT_EQ(e.at("ph"), "X"); // one worker: no arrows between workers
    EXPECT_EQ(e.at("pid"), 0);
    EXPECT_GE(e.at("dur").get<int64_t>(), 1);
    EXPECT_GE(e.at("ts").get<int64_t>(), 0);
    auto name = e.at("name").get<std::string>();
    ++names[name.rfind("step ", 0) == 0 ? "step N" : name];
    ++per_tid[e.at("tid").get<int>()];
  }
  EXPECT_EQ(names["step N"], 3);
  EXPECT_EQ(names["step"], 6);
  EXPECT_EQ(names["all_reduce(1 tensors)"], 30);
  EXPECT_EQ(per_tid[-1], 3);
  EXPECT_EQ(per_tid[0], 18);
  EXPECT_EQ(per_tid[1], 18);
  EXPECT_EQ(names["backward w2"], 6);
  EXPECT_EQ(names["backward w1"], 6);
  EXPECT_EQ(per_tid[100], 6);
  EXPECT_EQ(per_tid[101], 6);
  EXPECT_EQ(spans, 3u * (1 + 2 * (1 + 5 + 2)));
  EXPECT_EQ(threads, (std::map<int, std::string>{{-1, "steps"},
                                                 {0, "replica 0"},
                                                 {1, "replica 1"},
                                                 {100, "replica 0 compute"},
                                                 {101, "replica 1 compute"}}));
}

// The job's one trace (consort-train --trace with several workers): each worker a process, named;
// times from the earliest event on the workers' shared clock; a collective's spans linked by an
// arrow from the first worker's to each other worker's; names escaped by the JSON writer.
TEST(Trace, TheJobsTraceLinksEachCollectiveAcrossTheWorkers) {
  tracer a(true), b(true);
  const auto t0 = std::chrono::steady_clock::now();
  const auto ms = [&](int n) {
    return t0 + std::chrono::milliseconds(n);
  };
  a.add("step \"0\"", 0, -1, ms(0), ms(10));
  a.add("all_reduce(1 tensors)", 0, 0, ms(2), ms(5), "step 0 bucket 0");
  b.add("all_reduce(1 tensors)", 1, 0, ms(3), ms(5), "step 0 bucket 0");
  b.add("all_reduce(1 tensors)", 1, 0, ms(6), ms(7), "step 0 bucket 1"); // on one worker only
  temp_file file("job.json");
  tracer::write_job(file.path(), {a.events_json(), b.events_json()}, {"worker:0", "worker:1"});
  auto doc = nlohmann::json::parse(slurp(file.path()));
  std::map<int, std::string> processes;
  std::vector<nlohmann::json> spans, starts, ends;
  for (const auto& e : doc.at("traceEvents")) {
    if (e.at("ph") == "M" && e.at("name") == "process_name")
      processes[e.at("pid").get<int>()] = e.at("args").at("name").get<std::string>();
    else if (e.at("ph") == "X")
      spans.push_back(e);
    else if (e.at("ph") == "s")
      starts.push_back(e);
    else if (e.at("ph") == "f")
      ends.push_back(e);
  }
  EXPECT_EQ(processes, (std::map<int, std::string>{{0, "worker:0"}, {1, "worker:1"}}));
  ASSERT_EQ(spans.size(), 4u);
  EXPECT_EQ(spans[0].at("name"), "step \"0\"");
  EXPECT_EQ(spans[0].at("ts"), 0); // the earliest event
  // Each tracer maps its steady clock to the wall clock with its own pair of reads: a and b
  // were made apart, so their times may differ by a microsecond of rounding.
  EXPECT_NEAR(spans[2].at("ts").get<int64_t>(), 3000, 1);
  ASSERT_EQ(starts.size(), 1u); // bucket 0 only: bucket 1 ran on one worker
  ASSERT_EQ(ends.size(), 1u);
  EXPECT_EQ(starts[0].at("pid"), 0);
  EXPECT_EQ(starts[0].at("ts"), 2000);
  EXPECT_EQ(ends[0].at("pid"), 1);
  EXPECT_NEAR(ends[0].at("ts").get<int64_t>(), 3000, 1);
  EXPECT_EQ(starts[0].at("id"), ends[0].at("id"));
  EXPECT_EQ(starts[0].at("name"), "step 0 bucket 0");
}

TEST(Trace, AWorkersEventsThatAreNotAnArrayAreAnErrorNamingIt) {
  temp_file file("job.json");
  try {
    tracer::write_job(file.path(), {"[]", "{\"no\": 1}"}, {"worker:0", "worker:1"});
    FAIL() << "expected an error";
  } catch (const std::runtime_error& e) {
    EXPECT_NE(std::string{e.what()}.find("worker:1"), std::string::npos) << e.what();
    EXPECT_NE(std::string{e.what()}.find("not a JSON array"), std::string::npos) << e.what();
  }
}

TEST(Trace, OffRecordsNothing) {
  tracer trace(false);
  auto now = std::chrono::steady_clock::now();
  trace.add("x", 0, 0, now, now);
  EXPECT_EQ(trace.size(), 0u);
}

TEST(Trace, AnUnwritablePathIsAnErrorNamingIt) {
  tracer trace(true);
  try {
    trace.write("/nonexistent-dir/trace.json");
    FAIL() << "expected an error";
  } catch (const std::runtime_error& e) {
    EXPECT_NE(std::string{e.what()}.find("/nonexistent-dir/trace.json"), std::string::npos);
  }
}

TEST(Plot, DrawsLossAndAccuracyInsideTheAxes) {
  history h;
  h.loss = {2.0, 1.0, 0.5, 0.25};
  h.accuracy = {0.25, 0.5, 0.75, 1.0};
  temp_file file("plot.svg");
  write_plot(file.path(), h);
  auto svg = slurp(file.path());
  ASSERT_EQ(svg.rfind("<svg", 0), 0u);
  EXPECT_NE(svg.find("</svg>"), std::string::npos);
  std::regex polyline(R"re(<polyline[^>]*points="([^"]*)")re");
  std::vector<std::vector<std::pair<double, double>>> lines;
  for (auto it = std::sregex_iterator(svg.begin(), svg.end(), polyline);
       it != std::sregex_iterator(); ++it) {
    std::vector<std::pair<double, double>> pts;
    std::istringstream in((*it)[1].str());
    std::string xy;
    while (in >> xy) {
      auto comma = xy.find(',');
      pts.emplace_back(std::stod(xy.substr(0, comma)), std::stod(xy.substr(comma + 1)));
    }
    lines.push_back(pts);
  }
  ASSERT_EQ(lines.size(), 2u);
  for (const auto& pts : lines) {
    ASSERT_EQ(pts.size(), 4u);
    EXPECT_DOUBLE_EQ(pts.front().first, 40);
    EXPECT_DOUBLE_EQ(pts.back().first, 600);
    for (auto [x, y] : pts) {
      EXPECT_GE(y, 40);
      EXPECT_LE(y, 320);
    }
  }
  // Loss falls (y grows downwards in SVG), accuracy rises: the highest loss is at the top.
  EXPECT_DOUBLE_EQ(lines[0].front().second, 40);
  EXPECT_GT(lines[0].back().second, lines[0].front().second);
  EXPECT_DOUBLE_EQ(lines[1].back().second, 40);
  EXPECT_NE(svg.find("step 4"), std::string::npos);
}

TEST(Plot, AnUnwritablePathIsAnErrorNamingIt) {
  try {
    write_plot("/nonexistent-dir/loss.svg", history{});
    FAIL() << "expected an error";
  } catch (const std::runtime_error& e) {
    EXPECT_NE(std::string{e.what()}.find("/nonexistent-dir/loss.svg"), std::string::npos);
  }
}

TEST(TrainOn, LargestDifferenceNamesWhereAndMeasuresNormwise) {
  // --verify's measures: elementwise relative (floor 1e-3) with its place, and normwise per leaf.
  auto a = nest::dict(
      {{"b", tensor::from<float>({1.0f, 2.0f, 0.0f})}, {"w", tensor::from<float>({3.0f, 4.0f})}});
  auto b = nest::dict(
      {{"b", tensor::from<float>({1.0f, 2.0f, 1e-4f})}, {"w", tensor::from<float>({3.0f, 4.5f})}});
  auto d = largest_difference(a, b);
  // b[2]: |0 - 1e-4| / 1e-3 = 0.1; w[1]: 0.5 / 4.5 = 0.111...
  EXPECT_EQ(d.tensor, 1u);
  EXPECT_EQ(d.element, 1u);
  EXPECT_FLOAT_EQ(d.a, 4.0f);
  EXPECT_FLOAT_EQ(d.b, 4.5f);
  EXPECT_NEAR(d.relative, 0.5 / 4.5, 1e-9);
  // Normwise: "b" differs by 1e-4 over a norm of sqrt(5), "w" by 0.5 over sqrt(3^2 + 4.5^2).
  EXPECT_NEAR(d.normwise, 0.5 / std::sqrt(9.0 + 20.25), 1e-7);
  EXPECT_EQ(d.normwise_tensor, 1u);
  EXPECT_EQ(largest_difference(a, a).relative, 0.0);
  EXPECT_EQ(largest_difference(a, a).normwise, 0.0);
  // Different structures are refused, saying how.
  EXPECT_THROW(largest_difference(a, nest::dict({{"b", tensor::from<float>({1.0f})}})),
               std::invalid_argument);
}

TEST(TrainOn, KeepsTheModelInTheStrategysVariablesAndItsMetricsInSyncOnReadOnes) {
  mirrored_strategy two({"CPU:0", "CPU:1"});
  tracer off(false);
  auto o = few_steps(14); // 256 rows in batches of 24: epochs of 11 steps, the last of 16 rows
  auto r = train_on(two, o, small_data(), off, 0);
  // The parameters: one mirrored variable each, in the order the gradients are produced, every
  // copy equal to the result; then the metrics, sync-on-read sums.
  std::vector<std::string> names;
  for (const auto& v : two.variables())
    names.push_back(v.name());
  EXPECT_EQ(names, (std::vector<std::string>{"w2", "b2", "w1", "b1", "metrics/totals"}));
  for (const auto& v : two.variables()) {
    const bool metric = v.name().rfind("metrics/", 0) == 0;
    EXPECT_EQ(v.synchronization(),
              metric ? variable_synchronization::on_read : variable_synchronization::on_write)
        << v.name();
    if (metric)
      continue;
    for (const auto& copy : two.local_results(v))
      EXPECT_EQ(copy.to_vector<float>(), r.params[v.name()].as_tensor().to_vector<float>())
          << v.name();
  }
  // The metrics of each epoch: the row-weighted mean of its steps' losses and accuracies.
  ASSERT_EQ(r.curve.epoch_end, (std::vector<int64_t>{11, 14}));
  EXPECT_EQ(r.curve.epoch_first, (std::vector<int64_t>{1, 12}));
  const std::vector<double> rows = {24, 24, 24, 24, 24, 24, 24, 24, 24, 24, 16, 24, 24, 24};
  for (size_t e = 0; e < 2; ++e) {
    double loss = 0, accuracy = 0, n = 0;
    for (auto s = r.curve.epoch_first[e] - 1; s < r.curve.epoch_end[e]; ++s) {
      const auto i = static_cast<size_t>(s);
      loss += r.curve.loss[i] * rows[i];
      accuracy += r.curve.accuracy[i] * rows[i];
      n += rows[i];
    }
    EXPECT_NEAR(r.curve.epoch_loss[e], loss / n, 1e-5 * loss / n) << "epoch " << e;
    EXPECT_NEAR(r.curve.epoch_accuracy[e], accuracy / n, 1e-6) << "epoch " << e;
  }
  // Read outside a step after the run, the metrics start afresh.
  EXPECT_EQ(two.variables()[4].value().to_vector<float>(), (std::vector<float>{0, 0, 0}));
}

TEST(TrainOn, ASecondRunOnTheStrategyReusesItsVariablesAndAnotherShapeIsRefused) {
  mirrored_strategy two({"CPU:0", "CPU:1"});
  tracer off(false);
  auto first = train_on(two, few_steps(5), small_data(), off, 0);
  auto again = train_on(two, few_steps(5), small_data(), off, 0);
  EXPECT_EQ(again.params, first.params); // from the seed's parameters again
  EXPECT_EQ(two.variables().size(), 5u);
  auto wider = few_steps(1);
  wider.hidden = 9;
  EXPECT_TRUE(consort::test::fails_with(
      [&] { train_on(two, wider, small_data(), off, 0); }, errc::invalid_argument,
      {"\"w2\" as float32[8, 4]", "float32[9, 4]", "a strategy of its own"}));
}

TEST(TrainOn, WorkersWithOtherDataFailTheStepWhoseRowsDisagreeNamingBothCounts) {
  // Worker 1 lacks the last 8 of the 256 rows: the first ten global batches of 24 still agree,
  // and the eleventh (16 rows on worker 0, 8 on worker 1) does not. Every worker stops at that
  // step with collective_mismatch; none hangs, and none trains on past it.
  consort::testing::cluster c({.workers = 2, .replicas_per_worker = 1, .seed = 5});
  const auto& full = small_data();
  const dataset_tensors shorter{full.x.slice(0, 248), full.y.slice(0, 248)};
  tracer off(false);
  std::vector<std::future<outcome>> runs;
  for (int w = 0; w < 2; ++w)
    runs.push_back(std::async(std::launch::async, [&, w] {
      return train_on(c.strategy(w), few_steps(14), w == 0 ? full : shorter, off, w);
    }));
  const char* expected[] = {"global batch has 16", "global batch has 8"};
  for (int w = 0; w < 2; ++w) {
    auto& r = runs[static_cast<size_t>(w)];
    ASSERT_EQ(r.wait_for(std::chrono::seconds(60)), std::future_status::ready) << c.describe();
    EXPECT_TRUE(consort::test::fails_with([&] { r.get(); }, errc::collective_mismatch,
                                          {"step 10 ran on 12 rows", expected[w]}))
        << "worker " << w;
  }
}

TEST(TrainOn, TwoWorkersShareOneModelAndTheirMetricsAreTheWholeJobs) {
  // Two workers over consort::testing's simulated network, 1 and 2 replicas each, as two
  // processes would run the demo: worker 1 starts from other parameters, which the variables'
  // creation replaces with worker 0's; every copy on both workers ends equal, within the float32
  // tolerance of one replica on the global batch; and each epoch's sync-on-read metrics, read
  // across the workers, are the row-weighted mean of the job's per-step figures.
  for (int replicas : {1, 2}) {
    consort::testing::cluster c({.workers = 2, .replicas_per_worker = replicas, .seed = 3});
    auto o = few_steps(14);
    tracer off(false);
    std::vector<std::future<outcome>> runs;
    for (int w = 0; w < 2; ++w)
      runs.push_back(std::async(std::launch::async, [&, w] {
        auto mine = o;
        if (w == 1) { // another seed: other initial parameters
          mlp_shape shape{static_cast<int>(small_data().x.shape()[1]), o.hidden,
                          classes_of(o, small_data()), o.layers};
          mine.initial_params = init_params(shape, o.seed + 1);
        }
        return train_on(c.strategy(w), mine, small_data(), off, w);
      }));
    std::vector<outcome> out;
    for (auto& r : runs) {
      ASSERT_EQ(r.wait_for(std::chrono::seconds(60)), std::future_status::ready) << c.describe();
      out.push_back(r.get());
    }
    const auto what = std::to_string(replicas) + " replica(s) per worker";
    EXPECT_EQ(out[0].params, out[1].params) << what;
    for (int w = 0; w < 2; ++w)
      for (const auto& v : c.strategy(w).variables()) {
        if (v.synchronization() != variable_synchronization::on_write)
          continue;
        for (const auto& copy : c.strategy(w).local_results(v))
          EXPECT_EQ(copy.to_vector<float>(), out[0].params[v.name()].as_tensor().to_vector<float>())
              << v.name() << ", worker " << w << ", " << what;
      }
    one_device_strategy one("CPU:0");
    auto single = train_on(one, o, small_data(), off, 0);
    EXPECT_LE(max_relative_difference(out[0].params, single.params), verify_tolerance) << what;
    ASSERT_EQ(out[0].curve.epoch_end, (std::vector<int64_t>{11, 14})) << what;
    EXPECT_EQ(out[1].curve.epoch_loss, out[0].curve.epoch_loss) << what;
    const std::vector<double> rows = {24, 24, 24, 24, 24, 24, 24, 24, 24, 24, 16, 24, 24, 24};
    for (size_t e = 0; e < 2; ++e) {
      double loss = 0, n = 0;
      for (auto s = out[0].curve.epoch_first[e] - 1; s < out[0].curve.epoch_end[e]; ++s) {
        loss += out[0].curve.loss[static_cast<size_t>(s)] * rows[static_cast<size_t>(s)];
        n += rows[static_cast<size_t>(s)];
      }
      EXPECT_NEAR(out[0].curve.epoch_loss[e], loss / n, 1e-5 * loss / n)
          << "epoch " << e << ", " << what;
    }
  }
}
